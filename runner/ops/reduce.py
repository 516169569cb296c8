"""Sums over some dims of a tensor: bias gradients, unbroadcasting, global average pooling.

Most such sums, seen in memory order, are column sums of a row-major [A, M, C] block (sum over M): a channel
reduction of an NHWC tensor is [1, N*H*W, C], a global average pool is [N, H*W, C]. Those run as a coalesced
column-sum kernel whose rows are split over enough blocks to fill the GPU; the split partial sums go to the
workspace and a second kernel adds them (one kernel when one split suffices). Any other pattern falls back to a
one-thread-per-output loop.
"""

from __future__ import annotations

import math

from runner.ops.common import THREADS, TensorSpec, blocks_for, f32, i32, kernel, physical

TARGET_BLOCKS = 1024  # about four blocks per SM on a 132-SM H100: enough to cover DRAM latency
MIN_ROWS_PER_SPLIT = 64
MAX_SPLITS = 4096

SRC = r"""
// x is [A, M, C] row-major; block (32, 8) sums 32 columns of one row split; direct: write scale * sum to out
extern "C" __global__ void colsum_partial(const T* x, int M, int C, int S, int ctiles, float* part, T* out,
                                          float scale, int direct) {
    int a = blockIdx.x / ctiles, c = (blockIdx.x % ctiles) * 32 + threadIdx.x, s = blockIdx.y;
    int rows = (M + S - 1) / S, r0 = s * rows, r1 = min(M, r0 + rows);
    float acc = 0.f;
    if (c < C)
        for (int r = r0 + threadIdx.y; r < r1; r += 8) acc += ld(x, ((long long)a * M + r) * C + c);
    __shared__ float sh[8][33];
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float t = 0.f;
        for (int k = 0; k < 8; ++k) t += sh[k][threadIdx.x];
        if (direct) st(out, (long long)a * C + c, t * scale);
        else part[((long long)a * S + s) * C + c] = t;
    }
}

// one warp per output: out[a, c] = scale * sum over s of part[a, s, c]
extern "C" __global__ void colsum_final(const float* part, int S, int C, T* out, float scale) {
    int o = blockIdx.x, a = o / C, c = o % C;
    float acc = 0.f;
    for (int s = threadIdx.x; s < S; s += 32) acc += part[((long long)a * S + s) * C + c];
    acc = warp_sum(acc);
    if (threadIdx.x == 0) st(out, o, acc * scale);
}

// any pattern: one thread per output; kept dims (size ko, x stride kx, y stride ky), reduced dims (size rs,
// x stride rx), four of each in memory order
extern "C" __global__ void reduce_general(const T* x, T* y, int n_out, int n_red,
        int ko1, int ko2, int ko3, int kx0, int kx1, int kx2, int kx3, int ky0, int ky1, int ky2, int ky3,
        int rs1, int rs2, int rs3, int rx0, int rx1, int rx2, int rx3, float scale) {
    GRID_LOOP(j, n_out) {
        int t = j, i3 = t % ko3; t /= ko3;
        int i2 = t % ko2; t /= ko2;
        int i1 = t % ko1, i0 = t / ko1;
        long long base = (long long)i0 * kx0 + (long long)i1 * kx1 + (long long)i2 * kx2 + (long long)i3 * kx3;
        float acc = 0.f;
        for (int r = 0; r < n_red; ++r) {
            int u = r, r3 = u % rs3; u /= rs3;
            int r2 = u % rs2; u /= rs2;
            int r1 = u % rs1, r0 = u / rs1;
            acc += ld(x, base + (long long)r0 * rx0 + (long long)r1 * rx1 + (long long)r2 * rx2 + (long long)r3 * rx3);
        }
        st(y, (long long)i0 * ky0 + (long long)i1 * ky1 + (long long)i2 * ky2 + (long long)i3 * ky3, acc * scale);
    }
}
"""

_PATTERNS = {(): (0, 0, 0), (False,): (0, 0, 1), (True,): (0, 1, 0), (False, True): (1, 1, 0),
             (True, False): (0, 1, 1), (False, True, False): (1, 1, 1)}


