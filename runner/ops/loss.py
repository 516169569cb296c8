"""Softmax along the last axis (and its gradient), and the training loss: mean softmax cross-entropy over the
batch (fp32 loss and fp32 probabilities) and its gradient.

One block per row; a row of a 4-D tensor runs along W, which in NHWC memory is strided by C, so rows are
addressed as (a, b) of a physical [A, K, B] view: start a * K * B + b, stride B.
"""

from __future__ import annotations

import math

from runner.ops.common import (
    SingleKernelOp, TensorSpec, check_index_range, f32, i32, kernel, launch_1d, physical, physical_axis,
)

SRC = r"""
#define ROW_START long long base = (long long)(blockIdx.x / B) * K * B + blockIdx.x % B;
#define ROW_LOOP(k) for (int k = threadIdx.x; k < K; k += blockDim.x)

extern "C" __global__ void softmax_fwd(const T* x, T* y, int K, int B) {
    ROW_START
    float m = NEG_INF, s = 0.f;
    ROW_LOOP(k) m = fmaxf(m, ld(x, base + (long long)k * B));
    m = block_max(m);
    ROW_LOOP(k) s += expf(ld(x, base + (long long)k * B) - m);
    float inv = 1.f / block_sum(s);
    ROW_LOOP(k) { long long o = base + (long long)k * B; st(y, o, expf(ld(x, o) - m) * inv); }
}

extern "C" __global__ void softmax_bwd(const T* y, const T* dy, T* dx, int K, int B) {
    ROW_START
    float d = 0.f;
    ROW_LOOP(k) { long long o = base + (long long)k * B; d += ld(dy, o) * ld(y, o); }
    d = block_sum(d);
    ROW_LOOP(k) { long long o = base + (long long)k * B; st(dx, o, ld(y, o) * (ld(dy, o) - d)); }
}

// one block per sample: fp32 probabilities and the sample's loss, log-sum-exp - logit[label]
extern "C" __global__ void xent_rows(const T* logits, const long long* labels, float* probs, float* row_loss,
                                     int K) {
    const int B = 1;
    ROW_START
    float m = NEG_INF, s = 0.f;
    ROW_LOOP(k) m = fmaxf(m, ld(logits, base + k));
    m = block_max(m);
    ROW_LOOP(k) s += expf(ld(logits, base + k) - m);
    s = block_sum(s);
    float inv = 1.f / s;
    ROW_LOOP(k) probs[base + k] = expf(ld(logits, base + k) - m) * inv;
    if (threadIdx.x == 0) {
        long long label = labels[blockIdx.x];
        row_loss[blockIdx.x] = (label >= 0 && label < K) ? m + logf(s) - ld(logits, base + label) : 0.f;
    }
}

extern "C" __global__ void xent_mean(const float* row_loss, float* loss, int N) {
    float s = 0.f;
    for (int r = threadIdx.x; r < N; r += blockDim.x) s += row_loss[r];
    s = block_sum(s);
    if (threadIdx.x == 0) loss[0] = s / N;
}

extern "C" __global__ void xent_bwd(const float* probs, const long long* labels, T* dx, int n, int K, float inv_n) {
    GRID_LOOP(i, n) {
        int r = i / K, k = i - r * K;
        st(dx, i, (probs[i] - (labels[r] == k ? 1.f : 0.f)) * inv_n);
    }
}
"""


def _row_threads(k: int) -> int:
    return min(256, 32 * -(-k // 32))


class Softmax(SingleKernelOp):
    name = "cupy_rows"

    def __init__(self, kind: str, attrs: dict, x: TensorSpec):
        check_index_range(x)
        dims = physical(x.shape)
        p = physical_axis(attrs["axis"], len(x.shape))
        self.kernel_name = "softmax_fwd" if kind == "softmax" else "softmax_bwd"
        self.dtype, self.k, self.b = x.dtype, dims[p], math.prod(dims[p + 1:])
        self.rows = math.prod(dims[:p]) * self.b

    def run(self, inputs, outputs, workspace):
        kernel(SRC, self.kernel_name, self.dtype)((self.rows,), (_row_threads(self.k),),
                                                  (*inputs, outputs[0], i32(self.k), i32(self.b)))


class SoftmaxXent(SingleKernelOp):
    """[logits, labels] -> [loss, probs]: per-sample losses in the workspace, then their mean."""

    name = "cupy_rows"

    def __init__(self, logits: TensorSpec):
        check_index_range(logits)
        self.dtype, (self.n, self.k) = logits.dtype, logits.shape
        self.workspace_bytes = -(-self.n * 4 // 16) * 16

    def run(self, inputs, outputs, workspace):
        logits, labels = inputs
        loss, probs = outputs
        kernel(SRC, "xent_rows", self.dtype)((self.n,), (_row_threads(self.k),),
                                             (logits, labels, probs, workspace, i32(self.k)))
        kernel(SRC, "xent_mean", self.dtype)((1,), (256,), (workspace, loss, i32(self.n)))


class SoftmaxXentBwd(SingleKernelOp):
    name = "cupy_elementwise"

    def __init__(self, attrs: dict, dx: TensorSpec):
        check_index_range(dx)
        self.dtype, self.numel = dx.dtype, dx.numel
        self.params = (i32(dx.shape[1]), f32(attrs.get("loss_scale", 1.0) / dx.shape[0]))

    def run(self, inputs, outputs, workspace):
        launch_1d(kernel(SRC, "xent_bwd", self.dtype), self.numel, *inputs, outputs[0], i32(self.numel), *self.params)


OPS = {
    "softmax": lambda a, i, o, h: Softmax("softmax", a, i[0]),
    "softmax_bwd": lambda a, i, o, h: Softmax("softmax_bwd", a, i[0]),
    "softmax_xent": lambda a, i, o, h: SoftmaxXent(i[0]),
    "softmax_xent_bwd": lambda a, i, o, h: SoftmaxXentBwd(a, o[0]),
}
