"""Convolutions (forward, data gradient, weight gradient) as cuDNN frontend graphs, every engine config a
candidate. Tensors are channels-last (NHWC) in memory with logical NCHW dims, as cuDNN's fastest engines want.
"""

from __future__ import annotations

from functools import partial

from runner.gpu import cudnn_dtype, gpu
from runner.ops.common import WANTED_ALGORITHM, check_index_range
from runner.ops.reduce import channel_bias_add

CONV_KINDS = ("conv", "conv_bwd_data", "conv_bwd_filter")


def nhwc_strides(dims: list[int]) -> list[int]:
    n, c, h, w = dims
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
        plan = wanted.removeprefix("cudnn:")
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
    """One convolution node; `candidates` are the cuDNN plans that build, `launch(i, ...)` runs plan i."""

    def __init__(self, kind: str, attrs: dict, x_dims: list[int], w_dims: list[int], y_dims: list[int],
                 dtype: str, handle):
        cudnn = gpu().cudnn
        self.kind, self.handle = kind, handle
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
            out.set_dim(y_dims).set_stride(nhwc_strides(y_dims))
            self.names = ("x", "w", "y")
        elif kind == "conv_bwd_data":
            self.x, self.w = mk("dy", y_dims), mk("w", w_dims)
            out = g.conv_dgrad(loss=self.x, filter=self.w, **conv_args)
            out.set_dim(x_dims).set_stride(nhwc_strides(x_dims))
            self.names = ("dy", "w", "dx")
        else:
            self.x, self.w = mk("x", x_dims), mk("dy", y_dims)
            out = g.conv_wgrad(image=self.x, loss=self.w, **conv_args)
            out.set_dim(w_dims).set_stride(nhwc_strides(w_dims))
            self.names = ("x", "dy", "dw")
        out.set_output(True).set_data_type(cudnn_dtype(dtype))
        self.y = out
        self.graph = g
        self.candidates, self.unsupported = build_plans(g)

    def launch(self, index: int, a, b, out, workspace) -> None:
        """a, b: the two inputs (x, w | dy, w | x, dy) and out, as CuPy arrays with NHWC strides."""
        self.graph.execute_plan_at_index({self.x: a, self.w: b, self.y: out}, workspace, index, handle=self.handle)


class ConvNode:
    """A conv-family graph node in the registry's interface: candidates (plan name, workspace bytes); inputs
    and outputs in the node's order ([x, w, b?] -> [y], [dy, w] -> [dx], [x, dy] -> [dw]). A conv bias is added
    by a second kernel after the cuDNN plan."""

    def __init__(self, kind: str, attrs: dict, ins, outs, handle):
        check_index_range(*ins, *outs)
        if kind == "conv":
            x, w, y = ins[0], ins[1], outs[0]
        elif kind == "conv_bwd_data":
            x, w, y = outs[0], ins[1], ins[0]
        else:
            x, w, y = ins[0], outs[0], ins[1]
        self.op = ConvOp(kind, attrs, list(x.shape), list(w.shape), list(y.shape), y.dtype, handle)
        self.candidates = [(name, workspace) for _, name, workspace in self.op.candidates]
        self.unsupported = self.op.unsupported
        self.bias = (y.numel, y.shape[1], y.dtype) if kind == "conv" and len(ins) > 2 else None

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        self.op.launch(self.op.candidates[index][0], inputs[0], inputs[1], outputs[0], workspace)
        if self.bias:
            channel_bias_add(outputs[0], inputs[2], *self.bias)


OPS = {kind: partial(ConvNode, kind) for kind in CONV_KINDS}
