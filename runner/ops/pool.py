"""Max, average and global-average pooling and their gradients on NHWC tensors, with the reference's geometry:
explicit [t, l, b, r] pads, dilations (max), ceil_mode windows that run past the pads (never counted), and
count_include_pad counting the explicit pads only.

Threads map to consecutive channels, so every load is coalesced; each thread takes a group of channels read
with 16-byte accesses (eight fp16 values) when the channel count and alignment allow. Gradients gather rather
than scatter: each dx element sums the windows that cover it, so there are no atomics and no zero-fill; for the
common windows a second candidate gathers a 2x2 block of elements a thread, reading each window once.
maxpool_bwd first records each window's first maximum (row-major order, as the reference's argmax) in the
workspace, then gathers.
"""

from __future__ import annotations

from runner.ops.common import (
    SingleKernelOp, TensorSpec, check_index_range, f32, i32, kernel, launch_1d, vector_width,
)
from runner.ops.reduce import Reduction

SRC = r"""
// 32-bit offsets: Pool checks every tensor holds fewer than 2^31 elements (64-bit ones cost the gather 10%)
#define X_AT(hh, ww) (((b * H + (hh)) * W + (ww)) * C + c)
#define Y_AT(pp, qq) (((b * P + (pp)) * Q + (qq)) * C + c)
#define GEOMETRY int C, int H, int W, int P, int Q, int kh, int kw, int sh, int sw
#define SQUARE_WINDOW(K, S) (kh == K && kw == K && sh == S && sw == S)  // a K x K window at stride S
#define MAX_GEOMETRY GEOMETRY, int dh, int dw, int pt, int pl
#define MAX_ARGS C, H, W, P, Q, kh, kw, sh, sw, dh, dw, pt, pl
#define FIXED_WINDOW(K, S) (SQUARE_WINDOW(K, S) && dh == 1 && dw == 1)
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

// dx gathers dy from every window that covers it and whose recorded tap is this element: no atomics, no zero-fill.
// Windows run from the last covering (h, w) back to the first. UNIT (dilation 1, the common case) finds the first
// by where a window stops reaching (h, w) and needs no division per window: with those divisions the kernel ran
// ~940 instructions a thread, compute-bound at 0.6 TB/s (maxpool1 of GoogLeNet b32 on H100).
template <int V, bool UNIT> __device__ void maxpool_bwd_groups(const unsigned char* arg, const T* dy, T* dx, int n,
                                                               MAX_GEOMETRY) {
    GRID_LOOP(i, n) {
        GROUP_IN(V)
        int hp = h + pt, wp = w + pl, p0 = 0, q0 = 0, p1 = min(P - 1, hp / sh), q1 = min(Q - 1, wp / sw);
        if (!UNIT) {
            int lo = hp - (kh - 1) * dh;
            p0 = lo <= 0 ? 0 : (lo + sh - 1) / sh;
            lo = wp - (kw - 1) * dw;
            q0 = lo <= 0 ? 0 : (lo + sw - 1) / sw;
        }
        float acc[V], grad[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.f;
        for (int p = p1; p >= p0 && (!UNIT || hp - p * sh < kh); --p) {
            int di = hp - p * sh;
            if (!UNIT && di % dh) continue;
            for (int q = q1; q >= q0 && (!UNIT || wp - q * sw < kw); --q) {
                int dj = wp - q * sw;
                if (!UNIT && dj % dw) continue;
                long long o = Y_AT(p, q);
                Taps<V> taps = *reinterpret_cast<const Taps<V>*>(arg + o);
                unsigned char want = UNIT ? di * kw + dj : (di / dh) * kw + dj / dw;
                ldv<V>(dy, o, grad);
#pragma unroll
                for (int e = 0; e < V; ++e) if (taps.tap[e] == want) acc[e] += grad[e];
            }
        }
        stv<V>(dx, X_AT(h, w), acc);
    }
}

// the K x K windows at stride S (dilation 1) that cover element (h, w), the last covering one first, as
// maxpool_bwd_groups walks them: at most R = ceil(K / S) rows and columns of them, unrolled so that their loads
// issue together; BODY sees the window (p, q) and the element's tap in it (di, dj)
#define FOR_COVERING(K, S, BODY) { \
    int hp = h + pt, wp = w + pl, p1 = min(P - 1, hp / S), q1 = min(Q - 1, wp / S); \
    _Pragma("unroll") for (int a = 0; a < (K + S - 1) / S; ++a) { \
        int p = p1 - a, di = hp - p * S; \
        _Pragma("unroll") for (int d = 0; d < (K + S - 1) / S; ++d) { \
            int q = q1 - d, dj = wp - q * S; \
            if (p < 0 || di >= K || q < 0 || dj >= K) continue; \
            BODY \
        } \
    } \
}

// maxpool_bwd_groups for a fixed window: the same windows in the same order, so the same sums (GoogLeNet's
// maxpool1 on H200: 52.2 -> 47.5 us)
template <int V, int K, int S> __device__ void maxpool_bwd_fixed(const unsigned char* arg, const T* dy, T* dx, int n,
                                                                 int C, int H, int W, int P, int Q, int pt, int pl) {
    GRID_LOOP(i, n) {
        GROUP_IN(V)
        float acc[V], grad[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.f;
        FOR_COVERING(K, S,
            int o = Y_AT(p, q);
            Taps<V> taps = *reinterpret_cast<const Taps<V>*>(arg + o);
            unsigned char want = di * K + dj;
            ldv<V>(dy, o, grad);
            _Pragma("unroll") for (int e = 0; e < V; ++e) if (taps.tap[e] == want) acc[e] += grad[e];
        )
        stv<V>(dx, X_AT(h, w), acc);
    }
}

// dx of an R x R block of elements a thread, for a K x K window at stride S (dilation 1): the windows covering
// the block, at most (R + K - 2) / S + 1 rows and columns of them, unrolled so that their loads issue together,
// are read once each rather than once for each element they cover (R = 2: 3x3/2 reads 4 windows for 4 elements,
// not 9; 3x3/1 16, not 36). Windows run from the last one back, so each element sums its windows in
// maxpool_bwd_groups' order: the same sums. (R = 1 would be maxpool_bwd_fixed, whose code runs 2-10% faster.)
#define BLOCK_IN(V, R) int g = i % (C / V), t = i / (C / V), WB = (W + R - 1) / R, HB = (H + R - 1) / R; \
    int w0 = t % WB * R; t /= WB; int h0 = t % HB * R, b = t / HB, c = g * V;
// BODY sees each window (p, q) that covers an element of the block
#define FOR_BLOCK_WINDOWS(K, S, R, BODY) { \
    int p1 = min(P - 1, (h0 + R - 1 + pt) / S), q1 = min(Q - 1, (w0 + R - 1 + pl) / S); \
    _Pragma("unroll") for (int a = 0; a < (R + K - 2) / S + 1; ++a) { \
        int p = p1 - a; \
        if (p < 0 || p * S - pt + K <= h0) continue; \
        _Pragma("unroll") for (int d = 0; d < (R + K - 2) / S + 1; ++d) { \
            int q = q1 - d; \
            if (q < 0 || q * S - pl + K <= w0) continue; \
            BODY \
        } \
    } \
}
// BODY sees each element (r, s) of the block that window (p, q) covers, and its tap (di, dj) in the window
#define FOR_COVERED(K, S, R, BODY) \
    _Pragma("unroll") for (int r = 0; r < R; ++r) { \
        int di = h0 + r + pt - p * S; \
        if (di < 0 || di >= K) continue; \
        _Pragma("unroll") for (int s = 0; s < R; ++s) { \
            int dj = w0 + s + pl - q * S; \
            if (dj < 0 || dj >= K) continue; \
            BODY \
        } \
    }
#define BLOCK_STORE(V, R) \
    _Pragma("unroll") for (int r = 0; r < R; ++r) \
        _Pragma("unroll") for (int s = 0; s < R; ++s) \
            if (h0 + r < H && w0 + s < W) stv<V>(dx, X_AT(h0 + r, w0 + s), acc[r][s]);

template <int V, int K, int S, int R> __device__ void maxpool_bwd_block(const unsigned char* arg, const T* dy, T* dx,
                                                                        int n, int C, int H, int W, int P, int Q,
                                                                        int pt, int pl) {
    GRID_LOOP(i, n) {
        BLOCK_IN(V, R)
        float acc[R][R][V] = {}, grad[V];
        FOR_BLOCK_WINDOWS(K, S, R,
            int o = Y_AT(p, q);
            Taps<V> taps = *reinterpret_cast<const Taps<V>*>(arg + o);
            ldv<V>(dy, o, grad);
            FOR_COVERED(K, S, R,
                unsigned char want = di * K + dj;
                _Pragma("unroll") for (int e = 0; e < V; ++e) if (taps.tap[e] == want) acc[r][s][e] += grad[e];
            )
        )
        BLOCK_STORE(V, R)
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
#define MAXPOOL_BWD(SUFFIX, V) \
extern "C" __global__ void maxpool_bwd##SUFFIX(const unsigned char* arg, const T* dy, T* dx, int n, MAX_GEOMETRY) { \
    if (FIXED_WINDOW(3, 2)) maxpool_bwd_fixed<V, 3, 2>(arg, dy, dx, n, C, H, W, P, Q, pt, pl); \
    else if (FIXED_WINDOW(3, 1)) maxpool_bwd_fixed<V, 3, 1>(arg, dy, dx, n, C, H, W, P, Q, pt, pl); \
    else if (FIXED_WINDOW(2, 2)) maxpool_bwd_fixed<V, 2, 2>(arg, dy, dx, n, C, H, W, P, Q, pt, pl); \
    else if (dh == 1 && dw == 1) maxpool_bwd_groups<V, true>(arg, dy, dx, n, MAX_ARGS); \
    else maxpool_bwd_groups<V, false>(arg, dy, dx, n, MAX_ARGS); \
} \
extern "C" __global__ void maxpool_bwd_block##SUFFIX(const unsigned char* arg, const T* dy, T* dx, int n, \
                                                     MAX_GEOMETRY) { \
    if (SQUARE_WINDOW(3, 2)) maxpool_bwd_block<V, 3, 2, 2>(arg, dy, dx, n, C, H, W, P, Q, pt, pl); \
    else if (SQUARE_WINDOW(3, 1)) maxpool_bwd_block<V, 3, 1, 2>(arg, dy, dx, n, C, H, W, P, Q, pt, pl); \
    else maxpool_bwd_block<V, 2, 2, 2>(arg, dy, dx, n, C, H, W, P, Q, pt, pl); \
}
MAXPOOL_BWD(_1, 1)
MAXPOOL_BWD(_vec, VEC)

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

// dx gathers dy / count from every window that covers it, V channels a thread: windows from the last covering
// (h, w) back while they still reach it, so no integer division per window (as maxpool_bwd_groups' UNIT
// path); each window's 1 / count stays one float division
template <int V> __device__ void avgpool_bwd_groups(const T* dy, T* dx, int n, GEOMETRY, int pt, int pl, int pb,
                                                    int pr, int include_pad) {
    GRID_LOOP(i, n) {
        GROUP_IN(V)
        int hp = h + pt, wp = w + pl;
        float acc[V], grad[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.f;
        for (int p = min(P - 1, hp / sh); p >= 0 && hp - p * sh < kh; --p) {
            for (int q = min(Q - 1, wp / sw); q >= 0 && wp - q * sw < kw; --q) {
                float scale = 1.f / avg_count(p * sh - pt, q * sw - pl, kh, kw, H, W, pt, pl, pb, pr, include_pad);
                ldv<V>(dy, Y_AT(p, q), grad);
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] += grad[e] * scale;
            }
        }
        stv<V>(dx, X_AT(h, w), acc);
    }
}

// avgpool_bwd_groups for a fixed window: the same windows in the same order, so the same sums
template <int V, int K, int S> __device__ void avgpool_bwd_fixed(const T* dy, T* dx, int n, GEOMETRY, int pt, int pl,
                                                                 int pb, int pr, int include_pad) {
    GRID_LOOP(i, n) {
        GROUP_IN(V)
        float acc[V], grad[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.f;
        FOR_COVERING(K, S,
            float scale = 1.f / avg_count(p * S - pt, q * S - pl, K, K, H, W, pt, pl, pb, pr, include_pad);
            ldv<V>(dy, Y_AT(p, q), grad);
            _Pragma("unroll") for (int e = 0; e < V; ++e) acc[e] += grad[e] * scale;
        )
        stv<V>(dx, X_AT(h, w), acc);
    }
}

// avgpool_bwd_groups for a fixed window, R x R elements a thread as maxpool_bwd_block: the same sums, and each
// window's count and division once
template <int V, int K, int S, int R> __device__ void avgpool_bwd_block(const T* dy, T* dx, int n, GEOMETRY, int pt,
                                                                        int pl, int pb, int pr, int include_pad) {
    GRID_LOOP(i, n) {
        BLOCK_IN(V, R)
        float acc[R][R][V] = {}, grad[V];
        FOR_BLOCK_WINDOWS(K, S, R,
            float scale = 1.f / avg_count(p * S - pt, q * S - pl, K, K, H, W, pt, pl, pb, pr, include_pad);
            ldv<V>(dy, Y_AT(p, q), grad);
            FOR_COVERED(K, S, R, _Pragma("unroll") for (int e = 0; e < V; ++e) acc[r][s][e] += grad[e] * scale;)
        )
        BLOCK_STORE(V, R)
    }
}

#define AVG_ARGS C, H, W, P, Q, kh, kw, sh, sw, pt, pl, pb, pr, include_pad
#define AVGPOOL(SUFFIX, V) \
extern "C" __global__ void avgpool_fwd##SUFFIX(const T* x, T* y, int n, GEOMETRY, int pt, int pl, int pb, int pr, \
                                               int include_pad) { \
    if (kh == 3 && kw == 3) avgpool_groups<V, 3>(x, y, n, AVG_ARGS); \
    else if (kh == 2 && kw == 2) avgpool_groups<V, 2>(x, y, n, AVG_ARGS); \
    else avgpool_groups<V, 0>(x, y, n, AVG_ARGS); \
} \
extern "C" __global__ void avgpool_bwd##SUFFIX(const T* dy, T* dx, int n, GEOMETRY, int pt, int pl, int pb, int pr, \
                                               int include_pad) { \
    if (SQUARE_WINDOW(3, 1)) avgpool_bwd_fixed<V, 3, 1>(dy, dx, n, AVG_ARGS); \
    else if (SQUARE_WINDOW(2, 2)) avgpool_bwd_fixed<V, 2, 2>(dy, dx, n, AVG_ARGS); \
    else avgpool_bwd_groups<V>(dy, dx, n, AVG_ARGS); \
} \
extern "C" __global__ void avgpool_bwd_block##SUFFIX(const T* dy, T* dx, int n, GEOMETRY, int pt, int pl, int pb, \
                                                     int pr, int include_pad) { \
    if (SQUARE_WINDOW(3, 2)) avgpool_bwd_block<V, 3, 2, 2>(dy, dx, n, AVG_ARGS); \
    else if (SQUARE_WINDOW(3, 1)) avgpool_bwd_block<V, 3, 1, 2>(dy, dx, n, AVG_ARGS); \
    else avgpool_bwd_block<V, 2, 2, 2>(dy, dx, n, AVG_ARGS); \
}
AVGPOOL(_1, 1)
AVGPOOL(_vec, VEC)

extern "C" __global__ void globalavgpool_bwd(const T* dy, T* dx, int n, int C, int HWC, float scale) {
    GRID_LOOP(i, n) st(dx, i, ld(dy, (long long)(i / HWC) * C + i % C) * scale);
}
"""


BLOCK = 2  # the block kernels' R
BLOCK_WINDOWS = {(3, 3, 2, 2), (3, 3, 1, 1), (2, 2, 2, 2)}  # (kh, kw, sh, sw) the block kernels dispatch on


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
        # (kernel, threads) of each candidate
        self.kernels = [(kind, x.numel)] if kind.endswith("_bwd") else [(f"{kind}_fwd", y.numel)]
        if offered(kind, attrs):
            self.kernels.append((f"{kind}_block", n * -(-h // BLOCK) * -(-w // BLOCK) * c))
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
        gradient on H200: 13.5 -> 15.9 us), so the profile decides."""
        names = [self.name, f"{self.name}_{BLOCK}x{BLOCK}"]
        return [(name, self.workspace_bytes) for name in names[:len(self.kernels)]]

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        name, threads = self.kernels[index]
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
