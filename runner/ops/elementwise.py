"""Pointwise activations and arithmetic, gradient sums, dropout, concat/slice, and the sums that undo
broadcasting (bias_grad, reduce_to_shape).

Operands of one shape share the layout, so a pointwise kernel runs over the flat memory. Broadcasting operands
are read through physical strides (0 along broadcast dims). Concat and slice along an axis are 2-D strided
copies in memory order (channel concat of NHWC tensors interleaves rows), moving the widest unit that every
offset and pitch allows.
"""

from __future__ import annotations

import math

import numpy as np

from runner.ops.common import (
    NUMPY_DTYPE, SingleKernelOp, TensorSpec, blocks_for, broadcast_view, check_index_range, f32, i32, kernel,
    launch_1d, launch_flat, launch_rows, logical_strides, physical, physical_axis,
)
from runner.ops.reduce import Reduction

SRC = r"""
extern "C" __global__ void relu_fwd(const T* x, T* y, int n, int nv) {
    map_flat<1>(x, x, y, n, nv, [](float v, float) { return v > 0.f ? v : 0.f; });
}
extern "C" __global__ void relu_bwd(const T* y, const T* dy, T* dx, int n, int nv) {
    map_flat<2>(y, dy, dx, n, nv, [](float v, float g) { return v > 0.f ? g : 0.f; });
}
// map_flat over channel slices of wider NHWC buffers (a concat_view's output, its gradient): element i is channel
// i % c of pixel i / c, and each operand's pixels are its own pitch (pa, pb, py) apart; VEC a thread when c and
// every pitch are multiples of VEC
template <int K, class F> __device__ __forceinline__ void map_rows(const T* a, const T* b, T* y, int n, int nv,
                                                                   int c, int pa, int pb, int py, F f) {
    int t = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    for (int j = t; j < nv; j += stride) {
        int r = j * VEC / c, k = j * VEC - r * c;
        float u[VEC], v[VEC] = {};
        ldv<VEC>(a, (long long)r * pa + k, u);
        if (K == 2) ldv<VEC>(b, (long long)r * pb + k, v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) u[e] = f(u[e], v[e]);
        stv<VEC>(y, (long long)r * py + k, u);
    }
    for (int i = nv * VEC + t; i < n; i += stride) {
        int r = i / c, k = i - r * c;
        st(y, (long long)r * py + k, f(ld(a, (long long)r * pa + k), K == 2 ? ld(b, (long long)r * pb + k) : 0.f));
    }
}
extern "C" __global__ void relu_fwd_rows(const T* x, T* y, int n, int nv, int c, int px, int py) {
    map_rows<1>(x, x, y, n, nv, c, px, px, py, [](float v, float) { return v > 0.f ? v : 0.f; });
}
extern "C" __global__ void relu_bwd_rows(const T* y, const T* dy, T* dx, int n, int nv, int c, int py, int pdy,
                                         int pdx) {
    map_rows<2>(y, dy, dx, n, nv, c, py, pdy, pdx, [](float v, float g) { return v > 0.f ? g : 0.f; });
}
extern "C" __global__ void clip_fwd(const T* x, T* y, int n, int nv, float lo, float hi) {
    map_flat<1>(x, x, y, n, nv, [=](float v, float) { return fminf(fmaxf(v, lo), hi); });
}
extern "C" __global__ void clip_bwd(const T* x, const T* dy, T* dx, int n, int nv, float lo, float hi) {
    map_flat<2>(x, dy, dx, n, nv, [=](float v, float g) { return (v > lo && v < hi) ? g : 0.f; });
}
extern "C" __global__ void sigmoid_fwd(const T* x, T* y, int n, int nv) {
    map_flat<1>(x, x, y, n, nv, [](float v, float) { return 1.f / (1.f + expf(-v)); });
}
extern "C" __global__ void sigmoid_bwd(const T* y, const T* dy, T* dx, int n, int nv) {
    map_flat<2>(y, dy, dx, n, nv, [](float v, float g) { return g * v * (1.f - v); });
}
extern "C" __global__ void add_flat(const T* a, const T* b, T* y, int n, int nv) {
    map_flat<2>(a, b, y, n, nv, [](float u, float v) { return u + v; });
}
extern "C" __global__ void mul_flat(const T* a, const T* b, T* y, int n, int nv) {
    map_flat<2>(a, b, y, n, nv, [](float u, float v) { return u * v; });
}
// y (contiguous, physical dims d0..d3) = a op b, a and b read through physical strides (0 where broadcast)
extern "C" __global__ void binary_bcast(const T* a, const T* b, T* y, int n, int mul, int d1, int d2, int d3,
        int sa0, int sa1, int sa2, int sa3, int sb0, int sb1, int sb2, int sb3) {
    GRID_LOOP(i, n) {
        int t = i, i3 = t % d3; t /= d3;
        int i2 = t % d2; t /= d2;
        int i1 = t % d1, i0 = t / d1;
        float u = ld(a, (long long)i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3);
        float v = ld(b, (long long)i0 * sb0 + i1 * sb1 + i2 * sb2 + i3 * sb3);
        st(y, i, mul ? u * v : u + v);
    }
}
// y = p[0] + ... + p[k-1] (k <= 8), with MASK zero where mask is not positive, vectorised like map_flat
template <bool MASK> __device__ __forceinline__ void sum_flat(const T* const (&p)[8], int k, const T* mask, T* y,
                                                              int n, int nv) {
    int t = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    for (int j = t; j < nv; j += stride) {
        float acc[VEC], v[VEC];
        ldv<VEC>(p[0], (long long)j * VEC, acc);
#pragma unroll
        for (int s = 1; s < 8; ++s) {
            if (s < k) {
                ldv<VEC>(p[s], (long long)j * VEC, v);
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[e] += v[e];
            }
        }
        if (MASK) {
            ldv<VEC>(mask, (long long)j * VEC, v);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] = v[e] > 0.f ? acc[e] : 0.f;
        }
        stv<VEC>(y, (long long)j * VEC, acc);
    }
    for (int i = nv * VEC + t; i < n; i += stride) {
        float acc = ld(p[0], i);
#pragma unroll
        for (int s = 1; s < 8; ++s) if (s < k) acc += ld(p[s], i);
        st(y, i, MASK && !(ld(mask, i) > 0.f) ? 0.f : acc);
    }
}
extern "C" __global__ void sum8(const T* p0, const T* p1, const T* p2, const T* p3, const T* p4, const T* p5,
                                const T* p6, const T* p7, T* y, int n, int nv, int k) {
    const T* p[8] = {p0, p1, p2, p3, p4, p5, p6, p7};
    sum_flat<false>(p, k, p0, y, n, nv);
}
// a ReLU's backward after the gradient sum before it (fuse.with_relu_sums): dx = (p0 + ... + p(k-1)) * (y > 0),
// k <= 7
extern "C" __global__ void relu_bwd_sum(const T* y, const T* p0, const T* p1, const T* p2, const T* p3,
                                        const T* p4, const T* p5, const T* p6, T* dx, int n, int nv, int k) {
    const T* p[8] = {p0, p1, p2, p3, p4, p5, p6, p6};
    sum_flat<true>(p, k, y, dx, n, nv);
}
// keep[i] = fmix32(i * 0x9E3779B1 + seed_term) >= thr, i the logical (NCHW) index of the element
extern "C" __global__ void dropout_fwd(const T* x, T* y, unsigned char* mask, int n, int C, int H, int W,
        int nhwc, unsigned long long thr, unsigned int seed_term, float scale) {
    GRID_LOOP(i, n) {
        unsigned int li = i;
        if (nhwc) {
            int c = i % C, t = i / C, w = t % W; t /= W;
            int h = t % H, b = t / H;
            li = ((unsigned int)(b * C + c) * H + h) * W + w;
        }
        unsigned int k = li * 0x9E3779B1u + seed_term;
        k ^= k >> 16; k *= 0x85EBCA6Bu; k ^= k >> 13; k *= 0xC2B2AE35u; k ^= k >> 16;
        bool keep = (unsigned long long)k >= thr;
        mask[i] = keep;
        st(y, i, keep ? ld(x, i) * scale : 0.f);
    }
}
extern "C" __global__ void dropout_bwd(const T* dy, const unsigned char* mask, T* dx, int n, float scale) {
    GRID_LOOP(i, n) st(dx, i, mask[i] ? ld(dy, i) * scale : 0.f);
}
#define COPY2D(NAME, U) \
extern "C" __global__ void NAME(const U* src, int src_ld, int src_off, U* dst, int dst_ld, int dst_off, \
                                int rows, int cols) { \
    GRID_LOOP(i, rows * cols) { \
        int r = i / cols, c = i - r * cols; \
        dst[dst_off + (long long)r * dst_ld + c] = src[src_off + (long long)r * src_ld + c]; \
    } \
}
COPY2D(copy2d_1, unsigned char)
COPY2D(copy2d_2, unsigned short)
COPY2D(copy2d_4, unsigned int)
COPY2D(copy2d_8, unsigned long long)
COPY2D(copy2d_16, uint4)
"""


