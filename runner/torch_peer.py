"""PyTorch peers for `planner bench`: the same network, built from our IR, run the ways PyTorch users run it.

The network is planner/export_torch.py's module with no plan (the plain serial network), so any model we import
can be compared; its ops (GRAPH, KERNELS) run in a lean serial loop that frees each activation after its last
use, as a hand-written PyTorch model does (the module's own forward keeps per-op stream bookkeeping for plans,
which costs eager mode CPU time on every op). Each peer is a zero-argument `step()` that enqueues one iteration
on the peer's own stream:

- eager: cudnn.benchmark, channels-last input and 4-D weights (PyTorch's fastest convolution layout);
- graph: that eager step captured once as a torch.cuda.CUDAGraph and replayed (in training the whole iteration:
  forward, loss, backward and the SGD update, PyTorch's whole-network capture);
- save_on_cpu (training): every tensor saved for backward in pinned host memory, torch.autograd.graph.save_on_cpu;
- checkpoint (training): torch.utils.checkpoint over segments of about sqrt(n) forward ops, the last one kept;
  as in any PyTorch checkpointing, BatchNormalization updates its running statistics again when recomputed;
- torchvision eager and graph: torchvision's own network of the same architecture, when there is one, to show
  that our build is not a handicapped peer (same dtype, channels-last, cudnn.benchmark; conv+BN folded for
  inference, as the ONNX export folded it).

Peak memory is what PyTorch's caching allocator held allocated at most while the peer was built, warmed up,
captured and timed, above what was allocated before it (other peers are idle meanwhile): weights, gradients and
optimizer state included, host memory and the CUDA context not. torch is imported lazily.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.export_torch import torch_module_source
from planner.ir import Graph

WARMUP = 3
TF32 = "fp32 convolutions may use TF32 (cuDNN's default, as our cuDNN engines do); fp32 matrix products may not " \
       "(cuBLAS default math, as our GEMMs)"
TORCHVISION = {  # our model name -> torchvision constructor, as tests/models/make_models.py exported them
    "googlenet": lambda tvm: tvm.googlenet(weights=None, aux_logits=False, init_weights=False),
    "inception_v3": lambda tvm: tvm.inception_v3(weights=None, aux_logits=False, init_weights=False),
    "resnet50": lambda tvm: tvm.resnet50(weights=None),
    "resnext50": lambda tvm: tvm.resnext50_32x4d(weights=None),
    "densenet121": lambda tvm: tvm.densenet121(weights=None),
    "mobilenet_v2": lambda tvm: tvm.mobilenet_v2(weights=None),
    "squeezenet": lambda tvm: tvm.squeezenet1_0(weights=None),
}


def torch_missing() -> str | None:
    """Why there are no PyTorch peers here, or None when there are."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA device"
    return None


def setup() -> dict[str, str]:
    """Our runner's numerics everywhere (TF32 as our runner uses it, cudnn.benchmark); the versions to report."""
    import torch

    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    versions = {"torch": torch.__version__, "torch_cuda": str(torch.version.cuda),
                "torch_cudnn": str(torch.backends.cudnn.version())}
    try:
        import torchvision

        versions["torchvision"] = torchvision.__version__
    except Exception:  # noqa: BLE001 - torchvision is optional, and a broken install is as good as none
        pass
    return versions


@dataclass
class Peer:
    name: str
    step: Callable[[], None]
    stream_ptr: int
    peak_bytes: int
    resident_bytes: int
    note: str = ""
    keep: list = field(default_factory=list)  # what the step's captured memory belongs to

    def tracked(self, run: Callable[[], list[float]]) -> list[float]:
        """Run timed iterations, raising the peak to what they allocated above this peer's resident bytes."""
        import torch

        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = run()
        torch.cuda.synchronize()
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes + torch.cuda.max_memory_allocated() - before)
        return times


def peer_module(graph: Graph) -> types.ModuleType:
    """Our IR's plain serial network as a fresh module (planner/export_torch.py with no plan)."""
    module = types.ModuleType("peer_" + re.sub(r"\W", "_", graph.model_name))
    exec(compile(torch_module_source(graph), f"<PyTorch peer of {graph.model_name}>", "exec"), module.__dict__)
    return module


