"""The stem's convolution with 64 output channels on Hopper's warpgroup MMA (wgmma), forward and weight
gradient: the `stem:wgmma...` candidates beside runner/ops/stem.py's mma.sync kernels.

GoogLeNet's and ResNet-50's 7x7/s2 stem (3 -> 64 channels, 224x224, fp16, batch 32) on an H200: forward 38.2 us
with bias and ReLU (mma.sync 72.3, cuDNN's best 83.0), 5.5 at batch 1 (9.8); weight gradient 34.5 (mma.sync 69.0,
cuDNN 140.6) (docs/BENCHMARKS.md, sixtieth session). The mma.sync kernels were bound by every warp reloading
operand fragments from shared memory at every step; wgmma reads its B from shared memory itself.

The input rows an output row needs are held with the channels padded to CP, so a pixel's patch row (j = (s, c)
of one kernel row, padded to JP) starts SW * CP = 8 halves (16 bytes) after the previous pixel's: the row stride
of wgmma's 8x8 core matrices. Patches are read in place as B, adjacent core matrices overlapping; no im2col.
Each CTA (one warpgroup, 128 threads) takes a contiguous run of output rows of one image, so consecutive rows
share R - SH input rows: a ring of R + SH row slots holds them and each row loads only its SH new rows (16-byte
loads, then padded in shared memory).
- Forward, D[k, q] = sum over r, j of w[k, (r, j)] patch_r[q, j]: A = the weights (M = the 64 output channels)
  in registers for the whole kernel, each thread loading its own fragments from global memory (a shared-memory
  pass first cost 12 us at batch 32); B = the row's pixels (N = Q, K-major). Two accumulator sets: the next row's
  wgmmas are issued before this row's epilogue (to fp16, ReLU in the conversion, through stmatrix into a tile,
  then 16-byte stores of the NHWC row). A conv_fused's bias is one more product, as in stem.py: padding channel C
  of every pixel held is 1 and its weight at r = s = 0 is the bias.
- Weight gradient, D_r[k, j] += dy[q, k] patch_r[q, j] over 16-pixel chunks: A = dy^T (ldmatrix.trans from the
  dy row held, two chunks' fragments so one chunk's wgmmas run while the next loads), one wgmma a kernel row r
  (N = JP, B N-major); the next row's dy and input rows load during the chunks. Each CTA writes its sums; stem.py's
  second kernel adds them in a fixed order (deterministic).
"""

from __future__ import annotations

from runner.gpu import gpu
from runner.ops.common import hopper_kernel, i32
from runner.ops.stem import HALF_ONE, SHARED_LIMIT_BYTES, StemShape

THREADS = 128  # one warpgroup
OUTPUT_CHANNELS = 64  # wgmma's M
MAX_PIXELS = 256  # wgmma's largest N
MAX_WEIGHT_SUMS = 112  # fp32 registers a thread keeps the weight gradient's sums in