class Pointwise(SingleKernelOp):
    """Same-shape operands over flat memory: a `map_flat` kernel(inputs..., outputs..., n, nv, params...), or with
    `flat=False` one thread per element, kernel(inputs..., outputs..., n, params...)."""

    name = "cupy_elementwise"

    def __init__(self, kernel_name: str, s: TensorSpec, params=(), flat: bool = True):
        check_index_range(s)
        self.kernel_name, self.dtype, self.n, self.params = kernel_name, s.dtype, s.numel, tuple(params)
        self.flat = flat

    def run(self, inputs, outputs, workspace):
        fn = kernel(SRC, self.kernel_name, self.dtype)
        if self.flat:
            launch_flat(fn, self.n, self.dtype, [*inputs, *outputs], *self.params)
        else:
            launch_1d(fn, self.n, *inputs, *outputs, i32(self.n), *self.params)


class SlicedPointwise(SingleKernelOp):
    """relu / relu_bwd on channel slices (`TensorSpec.row_channels`) of wider NHWC buffers: a `map_rows` kernel
    (inputs..., outputs..., n, nv, c, pitch of each operand)."""

    name = "cupy_elementwise"

    def __init__(self, kernel_name: str, operands: list[TensorSpec]):
        check_index_range(*operands)
        self.kernel_name, self.dtype, self.n = kernel_name, operands[-1].dtype, operands[-1].numel
        self.channels = operands[-1].shape[1]
        self.pitches = [s.row_channels or s.shape[1] for s in operands]

    def run(self, inputs, outputs, workspace):
        launch_rows(kernel(SRC, self.kernel_name, self.dtype), self.n, self.channels, self.dtype,
                    [*inputs, *outputs], self.pitches)


