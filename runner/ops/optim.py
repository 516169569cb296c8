"""SGD with momentum (PyTorch's rule, dampening 0), one pass, in place when the outputs are the inputs."""

from __future__ import annotations

from runner.ops.common import SingleKernelOp, TensorSpec, check_index_range, f32, i32, kernel, launch_1d

SRC = r"""
// v' = momentum * v + dw + weight_decay * w; w' = w - lr * v'; each element read before it is written
extern "C" __global__ void sgd(const T* w, const T* dw, const T* v, T* w_out, T* v_out, int n, float lr,
                               float momentum, float weight_decay) {
    GRID_LOOP(i, n) {
        float wv = ld(w, i), vn = momentum * ld(v, i) + ld(dw, i) + weight_decay * wv;
        st(v_out, i, vn);
        st(w_out, i, wv - lr * vn);
    }
}
"""


class Sgd(SingleKernelOp):
    name = "cupy_elementwise"

    def __init__(self, attrs: dict, w: TensorSpec):
        check_index_range(w)
        self.dtype, self.n = w.dtype, w.numel
        self.params = (f32(attrs["lr"]), f32(attrs["momentum"]), f32(attrs["weight_decay"]))

    def run(self, inputs, outputs, workspace):
        launch_1d(kernel(SRC, "sgd", self.dtype), self.n, *inputs, *outputs, i32(self.n), *self.params)


OPS = {"sgd": lambda a, i, o, h: Sgd(a, i[0])}