def splits(a: int, m: int, c: int) -> int:
    """Row splits of an [A, M, C] column sum: enough blocks to fill the GPU, at least 64 rows each."""
    ctiles = -(-c // 32)
    want = -(-TARGET_BLOCKS // (a * ctiles))
    return max(1, min(want, -(-m // MIN_ROWS_PER_SPLIT), MAX_SPLITS))


class Reduction:
    """scale * the sum of x over the dims where the output has size 1, written to the output's memory.

    out_dims and out_strides are logical and of x's rank (a lower-rank output is right-aligned as numpy
    broadcasting does; a bias gradient sits on its axis); strides are in elements.
    """

    def __init__(self, x: TensorSpec, out_dims: list[int], out_strides: list[int]):
        rank = len(x.shape)
        order = [0, 2, 3, 1] if rank == 4 else list(range(rank))
        xd = list(physical(x.shape))
        xs = [math.prod(xd[j + 1:]) for j in range(rank)]
        od = [out_dims[i] for i in order]
        ost = [out_strides[i] for i in order]
        assert all(o in (1, d) for o, d in zip(od, xd)), (x.shape, out_dims)
        self.dtype = x.dtype
        dims = [(xd[j], od[j] == 1, xs[j], ost[j]) for j in range(rank) if xd[j] > 1]
        self.workspace_bytes = 0
        if self._columns(dims):
            return
        self.mode = "general"
        if len(dims) > 4:
            raise ValueError(f"reduction of {x.shape} to {out_dims}: more than 4 non-unit dims")
        dims = [(1, False, 0, 0)] * (4 - len(dims)) + dims
        self.n_out = math.prod(d[0] for d in dims if not d[1])
        self.n_red = math.prod(d[0] for d in dims if d[1])
        kept = [(1 if red else size, 0 if red else xstr, 0 if red else ostr) for size, red, xstr, ostr in dims]
        red = [(size if red else 1, xstr if red else 0) for size, red, xstr, _ in dims]
        self.general_args = ([i32(k[0]) for k in kept[1:]] + [i32(k[1]) for k in kept] + [i32(k[2]) for k in kept]
                             + [i32(r[0]) for r in red[1:]] + [i32(r[1]) for r in red])

    def _columns(self, dims) -> bool:
        """[A, M, C] when the reduced dims are one run and the output is row-major over the kept ones."""
        groups: list[list] = []
        for size, red, _, ostr in dims:
            if groups and groups[-1][1] == red:
                groups[-1][0] *= size
                groups[-1][2].append((size, ostr))
            else:
                groups.append([size, red, [(size, ostr)]])
        pattern = tuple(g[1] for g in groups)
        if pattern not in _PATTERNS:
            return False
        step = 1
        for size, ostr in reversed([d for g in groups if not g[1] for d in g[2]]):
            if ostr != step:
                return False
            step *= size
        has_a, has_m, has_c = _PATTERNS[pattern]
        it = iter(g[0] for g in groups)
        self.a = next(it) if has_a else 1
        self.m = next(it) if has_m else 1
        self.c = next(it) if has_c else 1
        self.mode = "columns"
        self.splits = splits(self.a, self.m, self.c)
        if self.splits > 1:
            self.workspace_bytes = 4 * self.a * self.splits * self.c
        return True

    def launch(self, x, y, workspace, scale: float = 1.0) -> None:
        if self.mode == "general":
            fn = kernel(SRC, "reduce_general", self.dtype)
            fn((blocks_for(self.n_out),), (THREADS,), (x, y, i32(self.n_out), i32(self.n_red), *self.general_args,
                                                        f32(scale)))
            return
        ctiles = -(-self.c // 32)
        direct = self.splits == 1
        part = y if direct else workspace
        kernel(SRC, "colsum_partial", self.dtype)(
            (self.a * ctiles, self.splits), (32, 8),
            (x, i32(self.m), i32(self.c), i32(self.splits), i32(ctiles), part, y, f32(scale), i32(direct)))
        if not direct:
            kernel(SRC, "colsum_final", self.dtype)(
                (self.a * self.c,), (32,), (workspace, i32(self.splits), i32(self.c), y, f32(scale)))