def _relu(attrs, ins, outs, handle):
    if outs[0].row_channels:
        return SlicedPointwise("relu_fwd_rows", [ins[0], outs[0]])
    return Pointwise("relu_fwd", outs[0])


def _relu_bwd(attrs, ins, outs, handle):
    if len(ins) > 2:
        return ReluBwdSum(outs[0], len(ins) - 1)
    if ins[0].row_channels:
        return SlicedPointwise("relu_bwd_rows", [ins[0], ins[1], outs[0]])
    return Pointwise("relu_bwd", outs[0])


class Binary(SingleKernelOp):
    """add / mul with numpy broadcasting."""

    name = "cupy_elementwise"

    def __init__(self, mul: bool, a: TensorSpec, b: TensorSpec, y: TensorSpec):
        check_index_range(y)
        if len(y.shape) > 4:
            raise ValueError(f"broadcasting over {len(y.shape)} dims (at most 4)")
        self.mul, self.dtype, self.n = mul, y.dtype, y.numel
        self.same = a.shape == b.shape == y.shape
        rank = len(y.shape)
        dims, _ = broadcast_view(y.shape, rank)
        _, sa = broadcast_view(a.shape, rank)
        _, sb = broadcast_view(b.shape, rank)
        pad = 4 - rank
        self.dims = [1] * pad + dims
        self.strides = [0] * pad + sa + [0] * pad + sb

    def run(self, inputs, outputs, workspace):
        if self.same:
            name = "mul_flat" if self.mul else "add_flat"
            launch_flat(kernel(SRC, name, self.dtype), self.n, self.dtype, [inputs[0], inputs[1], outputs[0]])
            return
        launch_1d(kernel(SRC, "binary_bcast", self.dtype), self.n, inputs[0], inputs[1], outputs[0], i32(self.n),
                  i32(self.mul), *(i32(d) for d in self.dims[1:]), *(i32(s) for s in self.strides))