COMMON = r"""
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
#define ROW_VECS (W * C / 8)  // 16-byte pieces of an input row
#define VECS_A_THREAD(NR) ((NR * ROW_VECS + NTHREADS - 1) / NTHREADS)
__device__ __forceinline__ int slot_of(int h) { return (h + PT) % RING; }

struct Smem { half_bits* xs; half_bits* raw; half_bits* tile; };  // tile: y's row forward, dy's backward

// accumulators an in-flight wgmma writes: the compiler must not move their reads or writes across this point
template <int N> __device__ __forceinline__ void hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// input rows h0 .. h0 + NR - 1 of image n into registers (zero outside the image), then into `raw` as they are
template <int NR> __device__ __forceinline__ void fetch(uint4 (&v)[VECS_A_THREAD(NR)], const half_bits* x, int n,
                                                        int h0) {
#pragma unroll
    for (int i = 0; i < VECS_A_THREAD(NR); ++i) {
        int e = i * NTHREADS + threadIdx.x, h = h0 + e / ROW_VECS;
        v[i] = e < NR * ROW_VECS && h >= 0 && h < H
                   ? *reinterpret_cast<const uint4*>(x + (long long)(n * H + h) * W * C + (e % ROW_VECS) * 8)
                   : make_uint4(0, 0, 0, 0);
    }
}
template <int NR> __device__ __forceinline__ void put_raw(half_bits* raw, const uint4 (&v)[VECS_A_THREAD(NR)]) {
#pragma unroll
    for (int i = 0; i < VECS_A_THREAD(NR); ++i) {
        int e = i * NTHREADS + threadIdx.x;
        if (e < NR * ROW_VECS) reinterpret_cast<uint4*>(raw)[e] = v[i];
    }
}
// raw rows -> their ring slots: channels padded to CP, columns shifted by the left pad, zero outside the image;
// padding channel C is 1 where the bias is a product
template <int NR> __device__ __forceinline__ void expand(const Smem& sm, int h0) {
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int i = 0; i < (WSM + NTHREADS - 1) / NTHREADS; ++i) {
            int u = i * NTHREADS + threadIdx.x, h = h0 + r, w = u - PL;
            if (u >= WSM) break;
            bool inside = h >= 0 && h < H && w >= 0 && w < W;
            const half_bits* src = sm.raw + r * W * C + w * C;
            unsigned v[CP / 2];
#pragma unroll
            for (int c = 0; c < CP / 2; ++c) {
                unsigned lo = inside && 2 * c < C ? src[2 * c] : BIAS && 2 * c == C ? HALF_ONE : 0;
                unsigned hi = inside && 2 * c + 1 < C ? src[2 * c + 1] : BIAS && 2 * c + 1 == C ? HALF_ONE : 0;
                v[c] = lo | hi << 16;
            }
            half_bits* dst = sm.xs + slot_of(h) * XS_ROW + u * CP;
            if (CP == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(v[0], v[1]);
            else *reinterpret_cast<uint4*>(dst) = make_uint4(v[0], v[1], v[CP / 2 - 2], v[CP / 2 - 1]);
        }
}
// rows h0 .. h0 + NR - 1 from global memory into their slots, ready for wgmma (the async proxy) to read
template <int NR> __device__ __forceinline__ void load_rows(const Smem& sm, const half_bits* x, int n, int h0) {
    uint4 v[VECS_A_THREAD(NR)];
    fetch<NR>(v, x, n, h0);
    put_raw<NR>(sm.raw, v);
    __syncthreads();
    expand<NR>(sm, h0);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
}
"""

