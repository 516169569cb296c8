"""SGD with momentum (PyTorch's rule, dampening 0), one pass, in place when the outputs are the inputs."""

from __future__ import annotations

from runner.ops.common import SingleKernelOp, TensorSpec, check_index_range, f32, i32, kernel, launch_1d

SRC = r"""
// v' = momentum * v + dw * grad_unscale + weight_decay * w; w' = w - lr * v'; v is fp32 (master optimizer
// state); each element read before it is written
extern "C" __global__ void sgd(const T* w, const T* dw, const float* v, T* w_out, float* v_out, int n, float lr,
                               float momentum, float weight_decay, float grad_unscale) {
    GRID_LOOP(i, n) {
        float wv = ld(w, i), vn = momentum * v[i] + ld(dw, i) * grad_unscale + weight_decay * wv;
        v_out[i] = vn;
        st(w_out, i, wv - lr * vn);
    }
}
"""


class Sgd(SingleKernelOp):
    name = "cupy_elementwise"

    def __init__(self, attrs: dict, w: TensorSpec):
        check_index_range(w)
        self.dtype, self.n = w.dtype, w.numel
        self.params = (f32(attrs["lr"]), f32(attrs["momentum"]), f32(attrs["weight_decay"]),
                       f32(attrs.get("grad_unscale", 1.0)))

    def run(self, inputs, outputs, workspace):
        launch_1d(kernel(SRC, "sgd", self.dtype), self.n, *inputs, *outputs, i32(self.n), *self.params)


OPS = {"sgd": lambda a, i, o, h: Sgd(a, i[0])}