class Sum(SingleKernelOp):
    """Gradient accumulation: eight operands per kernel, the running total carried into the next."""

    name = "cupy_elementwise"

    def __init__(self, s: TensorSpec, count: int):
        check_index_range(s)
        self.dtype, self.n, self.count = s.dtype, s.numel, count

    def run(self, inputs, outputs, workspace):
        fn, y = kernel(SRC, "sum8", self.dtype), outputs[0]
        chunk, rest = list(inputs[:8]), list(inputs[8:])
        while True:
            k = len(chunk)
            launch_flat(fn, self.n, self.dtype, chunk + [y] * (9 - k), i32(k))
            if not rest:
                return
            chunk, rest = [y] + rest[:7], rest[7:]


class ReluBwdSum(SingleKernelOp):
    """A ReLU's backward that adds up its output's gradients first (fuse.with_relu_sums: the gradient sum of a
    ResNet block's output, read by the next block's conv and residual Add): [y, dy1, ..., dyk], k <= 7."""

    name = "cupy_elementwise"

    def __init__(self, s: TensorSpec, count: int):
        check_index_range(s)
        if count > 7:
            raise ValueError(f"a ReLU's backward sums at most 7 gradients ({count} given)")
        self.dtype, self.n = s.dtype, s.numel

    def run(self, inputs, outputs, workspace):
        grads = list(inputs[1:])
        launch_flat(kernel(SRC, "relu_bwd_sum", self.dtype), self.n, self.dtype,
                    [inputs[0], *grads, *grads[-1:] * (7 - len(grads)), outputs[0]], i32(len(grads)))


class Dropout(SingleKernelOp):
    """y = x * keep / (1 - ratio) with the reference's counter-based mask, hashed on the logical index."""

    name = "cupy_elementwise"

    def __init__(self, attrs, x: TensorSpec):
        check_index_range(x)
        self.dtype, self.n = x.dtype, x.numel
        ratio = attrs["ratio"]
        self.nhwc = len(x.shape) == 4
        c, h, w = (x.shape[1], x.shape[2], x.shape[3]) if self.nhwc else (1, 1, 1)
        self.params = (i32(c), i32(h), i32(w), i32(self.nhwc), np.uint64(math.floor(ratio * 2**32)),
                       np.uint32((attrs["seed"] * 0x85EBCA77) & 0xFFFFFFFF), f32(1.0 / (1.0 - ratio)))

    def run(self, inputs, outputs, workspace):
        launch_1d(kernel(SRC, "dropout_fwd", self.dtype), self.n, inputs[0], outputs[0], outputs[1], i32(self.n),
                  *self.params)