def build_peers(graph: Graph, capped: bool, seed: int = 0) -> tuple[list[Peer], list[str]]:
    """Every peer for this graph (save_on_cpu and checkpoint only for training under a cap), and notes on the
    ones that could not be built; a peer that fails is left out, never the whole benchmark."""
    import torch

    module = peer_module(graph)
    x, labels = _inputs(graph)
    serial = lambda net: serial_forward(module, net)  # noqa: E731
    builds: list[tuple[str, Callable, str]] = [
        ("torch eager", lambda s: _ours(module, graph, s, x, labels, seed, serial), "cudnn.benchmark, channels-last"),
        ("torch graph", lambda s: _captured(_ours(module, graph, s, x, labels, seed, serial), s), "CUDA graph"),
    ]
    if graph.training and capped:
        builds += [
            ("torch save_on_cpu", lambda s: _ours(module, graph, s, x, labels, seed,
                                                   lambda net: _saved_on_cpu(serial(net))), "to pinned host memory"),
            ("torch checkpoint", lambda s: _ours(module, graph, s, x, labels, seed,
                                                  lambda net: _checkpointed(module, net)),
             f"every {_segment_ops(module)} ops"),
        ]
    tv = _torchvision_build(graph, x, labels)
    if tv is not None:
        builds += [("torchvision eager", tv, "fairness check"),
                   ("torchvision graph", lambda s: _captured(tv(s), s), "fairness check")]
    peers, notes = [], []
    for name, build, note in builds:
        try:
            peers.append(_measured(name, build, note))
        except Exception as e:  # noqa: BLE001 - one peer that PyTorch cannot run is a note, not a failure
            notes.append(f"{name} left out: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return peers, notes


def _measured(name: str, build, note: str) -> Peer:
    """Build a peer on a new stream, recording what it keeps allocated and its allocation peak meanwhile."""
    import torch

    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step, keep, more = build(stream)
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    return Peer(name, step, stream.cuda_stream, torch.cuda.max_memory_allocated() - before,
                torch.cuda.memory_allocated() - before, "; ".join(filter(None, [note, more])), keep)


def _inputs(graph: Graph):
    import torch

    dtype = torch.float16 if graph.dtype == "fp16" else torch.float32
    shape = graph.tensors[graph.inputs[0]].shape
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=gen).contiguous(memory_format=torch.channels_last)
    label = next((t for t in graph.inputs if graph.tensors[t].role == "label"), None)
    classes = next((graph.tensors[n.inputs[0]].shape[-1] for n in graph.nodes if n.kind == "softmax_xent"), 1)
    labels = None if label is None else torch.randint(0, classes, graph.tensors[label].shape, device="cuda",
                                                      generator=gen)
    return x, labels


def _ours(module, graph: Graph, stream, x, labels, seed: int, forward_of) -> tuple[Callable, list, str]:
    """Our IR's network on `stream` (built there, so its stream 0 is `stream`), channels-last weights, with the
    forward `forward_of(net)` (serial, save_on_cpu or checkpointed)."""
    import torch

    with torch.cuda.stream(stream):
        net = module.PlannedNet(None, device="cuda", seed=seed)
        for p in net.params.values():
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)
    net.forward = forward_of(net)
    if graph.training:
        def step():
            with torch.cuda.stream(stream):
                net.train_step(x, labels)
    else:
        def step():
            with torch.cuda.stream(stream), torch.inference_mode():
                net(x)
    return step, [net], ""


def _captured(built: tuple[Callable, list, str], stream) -> tuple[Callable, list, str]:
    """The step warmed up on its side stream, then captured whole and replayed there."""
    import torch

    eager, keep, note = built
    for _ in range(WARMUP):
        eager()
    torch.cuda.synchronize()
    for net in keep:
        if getattr(net, "optimizer", None) is not None:
            net.optimizer.zero_grad(set_to_none=True)  # gradients come from the graph's own memory pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        eager()

    def step():
        with torch.cuda.stream(stream):
            graph.replay()
    return step, keep + [graph], note


def serial_forward(module, net):
    """The ops in topological order, each activation dropped after its last reader."""
    nodes, kernels = module.GRAPH["nodes"], module.KERNELS
    source, result = module.GRAPH["inputs"][0], module.GRAPH["outputs"][0]
    last_use = {}
    for i, name in enumerate(module.PLAN["order"]):
        for t in nodes[name][1]:
            last_use[t] = i
    steps = []
    for i, name in enumerate(module.PLAN["order"]):
        kind, inputs, outputs, attrs = nodes[name]
        dead = [t for t in dict.fromkeys(inputs) if last_use[t] == i and t != result and t not in net.buffers_]
        steps.append((kernels[kind], inputs, outputs, attrs, dead))

    def forward(x):
        env = dict(net.buffers_)
        env[source] = x.to(net.device_, net.dtype_)
        for kernel, inputs, outputs, attrs, dead in steps:
            got = kernel(net, [env[t] for t in inputs], attrs)
            env.update(zip(outputs, got if isinstance(got, tuple) else (got,)))
            for t in dead:
                del env[t]
        return env[result]
    return forward


