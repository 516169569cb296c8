"""Convolutions (forward, data gradient, weight gradient) as cuDNN frontend graphs, every engine config a
candidate. Tensors are channels-last (NHWC) in memory with logical NCHW dims, as cuDNN's fastest engines want.
"""

from __future__ import annotations

from runner.gpu import cudnn_dtype, gpu

CONV_KINDS = ("conv", "conv_bwd_data", "conv_bwd_filter")


def nhwc_strides(dims: list[int]) -> list[int]:
    n, c, h, w = dims
    return [c * h * w, 1, w * c, c]


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
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
        self.graph = g
        self.unsupported: list[tuple[str, str]] = []
        self.candidates: list[tuple[int, str, int]] = []  # (plan index, plan name, workspace bytes)
        seen = set()
        for i in range(g.get_execution_plan_count()):
            try:
                name = g.get_plan_name_at_index(i)
                workspace = int(g.get_workspace_size_plan_at_index(i))
            except Exception as e:  # noqa: BLE001 - a plan that did not build is recorded, not fatal
                self.unsupported.append((f"plan{i}", f"{type(e).__name__}: {str(e)[:120]}"))
                continue
            if name not in seen:
                seen.add(name)
                self.candidates.append((i, name, workspace))

    def launch(self, index: int, a, b, out, workspace) -> None:
        """a, b: the two inputs (x, w | dy, w | x, dy) and out, as CuPy arrays with NHWC strides."""
        self.graph.execute_plan_at_index({self.x: a, self.w: b, self.y: out}, workspace, index, handle=self.handle)
