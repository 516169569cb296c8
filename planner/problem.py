"""Graph + Profile -> the scheduling problem the heuristic and CP-SAT both solve (pure data, integer time).

Ops are the graph's non-view nodes; each has alternatives (the profile's candidates, dominated ones dropped);
tensors are storages (a view or an in-place result shares its root's storage). Time is in integer ticks of
`tick_us`; memory is in exact bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from planner.files import PlannerError
from planner.ir import Graph, recompute_nodes
from planner.ops import KINDS
from planner.plan import FUSED_RECOMPUTE
from planner.profile import Candidate, DeviceInfo, Profile

SM_CAPACITY = 100  # sm_fraction 1.0 in the cumulative's integer units
DRAM_CAPACITY = 100  # dram_fraction 1.0: the measured peak bandwidth, in the same units
MAX_TICKS = 400_000  # the horizon's resolution: coarser ticks beyond it keep large graphs tractable
MIN_TICK_US = 0.1
MIN_OFFLOAD_BYTES = 1 << 20  # smaller saved tensors are always kept: a copy's latency outweighs the saving


@dataclass
class Alternative:
    """One candidate algorithm of one op."""

    name: str
    time_us: float
    duration: int  # ticks
    workspace_bytes: int
    sm_demand: int  # of SM_CAPACITY
    dram_demand: int = 0  # of DRAM_CAPACITY


@dataclass
class Op:
    name: str
    kind: str
    phase: str
    alternatives: list[Alternative]
    preds: list[int] = field(default_factory=list)  # ops that must end before this one starts
    reads: list[int] = field(default_factory=list)  # tensors (storages) this op reads
    writes: list[int] = field(default_factory=list)  # tensors (storages) this op creates


@dataclass
class TensorUse:
    """One non-persistent storage: live from its first writer's start (0 for graph inputs) to its last use."""

    name: str
    bytes: int
    producer: int | None  # the last writer (None for a graph input)
    early: list[int]  # consumers served by the first residency (all of them when the tensor is always kept)
    late: list[int]  # backward consumers, which an offloaded or recomputed tensor serves from its second residency
    is_output: bool
    writers: list[int] = field(default_factory=list)  # ops that write it: the producer, or a concat_view's several
    can_offload: bool = False
    can_recompute: bool = False
    d2h_ticks: int = 0
    h2d_ticks: int = 0
    d2h_us: float = 0.0
    h2d_us: float = 0.0
    recompute_alternatives: list[Alternative] = field(default_factory=list)  # what the recomputation may run as
    # (`recompute_cost`): the lean way first, then a faster one that needs more workspace
    recompute_chain: list[int] = field(default_factory=list)  # ops re-run, in order; the last is the producer
    recompute_reads: list[int] = field(default_factory=list)  # tensors the chain reads, live until it ends
    deep: tuple[list[int], list[int], list[Alternative]] | None = None  # (chain, reads, alternatives) re-running
    # its reads' chains

    def __post_init__(self):
        if not self.writers and self.producer is not None:
            self.writers = [self.producer]

    @property
    def recompute(self) -> Alternative | None:
        """The recomputation's lean way: what decisions are priced at and what always fits where it runs."""
        return self.recompute_alternatives[0] if self.recompute_alternatives else None

    @recompute.setter
    def recompute(self, alternative: Alternative) -> None:
        self.recompute_alternatives = [alternative]

    @property
    def choosable(self) -> bool:
        return self.can_offload or self.can_recompute


