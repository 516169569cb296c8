"""Max, average and global-average pooling and their gradients on NHWC tensors, with the reference's geometry:
explicit [t, l, b, r] pads, dilations (max), ceil_mode windows that run past the pads (never counted), and
count_include_pad counting the explicit pads only.

Threads map to consecutive channels, so every load is coalesced; each thread takes a group of channels read
with 16-byte accesses (eight fp16 values) when the channel count and alignment allow. Gradients gather rather
than scatter (runner/ops/pool_grad.py holds their source). maxpool_bwd first records each window's first maximum
(row-major order, as the reference's argmax) in the workspace, then gathers.
"""

from __future__ import annotations

from runner.ops.common import (
    SingleKernelOp, TensorSpec, check_index_range, f32, i32, kernel, launch_1d, vector_width,
)
from runner.ops.pool_grad import BLOCK, BLOCK_WINDOWS, GRADIENT_SRC
from runner.ops.reduce import Reduction

FORWARD_SRC = r"""
// 32-bit offsets: Pool checks every tensor holds fewer than 2^31 elements (64-bit ones cost the gather 10%)
#define X_AT(hh, ww) (((b * H + (hh)) * W + (ww)) * C + c)
#define Y_AT(pp, qq) (((b * P + (pp)) * Q + (qq)) * C + c)
#define GEOMETRY int C, int H, int W, int P, int Q, int kh, int kw, int sh, int sw
#define MAX_GEOMETRY GEOMETRY, int dh, int dw, int pt, int pl
#define MAX_ARGS C, H, W, P, Q, kh, kw, sh, sw, dh, dw, pt, pl
// Max pooling reads 16 bytes a thread (V = VEC elements of one pixel's channels) when C and alignment allow, else
// one element: i counts groups, c is the group's first channel. The 16-byte path works on 32-bit words with
// packed instructions (two halves a word in fp16): the kernels were compute-bound, converting and comparing
// element by element (ncu, inception3b's pool of GoogLeNet b32 fp16 on H100: SM throughput 69%, memory 18%).
#define GROUP_OUT(V) int g = i % (C / V), t = i / (C / V), q = t % Q; t /= Q; int p = t % P, b = t / P, c = g * V;
#define GROUP_IN(V) int g = i % (C / V), t = i / (C / V), w = t % W; t /= W; int h = t % H, b = t / H, c = g * V;
#define EW (4 / (int)sizeof(T))  // elements a 32-bit word holds
// the window's taps in row-major order; K > 0: a K x K window, unrolled so its loads issue together
#define FOR_TAPS(K, BODY) \
    _Pragma("unroll") for (int ki = 0; ki < (K ? K : kh); ++ki) { \
        int h = p * sh - pt + ki * dh; \
        if (h < 0 || h >= H) continue; \
        _Pragma("unroll") for (int kj = 0; kj < (K ? K : kw); ++kj) { \
            int w = q * sw - pl + kj * dw; \
            if (w < 0 || w >= W) continue; \
            BODY \
        } \
    }

// V one-byte taps moved with one V-byte access
template <int V> struct __align__(V) Taps { unsigned char tap[V]; };

// the larger of two words element by element, NaN if either is (the reference's max)
__device__ __forceinline__ unsigned max_word(const half_bits*, unsigned a, unsigned b) {
    unsigned d;
    asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ unsigned max_word(const float*, unsigned a, unsigned b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(__uint_as_float(a)), "f"(__uint_as_float(b)));
    return __float_as_uint(d);
}
// a running first maximum, element by element: where v is strictly greater than best, the tap moves to t (taps
// are kept a register each: packing them into bytes as they change cost more than the comparisons saved)
__device__ __forceinline__ void argmax_word(const half_bits*, unsigned v, unsigned& best, unsigned* tap, unsigned t) {
    asm("{\n\t.reg .pred gl, gh;\n\tsetp.gt.f16x2 gl|gh, %3, %0;\n\tselp.b32 %1, %4, %1, gl;\n\t"
        "selp.b32 %2, %4, %2, gh;\n\tmax.f16x2 %0, %0, %3;\n\t}" : "+r"(best), "+r"(tap[0]), "+r"(tap[1])
        : "r"(v), "r"(t));
}
__device__ __forceinline__ void argmax_word(const float*, unsigned v, unsigned& best, unsigned* tap, unsigned t) {
    if (__uint_as_float(v) > __uint_as_float(best)) { best = v; tap[0] = t; }
}

// y = window max, 16 bytes a thread
template <int K> __device__ void maxpool_words(const T* x, T* y, int n, MAX_GEOMETRY) {
    const unsigned lowest = sizeof(T) == 2 ? 0xfc00fc00u : 0xff800000u;  // -inf in every element
    GRID_LOOP(i, n) {
        GROUP_OUT(VEC)
        uint4 best = make_uint4(lowest, lowest, lowest, lowest);
        FOR_TAPS(K,
            uint4 v = *reinterpret_cast<const uint4*>(x + X_AT(h, w));
            best.x = max_word(x, best.x, v.x);
            best.y = max_word(x, best.y, v.y);
            best.z = max_word(x, best.z, v.z);
            best.w = max_word(x, best.w, v.w);
        )
        *reinterpret_cast<uint4*>(y + Y_AT(p, q)) = best;
    }
}

// each window's first maximum (row-major, as the reference's argmax) as the tap index ki * kw + kj, 255 when the
// window holds no input element; 16 bytes a thread. The first tap in the window sets the running maximum, so a
// window of -inf still names its first element.
template <int K> __device__ void maxpool_argmax_words(const T* x, unsigned char* arg, int n, MAX_GEOMETRY) {
    GRID_LOOP(i, n) {
        GROUP_OUT(VEC)
        uint4 best;
        unsigned tap[VEC];
        bool seen = false;
#pragma unroll
        for (int e = 0; e < VEC; ++e) tap[e] = 255;
        FOR_TAPS(K,
            uint4 v = *reinterpret_cast<const uint4*>(x + X_AT(h, w));
            unsigned t = ki * kw + kj;
            if (!seen) {
                best = v;
                _Pragma("unroll") for (int e = 0; e < VEC; ++e) tap[e] = t;
                seen = true;
                continue;
            }
            argmax_word(x, v.x, best.x, tap, t);
            argmax_word(x, v.y, best.y, tap + EW, t);
            argmax_word(x, v.z, best.z, tap + 2 * EW, t);
            argmax_word(x, v.w, best.w, tap + 3 * EW, t);
        )
        Taps<VEC> taps;
#pragma unroll
        for (int e = 0; e < VEC; ++e) taps.tap[e] = tap[e];
        *reinterpret_cast<Taps<VEC>*>(arg + Y_AT(p, q)) = taps;
    }
}

// the same one element a thread: y = window max (NaN if any element is), or the first maximum's tap
__device__ void maxpool_elements(const T* x, T* y, unsigned char* arg, int n, MAX_GEOMETRY) {
    GRID_LOOP(i, n) {
        GROUP_OUT(1)
        float best = NEG_INF;
        unsigned char tap = 255;
        FOR_TAPS(0,
            float v = ld(x, X_AT(h, w));
            if (y ? v > best || v != v : tap == 255 || v > best) { best = v; tap = ki * kw + kj; }
        )
        long long o = Y_AT(p, q);
        if (y) st(y, o, best);
        else arg[o] = tap;
    }
}

extern "C" __global__ void maxpool_fwd_1(const T* x, T* y, int n, MAX_GEOMETRY) {
    maxpool_elements(x, y, nullptr, n, MAX_ARGS);
}
extern "C" __global__ void maxpool_fwd_vec(const T* x, T* y, int n, MAX_GEOMETRY) {
    if (kh == 3 && kw == 3) maxpool_words<3>(x, y, n, MAX_ARGS);
    else maxpool_words<0>(x, y, n, MAX_ARGS);
}
extern "C" __global__ void maxpool_argmax_1(const T* x, unsigned char* arg, int n, MAX_GEOMETRY) {
    maxpool_elements(x, nullptr, arg, n, MAX_ARGS);
}
extern "C" __global__ void maxpool_argmax_vec(const T* x, unsigned char* arg, int n, MAX_GEOMETRY) {
    if (kh == 3 && kw == 3) maxpool_argmax_words<3>(x, arg, n, MAX_ARGS);
    else maxpool_argmax_words<0>(x, arg, n, MAX_ARGS);
}
__device__ __forceinline__ int avg_count(int hs, int ws, int kh, int kw, int H, int W, int pt, int pl, int pb,
                                         int pr, int include_pad) {
    if (include_pad) return (min(hs + kh, H + pb) - max(hs, -pt)) * (min(ws + kw, W + pr) - max(ws, -pl));
    return (min(hs + kh, H) - max(hs, 0)) * (min(ws + kw, W) - max(ws, 0));
}

// y = window mean, V channels a thread (16-byte accesses when VEC); K > 0: a K x K window, unrolled
template <int V, int K> __device__ void avgpool_groups(const T* x, T* y, int n, GEOMETRY, int pt, int pl, int pb,
                                                       int pr, int include_pad) {
    const int dh = 1, dw = 1;  // FOR_TAPS's dilations
    GRID_LOOP(i, n) {
        GROUP_OUT(V)
        float acc[V], v[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.f;
        FOR_TAPS(K,
            ldv<V>(x, X_AT(h, w), v);
            _Pragma("unroll") for (int e = 0; e < V; ++e) acc[e] += v[e];
        )
        float scale = 1.f / avg_count(p * sh - pt, q * sw - pl, kh, kw, H, W, pt, pl, pb, pr, include_pad);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] *= scale;
        stv<V>(y, Y_AT(p, q), acc);
    }
}

#define AVG_ARGS C, H, W, P, Q, kh, kw, sh, sw, pt, pl, pb, pr, include_pad
#define AVGPOOL(SUFFIX, V) \
extern "C" __global__ void avgpool_fwd##SUFFIX(const T* x, T* y, int n, GEOMETRY, int pt, int pl, int pb, int pr, \
                                               int include_pad) { \
    if (kh == 3 && kw == 3) avgpool_groups<V, 3>(x, y, n, AVG_ARGS); \
    else if (kh == 2 && kw == 2) avgpool_groups<V, 2>(x, y, n, AVG_ARGS); \
    else avgpool_groups<V, 0>(x, y, n, AVG_ARGS); \
}
AVGPOOL(_1, 1)
AVGPOOL(_vec, VEC)

"""
SRC = FORWARD_SRC + GRADIENT_SRC  # one module: the gradients use the macros above