def _saved_on_cpu(plain):
    import torch

    def forward(x):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return plain(x)
    return forward


def _segment_ops(module) -> int:
    return max(1, math.ceil(math.sqrt(len(module.PLAN["order"]))))


def checkpoint_segments(module, persistent: set[str]) -> list[tuple[list[str], list[str], list[str], set[str]]]:
    """The forward order cut every ~sqrt(n) ops: (ops, tensors read from before, tensors needed after, tensors
    still needed once the segment ran), from the last segment back."""
    nodes, order, k = module.GRAPH["nodes"], module.PLAN["order"], _segment_ops(module)
    needed = set(module.GRAPH["outputs"])
    out = []
    for start in reversed(range(0, len(order), k)):
        ops = order[start:start + k]
        made = {t for n in ops for t in nodes[n][2]}
        read = {t for n in ops for t in nodes[n][1] if t not in persistent}
        after = set(needed)
        needed = (needed - made) | (read - made)
        out.append((ops, sorted(read - made), sorted(made & after), after))
    return out[::-1]


def _checkpointed(module, net):
    """A forward that keeps only each segment's inputs for backward and recomputes the rest there."""
    from torch.utils.checkpoint import checkpoint

    nodes, kernels = module.GRAPH["nodes"], module.KERNELS
    segments = checkpoint_segments(module, set(net.buffers_))

    def run(ops, ins, outs):
        def segment(*values):
            env = dict(zip(ins, values))
            for name in ops:
                kind, inputs, outputs, attrs = nodes[name]
                got = kernels[kind](net, [env[t] if t in env else net.buffers_[t] for t in inputs], attrs)
                env.update(zip(outputs, got if isinstance(got, tuple) else (got,)))
            return tuple(env[t] for t in outs)
        return segment

    runs = [run(ops, ins, outs) for ops, ins, outs, _ in segments]

    def forward(x):
        env = {module.GRAPH["inputs"][0]: x.to(net.device_, net.dtype_)}
        for i, ((_, ins, outs, after), segment) in enumerate(zip(segments, runs)):
            args = [env[t] for t in ins]
            last = i == len(segments) - 1
            got = segment(*args) if last else checkpoint(segment, *args, use_reentrant=False,
                                                          preserve_rng_state=False)
            env = {t: v for t, v in env.items() if t in after} | dict(zip(outs, got))
        return env[module.GRAPH["outputs"][0]]
    return forward


def _torchvision_build(graph: Graph, x, labels):
    """build(stream) for torchvision's network of the same architecture (same weight shapes), or None."""
    import torch

    make = TORCHVISION.get(graph.model_name.split(".")[0])
    if make is None:
        return None
    try:
        import torchvision.models as tvm

        probe = make(tvm)
    except Exception:  # noqa: BLE001 - no (working) torchvision: no check
        return None
    ours = sorted(tuple(t.shape) for t in graph.tensors.values()
                  if t.role == "weight" and t.alias_of is None and len(t.shape) >= 2)
    if ours != sorted(tuple(p.shape) for p in probe.parameters() if p.dim() >= 2):
        return None
    dtype = torch.float16 if graph.dtype == "fp16" else torch.float32

    def build(stream):
        with torch.cuda.stream(stream):
            net, note = _torchvision_model(make(tvm).train(graph.training), graph.training, dtype)
        if graph.training:
            sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

            def step():
                with torch.cuda.stream(stream):
                    sgd.zero_grad(set_to_none=True)
                    torch.nn.functional.cross_entropy(net(x).float(), labels).backward()
                    sgd.step()
        else:
            def step():
                with torch.cuda.stream(stream), torch.inference_mode():
                    net(x)
        return step, [net], note
    return build


def _torchvision_model(model, training: bool, dtype):
    """On the GPU in `dtype` with BatchNormalization kept fp32 (as our build keeps it), channels-last; for
    inference conv+BN folded (torch.fx), as the ONNX export we import folded them."""
    import torch

    note = ""
    if not training:
        try:
            from torch.fx.experimental.optimization import fuse

            model = fuse(model.eval())
        except Exception as e:  # noqa: BLE001 - an untraceable model runs unfolded, said in the note
            note = f"conv+BN not folded ({type(e).__name__})"
    model = model.to("cuda", dtype).to(memory_format=torch.channels_last)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.float()
    return model, note