@dataclass
class Problem:
    model_name: str
    training: bool
    ops: list[Op]
    tensors: list[TensorUse]
    resident_bytes: int  # weights, state, optimizer state: on the device throughout
    tick_us: float
    device: DeviceInfo
    estimated: bool
    simplifications: list[str] = field(default_factory=list)
    dispatch_us: float = 0.0  # what every op's duration adds to its profiled time (DeviceInfo.dispatch_for)
    co_running: float = 0.0  # k of the slowdown the plan's timeline is settled under (DeviceInfo.co_running_for)

    @property
    def op_index(self) -> dict[str, int]:
        return {o.name: i for i, o in enumerate(self.ops)}

    def ticks(self, us: float) -> int:
        return max(1, round(us / self.tick_us))

    def bound_scale(self) -> tuple[float, int]:
        """(r, u): a bound of B ticks of what the model times (ops, recomputations, copies) is one of (B - u) r
        ticks in real time. Times round to the nearest tick, so the ticks' optimum can exceed the real one
        (ResNet-50 b1 on one stream, H200: CP-SAT's bound 331.1 us, its plan 330.9). Scaled by 1 / r, r the least
        real over tick time, a real schedule keeps its order with every interval holding its tick time, except
        what takes no time at all (a graph input's copy out), u ticks at most."""
        timed = [(a.time_us, a.duration) for o in self.ops for a in o.alternatives]
        for t in self.tensors:
            timed += [(a.time_us, a.duration) for a in t.recompute_alternatives + (t.deep[2] if t.deep else [])]
            if t.can_offload:
                timed += [(t.d2h_us, t.d2h_ticks), (t.h2d_us, t.h2d_ticks)]
        ratio = min([1.0] + [us / (ticks * self.tick_us) for us, ticks in timed if ticks > 0 and us > 0])
        return ratio, sum(ticks for us, ticks in timed if us <= 0)


def dominated(c: Candidate, others: list[Candidate]) -> bool:
    """Another candidate is no worse on time, workspace, SM share and DRAM share, and better on one."""
    key = (c.time_us, c.workspace_bytes, c.sm_fraction, c.dram_fraction)
    return any(
        (o.time_us, o.workspace_bytes, o.sm_fraction, o.dram_fraction) != key
        and o.time_us <= c.time_us and o.workspace_bytes <= c.workspace_bytes
        and o.sm_fraction <= c.sm_fraction and o.dram_fraction <= c.dram_fraction
        for o in others)


def choose_alternatives(candidates: list[Candidate], limit: int) -> list[Candidate]:
    """The non-dominated candidates, fastest first; past `limit`, the fastest, the leanest, the narrowest and
    then the fastest others, so every kind of trade-off stays available."""
    front = sorted((c for c in candidates if not dominated(c, candidates)), key=lambda c: c.time_us)
    front = list({c.name: c for c in front}.values())
    if len(front) <= limit:
        return front
    picks = [front[0], min(front, key=lambda c: (c.workspace_bytes, c.time_us)),
             min(front, key=lambda c: (c.sm_fraction, c.time_us))]
    for c in front:
        picks.append(c)
    out = list({id(c): c for c in picks}.values())[:limit]
    return sorted(out, key=lambda c: c.time_us)


def choose_tick_us(total_us: float) -> float:
    """0.1 us, or coarser so the serial time spans at most MAX_TICKS ticks; a 1-2-5 step keeps it readable."""
    raw = max(MIN_TICK_US, total_us / MAX_TICKS)
    exponent = math.floor(math.log10(raw))
    for step in (1, 2, 5, 10):
        if step * 10 ** exponent >= raw - 1e-12:
            return round(step * 10 ** exponent, 6)
    return raw


