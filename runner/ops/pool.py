"""Max, average and global-average pooling and their gradients on NHWC tensors, with the reference's geometry:
explicit [t, l, b, r] pads, dilations (max), ceil_mode windows that run past the pads (never counted), and
count_include_pad counting the explicit pads only.

Threads map to consecutive channels, so every load is coalesced. Gradients gather rather than scatter: each dx
element sums the windows that cover it, so there are no atomics and no zero-fill. maxpool_bwd first records
each window's first maximum (row-major order, as the reference's argmax) in the workspace, then gathers.
"""

from __future__ import annotations

from runner.ops.common import SingleKernelOp, TensorSpec, check_index_range, f32, i32, kernel, launch_1d
from runner.ops.reduce import Reduction

SRC = r"""
#define DECODE_OUT int c = i % C, t = i / C, q = t % Q; t /= Q; int p = t % P, b = t / P;
#define DECODE_IN int c = i % C, t = i / C, w = t % W; t /= W; int h = t % H, b = t / H;
#define X_AT(hh, ww) (((long long)(b * H + (hh)) * W + (ww)) * C + c)
#define Y_AT(pp, qq) (((long long)(b * P + (pp)) * Q + (qq)) * C + c)
#define GEOMETRY int C, int H, int W, int P, int Q, int kh, int kw, int sh, int sw

extern "C" __global__ void maxpool_fwd(const T* x, T* y, int n, GEOMETRY, int dh, int dw, int pt, int pl) {
    GRID_LOOP(i, n) {
        DECODE_OUT
        float best = NEG_INF;
        for (int ki = 0; ki < kh; ++ki) {
            int h = p * sh - pt + ki * dh;
            if (h < 0 || h >= H) continue;
            for (int kj = 0; kj < kw; ++kj) {
                int w = q * sw - pl + kj * dw;
                if (w >= 0 && w < W) best = fmaxf(best, ld(x, X_AT(h, w)));
            }
        }
        st(y, i, best);
    }
}

// tap index (ki * kw + kj) of each window's first maximum; 255 when the window holds no input element
extern "C" __global__ void maxpool_argmax(const T* x, unsigned char* arg, int n, GEOMETRY, int dh, int dw,
                                          int pt, int pl) {
    GRID_LOOP(i, n) {
        DECODE_OUT
        float best = NEG_INF;
        int tap = 255;
        for (int ki = 0; ki < kh; ++ki) {
            int h = p * sh - pt + ki * dh;
            if (h < 0 || h >= H) continue;
            for (int kj = 0; kj < kw; ++kj) {
                int w = q * sw - pl + kj * dw;
                if (w < 0 || w >= W) continue;
                float v = ld(x, X_AT(h, w));
                if (tap == 255 || v > best) { best = v; tap = ki * kw + kj; }
            }
        }
        arg[i] = (unsigned char)tap;
    }
}

extern "C" __global__ void maxpool_bwd(const unsigned char* arg, const T* dy, T* dx, int n, GEOMETRY, int dh,
                                       int dw, int pt, int pl) {
    GRID_LOOP(i, n) {
        DECODE_IN
        int hp = h + pt, wp = w + pl;
        int lo = hp - (kh - 1) * dh, p0 = lo <= 0 ? 0 : (lo + sh - 1) / sh, p1 = min(P - 1, hp / sh);
        lo = wp - (kw - 1) * dw;
        int q0 = lo <= 0 ? 0 : (lo + sw - 1) / sw, q1 = min(Q - 1, wp / sw);
        float acc = 0.f;
        for (int p = p0; p <= p1; ++p) {
            int di = hp - p * sh;
            if (di % dh) continue;
            for (int q = q0; q <= q1; ++q) {
                int dj = wp - q * sw;
                if (dj % dw) continue;
                long long o = Y_AT(p, q);
                if (arg[o] == (di / dh) * kw + dj / dw) acc += ld(dy, o);
            }
        }
        st(dx, i, acc);
    }
}

__device__ __forceinline__ int avg_count(int hs, int ws, int kh, int kw, int H, int W, int pt, int pl, int pb,
                                         int pr, int include_pad) {
    if (include_pad) return (min(hs + kh, H + pb) - max(hs, -pt)) * (min(ws + kw, W + pr) - max(ws, -pl));
    return (min(hs + kh, H) - max(hs, 0)) * (min(ws + kw, W) - max(ws, 0));
}

extern "C" __global__ void avgpool_fwd(const T* x, T* y, int n, GEOMETRY, int pt, int pl, int pb, int pr,
                                       int include_pad) {
    GRID_LOOP(i, n) {
        DECODE_OUT
        int hs = p * sh - pt, ws = q * sw - pl;
        float acc = 0.f;
        for (int h = max(hs, 0); h < min(hs + kh, H); ++h)
            for (int w = max(ws, 0); w < min(ws + kw, W); ++w) acc += ld(x, X_AT(h, w));
        st(y, i, acc / avg_count(hs, ws, kh, kw, H, W, pt, pl, pb, pr, include_pad));
    }
}

extern "C" __global__ void avgpool_bwd(const T* dy, T* dx, int n, GEOMETRY, int pt, int pl, int pb, int pr,
                                       int include_pad) {
    GRID_LOOP(i, n) {
        DECODE_IN
        int hp = h + pt, wp = w + pl;
        int lo = hp - kh + 1, p0 = lo <= 0 ? 0 : (lo + sh - 1) / sh, p1 = min(P - 1, hp / sh);
        lo = wp - kw + 1;
        int q0 = lo <= 0 ? 0 : (lo + sw - 1) / sw, q1 = min(Q - 1, wp / sw);
        float acc = 0.f;
        for (int p = p0; p <= p1; ++p)
            for (int q = q0; q <= q1; ++q)
                acc += ld(dy, Y_AT(p, q)) / avg_count(p * sh - pt, q * sw - pl, kh, kw, H, W, pt, pl, pb, pr,
                                                      include_pad);
        st(dx, i, acc);
    }
}

extern "C" __global__ void globalavgpool_bwd(const T* dy, T* dx, int n, int C, int HWC, float scale) {
    GRID_LOOP(i, n) st(dx, i, ld(dy, (long long)(i / HWC) * C + i % C) * scale);
}
"""


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
        self.geometry = tuple(i32(v) for v in (c, h, w, p, q, kh, kw, sh, sw))
        if kind.startswith("maxpool"):
            if kh * kw > 255:
                raise ValueError(f"max pooling window of {kh * kw} taps (the gradient records at most 255)")
            self.extra = tuple(i32(v) for v in (*attrs.get("dilations", [1, 1]), t, l))
            self.workspace_bytes = -(-y.numel // 16) * 16 if kind == "maxpool_bwd" else 0
        else:
            self.extra = tuple(i32(v) for v in (t, l, b, r, attrs["count_include_pad"]))

    def run(self, inputs, outputs, workspace):
        args = self.geometry + self.extra
        if self.kind == "maxpool_bwd":
            x, dy = inputs
            launch_1d(kernel(SRC, "maxpool_argmax", self.dtype), self.y_numel, x, workspace, i32(self.y_numel), *args)
            launch_1d(kernel(SRC, "maxpool_bwd", self.dtype), self.x_numel, workspace, dy, outputs[0],
                      i32(self.x_numel), *args)
            return
        n = self.x_numel if self.kind == "avgpool_bwd" else self.y_numel
        name = {"maxpool": "maxpool_fwd", "avgpool": "avgpool_fwd", "avgpool_bwd": "avgpool_bwd"}[self.kind]
        launch_1d(kernel(SRC, name, self.dtype), n, inputs[0], outputs[0], i32(n), *args)


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