FORWARD = r"""
__device__ __forceinline__ void stsm_t(half_bits* p, const unsigned* r) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};"
                 :: "r"(smem_u32(p)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
__device__ __forceinline__ unsigned pack_out(float lo, float hi) {
    unsigned v;
    if (RELU) asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
    return v;
}
// B's descriptor, no swizzle, K-major: core matrices' rows 16 bytes apart, 16 bytes apart along K, 128 along N
__device__ __forceinline__ unsigned long long pixels_desc(const half_bits* p) {
    return (unsigned long long)((smem_u32(p) & 0x3FFFF) >> 4) | (1ull << 16) | (8ull << 32);
}
WGMMA_DEF
// output row p's wgmma group into d: for each kernel row r and 16-column step t, D += A[r, t] B(slot of r)
__device__ __forceinline__ void issue(float (&d)[NW / 2], const unsigned (&a)[R * NT][4], const Smem& sm, int p) {
    hold(d);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    int slot = slot_of(SH * p - PT);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        unsigned long long b = pixels_desc(sm.xs + slot * XS_ROW);
#pragma unroll
        for (int t = 0; t < NT; ++t) wgmma(d, a[r * NT + t], b + t * 2, r + t > 0);  // 16 columns = 2 x 16 bytes
        slot = slot + 1 == RING ? 0 : slot + 1;
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int PENDING> __device__ __forceinline__ void settle(float (&d)[NW / 2]) {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(PENDING) : "memory");
    hold(d);
}
// D (rows k, columns q) -> tile[q * YS + k] in fp16, transposed by stmatrix; then the row out in 16-byte pieces
__device__ __forceinline__ void to_tile(const float (&d)[NW / 2], const Smem& sm) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
    for (int i = 0; i < NW / 8; i += 2) {
        unsigned r[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            r[2 * h] = pack_out(d[4 * (i + h)], d[4 * (i + h) + 1]);
            r[2 * h + 1] = pack_out(d[4 * (i + h) + 2], d[4 * (i + h) + 3]);
        }
        stsm_t(sm.tile + (8 * (i + (m >> 1)) + (lane & 7)) * YS + 16 * warp + 8 * (m & 1), r);
    }
}
__device__ __forceinline__ void write_out(const Smem& sm, half_bits* y, int unit) {
    half_bits* out = y + (long long)unit * Q * K;
#pragma unroll
    for (int i = 0; i < (Q * K / 8 + NTHREADS - 1) / NTHREADS; ++i) {
        int e = i * NTHREADS + threadIdx.x, q = e / (K / 8), c = e % (K / 8);
        if (e < Q * K / 8)
            *reinterpret_cast<uint4*>(out + q * K + c * 8) = *reinterpret_cast<const uint4*>(sm.tile + q * YS + c * 8);
    }
}
// output row p of image n, its wgmma group in flight into cur: the next row's group goes out first (into nxt),
// then this row's epilogue runs while the tensor cores work, and the row after next's SH new rows come in
__device__ __forceinline__ void row(float (&cur)[NW / 2], float (&nxt)[NW / 2], const unsigned (&a)[R * NT][4],
                                    const Smem& sm, const half_bits* x, half_bits* y, int n, int p, int last) {
    uint4 v[VECS_A_THREAD(SH)];
    bool more = p + 1 < last, fetch_next = p + 2 < last;
    int h_new = SH * (p + 2) - PT + R - SH;
    if (more) issue(nxt, a, sm, p + 1);
    if (fetch_next) fetch<SH>(v, x, n, h_new);
    if (more) settle<1>(cur);
    else settle<0>(cur);
    to_tile(cur, sm);
    if (fetch_next) put_raw<SH>(sm.raw, v);
    __syncthreads();
    write_out(sm, y, n * P + p);
    if (fetch_next) expand<SH>(sm, h_new);  // into the slots row p alone read
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 2) stem_fwd_wgmma(const half_bits* x, const half_bits* wt,
                                                                       const half_bits* bias, half_bits* y,
                                                                       int units) {
    extern __shared__ __align__(128) half_bits smem[];
    Smem sm{smem, smem + RING * XS_ROW, smem + RING * XS_ROW + R * W * C};
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned a[R * NT][4];  // A's fragments: rows k = 16 * warp + lane / 4 (+ 8), columns j (+ 1) (+ 8)
#pragma unroll
    for (int step = 0; step < R * NT; ++step)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int k = 16 * warp + (lane >> 2) + 8 * (i & 1), j = (step % NT) * 16 + 2 * (lane & 3) + 8 * (i >> 1);
            int r = step / NT;
            unsigned v = 0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int s = (j + h) / CP, c = (j + h) % CP;
                unsigned e = s < S && c < C ? wt[((k * R + r) * S + s) * C + c]
                             : BIAS && r == 0 && j + h == C ? bias[k] : 0;
                v |= e << (16 * h);
            }
            a[step][i] = v;
        }
    float da[NW / 2], db[NW / 2];
    int begin = (int)((long long)blockIdx.x * units / gridDim.x);
    int end = (int)((long long)(blockIdx.x + 1) * units / gridDim.x);
    for (int first = begin; first < end;) {  // a run of rows of one image
        int n = first / P, p0 = first % P, last = min(P, p0 + end - first);
        load_rows<R>(sm, x, n, SH * p0 - PT);
        issue(da, a, sm, p0);
        if (p0 + 1 < last) load_rows<SH>(sm, x, n, SH * (p0 + 1) - PT + R - SH);
        for (int p = p0; p < last; p += 2) {
            row(da, db, a, sm, x, y, n, p, last);
            if (p + 1 < last) row(db, da, a, sm, x, y, n, p + 1, last);
        }
        first += last - p0;
    }
}
"""

