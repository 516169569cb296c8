"""Convolutions with few input channels (a network's stem: 3 colour channels) as implicit GEMMs on tensor cores.

cuDNN pads a 3-channel image to 4 or 8 channels in a pass of its own and then runs its first-layer kernels at a
small part of the tensor cores' rate: the 7x7/s2 stem (3 -> 64 channels, 224x224, batch 32, fp16) took 84.6 us
forward and 140.6 us for its weight gradient on an H200 (the latter most of GoogLeNet's backward serial tail);
these kernels take 69.5 and 70.6 us (docs/BENCHMARKS.md, fifty-eighth session).

Here one CTA takes one output row at a time. It copies the R input rows that row reads into shared memory, the
channels padded to CP (4 or 8) and the columns shifted by the left pad, so that for kernel row r the patches of 16
consecutive output pixels form a 16 x (S*CP) matrix whose rows start SW*CP halves apart: an ldmatrix operand as
it lies, without an im2col buffer. mma.sync m16n8k16 (fp16 in, fp32 accumulation) does the products:
- forward: y[q, k] = sum over r of patches_r[q, :] @ w_r[:, k], the weights laid out once per CTA, then the
  bias and ReLU of an inference conv_fused, folded in. Where a padding channel is free (C < CP) the bias is one
  more product: that channel of the input rows held is 1 and its weight at r = s = 0 is the bias (GoogLeNet's b32
  stem: 72.4 us, against 79.1 with the bias loaded as each warp writes y);
- weight gradient: dw_r[k, :] = sum over the output pixels of dy[q, k] patches_r[q, :]; every CTA (and warp
  phase) sums its rows in registers and writes its partial sums; a second kernel adds them in a fixed order, so
  the result is deterministic, and writes fp16.
Patch columns for s >= S or c >= C are padding: zero weights forward, discarded sums backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runner.gpu import gpu
from runner.ops.common import THREADS, i32, kernel

STEM_KINDS = ("conv", "conv_bwd_filter")
MAX_CHANNELS = 8
HALF_ONE = 0x3C00  # fp16 1.0: the padding channel that carries a bias as a product
SHARED_LIMIT_BYTES = 48 << 10  # without opting in to more per block
MAX_ACCUMULATORS = 64  # fp32 registers a thread keeps its sums in
CTAS_PER_SM = {"conv": (2, 4), "conv_bwd_filter": (1, 2)}  # the candidates: persistent CTAs per SM
WARPS = THREADS // 32
MAX_PIXELS_A_THREAD = 16  # a unit's input pixels each thread holds in registers
MAX_DY_LOADS_A_THREAD = 8  # and 16-byte pieces of its dy row

SRC = r"""
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
// four 8x8 fp16 matrices from shared memory, each lane giving one 16-byte row address (ldsm_t: transposed)
__device__ __forceinline__ void ldsm(unsigned* d, const half_bits* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_t(unsigned* d, const half_bits* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(smem_u32(p)));
}
// c[16x8] += a[16x16] b[16x8], fp32 accumulation
__device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void st_pair(half_bits* p, float lo, float hi) {
    unsigned v;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
    *reinterpret_cast<unsigned*>(p) = v;
}
// A unit (output row p of image n) reads input rows SH * p - PT + r, r < R, held as xs[r][u][c], u = w + PL, the
// channels padded to CP, zero outside the image; a weight gradient also reads dy's row, held as dys[q * KS + k],
// zero for q >= Q. Each thread loads its share of the next unit into registers before the products of this one
// (loads one at a time, each waited for, had made the kernels latency-bound) and stores it after them.
__device__ __forceinline__ void load_rows(unsigned (&v)[BATCH][CP / 2], const half_bits* x, int unit) {
    int n = unit / P, p = unit % P;
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
        int e = i * WARPS * 32 + threadIdx.x, h = SH * p - PT + e / WSM, w = e % WSM - PL;
        bool inside = e < R * WSM && h >= 0 && h < H && w >= 0 && w < W;
        const half_bits* src = x + ((long long)(n * H + h) * W + w) * C;
#pragma unroll
        for (int c = 0; c < CP / 2; ++c) {
            unsigned lo = inside && 2 * c < C ? src[2 * c] : BIAS_IN_PATCH && 2 * c == C ? HALF_ONE : 0;
            unsigned hi = inside && 2 * c + 1 < C ? src[2 * c + 1] : BIAS_IN_PATCH && 2 * c + 1 == C ? HALF_ONE : 0;
            v[i][c] = lo | hi << 16;
        }
    }
}
__device__ __forceinline__ void store_rows(half_bits* xs, const unsigned (&v)[BATCH][CP / 2]) {
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
        int e = i * WARPS * 32 + threadIdx.x;
        if (e >= R * WSM) break;
        if (CP == 4) *reinterpret_cast<uint2*>(xs + e * CP) = make_uint2(v[i][0], v[i][1]);
        else *reinterpret_cast<uint4*>(xs + e * CP) = make_uint4(v[i][0], v[i][1], v[i][CP / 2 - 2], v[i][CP / 2 - 1]);
    }
}
__device__ __forceinline__ void load_dy(uint4 (&v)[DY_BATCH], const half_bits* dy, int unit) {
#pragma unroll
    for (int i = 0; i < DY_BATCH; ++i) {
        int e = i * WARPS * 32 + threadIdx.x, q = e / (K / 8), k = e % (K / 8) * 8;
        v[i] = q < Q ? *reinterpret_cast<const uint4*>(dy + ((long long)unit * Q + q) * K + k) : make_uint4(0, 0, 0, 0);
    }
}
__device__ __forceinline__ void store_dy(half_bits* dys, const uint4 (&v)[DY_BATCH]) {
#pragma unroll
    for (int i = 0; i < DY_BATCH; ++i) {
        int e = i * WARPS * 32 + threadIdx.x, q = e / (K / 8), k = e % (K / 8) * 8;
        if (q < QP) *reinterpret_cast<uint4*>(dys + q * KS + k) = v[i];
    }
}
// lane's row address in a 16x16 tile of 8x8 matrices ordered (0,0), (8,0), (0,8), (8,8) by (row, column)
#define ROW_OF(lane) ((((lane) >> 3) & 1) * 8 + ((lane) & 7))
#define COL_OF(lane) (((lane) >> 4) * 8)