def build_problem(graph: Graph, profile: Profile, max_alternatives: int = 8, offload: bool = True,
                  recompute: bool = True, dram: bool = False, streams: int = 2) -> Problem:
    """The scheduling problem of one graph with the costs of one profile for plans on `streams` compute streams
    (one stream runs nothing side by side: its ops pay the one-stream dispatch time); without `dram`, every DRAM
    demand is 0 (the bandwidth is not a constraint)."""
    if profile.graph_sha256 not in (None, graph.graph_sha256):
        raise PlannerError("the profile was assembled for another graph (model, batch, dtype or mode differ)")
    if profile.dtype != graph.dtype:
        raise PlannerError(f"the profile is for {profile.dtype}, the graph is {graph.dtype}")
    nodes = [n for n in graph.nodes if not KINDS[n.kind].view]
    chosen: dict[str, list[Candidate]] = {}
    simplifications: list[str] = []
    trimmed = 0
    for n in nodes:
        op_profile = profile.ops.get(n.signature)
        if op_profile is None or not op_profile.candidates:
            raise PlannerError(f"the profile has no candidate for op {n.name} ({n.kind}); run `planner profile`")
        chosen[n.name] = choose_alternatives(op_profile.candidates, max_alternatives)
        trimmed += len([c for c in op_profile.candidates if not dominated(c, op_profile.candidates)]) > max_alternatives
    if trimmed:
        simplifications.append(f"{trimmed} ops kept {max_alternatives} of their non-dominated candidates")
    serial_us = sum(min(c.time_us for c in chosen[n.name]) for n in nodes)
    tick_us = choose_tick_us(serial_us)
    if tick_us > MIN_TICK_US:
        simplifications.append(f"time grid coarsened to {tick_us:g} us")

    dispatch_us = profile.device.dispatch_for(graph.training, streams, graph.batch, graph.model_name, graph.dtype)

    def alternative(c: Candidate) -> Alternative:  # each op also pays the device's calibrated dispatch time
        time_us = c.time_us + dispatch_us
        return Alternative(c.name, time_us, max(1, round(time_us / tick_us)), c.workspace_bytes,
                           max(1, min(SM_CAPACITY, math.ceil(c.sm_fraction * SM_CAPACITY - 1e-9))),
                           max(0, min(DRAM_CAPACITY, math.ceil(c.dram_fraction * DRAM_CAPACITY - 1e-9))) if dram else 0)

    ops = [Op(n.name, n.kind, n.phase, [alternative(c) for c in chosen[n.name]]) for n in nodes]
    index = {o.name: i for i, o in enumerate(ops)}
    tensors = _tensor_uses(graph, index)
    for t_i, t in enumerate(tensors):
        for w in t.writers:
            ops[w].writes.append(t_i)
        for c in t.early + t.late:
            ops[c].reads.append(t_i)
    for n in nodes:
        preds = {index[p] for name in n.inputs for p in _data_producers(graph, name) if p in index}
        for out in n.outputs:  # an in-place update comes after every other reader of what it overwrites
            if graph.tensors[out].alias_of is not None and graph.tensors[out].persistent:
                preds |= {index[r] for r in graph.tensors[graph.tensors[out].alias_of].consumers if r in index}
        preds.discard(index[n.name])
        ops[index[n.name]].preds = sorted(preds)
    resident = sum(t.bytes for name, t in graph.tensors.items() if t.alias_of is None and t.persistent)
    problem = Problem(graph.model_name, graph.training, ops, tensors, resident, tick_us, profile.device,
                      profile.estimated, simplifications, dispatch_us,
                      profile.device.co_running_for(graph.training, streams, graph.batch, graph.model_name,
                                                    graph.dtype))
    fused = {chain: replace(a := alternative(min(profile.ops[n.signature].candidates, key=lambda c: c.time_us)),
                            name=FUSED_RECOMPUTE + a.name)
             for chain, n in recompute_nodes(graph).items() if profile.ops.get(n.signature)
             and profile.ops[n.signature].candidates}
    _mark_choices(problem, graph, offload, recompute, fused)
    return problem


def _data_producers(graph: Graph, name: str) -> set[str]:
    """The ops that computed a tensor's data, looking through views (which are not ops; a concat_view's data
    comes from every input's producer)."""
    p = graph.tensors[name].producer
    if p is None:
        return set()
    node = graph.node_by_name[p]
    if not KINDS[node.kind].view:
        return {p}
    inputs = node.inputs if node.kind == "concat_view" else node.inputs[:1]
    return set().union(*(_data_producers(graph, x) for x in inputs))


def _tensor_uses(graph: Graph, index: dict[str, int]) -> list[TensorUse]:
    """One TensorUse per non-persistent storage, with the (non-view) ops that create and read it."""
    uses: dict[str, TensorUse] = {}
    for name, t in graph.tensors.items():
        if t.persistent:
            continue
        root = graph.storage_of(name)
        if root not in uses:
            writers = sorted(index[w] for w in _data_producers(graph, root) if w in index)
            uses[root] = TensorUse(root, graph.tensors[root].bytes, writers[-1] if writers else None, [], [], False,
                                   writers=writers)
        u = uses[root]
        u.early = sorted(set(u.early) | {index[c] for c in t.consumers if c in index})
        u.is_output |= name in graph.outputs
    return list(uses.values())