WEIGHT_GRADIENT = r"""
__device__ __forceinline__ void ldsm_t(unsigned* d, const half_bits* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(smem_u32(p)));
}
// B's descriptor, no swizzle, N-major (patch columns j contiguous): core matrices 16 bytes apart along N, 128
// along K (8 pixels)
__device__ __forceinline__ unsigned long long patches_desc(const half_bits* p) {
    return (unsigned long long)((smem_u32(p) & 0x3FFFF) >> 4) | (8ull << 16) | (1ull << 32);
}
WGMMA_DEF
#define DY_VECS (Q * K / 8)
#define DY_A_THREAD ((DY_VECS + NTHREADS - 1) / NTHREADS)
__device__ __forceinline__ void fetch_dy(uint4 (&v)[DY_A_THREAD], const half_bits* dy, int unit) {
    const uint4* src = reinterpret_cast<const uint4*>(dy + (long long)unit * Q * K);
#pragma unroll
    for (int i = 0; i < DY_A_THREAD; ++i) {
        int e = i * NTHREADS + threadIdx.x;
        if (e < DY_VECS) v[i] = src[e];
    }
}

// partial[block][k][r * JP + j] = this CTA's sum over its rows' pixels q of dy[q, k] patches_r[q, j]: for each
// 16-pixel chunk, A = dy^T (ldmatrix.trans from the dy row held) and one wgmma per kernel row r into acc[r]
extern "C" __global__ void __launch_bounds__(NTHREADS, 2) stem_wgrad_wgmma(const half_bits* x, const half_bits* dy,
                                                                         float* partial, int units) {
    extern __shared__ __align__(128) half_bits smem[];
    Smem sm{smem, smem + RING * XS_ROW, smem + RING * XS_ROW + R * W * C};  // tile[q * YS + k], zero for q >= Q
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float acc[R][JP / 2];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < JP / 2; ++i) acc[r][i] = 0.f;
    for (int e = threadIdx.x; e < (NW - Q) * YS; e += NTHREADS) sm.tile[Q * YS + e] = 0;
    int begin = (int)((long long)blockIdx.x * units / gridDim.x);
    int end = (int)((long long)(blockIdx.x + 1) * units / gridDim.x);
    uint4 dv[DY_A_THREAD], xv[VECS_A_THREAD(SH)];
    for (int first = begin; first < end;) {  // a run of rows of one image
        int n = first / P, p0 = first % P, last = min(P, p0 + end - first);
        fetch_dy(dv, dy, n * P + p0);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        __syncthreads();
        load_rows<R>(sm, x, n, SH * p0 - PT);
        for (int p = p0; p < last; ++p) {
#pragma unroll
            for (int i = 0; i < DY_A_THREAD; ++i) {
                int e = i * NTHREADS + threadIdx.x;
                if (e < DY_VECS) *reinterpret_cast<uint4*>(sm.tile + (e / (K / 8)) * YS + (e % (K / 8)) * 8) = dv[i];
            }
            __syncthreads();
            bool more = p + 1 < last;
            if (more) {  // the next row's dy and new input rows load while this row's wgmmas run
                fetch_dy(dv, dy, n * P + p + 1);
                fetch<SH>(xv, x, n, SH * (p + 1) - PT + R - SH);
            }
            int slot0 = slot_of(SH * p - PT);
            unsigned a[2][4];  // two chunks' A: a chunk's wgmmas read theirs while the next is loaded
#pragma unroll
            for (int c = 0; c < NW / 16; ++c) {
                ldsm_t(a[c & 1], sm.tile + (c * 16 + ((lane >> 4) << 3) + (lane & 7)) * YS + 16 * warp
                                     + ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int r = 0; r < R; ++r) hold(acc[r]);
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
                int slot = slot0;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    wgmma(acc[r], a[c & 1], patches_desc(sm.xs + slot * XS_ROW + c * 16 * CP * SW), 1);
                    slot = slot + 1 == RING ? 0 : slot + 1;
                }
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            __syncthreads();
            if (more) {
                put_raw<SH>(sm.raw, xv);
                __syncthreads();
                expand<SH>(sm, SH * (p + 1) - PT + R - SH);
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            }
        }
        first += last - p0;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) hold(acc[r]);
    // acc[r][4 * b + e]: k = 16 * warp + lane / 4 (+ 8 for e >= 2), j = 8 * b + 2 * (lane % 4) (+ 1 for odd e)
    float* out = partial + (long long)blockIdx.x * K * R * JP;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < JP / 8; ++b) {
            int k = 16 * warp + (lane >> 2), j = r * JP + 8 * b + 2 * (lane & 3);
            *reinterpret_cast<float2*>(out + k * R * JP + j) = make_float2(acc[r][4 * b], acc[r][4 * b + 1]);
            *reinterpret_cast<float2*>(out + (k + 8) * R * JP + j) = make_float2(acc[r][4 * b + 2], acc[r][4 * b + 3]);
        }
}
"""