extern "C" __global__ void __launch_bounds__(256, 2) stem_fwd(const half_bits* x, const half_bits* wt,
                                                             const half_bits* bias, half_bits* y, int units) {
    extern __shared__ __align__(16) half_bits smem[];
    half_bits* xs = smem;
    half_bits* ws = smem + R * XS_ROW;  // ws[(r * JP + j) * KS + k] = w[k][r][s][c], j = s * CP + c
    for (int first = 0; first < R * JP * K; first += 16 * WARPS * 32) {
        half_bits v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            int e = first + i * WARPS * 32 + threadIdx.x, k = e % K, j = e / K % JP, r = e / (K * JP);
            v[i] = e < R * JP * K && j / CP < S && j % CP < C ? wt[((k * R + r) * S + j / CP) * C + j % CP] : 0;
            if (BIAS_IN_PATCH && e < R * JP * K && r == 0 && j == C) v[i] = bias[k];
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            int e = first + i * WARPS * 32 + threadIdx.x;
            if (e < R * JP * K) ws[(e / K) * KS + e % K] = v[i];
        }
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned next_rows[BATCH][CP / 2];
    if (blockIdx.x < units) load_rows(next_rows, x, blockIdx.x);
    for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
        __syncthreads();
        store_rows(xs, next_rows);
        __syncthreads();
        if (unit + gridDim.x < units) load_rows(next_rows, x, unit + gridDim.x);
        for (int chunk = warp; chunk < QP / 16; chunk += WARPS) {
            float acc[K / 8][4] = {};
            unsigned a[2][4], b[2][K / 16][4];  // two stages: the next step's fragments load during this one's mma
#pragma unroll
            for (int step = 0; step <= R * NT; ++step) {
                if (step < R * NT) {
                    int r = step / NT, t = step % NT, at = step & 1;
                    ldsm(a[at], xs + r * XS_ROW + (chunk * 16 + ROW_OF(lane)) * LDM + t * 16 + COL_OF(lane));
                    const half_bits* wr = ws + (r * JP + t * 16 + ROW_OF(lane)) * KS + COL_OF(lane);
#pragma unroll
                    for (int kb = 0; kb < K / 16; ++kb) ldsm_t(b[at][kb], wr + kb * 16);
                }
                if (step > 0) {
                    int at = (step - 1) & 1;
#pragma unroll
                    for (int kb = 0; kb < K / 16; ++kb) {
                        mma(acc[2 * kb], a[at], b[at][kb]);
                        mma(acc[2 * kb + 1], a[at], b[at][kb] + 2);
                    }
                }
            }
            int q = chunk * 16 + (lane >> 2);
            half_bits* out = y + (long long)unit * Q * K + 2 * (lane & 3);
#pragma unroll
            for (int kb = 0; kb < K / 8; ++kb) {
                float b0 = 0.f, b1 = 0.f;
                if (BIAS && !BIAS_IN_PATCH)
                    b0 = ld(bias, kb * 8 + 2 * (lane & 3)), b1 = ld(bias, kb * 8 + 2 * (lane & 3) + 1);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc[kb][e] += e % 2 ? b1 : b0;
                    if (RELU) acc[kb][e] = fmaxf(acc[kb][e], 0.f);
                }
                if (q < Q) st_pair(out + q * K + kb * 8, acc[kb][0], acc[kb][1]);
                if (q + 8 < Q) st_pair(out + (q + 8) * K + kb * 8, acc[kb][2], acc[kb][3]);
            }
        }
    }
}