def _mark_choices(problem: Problem, graph: Graph, offload: bool, recompute: bool,
                  fused: dict[tuple[str, ...], Alternative]) -> None:
    """Which tensors may be offloaded or recomputed: made in the forward pass (or graph inputs), saved for
    backward, big enough. A graph input's batch comes from the host, which keeps it: offloading an input drops it
    and copies it back, and its copy out takes no time (the runner stages the host copy with the batch)."""
    if not problem.training:
        return
    dev = problem.device
    if offload and not (dev.h2d_bytes_per_s > 0 and dev.d2h_bytes_per_s > 0):
        problem.simplifications.append("no offload: the profile has no host copy bandwidth")
        offload = False
    for t in problem.tensors:
        late = [c for c in t.early if problem.ops[c].phase in ("backward", "update")]
        made_in_backward = t.producer is not None and problem.ops[t.producer].phase in ("backward", "update")
        if not late or made_in_backward or t.bytes < MIN_OFFLOAD_BYTES or t.is_output or len(t.writers) > 1:
            continue  # a gradient is read in the phase it is made in: nothing idle to offload or recompute
        t.early = [c for c in t.early if c not in late]
        t.late = late
        t.can_offload = offload
        t.d2h_us = dev.copy_us("d2h", t.bytes) if offload and t.writers else 0.0
        t.h2d_us = dev.copy_us("h2d", t.bytes) if offload else 0.0
        t.d2h_ticks, t.h2d_ticks = problem.ticks(t.d2h_us), problem.ticks(t.h2d_us)
        if recompute and t.producer is not None:
            _mark_recompute(problem, graph, t, fused)
        if not t.choosable:
            t.early, t.late = sorted(t.early + t.late), []
    for t in problem.tensors:
        if t.can_recompute:
            _mark_deep(problem, graph, t, fused)


MAX_CHAIN_OPS = 4


def _mark_recompute(problem: Problem, graph: Graph, t: TensorUse, fused: dict[tuple[str, ...], Alternative]
                    ) -> None:
    """A saved tensor is recomputable from the forward ops that made it (cheap ones, and convolutions:
    ResNet-50's convolution outputs, read by BatchNormalization's backward pass, are most of what it saves),
    walked back through every input not saved for the backward pass anyway, while the ops re-run stay within
    MAX_CHAIN_OPS (ResNet-50's downsampling block output: both BatchNormalizations, the Add and the ReLU,
    each BatchNormalization reading a saved convolution output). BatchNormalization is re-applied with its saved
    batch statistics (no running-stat update); a chain the profile measured fused (BatchNormalization, Add?,
    ReLU as one `bn_apply` kernel) costs that. A chain that would hold unsaved inputs as big as the tensor
    itself is not offered."""
    saved = {i for i, u in enumerate(problem.tensors)
             if any(problem.ops[c].phase in ("backward", "update") for c in u.early + u.late)}
    chain: list[int] = []
    queue = [t.producer]
    while queue:
        op = queue.pop(0)  # queued once: never already in the chain
        node = graph.node_by_name[problem.ops[op].name]
        recomputable = KINDS[node.kind].recomputable and (len(node.outputs) == 1 or node.kind == "batchnorm")
        if not recomputable or problem.ops[op].phase != "forward":
            return
        chain.append(op)
        unsaved = {problem.tensors[r].producer for r in problem.ops[op].reads
                   if r not in saved and problem.tensors[r].producer is not None} - set(chain) - set(queue)
        if len(chain) + len(queue) + len(unsaved) <= MAX_CHAIN_OPS:  # else they are read as they are
            queue += sorted(unsaved)
    chain.sort()  # ops are in topological order: the producer of t comes last
    reads, alternatives = recompute_cost(problem, graph, chain, t.bytes, fused)
    held = sum(problem.tensors[r].bytes for r in reads if r not in saved)
    if held >= t.bytes:  # the chain would hold unsaved inputs at least as big as what it frees
        return
    t.can_recompute = True
    t.recompute_chain, t.recompute_reads, t.recompute_alternatives = chain, reads, alternatives