class StridedCopies(SingleKernelOp):
    """Concat (many sources into one destination) and slice (one source): 2-D copies in memory order."""

    name = "cupy_copy"

    def __init__(self, copies: list[tuple[int, int, int, int, int, int]], itemsize: int):
        """copies: (src_ld, src_off, dst_ld, dst_off, rows, cols) in elements, one per source operand."""
        self.copies = [tuple(v * (itemsize if j != 4 else 1) for j, v in enumerate(c)) for c in copies]
        for c in self.copies:
            if c[4] * c[5] // itemsize >= 1 << 31:
                raise ValueError("copy beyond the kernels' 32-bit indexing")

    def run(self, inputs, outputs, workspace):
        dst = outputs[0]
        for src, (src_ld, src_off, dst_ld, dst_off, rows, cols) in zip(inputs, self.copies):
            unit = next(u for u in (16, 8, 4, 2, 1) if (src_ld | src_off | dst_ld | dst_off | cols | src.data.ptr
                                                         | dst.data.ptr) % u == 0)
            fn = kernel(SRC, f"copy2d_{unit}")
            n = rows * (cols // unit)
            fn((blocks_for(n),), (256,), (src, i32(src_ld // unit), i32(src_off // unit), dst, i32(dst_ld // unit),
                                          i32(dst_off // unit), i32(rows), i32(cols // unit)))


def _axis_block(shape, axis: int) -> tuple[int, int, int]:
    """(rows, length along the axis, inner elements per axis step) of a tensor seen in memory order."""
    dims = physical(shape)
    p = physical_axis(axis, len(shape))
    return math.prod(dims[:p]), dims[p], math.prod(dims[p + 1:])


def _concat(attrs, ins, outs, handle):
    rows, total, inner = _axis_block(outs[0].shape, attrs["axis"])
    copies, start = [], 0
    for s in ins:
        _, size, _ = _axis_block(s.shape, attrs["axis"])
        copies.append((size * inner, 0, total * inner, start * inner, rows, size * inner))
        start += size
    return StridedCopies(copies, np.dtype(NUMPY_DTYPE[outs[0].dtype]).itemsize)


def _slice(attrs, ins, outs, handle):
    rows, total, inner = _axis_block(ins[0].shape, attrs["axis"])
    size = attrs["end"] - attrs["start"]
    copy = (total * inner, attrs["start"] * inner, size * inner, 0, rows, size * inner)
    return StridedCopies([copy], np.dtype(NUMPY_DTYPE[outs[0].dtype]).itemsize)


class Reduce(SingleKernelOp):
    """bias_grad and reduce_to_shape: a Reduction of the input into the output."""

    name = "cupy_reduce"

    def __init__(self, reduction: Reduction):
        self.reduction, self.workspace_bytes = reduction, reduction.workspace_bytes

    def run(self, inputs, outputs, workspace):
        self.reduction.launch(inputs[0], outputs[0], workspace)


def _bias_grad(attrs, ins, outs, handle):
    rank, axis = len(ins[0].shape), attrs["axis"]
    dims = [ins[0].shape[axis] if i == axis else 1 for i in range(rank)]
    return Reduce(Reduction(ins[0], dims, [1 if i == axis else 0 for i in range(rank)]))


def _reduce_to_shape(attrs, ins, outs, handle):
    rank, shape = len(ins[0].shape), list(outs[0].shape)
    pad = rank - len(shape)
    return Reduce(Reduction(ins[0], [1] * pad + shape, [0] * pad + logical_strides(shape)))


def _clip_params(attrs):
    return f32(attrs["min"]), f32(attrs["max"])


OPS = {
    "relu": _relu,
    "relu_bwd": _relu_bwd,
    "clip": lambda a, i, o, h: Pointwise("clip_fwd", o[0], _clip_params(a)),
    "clip_bwd": lambda a, i, o, h: Pointwise("clip_bwd", o[0], _clip_params(a)),
    "sigmoid": lambda a, i, o, h: Pointwise("sigmoid_fwd", o[0]),
    "sigmoid_bwd": lambda a, i, o, h: Pointwise("sigmoid_bwd", o[0]),
    "add": lambda a, i, o, h: Binary(False, i[0], i[1], o[0]),
    "mul": lambda a, i, o, h: Binary(True, i[0], i[1], o[0]),
    "sum": lambda a, i, o, h: Sum(o[0], len(i)),
    "dropout": lambda a, i, o, h: Dropout(a, i[0]),
    "dropout_bwd": lambda a, i, o, h: Pointwise("dropout_bwd", o[0], (f32(1.0 / (1.0 - a["ratio"])),), flat=False),
    "concat": _concat,
    "slice": _slice,
    "bias_grad": _bias_grad,
    "reduce_to_shape": _reduce_to_shape,
}
