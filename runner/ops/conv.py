"""Convolutions (forward, data gradient, weight gradient, and the fused inference op conv_fused) as cuDNN
frontend graphs, every engine config a candidate. Tensors are channels-last (NHWC) in memory with logical NCHW
dims, as cuDNN's fastest engines want.

conv_fused (conv + bias [+ residual] [+ ReLU]) has two kinds of candidates: `fused:<plan>`, one cuDNN graph
whose engines apply the epilogue inside the conv kernel, and `unfused:<plan>`, any conv plan followed by one
epilogue kernel (precompiled conv engines outnumber fused ones, and one of them may still win).

Where few input channels make cuDNN slow (a network's first conv), `stem:<CTAs per SM>x` candidates run the
stem kernels of runner/ops/stem.py instead, an inference conv's bias and ReLU folded into them, and on Hopper, with
64 output channels, `stem:wgmma` (forward) and `stem:wgmma:<CTAs per SM>x` (weight gradient; runner/ops/stem_wgmma.py).
"""

from __future__ import annotations

from functools import partial

from runner.gpu import cudnn_dtype, device_pointer, gpu
from runner.ops.common import THREADS, WANTED_ALGORITHM, Alternatives, blocks_for, check_index_range, i32, kernel
from runner.ops.stem import StemConv, stem_shape
from runner.ops.stem import applies as stem_applies
from runner.ops.stem_wgmma import StemWgmma
from runner.ops.stem_wgmma import applies as wgmma_applies

CONV_KINDS = ("conv", "conv_bwd_data", "conv_bwd_filter")

SRC = r"""
// in place after a conv plan: y = relu?(y + b[c] + z), the channel c the last physical dim; y's pixels are
// `pitch` channels apart (C, or a concat_view output's channel count when y is a channel slice of it)
extern "C" __global__ void conv_epilogue(T* y, const T* b, const T* z, int n, int C, int pitch, int has_bias,
                                         int has_z, int relu) {
    GRID_LOOP(i, n) {
        long long at = (long long)(i / C) * pitch + i % C;
        float v = ld(y, at);
        if (has_bias) v += ld(b, i % C);
        if (has_z) v += ld(z, i);
        st(y, at, relu && v < 0.f ? 0.f : v);
    }
}
"""


def nhwc_strides(dims: list[int], pitch: int | None = None) -> list[int]:
    """NHWC element strides of NCHW dims; `pitch`: channels between pixels (a channel slice of a wider tensor)."""
    n, c, h, w = dims
    c = pitch or c
    return [c * h * w, 1, w * c, c]