def _mark_deep(problem: Problem, graph: Graph, t: TensorUse, fused: dict[tuple[str, ...], Alternative]) -> None:
    """The deep recomputation of t also re-runs the chains of the recomputable tensors its chain reads, so that
    those need not be on the device when it runs. GoogLeNet training b32 at 35%: recomputing conv1's ReLU output
    reads conv1's output, which must then stay from before the max-pool backward to after the BatchNormalization
    backward, beside both gradients (over the cap); re-running conv1 instead, the plan recomputes 55 MiB more
    and offloads 57 MiB less (`deep.deep_recomputations`)."""
    absorbed = [problem.tensors[u] for u in t.recompute_reads if problem.tensors[u].can_recompute
                and not set(problem.tensors[u].recompute_chain) & set(t.recompute_chain)]
    if absorbed:
        chain = sorted(set(t.recompute_chain).union(*(u.recompute_chain for u in absorbed)))
        t.deep = (chain, *recompute_cost(problem, graph, chain, t.bytes, fused, fused_tail=True))


def recompute_cost(problem: Problem, graph: Graph, chain: list[int], freed_bytes: int,
                   fused: dict[tuple[str, ...], Alternative], fused_tail: bool = False
                   ) -> tuple[list[int], list[Alternative]]:
    """(what the chain of forward ops reads, what it may run as): the profile's fused kernel where it measured the
    chain as one, else its ops one after another, the intermediates held in the workspace. The lean way first:
    each op on its fastest algorithm whose workspace is at most a quarter of the bytes the recomputation frees
    (it runs where memory is tightest); then, where faster, each on its fastest whatever its workspace
    (GoogLeNet's and ResNet-50's conv1, 49 MiB out: 197 us lean, 91 us with 12.3 MiB; which fits depends on the
    schedule, so the solver chooses). With `fused_tail`, the longest tail measured fused runs as that kernel (a
    BatchNormalization running its ReLU, fuse.with_bn_relu, is a tail of one)."""
    by_name = {u.name: i for i, u in enumerate(problem.tensors)}
    made = set()
    reads: list[int] = []
    for op in chain:
        node = graph.node_by_name[problem.ops[op].name]
        for r in problem.ops[op].reads:
            if r not in made and r not in reads:
                reads.append(r)
        if node.kind == "batchnorm" and node.attrs.get("training"):
            reads += [by_name[graph.storage_of(x)] for x in node.outputs[3:5] if graph.storage_of(x) in by_name]
        made |= set(problem.ops[op].writes)
    names = tuple(problem.ops[o].name for o in chain)
    if (one := fused.get(names)) is not None:
        return reads, [one]
    cut = next((k for k in range(1, len(chain)) if names[k:] in fused), len(chain)) if fused_tail else len(chain)
    intermediate = sum(problem.tensors[w].bytes for o in chain[:min(cut, len(chain) - 1)] for w in problem.ops[o].writes)
    tail = [fused[names[cut:]]] if cut < len(chain) else []
    ways = []
    for workspace_limit in (freed_bytes // 4, None):
        steps = [_recompute_alternative(problem.ops[o].alternatives, workspace_limit) for o in chain[:cut]] + tail
        time_us = sum(a.time_us for a in steps)
        if not ways or time_us < ways[0].time_us:
            ways.append(Alternative("+".join(a.name for a in steps), time_us, problem.ticks(time_us),
                                    max(a.workspace_bytes for a in steps) + intermediate,
                                    max(a.sm_demand for a in steps), max(a.dram_demand for a in steps)))
    return reads, ways


def _recompute_alternative(alternatives: list[Alternative], workspace_limit: int | None) -> Alternative:
    """A chain op's algorithm when recomputed: the fastest whose workspace is within the limit (none: the fastest),
    else the leanest."""
    fitting = [a for a in alternatives if workspace_limit is None or a.workspace_bytes <= workspace_limit]
    if fitting:
        return min(fitting, key=lambda a: (a.time_us, a.workspace_bytes))
    return min(alternatives, key=lambda a: (a.workspace_bytes, a.time_us))