// warp = (group, phase): group g sums patch tiles g * RPW ... for every k, phase takes every WC-th 16-pixel chunk
extern "C" __global__ void __launch_bounds__(256) stem_wgrad(const half_bits* x, const half_bits* dy,
                                                            float* partial, int units) {
    extern __shared__ __align__(16) half_bits smem[];
    half_bits* xs = smem;
    half_bits* dys = smem + R * XS_ROW;  // dys[q * KS + k], zero for q >= Q
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = warp % GR, phase = warp / GR;
    float acc[KT][RPW][2][4] = {};
    unsigned next_rows[BATCH][CP / 2];
    uint4 next_dy[DY_BATCH];
    if (blockIdx.x < units) {
        load_rows(next_rows, x, blockIdx.x);
        load_dy(next_dy, dy, blockIdx.x);
    }
    for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
        __syncthreads();
        store_rows(xs, next_rows);
        store_dy(dys, next_dy);
        __syncthreads();
        if (unit + gridDim.x < units) {
            load_rows(next_rows, x, unit + gridDim.x);
            load_dy(next_dy, dy, unit + gridDim.x);
        }
        if (phase >= WC) continue;
        for (int chunk = phase; chunk < QP / 16; chunk += WC) {
            unsigned a[KT][4], b[RPW][4];  // dy^T (k rows, pixel columns; dys holds it transposed), patches
#pragma unroll
            for (int kt = 0; kt < KT; ++kt)
                ldsm_t(a[kt], dys + (chunk * 16 + COL_OF(lane) + (lane & 7)) * KS + kt * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                int tile = min(group * RPW + i, RT - 1);
                ldsm_t(b[i], xs + (tile / NT) * XS_ROW + (chunk * 16 + ROW_OF(lane)) * LDM + (tile % NT) * 16
                       + COL_OF(lane));
            }
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                if (group * RPW + i >= RT) break;
#pragma unroll
                for (int kt = 0; kt < KT; ++kt) {
                    mma(acc[kt][i][0], a[kt], b[i]);
                    mma(acc[kt][i][1], a[kt], b[i] + 2);
                }
            }
        }
    }
    if (phase >= WC) return;
    float* out = partial + (long long)(blockIdx.x * WC + phase) * K * RT * 16;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            int tile = group * RPW + i;
            if (tile >= RT) break;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int k = kt * 16 + (lane >> 2), j = tile * 16 + h * 8 + 2 * (lane & 3);
                out[k * RT * 16 + j] = acc[kt][i][h][0];
                out[k * RT * 16 + j + 1] = acc[kt][i][h][1];
                out[(k + 8) * RT * 16 + j] = acc[kt][i][h][2];
                out[(k + 8) * RT * 16 + j + 1] = acc[kt][i][h][3];
            }
        }
}