def build_plans(g, max_plans: int | None = None) -> tuple[list[tuple[int, str, int]], list[tuple[str, str]]]:
    """Build every engine config of a cuDNN frontend graph (or the first `max_plans` in heuristic order, for
    graphs whose engines are compiled at run time, about a second each): (plan index, plan name, workspace
    bytes) of each distinct plan that builds, and (name, reason) of each that does not."""
    cudnn = gpu().cudnn
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    count = g.get_execution_plan_count()
    unsupported: list[tuple[str, str]] = []
    wanted = WANTED_ALGORITHM.get()
    if wanted is not None:
        try:
            names = [g.get_plan_name_at_index(i) for i in range(count)]
        except Exception:  # noqa: BLE001 - names only after building: build them all below
            names = []
        plan = wanted.split(":", 1)[-1]  # candidate names may carry an implementation prefix
        if plan in names:
            i = names.index(plan)
            g.build_plan_at_index(i)
            return [(i, plan, int(g.get_workspace_size_plan_at_index(i)))], []
    if max_plans is None:
        g.build_plans(cudnn.build_plan_policy.ALL)
    else:
        count = min(count, max_plans)
        for i in range(count):
            try:
                g.build_plan_at_index(i)
            except Exception as e:  # noqa: BLE001 - recorded below when its name cannot be read
                unsupported.append((f"plan{i}", f"{type(e).__name__}: {str(e)[:120]}"))
    candidates: list[tuple[int, str, int]] = []
    seen = set()
    for i in range(count):
        if any(name == f"plan{i}" for name, _ in unsupported):
            continue
        try:
            name = g.get_plan_name_at_index(i)
            workspace = int(g.get_workspace_size_plan_at_index(i))
        except Exception as e:  # noqa: BLE001 - a plan that did not build is recorded, not fatal
            unsupported.append((f"plan{i}", f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        if name not in seen:
            seen.add(name)
            candidates.append((i, name, workspace))
    return candidates, unsupported


class ConvOp:
    """One convolution node; `candidates` are the cuDNN plans that build, `launch(i, ...)` runs plan i. A
    forward conv may carry an epilogue in the same graph: bias (added per channel), residual z, ReLU, and write
    y as a channel slice of a tensor with `y_pitch` channels."""

    def __init__(self, kind: str, attrs: dict, x_dims: list[int], w_dims: list[int], y_dims: list[int],
                 dtype: str, handle, bias: bool = False, residual: bool = False, relu: bool = False,
                 y_pitch: int | None = None):
        cudnn = gpu().cudnn
        self.kind, self.handle, self.dtype, self.epilogue = kind, handle, dtype, []
        g = cudnn.pygraph(io_data_type=cudnn_dtype(dtype), intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        t, l, b, r = attrs["pads"]
        conv_args = dict(pre_padding=[t, l], post_padding=[b, r], stride=attrs["strides"],
                         dilation=attrs["dilations"], compute_data_type=cudnn.data_type.FLOAT)
        mk = lambda name, dims: g.tensor(name=name, dim=dims, stride=nhwc_strides(dims),  # noqa: E731
                                         data_type=cudnn_dtype(dtype))
        if kind == "conv":
            self.x, self.w = mk("x", x_dims), mk("w", w_dims)
            out = g.conv_fprop(image=self.x, weight=self.w, **conv_args)
            k = y_dims[1]
            if bias:
                b = g.tensor(name="b", dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=cudnn_dtype(dtype))
                out = g.add(name="bias", a=out, b=b)
                self.epilogue.append(b)
            if residual:
                z = mk("z", y_dims)
                out = g.add(name="residual", a=out, b=z)
                self.epilogue.append(z)
            if relu:
                out = g.relu(name="relu", input=out)
            out.set_dim(y_dims).set_stride(nhwc_strides(y_dims, y_pitch))
        elif kind == "conv_bwd_data":
            self.x, self.w = mk("dy", y_dims), mk("w", w_dims)
            out = g.conv_dgrad(loss=self.x, filter=self.w, **conv_args)
            out.set_dim(x_dims).set_stride(nhwc_strides(x_dims))
        else:
            self.x, self.w = mk("x", x_dims), mk("dy", y_dims)
            out = g.conv_wgrad(image=self.x, loss=self.w, **conv_args)
            out.set_dim(w_dims).set_stride(nhwc_strides(w_dims))
        out.set_output(True).set_data_type(cudnn_dtype(dtype))
        self.y = out
        self.graph = g
        self.candidates, self.unsupported = build_plans(g)

    def launch(self, index: int, a, b, out, workspace, epilogue=()) -> None:
        """a, b: the two inputs (x, w | dy, w | x, dy) and out, as CuPy arrays with NHWC strides; epilogue: the
        bias and residual arrays the graph reads."""
        arrays = {self.x: a, self.w: b, self.y: out, **dict(zip(self.epilogue, epilogue))}
        tensors = {t: device_pointer(array) for t, array in arrays.items()}
        self.graph.execute_plan_at_index(tensors, device_pointer(workspace), index, handle=self.handle)


def conv_epilogue(y, bias, z, channels: int, relu: bool, dtype: str) -> None:
    """y = relu?(y + bias + z) in place; bias, z may be None; y may be a channel slice (pixel stride > C)."""
    n = y.size
    pitch = y.strides[3] // y.itemsize
    fn = kernel(SRC, "conv_epilogue", dtype)
    fn((blocks_for(n),), (THREADS,), (y, y if bias is None else bias, y if z is None else z, i32(n),
                                      i32(channels), i32(pitch), i32(bias is not None), i32(z is not None), i32(relu)))


def conv_operands(kind: str, ins, outs):
    """(x, w, y) specs of a conv-family node: [x, w, b?, z?] -> [y], [dy, w] -> [dx], [x, dy] -> [dw]."""
    if kind in ("conv", "conv_fused"):
        return ins[0], ins[1], outs[0]
    if kind == "conv_bwd_data":
        return outs[0], ins[1], ins[0]
    return ins[0], outs[0], ins[1]


class ConvNode:
    """A conv-family graph node in the registry's interface: candidates (plan name, workspace bytes); inputs
    and outputs in the node's order (conv_operands). A conv bias is added by an epilogue kernel after the conv
    (inference graphs fuse it: conv_fused)."""

    def __init__(self, kind: str, attrs: dict, ins, outs, handle):
        check_index_range(*ins, *outs)
        x, w, y = conv_operands(kind, ins, outs)
        self.op = ConvOp(kind, attrs, list(x.shape), list(w.shape), list(y.shape), y.dtype, handle)
        self.candidates = [(name, workspace) for _, name, workspace in self.op.candidates]
        self.unsupported = self.op.unsupported
        self.bias = kind == "conv" and len(ins) > 2

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        self.op.launch(self.op.candidates[index][0], inputs[0], inputs[1], outputs[0], workspace)
        if self.bias:
            conv_epilogue(outputs[0], inputs[2], None, outputs[0].shape[1], False, self.op.dtype)


class FusedConv:
    """conv_fused as one cuDNN graph (prefix "fused") or as a conv plan plus the epilogue kernel ("unfused");
    `skip`: plan names not to offer (an engine config that builds fused runs the same kernel with the epilogue
    folded in, so its unfused twin is only slower)."""

    def __init__(self, fused: bool, attrs: dict, ins, outs, handle, skip: set[str] = frozenset()):
        self.fused, self.relu, self.residual = fused, attrs["relu"], attrs["residual"]
        x, w, y = ins[0], ins[1], outs[0]
        self.bias = len(ins) - self.residual > 2
        conv_attrs = {k: v for k, v in attrs.items() if k not in ("relu", "residual", "concat_channels")}
        epilogue = dict(bias=self.bias, residual=self.residual, relu=self.relu) if fused else {}
        self.op = ConvOp("conv", conv_attrs, list(x.shape), list(w.shape), list(y.shape), y.dtype, handle, **epilogue,
                         y_pitch=y.row_channels)
        prefix = "fused" if fused else "unfused"
        self.plans = [p for p in self.op.candidates if p[1] not in skip]
        self.candidates = [(f"{prefix}:{name}", workspace) for _, name, workspace in self.plans]
        self.unsupported = [(f"{prefix}:{name}", reason) for name, reason in self.op.unsupported]

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        extra = inputs[2:]
        plan = self.plans[index][0]
        if self.fused:
            self.op.launch(plan, inputs[0], inputs[1], outputs[0], workspace, extra)
            return
        self.op.launch(plan, inputs[0], inputs[1], outputs[0], workspace)
        conv_epilogue(outputs[0], extra[0] if self.bias else None, extra[-1] if self.residual else None,
                      outputs[0].shape[1], self.relu, self.op.dtype)


class StemNode:
    """conv, conv_fused or conv_bwd_filter by the stem kernels (runner/ops/stem.py), which add a bias and apply
    ReLU as they write y (conv_fused with a residual is left to cuDNN); with 64 output channels also by Hopper's
    wgmma (runner/ops/stem_wgmma.py), where the device has it."""

    def __init__(self, kind: str, attrs: dict, ins, outs):
        check_index_range(*ins, *outs)
        x, w, y = conv_operands(kind, ins, outs)
        forward = kind in ("conv", "conv_fused")
        stem_kind = "conv" if forward else kind
        self.bias = forward and len(ins) > 2
        relu = bool(attrs.get("relu"))
        self.op = StemConv(stem_kind, attrs, list(x.shape), list(w.shape), list(y.shape), y.dtype, bias=self.bias,
                           relu=relu)
        self.candidates = [(name, workspace) for _, name, workspace in self.op.candidates]
        self.unsupported = list(self.op.unsupported)
        self.wgmma = None
        if wgmma_applies(stem_kind, self.op.shape, self.bias):
            try:
                self.wgmma = StemWgmma(stem_kind, self.op.shape, self.bias, relu, self.op.sum_partials)
                self.candidates += self.wgmma.candidates
            except Exception as e:  # noqa: BLE001 - no sm_90, or an NVRTC without sm_90a: the mma.sync ones stay
                self.unsupported.append(("stem:wgmma", f"{type(e).__name__}: {str(e)[:160]}"))

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        bias = inputs[2] if self.bias else None
        mma_sync = len(self.op.candidates)
        if index >= mma_sync:
            self.wgmma.launch(index - mma_sync, inputs[0], inputs[1], outputs[0], workspace, bias)
            return
        self.op.launch(self.op.candidates[index][0], inputs[0], inputs[1], outputs[0], workspace, bias)


def offered(kind: str, attrs: dict, ins, outs) -> list[str]:
    """["stem"] where the stem kernels take a node (runner/ops/stem.py), "stem_wgmma" too where the wgmma ones do
    (runner/ops/stem_wgmma.py; on any device: elsewhere than on Hopper they are recorded unsupported), else []."""
    if kind not in (*CONV_KINDS, "conv_fused") or attrs.get("residual"):
        return []
    x, w, y = conv_operands(kind, ins, outs)
    dims = list(x.shape), list(w.shape), list(y.shape)
    stem_kind = "conv" if kind == "conv_fused" else kind
    if y.row_channels is not None or not stem_applies(stem_kind, attrs, *dims, y.dtype):
        return []
    bias = kind == "conv_fused" and len(ins) > 2
    return ["stem", "stem_wgmma"] if wgmma_applies(stem_kind, stem_shape(attrs, *dims), bias) else ["stem"]


def _conv_fused(attrs, ins, outs, handle):
    """cuDNN's fused and unfused candidates, and the stem kernels where they take the node."""
    check_index_range(*ins, *outs)
    fused_plans: set[str] = set()

    def fused():
        impl = FusedConv(True, attrs, ins, outs, handle)
        fused_plans.update(name for _, name, _ in impl.plans)
        return impl

    builders = {"fused": fused, "unfused": lambda: FusedConv(False, attrs, ins, outs, handle, fused_plans)}
    if offered("conv_fused", attrs, ins, outs):
        builders["stem"] = lambda: StemNode("conv_fused", attrs, ins, outs)
    return Alternatives(builders)


def _conv_node(kind: str, attrs, ins, outs, handle):
    """cuDNN's engines (their plan names bare), and the stem kernels where they take the node."""
    builders = {"cudnn": lambda: ConvNode(kind, attrs, ins, outs, handle)}
    if offered(kind, attrs, ins, outs):
        builders["stem"] = lambda: StemNode(kind, attrs, ins, outs)
    return Alternatives(builders, bare="cudnn")


OPS = {kind: partial(_conv_node, kind) for kind in CONV_KINDS} | {"conv_fused": _conv_fused}
