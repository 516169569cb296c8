"""SGD with momentum (PyTorch's rule, dampening 0) for all of a layer's weights in one launch, in place when the
outputs are the inputs.

One thread per element. Grids of 32 or 128 blocks (a sliver of the GPU for longer) were tried as candidates and
measured slower on the H100 as planned: docs/BENCHMARKS.md, twenty-fourth session."""

from __future__ import annotations

from functools import cache

from runner.ops.common import KERNEL_TYPE, SingleKernelOp, TensorSpec, check_index_range, f32, i32, kernel, launch_1d

STEP = r"""
// v' = momentum * v + dw * grad_unscale + weight_decay * w; w' = w - lr * v'; v is fp32 (master optimizer
// state); each element read before it is written
template <typename W>
__device__ __forceinline__ void step(const W* w, const W* dw, const float* v, W* w_out, float* v_out, int i,
                                     float lr, float momentum, float weight_decay, float grad_unscale) {
    float wv = ld(w, i), vn = momentum * v[i] + ld(dw, i) * grad_unscale + weight_decay * wv;
    v_out[i] = vn;
    st(w_out, i, wv - lr * vn);
}
"""


@cache
def source(dtypes: tuple[str, ...]) -> str:
    """`sgd`: one grid over the weights' elements laid end to end; each thread finds its weight by the running
    sums of their sizes. Weights may differ in dtype (a conv's fp16 weight, its BatchNormalization's fp32 ones)."""
    types = [KERNEL_TYPE[d] for d in dtypes]
    params = ", ".join(f"const {t}* w{k}, const {t}* dw{k}, const float* v{k}, {t}* w_out{k}, float* v_out{k}, int n{k}"
                       for k, t in enumerate(types))
    total = " + ".join(f"n{k}" for k in range(len(types)))
    branches = []
    for k in range(len(types)):
        where = "i - (" + " + ".join(f"n{j}" for j in range(k)) + ")" if k else "i"
        call = f"step(w{k}, dw{k}, v{k}, w_out{k}, v_out{k}, {where}, lr, momentum, weight_decay, grad_unscale);"
        branches.append(call if k == len(types) - 1 else f"if ({where} < n{k}) {call} else")
    return STEP + (f"extern \"C\" __global__ void sgd({params}, float lr, float momentum, float weight_decay, "
                   f"float grad_unscale) {{\n    GRID_LOOP(i, {total}) {{\n        "
                   + "\n        ".join(branches) + "\n    }\n}\n")


class Sgd(SingleKernelOp):
    name = "cupy_elementwise"

    def __init__(self, attrs: dict, weights: list[TensorSpec]):
        check_index_range(TensorSpec((sum(w.numel for w in weights),), "fp32"))
        self.dtypes, self.sizes = tuple(w.dtype for w in weights), [w.numel for w in weights]
        self.params = (f32(attrs["lr"]), f32(attrs["momentum"]), f32(attrs["weight_decay"]),
                       f32(attrs.get("grad_unscale", 1.0)))

    def run(self, inputs, outputs, workspace):
        args = []
        for k, n in enumerate(self.sizes):
            args += [*inputs[3 * k:3 * k + 3], *outputs[2 * k:2 * k + 2], i32(n)]
        launch_1d(kernel(source(self.dtypes), "sgd"), sum(self.sizes), *args, *self.params)


OPS = {"sgd": lambda a, i, o, h: Sgd(a, i[0::3])}