def wgmma_source(columns: int, n_major: bool) -> str:
    """`wgmma(d, a, b, accumulate)`: D[64 x columns] (+)= A (registers) B (descriptor, K-major or N-major), fp16
    in, fp32 out; D's old value is dropped where `accumulate` is 0."""
    nd = columns // 2
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    regs = ",".join(f"%{i}" for i in range(nd))
    return ("__device__ __forceinline__ void wgmma(float* d, const unsigned* a, unsigned long long b, int acc) {\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 5}, 0;\\n"\n'
            f'        "wgmma.mma_async.sync.aligned.m64n{columns}k16.f32.f16.f16 {{{regs}}}, '
            f'{{%{nd},%{nd + 1},%{nd + 2},%{nd + 3}}}, %{nd + 4}, p, 1, 1, {int(n_major)};\\n}}\\n"\n'
            f"        : {outs}\n"
            '        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));\n}\n')


def pixels(shape: StemShape) -> int:
    """The row's pixels rounded up to 16: wgmma's N forward (stmatrix stores 16 at a time), chunks backward."""
    return -(-shape.q // 16) * 16


def shared_bytes(shape: StemShape) -> int:
    """The ring of input rows, the raw rows loaded into it, and y's or dy's row (both kernels)."""
    m = shape.layout
    return 2 * ((shape.r + shape.sh) * m["XS_ROW"] + shape.r * shape.w * shape.c + pixels(shape) * (shape.k + 8))


def check(kind: str, shape: StemShape, bias: bool = False) -> None:
    """Raise ValueError unless these kernels take the conv or weight gradient (stem.py's checks come first)."""
    if kind not in ("conv", "conv_bwd_filter"):
        raise ValueError(f"{kind}: a forward conv or a weight gradient")
    if shape.k != OUTPUT_CHANNELS:
        raise ValueError(f"{shape.k} output channels (wgmma: {OUTPUT_CHANNELS})")
    if shape.sw * shape.cp != 8:
        raise ValueError("pixels' patch rows not 16 bytes apart")
    if shape.w * shape.c % 8:
        raise ValueError("input rows not whole 16-byte pieces")
    if kind == "conv" and pixels(shape) > MAX_PIXELS:
        raise ValueError(f"{shape.q} output columns (wgmma: at most {MAX_PIXELS})")
    if kind == "conv_bwd_filter" and shape.r * shape.layout["JP"] // 2 > MAX_WEIGHT_SUMS:
        raise ValueError(f"{shape.r * shape.layout['JP'] // 2} sums a thread (at most {MAX_WEIGHT_SUMS})")
    if bias and shape.c >= shape.cp:
        raise ValueError("no padding channel for the bias")
    if shared_bytes(shape) > SHARED_LIMIT_BYTES:
        raise ValueError(f"{shared_bytes(shape)} bytes of shared memory")


def applies(kind: str, shape: StemShape, bias: bool = False) -> bool:
    try:
        check(kind, shape, bias)
    except ValueError:
        return False
    return True


class StemWgmma:
    """A forward conv, y = [ReLU](x * w [+ bias]) (NHWC fp16 x, KRSC w), or a weight gradient dw = x^T dy through
    partial sums that `sum_partials(partial, dw, parts)` adds (stem.py's, in a fixed order); an sm_90 device.
    `candidates`: (name, workspace bytes), the forward's `stem:wgmma`, the weight gradient's one and two CTAs an
    SM (more CTAs hide more latency and have more partial sums to add)."""

    def __init__(self, kind: str, shape: StemShape, bias: bool = False, relu: bool = False, sum_partials=None):
        check(kind, shape, bias)
        device = gpu().cp.cuda.Device()
        if device.compute_capability != "90":
            raise ValueError(f"wgmma needs compute capability 9.0, not {device.compute_capability}")
        m = shape.layout
        defines = {**m, "NTHREADS": THREADS, "NW": pixels(shape), "YS": shape.k + 8, "RING": shape.r + shape.sh,
                   "BIAS": int(bias), "RELU": int(relu), "HALF_ONE": HALF_ONE}
        source = "".join(f"#define {name} {value}\n" for name, value in defines.items()) + COMMON
        sms = device.attributes["MultiProcessorCount"]
        self.kind, self.units, self.shared = kind, shape.n * shape.p, shared_bytes(shape)
        self.sum_partials = sum_partials
        if kind == "conv":
            self.fn = hopper_kernel(source + FORWARD.replace("WGMMA_DEF", wgmma_source(pixels(shape), False)),
                                    "stem_fwd_wgmma")
            self.grids = [min(self.units, 2 * sms)]  # two CTAs an SM (registers), each a contiguous run of rows
            self.candidates = [("stem:wgmma", 0)]
            return
        self.fn = hopper_kernel(source + WEIGHT_GRADIENT.replace("WGMMA_DEF", wgmma_source(m["JP"], True)),
                                "stem_wgrad_wgmma")
        self.grids = sorted({min(self.units, per_sm * sms) for per_sm in (1, 2)})
        self.partial_bytes = 4 * shape.k * shape.r * m["JP"]  # a CTA's
        self.candidates = [(f"stem:wgmma:{-(-grid // sms)}x", grid * self.partial_bytes) for grid in self.grids]

    def launch(self, index: int, a, b, out, workspace, bias=None) -> None:
        """conv: (x, w) -> y; conv_bwd_filter: (x, dy) -> dw."""
        rows = (a, out) if self.kind == "conv" else (a, b)  # read or written in 16-byte pieces
        if any(t.data.ptr % 16 for t in rows):
            raise ValueError("x and y (dy) must start on a 16-byte boundary")
        grid = self.grids[index]
        if self.kind == "conv":
            self.fn((grid,), (THREADS,), (a, b, out if bias is None else bias, out, i32(self.units)),
                    shared_mem=self.shared)
            return
        self.fn((grid,), (THREADS,), (a, b, workspace, i32(self.units)), shared_mem=self.shared)
        self.sum_partials(workspace, out, grid)
