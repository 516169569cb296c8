"""The least device memory any schedule holds when an op starts, as a minimum cut over which ops ran before it.

At the instant op v starts, the ops split into those started by then (S: v and its ancestors among them) and the
rest (T: its descendants among them); the ops unrelated to v fall on either side, S closed under ancestors. A
tensor is on the device then when one op that holds it is in S and another in T: a kept tensor lives from its
first writer's start to its last reader's end, and whatever is decided for a saved tensor, its first residency
spans its writers and forward readers, its second its backward readers. So at v's start the device holds the
resident bytes, v's tensors and leanest workspace, and every other tensor the split cuts; the schedule's split is
one of the closed ones, so at least the least of them: a minimum s-t cut, each tensor a hyperedge (two nodes
joined by an arc of its bytes, its holders tied to them by infinite arcs), each dependency an infinite arc.

Op by op (what v reads and writes alone) gives ResNet-50 training b32 342.64 MiB; the cut gives 391.40 MiB, at
the sum of layer1.2's output gradient: its two 49-MiB parts and their sum, and either layer1.2's output, back
for layer2.0's weight gradients run before the sum and read again by the ReLU's gradient after it, or those
weight gradients' 24.5-MiB inputs, kept for after.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from planner.problem import Problem

UNIT_LIMIT = 1 << 27  # capacities are int32: tensor bytes are counted in units that keep their sum under this


def memory_floor(p: Problem, order: list[int], anc: np.ndarray, known_bytes: int = 0) -> tuple[int, int]:
    """(bytes, op): the most that the minimum cut at some op's start holds, resident bytes included, where that
    is above `known_bytes` (else op -1); ops in `order` (topological, anc[v, u]: the op at u ends before the one
    at v starts). Ops are cut in order of what two splits hold (the ops unrelated to v all before it, or all
    after: the cut is at most either), until that is no more than the best known (ResNet-50 training b32: one
    cut of 458 ops, 0.03 s)."""
    n = len(order)
    pos = {op: k for k, op in enumerate(order)}
    edges = _hyperedges(p, pos, anc)
    if not n or not edges:
        return known_bytes, -1
    total = sum(b for _, _, _, b, _ in edges)
    unit = 1 << max(0, (total // UNIT_LIMIT).bit_length())
    members = np.zeros((len(edges), n), dtype=np.float32)
    for k, (holders, _, _, _, _) in enumerate(edges):
        members[k, holders] = 1.0
    size = members.sum(axis=1)
    units = np.array([b // unit for _, _, _, b, _ in edges], dtype=np.int64)
    from_start = np.array([s for _, s, _, _, _ in edges])
    to_end = np.array([e for _, _, e, _, _ in edges])
    before = anc | np.eye(n, dtype=bool)  # fixed in S when op v starts
    in_s, in_t = members @ before.T.astype(np.float32), members @ anc.astype(np.float32)  # edges x ops
    start, end = from_start[:, None], to_end[:, None]
    all_after = ((in_s > 0) | start) & ((in_s < size[:, None]) | end)
    all_before = ((in_t > 0) | end) & ((in_t < size[:, None]) | start)
    edge_of: dict[int, list[int]] = {}
    for k, (_, _, _, _, t) in enumerate(edges):
        edge_of.setdefault(t, []).append(k)
    own = [sorted({k for t in set(p.ops[order[v]].reads) | set(p.ops[order[v]].writes) for k in edge_of.get(t, [])})
           for v in range(n)]
    base = [p.resident_bytes + own_bytes(p, order[v]) for v in range(n)]
    most = [base[v] + unit * min(int(units[split[:, v]].sum() - units[own[v]][split[own[v], v]].sum())
                                 for split in (all_after, all_before)) for v in range(n)]
    arcs = _arcs(p, order, pos, edges, units)
    best, where = known_bytes, -1
    for v in sorted(range(n), key=lambda v: (-most[v], v)):
        if most[v] <= best:
            break
        held = base[v] + unit * _min_cut(arcs, n, len(edges), anc, v, own[v])
        if held > best:
            best, where = held, order[v]
    return best, where


def own_bytes(p: Problem, op: int) -> int:
    """What op holds itself while it runs, in any schedule: the tensors it reads and writes, its leanest
    workspace."""
    o = p.ops[op]
    return sum(p.tensors[t].bytes for t in set(o.reads) | set(o.writes)) + min(a.workspace_bytes
                                                                                for a in o.alternatives)


def _hyperedges(p: Problem, pos: dict[int, int], anc: np.ndarray) -> list[tuple[list[int], bool, bool, int, int]]:
    """(holders' positions, held from the start, held to the end, bytes, tensor) per residency every schedule
    has: a tensor that is always kept, one hyperedge over all that write or read it; a saved tensor, its backward
    readers', and its writers' and forward readers' where all of those precede every backward reader (else the
    two residencies may overlap, where a kept tensor would be counted twice)."""
    edges = []
    for t, tu in enumerate(p.tensors):
        first = sorted({pos[u] for u in tu.writers + tu.early})
        late = sorted({pos[u] for u in tu.late})
        if not tu.choosable:
            edges.append((sorted(set(first + late)), not tu.writers, tu.is_output, tu.bytes, t))
            continue
        if all(anc[v, u] for v in late for u in first):
            edges.append((first, not tu.writers, tu.is_output, tu.bytes, t))
        edges.append((late, False, False, tu.bytes, t))
    return [e for e in edges if e[0] and e[3]]


def _arcs(p: Problem, order: list[int], pos: dict[int, int], edges: list, units: np.ndarray
          ) -> tuple[list[int], list[int], list[int], list[int]]:
    """(tails, heads, capacities, index of each hyperedge's own arc) of the network every cut shares: ops are
    nodes 0..n-1, the source n, the sink n+1, hyperedge k's two nodes n+2+2k and n+3+2k; capacity -1 is
    infinite. S closed under ancestors: an arc from each op to its preds."""
    n = len(order)
    tails, heads, caps, own_arc = [], [], [], []
    for v, op in enumerate(order):
        for u in p.ops[op].preds:
            tails.append(v), heads.append(pos[u]), caps.append(-1)
    for k, (holders, from_start, to_end, _, _) in enumerate(edges):
        a, b = n + 2 + 2 * k, n + 3 + 2 * k
        own_arc.append(len(caps))
        tails.append(a), heads.append(b), caps.append(int(units[k]))
        for h in holders:
            tails += [h, b]
            heads += [a, h]
            caps += [-1, -1]
        if from_start:
            tails.append(n), heads.append(a), caps.append(-1)
        if to_end:
            tails.append(b), heads.append(n + 1), caps.append(-1)
    return tails, heads, caps, own_arc


def _min_cut(arcs: tuple, n: int, n_edges: int, anc: np.ndarray, v: int, own: list[int]) -> int:
    """The least bytes (in units) of hyperedges cut by a split with v and its ancestors in S, its descendants in
    T; v's own tensors left out (counted whole)."""
    tails, heads, caps, own_arc = arcs
    caps = np.array(caps, dtype=np.int64)
    caps[[own_arc[k] for k in own]] = 0
    infinite = int(caps[caps > 0].sum()) + 1
    caps[caps < 0] = infinite
    fixed_s = np.flatnonzero(anc[v])
    fixed_t = np.flatnonzero(anc[:, v])
    source, sink = n, n + 1
    tails = np.concatenate([tails, np.full(len(fixed_s) + 1, source), fixed_t])
    heads = np.concatenate([heads, fixed_s, [v], np.full(len(fixed_t), sink)])
    caps = np.concatenate([caps, np.full(len(fixed_s) + 1 + len(fixed_t), infinite)])
    nodes = n + 2 + 2 * n_edges
    graph = csr_matrix((caps.astype(np.int32), (tails.astype(np.int32), heads.astype(np.int32))), shape=(nodes, nodes))
    return int(maximum_flow(graph, source, sink).flow_value)