// dw[k][r][s][c] = sum of the parts' partial[k][r * JP + s * CP + c]: 32 columns a block, its warps split the parts
extern "C" __global__ void stem_wgrad_sum(const float* partial, half_bits* dw, int parts) {
    __shared__ float sums[WARPS][32];
    const int cols = K * RT * 16;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, col = blockIdx.x * 32 + lane;
    float v = 0.f;
    if (col < cols)
        for (int g = warp; g < parts; g += WARPS) v += partial[(long long)g * cols + col];
    sums[warp][lane] = v;
    __syncthreads();
    if (warp != 0 || col >= cols) return;
    for (int i = 1; i < WARPS; ++i) v += sums[i][lane];
    int k = col / (R * JP), j = col % (R * JP), r = j / JP, s = (j % JP) / CP, c = j % CP;
    if (s < S && c < C) st(dw, ((k * R + r) * S + s) * C + c, v);
}
"""


@dataclass(frozen=True)
class StemShape:
    """One convolution's geometry (x: n, c, h, w; weights: k, c, r, s; output p x q) and the kernel layout."""

    n: int
    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    sh: int
    sw: int
    pt: int
    pl: int
    p: int
    q: int

    @property
    def cp(self) -> int:
        """Padded channels: 4 where a patch row then starts on a 16-byte boundary (SW even), else 8."""
        return 4 if self.c <= 4 and self.sw % 2 == 0 else 8

    @property
    def layout(self) -> dict[str, int]:
        cp = self.cp
        qp = math.ceil(self.q / 16) * 16
        jp = math.ceil(self.s * cp / 16) * 16
        wsm = self.sw * (qp - 1) + jp // cp
        wsm += (-wsm * cp) % 8 // cp  # whole 16-byte rows
        nt = jp // 16
        rt = self.r * nt
        rpw = math.ceil(rt / WARPS)
        gr = math.ceil(rt / rpw)
        return dict(C=self.c, H=self.h, W=self.w, K=self.k, R=self.r, S=self.s, SH=self.sh, SW=self.sw, PT=self.pt,
                    PL=self.pl, P=self.p, Q=self.q, CP=cp, LDM=self.sw * cp, QP=qp, JP=jp, NT=nt, WSM=wsm,
                    XS_ROW=wsm * cp, KS=self.k + 8, KT=self.k // 16, RT=rt, RPW=rpw, GR=gr, WC=WARPS // gr,
                    WARPS=WARPS, BATCH=math.ceil(self.r * wsm / THREADS),
                    DY_BATCH=math.ceil(qp * self.k // 8 / THREADS))

    def shared_bytes(self, kind: str) -> int:
        m = self.layout
        second = m["R"] * m["JP"] * m["KS"] if kind == "conv" else m["QP"] * m["KS"]
        return 2 * (m["R"] * m["XS_ROW"] + second)

    def check(self, kind: str, attrs: dict, dtype: str) -> None:
        """Raise ValueError unless these kernels take this convolution."""
        if kind not in STEM_KINDS:
            raise ValueError(f"{kind}: stem kernels are for conv and conv_bwd_filter")
        if dtype != "fp16":
            raise ValueError(f"{dtype}: stem kernels are fp16")
        if attrs.get("groups", 1) != 1 or list(attrs.get("dilations", [1, 1])) != [1, 1]:
            raise ValueError("groups or dilations")
        if self.c > MAX_CHANNELS or self.k % 16:
            raise ValueError(f"{self.c} input and {self.k} output channels (at most {MAX_CHANNELS}; a multiple of 16)")
        m = self.layout
        accumulators = self.k // 2 if kind == "conv" else 8 * m["KT"] * m["RPW"]
        if accumulators > MAX_ACCUMULATORS:
            raise ValueError(f"{accumulators} accumulators a thread")
        if m["BATCH"] > MAX_PIXELS_A_THREAD or (kind == "conv_bwd_filter" and m["DY_BATCH"] > MAX_DY_LOADS_A_THREAD):
            raise ValueError(f"{m['BATCH']} input pixels and {m['DY_BATCH']} 16-byte pieces of dy a thread")
        shared = self.shared_bytes(kind)
        if shared > SHARED_LIMIT_BYTES:
            raise ValueError(f"{shared} bytes of shared memory")


def stem_shape(attrs: dict, x_dims, w_dims, y_dims) -> StemShape:
    t, left, _, _ = attrs["pads"]
    return StemShape(n=x_dims[0], c=x_dims[1], h=x_dims[2], w=x_dims[3], k=w_dims[0], r=w_dims[2], s=w_dims[3],
                     sh=attrs["strides"][0], sw=attrs["strides"][1], pt=t, pl=left, p=y_dims[2], q=y_dims[3])


def applies(kind: str, attrs: dict, x_dims, w_dims, y_dims, dtype: str) -> bool:
    """Whether the stem kernels take this convolution (cheap: the registry asks for every conv node)."""
    try:
        stem_shape(attrs, x_dims, w_dims, y_dims).check(kind, attrs, dtype)
    except ValueError:
        return False
    return True


class StemConv:
    """conv or conv_bwd_filter by the stem kernels, in ConvOp's interface: `candidates` (token, name, workspace
    bytes), one per CTAS_PER_SM; `launch(token, a, b, out, workspace, bias)` with (x, w) or (x, dy). A forward
    conv may add a bias and apply ReLU as it writes y."""

    def __init__(self, kind: str, attrs: dict, x_dims, w_dims, y_dims, dtype: str, bias: bool = False,
                 relu: bool = False):
        self.kind, self.dtype, self.shape = kind, dtype, stem_shape(attrs, x_dims, w_dims, y_dims)
        self.shape.check(kind, attrs, dtype)
        sms = gpu().cp.cuda.Device().attributes["MultiProcessorCount"]
        units = self.shape.n * self.shape.p
        grids: dict[int, int] = {}  # grid -> CTAs per SM it was asked for (a small batch has one grid)
        for per_sm in CTAS_PER_SM[kind]:
            grids.setdefault(min(units, per_sm * sms), per_sm)
        self.grids = list(grids)
        m = self.shape.layout
        self.units, self.phases, self.shared = units, m["WC"], self.shape.shared_bytes(kind)
        self.partial_floats = m["WC"] * m["K"] * m["RT"] * 16  # per CTA
        self.candidates = [(i, f"stem:{per_sm}x", self.workspace_bytes(i)) for i, per_sm in enumerate(grids.values())]
        self.unsupported: list[tuple[str, str]] = []
        # compiled now: a source the compiler refuses makes the implementation unsupported, not a failed launch
        epilogue = dict(BIAS=int(bias), RELU=int(relu), BIAS_IN_PATCH=int(bias and self.shape.c < m["CP"]),
                        HALF_ONE=HALF_ONE)
        defines = "".join(f"#define {name} {value}\n" for name, value in (m | epilogue).items())
        names = ["stem_fwd"] if kind == "conv" else ["stem_wgrad", "stem_wgrad_sum"]
        self.kernels = [kernel(defines + SRC, name, "fp16") for name in names]

    def workspace_bytes(self, i: int) -> int:
        return 0 if self.kind == "conv" else 4 * self.grids[i] * self.partial_floats

    def launch(self, i: int, a, b, out, workspace, bias=None) -> None:
        grid = self.grids[i]
        if self.kind == "conv":
            self.kernels[0]((grid,), (THREADS,), (a, b, out if bias is None else bias, out, i32(self.units)),
                            shared_mem=self.shared)
            return
        self.kernels[0]((grid,), (THREADS,), (a, b, workspace, i32(self.units)), shared_mem=self.shared)
        self.sum_partials(workspace, out, grid * self.phases)

    def sum_partials(self, partial, dw, parts: int) -> None:
        """dw = the sum of `parts` partial sums partial[part][k][r * JP + j], in a fixed order (fp16 dw)."""
        self.kernels[1]((math.ceil(self.partial_floats / self.phases / 32),), (THREADS,), (partial, dw, i32(parts)))
