"""The pooling gradients' CUDA source, compiled in one module after runner/ops/pool.py's forward kernels, whose
macros it uses (X_AT, GROUP_IN, Taps, avg_count, ...); pool.Pool launches both.

Gradients gather rather than scatter: each dx element sums the windows that cover it, so there are no atomics and
no zero-fill. For 3x3/2, 3x3/1 and 2x2/2 windows a second candidate gathers a BLOCK x BLOCK block of elements a
thread and reads each covering window once.
"""

BLOCK = 2  # the block kernels' R
BLOCK_WINDOWS = {(3, 3, 2, 2), (3, 3, 1, 1), (2, 2, 2, 2)}  # (kh, kw, sh, sw) the block kernels dispatch on

GRADIENT_SRC = r"""
#define SQUARE_WINDOW(K, S) (kh == K && kw == K && sh == S && sw == S)  // a K x K window at stride S
#define FIXED_WINDOW(K, S) (SQUARE_WINDOW(K, S) && dh == 1 && dw == 1)
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

#define AVGPOOL_BWD(SUFFIX, V) \
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
AVGPOOL_BWD(_1, 1)
AVGPOOL_BWD(_vec, VEC)

extern "C" __global__ void globalavgpool_bwd(const T* dy, T* dx, int n, int C, int HWC, float scale) {
    GRID_LOOP(i, n) st(dx, i, ld(dy, (long long)(i / HWC) * C + i % C) * scale);
}
"""