def offered(kind: str, attrs: dict, *specs) -> list[str]:
    """["pool_2x2"] where a pooling gradient also offers the 2x2 blocks, else []."""
    window = (*attrs.get("kernel", ()), *attrs.get("strides", ()))
    unit_dilation = list(attrs.get("dilations", [1, 1])) == [1, 1]
    if kind in ("maxpool_bwd", "avgpool_bwd") and window in BLOCK_WINDOWS and unit_dilation:
        return [f"pool_{BLOCK}x{BLOCK}"]
    return []


class Pool(SingleKernelOp):
    """One pooling kind on one geometry: x is the input-sized tensor, y the output-sized one."""

    name = "cupy_pool"

    def __init__(self, kind: str, attrs: dict, x: TensorSpec, y: TensorSpec):
        check_index_range(x, y)
        self.kind, self.dtype = kind, x.dtype
        n, c, h, w = x.shape
        _, _, p, q = y.shape
        kh, kw = attrs["kernel"]
        sh, sw = attrs["strides"]
        t, l, b, r = attrs["pads"]
        self.x_numel, self.y_numel = x.numel, y.numel
        # (candidate name, kernel, threads) of each candidate
        first = (kind, x.numel) if kind.endswith("_bwd") else (f"{kind}_fwd", y.numel)
        self.kernels = [(self.name, *first)]
        if offered(kind, attrs):
            self.kernels.append((f"{self.name}_{BLOCK}x{BLOCK}", f"{kind}_block",
                                 n * -(-h // BLOCK) * -(-w // BLOCK) * c))
        self.geometry = tuple(i32(v) for v in (c, h, w, p, q, kh, kw, sh, sw))
        if kind.startswith("maxpool"):
            if kh * kw > 255:
                raise ValueError(f"max pooling window of {kh * kw} taps (the gradient records at most 255)")
            self.extra = tuple(i32(v) for v in (*attrs.get("dilations", [1, 1]), t, l))
            self.workspace_bytes = -(-y.numel // 16) * 16 if kind == "maxpool_bwd" else 0
        else:
            self.extra = tuple(i32(v) for v in (t, l, b, r, attrs["count_include_pad"]))

    @property
    def candidates(self) -> list[tuple[str, int]]:
        """One gradient per element, and where the window allows, a 2x2 block of elements per thread: the blocks
        read fewer windows but run a quarter of the threads, which loses on small maps (GoogLeNet's 7x7 pool
        gradient on H200: 13.4 -> 15.8 us), so the profile decides."""
        return [(name, self.workspace_bytes) for name, _, _ in self.kernels]

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        _, name, threads = self.kernels[index]
        args = self.geometry + self.extra
        arrays = [*inputs, *outputs] + ([workspace] if self.kind == "maxpool_bwd" else [])
        width = vector_width(self.dtype, *arrays)
        width = width if int(self.geometry[0]) % width == 0 else 1
        suffix = "_vec" if width > 1 else "_1"
        if self.kind == "maxpool_bwd":
            x, dy = inputs
            n = self.y_numel // width
            launch_1d(kernel(SRC, "maxpool_argmax" + suffix, self.dtype), n, x, workspace, i32(n), *args)
            n = threads // width
            launch_1d(kernel(SRC, name + suffix, self.dtype), n, workspace, dy, outputs[0], i32(n), *args)
            return
        n = threads // width
        launch_1d(kernel(SRC, name + suffix, self.dtype), n, inputs[0], outputs[0], i32(n), *args)

    def run(self, inputs, outputs, workspace):
        self.launch(0, inputs, outputs, workspace)


class GlobalAvgPool(SingleKernelOp):
    """Mean over H and W: an [N, H*W, C] column sum."""

    name = "cupy_reduce"

    def __init__(self, x: TensorSpec):
        n, c, h, w = x.shape
        self.reduction = Reduction(x, [n, c, 1, 1], [c, 1, c, c])
        self.workspace_bytes, self.scale = self.reduction.workspace_bytes, 1.0 / (h * w)

    def run(self, inputs, outputs, workspace):
        self.reduction.launch(inputs[0], outputs[0], workspace, self.scale)


class GlobalAvgPoolBwd(SingleKernelOp):
    name = "cupy_elementwise"

    def __init__(self, dx: TensorSpec):
        check_index_range(dx)
        n, c, h, w = dx.shape
        self.dtype, self.n, self.params = dx.dtype, dx.numel, (i32(c), i32(h * w * c), f32(1.0 / (h * w)))

    def run(self, inputs, outputs, workspace):
        launch_1d(kernel(SRC, "globalavgpool_bwd", self.dtype), self.n, inputs[0], outputs[0], i32(self.n),
                  *self.params)


OPS = {
    "maxpool": lambda a, i, o, h: Pool("maxpool", a, i[0], o[0]),
    "maxpool_bwd": lambda a, i, o, h: Pool("maxpool_bwd", a, i[0], i[1]),
    "avgpool": lambda a, i, o, h: Pool("avgpool", a, i[0], o[0]),
    "avgpool_bwd": lambda a, i, o, h: Pool("avgpool_bwd", a, o[0], i[0]),
    "globalavgpool": lambda a, i, o, h: GlobalAvgPool(i[0]),
    "globalavgpool_bwd": lambda a, i, o, h: GlobalAvgPoolBwd(o[0]),
}
