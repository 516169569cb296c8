"""BatchNormalization (inference; training with batch statistics and in-place running statistics; backward)
and LRN across channels, with its gradient.

Training batchnorm and its backward have two implementations: CuPy kernels (an [N*H*W, C] column reduction
split over enough blocks to fill the GPU, one warp per channel to finish the statistics and fold them into
per-channel coefficients, then one pass y = x * k1 + k0), and cuDNN's own norm engines through a frontend
graph (each engine config a candidate). Statistics are fp32 whatever the activation dtype.
"""

from __future__ import annotations

import math

import numpy as np

from runner.gpu import cudnn_dtype, device_pointer, gpu
from runner.ops.common import (
    Alternatives, SingleKernelOp, TensorSpec, check_index_range, f32, i32, kernel, launch_1d, launch_rows,
    vector_width,
)
from runner.ops.conv import build_plans, nhwc_strides
from runner.ops.norm_relu import FUSED_RELU_SRC
from runner.ops.reduce import splits

SRC = r"""
extern "C" __global__ void bn_infer(const T* x, T* y, const float* scale, const float* bias, const float* mean,
                                    const float* var, int n, int C, int inner, float eps) {
    GRID_LOOP(i, n) {
        int c = (i / inner) % C;
        float g = scale[c] * rsqrtf(var[c] + eps);
        st(y, i, (ld(x, i) - mean[c]) * g + bias[c]);
    }
}

// training batchnorm re-applied with the statistics its forward pass saved (a recomputation), then the residual
// z added (residual != 0) and ReLU (relu != 0): relu?(scale * (x - mean) * invstd + bias + z), one pass
extern "C" __global__ void bn_apply_saved(const T* x, const T* z, T* y, const float* scale, const float* bias,
                                          const float* mean, const float* invstd, int n, int C, int inner,
                                          int residual, int relu) {
    GRID_LOOP(i, n) {
        int c = (i / inner) % C;
        float v = (ld(x, i) - mean[c]) * invstd[c] * scale[c] + bias[c];
        if (residual) v += ld(z, i);
        st(y, i, relu ? fmaxf(v, 0.f) : v);
    }
}

// VEC per-channel floats from p + c as 16-byte loads (c a multiple of VEC, p 16-byte aligned)
__device__ __forceinline__ void ld_channels(const float* p, int c, float* f) {
#pragma unroll
    for (int e = 0; e < VEC; e += 4) {
        float4 q = __ldg(reinterpret_cast<const float4*>(p + c + e));
        f[e] = q.x; f[e + 1] = q.y; f[e + 2] = q.z; f[e + 3] = q.w;
    }
}

// the same, VEC channels a thread (inner == 1, C a multiple of VEC, every array 16-byte aligned): nv = n / VEC
extern "C" __global__ void bn_apply_saved_vec(const T* x, const T* z, T* y, const float* scale, const float* bias,
                                              const float* mean, const float* invstd, int nv, int C, int residual,
                                              int relu) {
    GRID_LOOP(j, nv) {
        int i = j * VEC, c = i % C;
        float v[VEC], w[VEC], g[VEC], b[VEC], m[VEC], s[VEC];
        ldv<VEC>(x, i, v);
        if (residual) ldv<VEC>(z, i, w);
        ld_channels(scale, c, g);
        ld_channels(bias, c, b);
        ld_channels(mean, c, m);
        ld_channels(invstd, c, s);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float a = s[e] * g[e];
            v[e] = v[e] * a + (b[e] - m[e] * a);
            if (residual) v[e] += w[e];
            if (relu) v[e] = fmaxf(v[e], 0.f);
        }
        stv<VEC>(y, i, v);
    }
}

// the block's (32, 8) column sums a and b, added over threadIdx.y, as split s of columns c (p1, p2: [S, C])
__device__ __forceinline__ void store_partial(float a, float b, int c, int C, int s, float* p1, float* p2) {
    __shared__ float sa[8][33], sb[8][33];
    sa[threadIdx.y][threadIdx.x] = a;
    sb[threadIdx.y][threadIdx.x] = b;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float ta = 0.f, tb = 0.f;
        for (int k = 0; k < 8; ++k) { ta += sa[k][threadIdx.x]; tb += sb[k][threadIdx.x]; }
        p1[(long long)s * C + c] = ta;
        p2[(long long)s * C + c] = tb;
    }
}

// block (32, 8): per column of [M, C], sums over one row split of v = x - x[0, c] and v * v (shifted, so a
// large mean does not cancel the variance), or of dy and dy * (x - mean)
extern "C" __global__ void bn_partial(const T* x, const T* dy, const float* mean, int backward, int M, int C,
                                      int S, float* p1, float* p2) {
    int c = blockIdx.x * 32 + threadIdx.x, s = blockIdx.y;
    int rows = (M + S - 1) / S, r0 = s * rows, r1 = min(M, r0 + rows);
    float a = 0.f, b = 0.f;
    if (c < C) {
        if (backward) {
            float m = mean[c];
            for (int r = r0 + threadIdx.y; r < r1; r += 8) {
                long long k = (long long)r * C + c;
                float g = ld(dy, k);
                a += g;
                b += g * (ld(x, k) - m);
            }
        } else {
            float shift = ld(x, c);
            for (int r = r0 + threadIdx.y; r < r1; r += 8) {
                float v = ld(x, (long long)r * C + c) - shift;
                a += v;
                b += v * v;
            }
        }
    }
    store_partial(a, b, c, C, s, p1, p2);
}

__device__ __forceinline__ void channel_sums(const float* p1, const float* p2, int S, int C, float& a, float& b) {
    int c = blockIdx.x;
    a = 0.f; b = 0.f;
    for (int s = threadIdx.x; s < S; s += 32) { a += p1[(long long)s * C + c]; b += p2[(long long)s * C + c]; }
    a = warp_sum(a);
    b = warp_sum(b);
}

// one warp per channel; running statistics may be updated in place (rmean_out == rmean)
extern "C" __global__ void bn_stats(const float* p1, const float* p2, int S, int M, int C, const T* x,
        const float* scale, const float* bias, const float* rmean, const float* rvar, float* rmean_out,
        float* rvar_out, float* saved_mean, float* saved_invstd, float* k1, float* k0, float eps, float momentum) {
    float a, b;
    channel_sums(p1, p2, S, C, a, b);
    int c = blockIdx.x;
    if (threadIdx.x == 0) {
        float d = a / M, mean = ld(x, c) + d, var = fmaxf(b / M - d * d, 0.f);
        float invstd = rsqrtf(var + eps);
        rmean_out[c] = rmean[c] * momentum + mean * (1.f - momentum);
        rvar_out[c] = rvar[c] * momentum + var * (1.f - momentum);
        saved_mean[c] = mean;
        saved_invstd[c] = invstd;
        float g = scale[c] * invstd;
        k1[c] = g;
        k0[c] = bias[c] - mean * g;
    }
}

extern "C" __global__ void bn_apply(const T* x, T* y, const float* k1, const float* k0, int n, int C) {
    GRID_LOOP(i, n) { int c = i % C; st(y, i, ld(x, i) * k1[c] + k0[c]); }
}

// dx = scale * invstd / M * (M * dy - dbias - xhat * dscale) = k2 * dy + k1 * x + k0
extern "C" __global__ void bn_bwd_stats(const float* p1, const float* p2, int S, int M, int C, const float* scale,
        const float* mean, const float* invstd, float* dscale, float* dbias, float* k2, float* k1, float* k0) {
    float a, b;
    channel_sums(p1, p2, S, C, a, b);
    int c = blockIdx.x;
    if (threadIdx.x == 0) {
        float ds = b * invstd[c], g = scale[c] * invstd[c], u = -g * ds * invstd[c] / M;
        dscale[c] = ds;
        dbias[c] = a;
        k2[c] = g;
        k1[c] = u;
        k0[c] = -g * a / M - u * mean[c];
    }
}

extern "C" __global__ void bn_bwd_apply(const T* x, const T* dy, T* dx, const float* k2, const float* k1,
                                        const float* k0, int n, int C) {
    GRID_LOOP(i, n) { int c = i % C; st(dx, i, ld(dy, i) * k2[c] + ld(x, i) * k1[c] + k0[c]); }
}

__device__ __forceinline__ float lrn_scale(const T* x, int base, int j, int C, int size, float alpha_n, float bias) {
    float s = 0.f;
    for (int k = max(0, j - (size - 1) / 2); k <= min(C - 1, j + size / 2); ++k) { float v = ld(x, base + k); s += v * v; }
    return bias + alpha_n * s;
}

extern "C" __global__ void lrn_fwd(const T* x, T* y, int n, int C, int size, float alpha_n, float beta, float bias) {
    GRID_LOOP(i, n) {
        int c = i % C;
        st(y, i, ld(x, i) * powf(lrn_scale(x, i - c, c, C, size, alpha_n, bias), -beta));
    }
}

// dx_c = dy_c s_c^-beta - 2 beta alpha/size x_c sum over j whose window holds c of dy_j x_j s_j^(-beta-1)
extern "C" __global__ void lrn_bwd(const T* x, const T* dy, T* dx, int n, int C, int size, float alpha_n,
                                   float beta, float bias) {
    GRID_LOOP(i, n) {
        int c = i % C, base = i - c;
        float acc = 0.f, own = 1.f;
        for (int j = max(0, c - size / 2); j <= min(C - 1, c + (size - 1) / 2); ++j) {
            float s = lrn_scale(x, base, j, C, size, alpha_n, bias);
            if (j == c) own = s;
            acc += ld(dy, base + j) * ld(x, base + j) * powf(s, -beta - 1.f);
        }
        st(dx, i, ld(dy, i) * powf(own, -beta) - 2.f * beta * alpha_n * ld(x, i) * acc);
    }
}
""" + FUSED_RELU_SRC


def _rows_channels(x: TensorSpec) -> tuple[int, int]:
    """[M, C] view of an NHWC 4-D or a row-major 2-D tensor."""
    if len(x.shape) not in (2, 4):
        raise ValueError(f"batch statistics over a {len(x.shape)}-D tensor (2-D or 4-D only)")
    return x.numel // x.shape[1], x.shape[1]


class BatchNormInference(SingleKernelOp):
    name = "cupy_elementwise"

    def __init__(self, attrs, x: TensorSpec):
        check_index_range(x)
        inner = 1 if len(x.shape) in (2, 4) else math.prod(x.shape[2:])
        self.dtype, self.n, self.params = x.dtype, x.numel, (i32(x.shape[1]), i32(inner), f32(attrs["epsilon"]))

    def run(self, inputs, outputs, workspace):
        x, scale, bias, mean, var = inputs
        launch_1d(kernel(SRC, "bn_infer", self.dtype), self.n, x, outputs[0], scale, bias, mean, var, i32(self.n),
                  *self.params)


class BatchNormApply(BatchNormInference):
    """Training BatchNormalization recomputed from the mean and inverse deviation its forward pass saved, with the
    Add and ReLU after it fused when attrs say so (kind bn_apply): inputs (x, scale, bias, saved_mean,
    saved_invstd, z?), no running-statistics update."""

    def __init__(self, attrs, x: TensorSpec):
        super().__init__({"epsilon": 0.0, **attrs}, x)
        self.residual, self.relu = i32(attrs.get("residual", 0)), i32(attrs.get("relu", 0))

    def run(self, inputs, outputs, workspace):
        x, scale, bias, mean, invstd = inputs[:5]
        z = inputs[5] if self.residual else x
        aligned = vector_width("fp32", scale, bias, mean, invstd) > 1
        width = vector_width(self.dtype, x, z, outputs[0]) if aligned else 1
        channels, inner = (int(v) for v in self.params[:2])
        if width > 1 and inner == 1 and channels % width == 0:
            nv = self.n // width
            launch_1d(kernel(SRC, "bn_apply_saved_vec", self.dtype), nv, x, z, outputs[0], scale, bias, mean,
                      invstd, i32(nv), i32(channels), self.residual, self.relu)
            return
        launch_1d(kernel(SRC, "bn_apply_saved", self.dtype), self.n, x, z, outputs[0], scale, bias, mean, invstd,
                  i32(self.n), *self.params[:2], self.residual, self.relu)


class _ColumnStats(SingleKernelOp):
    """Shared geometry of the training forward and backward: row splits and workspace slices."""

    name = "cupy_reduce"

    def __init__(self, x: TensorSpec, coefficients: int):
        check_index_range(x)
        self.dtype, self.n = x.dtype, x.numel
        self.m, self.c = _rows_channels(x)
        self.splits = splits(1, self.m, self.c)
        part = self.splits * self.c * 4
        self.slices = [(0, part), (part, 2 * part)] + [(2 * part + k * self.c * 4, 2 * part + (k + 1) * self.c * 4)
                                                        for k in range(coefficients)]
        self.workspace_bytes = -(-self.slices[-1][1] // 16) * 16
        self.grid = (-(-self.c // 32), self.splits)

    def views(self, workspace):
        return [workspace[a:b] for a, b in self.slices]

    def partial(self, x, dy, mean, p1, p2):
        """Column sums for the forward statistics (dy None) or the backward ones."""
        backward = dy is not None
        args = (x, dy if backward else x, mean if backward else p1, i32(backward), i32(self.m), i32(self.c),
                i32(self.splits), p1, p2)
        kernel(SRC, "bn_partial", self.dtype)(self.grid, (32, 8), args)


class BatchNormTraining(_ColumnStats):
    """With attr relu, y is the ReLU of the normalised x, written with `y`'s pitch; with attr residual too, the
    ReLU of it plus the last input, applied as a recomputation would be, from the statistics (fuse.with_bn_relu)."""

    def __init__(self, attrs, x: TensorSpec, y: TensorSpec):
        super().__init__(x, coefficients=2)
        self.eps, self.momentum = f32(attrs["epsilon"]), f32(attrs["momentum"])
        self.relu, self.pitch = bool(attrs.get("relu")), y.row_channels or self.c
        self.residual = BatchNormApply(attrs, x) if attrs.get("residual") else None

    def run(self, inputs, outputs, workspace):
        x, scale, bias, rmean, rvar = inputs[:5]
        y, rmean_out, rvar_out, saved_mean, saved_invstd = outputs
        p1, p2, k1, k0 = self.views(workspace)
        self.partial(x, None, None, p1, p2)
        kernel(SRC, "bn_stats", self.dtype)((self.c,), (32,), (
            p1, p2, i32(self.splits), i32(self.m), i32(self.c), x, scale, bias, rmean, rvar, rmean_out, rvar_out,
            saved_mean, saved_invstd, k1, k0, self.eps, self.momentum))
        if self.residual is not None:
            self.residual.run([x, scale, bias, saved_mean, saved_invstd, inputs[5]], [y], None)
        elif self.relu:
            launch_rows(kernel(SRC, "bn_relu_apply", self.dtype), self.n, self.c, self.dtype, [x, y, k1, k0],
                        [self.pitch])
        else:
            launch_1d(kernel(SRC, "bn_apply", self.dtype), self.n, x, y, k1, k0, i32(self.n), i32(self.c))


class BatchNormBackward(_ColumnStats):
    """With attr relu, the inputs are [x, dr, scale, mean, invstd, bias] and dy = dr where the ReLU's input,
    recomputed, is positive; dr read with its pitch (fuse.with_bn_relu)."""

    def __init__(self, attrs, ins: list[TensorSpec]):
        super().__init__(ins[0], coefficients=3)
        self.relu = bool(attrs.get("relu"))
        self.pitch = ins[1].row_channels or self.c

    def run(self, inputs, outputs, workspace):
        x, dy, scale, mean, invstd = inputs[:5]
        dx, dscale, dbias = outputs
        p1, p2, k2, k1, k0 = self.views(workspace)
        if self.relu:
            kernel(SRC, "bn_relu_partial", self.dtype)(self.grid, (32, 8), (
                x, dy, scale, inputs[5], mean, invstd, i32(self.m), i32(self.c), i32(self.splits), i32(self.pitch),
                p1, p2))
        else:
            self.partial(x, dy, mean, p1, p2)
        kernel(SRC, "bn_bwd_stats", self.dtype)((self.c,), (32,), (
            p1, p2, i32(self.splits), i32(self.m), i32(self.c), scale, mean, invstd, dscale, dbias, k2, k1, k0))
        if self.relu:
            launch_rows(kernel(SRC, "bn_relu_bwd_apply", self.dtype), self.n, self.c, self.dtype,
                        [x, dy, dx, k2, k1, k0, scale, inputs[5], mean, invstd], [self.pitch])
        else:
            launch_1d(kernel(SRC, "bn_bwd_apply", self.dtype), self.n, x, dy, dx, k2, k1, k0, i32(self.n),
                      i32(self.c))


RUNTIME_COMPILED_PLANS = 3  # cuDNN compiles norm engines at build time: ~1 s a plan


class CudnnBatchNorm:
    """Training batchnorm or its backward as a cuDNN frontend graph (NHWC activations, [1, C, 1, 1] fp32
    statistics); cuDNN's momentum weighs the batch statistic, so it gets 1 - the ONNX momentum. With attr relu
    the graph runs the ReLU after the batchnorm (after adding the residual, attr residual), or the ReLU's
    backward before it (fuse.with_bn_relu)."""

    def __init__(self, kind: str, attrs: dict, ins: list[TensorSpec], outs: list[TensorSpec], handle):
        cudnn = gpu().cudnn
        x = ins[0]
        if len(x.shape) != 4:
            raise ValueError("cuDNN batchnorm graphs take 4-D activations")
        check_index_range(x)
        dims, c, fp32 = list(x.shape), x.shape[1], cudnn.data_type.FLOAT
        io = cudnn_dtype(x.dtype)
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
        act = lambda name: g.tensor(name=name, dim=dims, stride=nhwc_strides(dims), data_type=io)  # noqa: E731
        chan = lambda name: g.tensor(name=name, dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=fp32)  # noqa: E731
        self.host_scalars: dict = {}
        if kind == "batchnorm":
            self.ins = [act("x"), chan("scale"), chan("bias"), chan("running_mean"), chan("running_var")]
            scalars = []
            for name, value in (("epsilon", attrs["epsilon"]), ("momentum", 1.0 - attrs["momentum"])):
                t = g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True, data_type=fp32)
                self.host_scalars[t] = np.array([value], dtype=np.float32)
                scalars.append(t)
            y, mean, invstd, rmean, rvar = g.batchnorm(input=self.ins[0], scale=self.ins[1], bias=self.ins[2],
                                                       in_running_mean=self.ins[3], in_running_var=self.ins[4],
                                                       epsilon=scalars[0], momentum=scalars[1], peer_stats=[])
            if attrs.get("residual"):
                self.ins.append(act("z"))
                y = g.add(name="residual", a=y, b=self.ins[5])
            if attrs.get("relu"):
                y = g.relu(name="relu", input=y)
            self.outs = [y, rmean, rvar, mean, invstd]
        else:
            if ins[1].row_channels:
                raise ValueError("cuDNN's backward reads dy packed (measured: wrong outputs from a channel slice)")
            self.ins = [act("x"), act("dy"), chan("scale"), chan("mean"), chan("invstd")]
            dy = self.ins[1]
            if attrs.get("relu"):  # the ReLU's input recomputed from x (the pattern cuDNN fuses)
                self.ins.append(chan("bias"))
                y = g.batchnorm_inference(input=self.ins[0], mean=self.ins[3], inv_variance=self.ins[4],
                                          scale=self.ins[2], bias=self.ins[5])
                dy = g.relu_backward(name="relu_bwd", loss=dy, input=y)
                dy.set_data_type(io)
            self.outs = list(g.batchnorm_backward(grad=dy, input=self.ins[0], scale=self.ins[2],
                                                  mean=self.ins[3], inv_variance=self.ins[4], peer_stats=[]))
        pitch = outs[0].row_channels if kind == "batchnorm" else None
        self.outs[0].set_dim(dims).set_stride(nhwc_strides(dims, pitch)).set_output(True).set_data_type(io)
        for t in self.outs[1:]:
            t.set_dim([1, c, 1, 1]).set_stride([c, 1, c, c]).set_output(True).set_data_type(fp32)
        self.graph, self.handle = g, handle
        plans, self.unsupported = build_plans(g, max_plans=RUNTIME_COMPILED_PLANS)
        self.plan_index = [i for i, _, _ in plans]
        self.candidates = [(f"cudnn:{name}", workspace) for _, name, workspace in plans]

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        pack = {t: device_pointer(a) for t, a in zip(self.ins + self.outs, inputs + outputs)}
        pack |= {t: host.ctypes.data for t, host in self.host_scalars.items()}
        self.graph.execute_plan_at_index(pack, device_pointer(workspace), self.plan_index[index], handle=self.handle)


class Lrn(SingleKernelOp):
    name = "cupy_elementwise"

    def __init__(self, kind: str, attrs, x: TensorSpec):
        if len(x.shape) != 4:
            raise ValueError("LRN over channels of a 4-D tensor only")
        check_index_range(x)
        self.kernel_name = "lrn_fwd" if kind == "lrn" else "lrn_bwd"
        self.dtype, self.n = x.dtype, x.numel
        self.params = (i32(x.shape[1]), i32(attrs["size"]), f32(attrs["alpha"] / attrs["size"]), f32(attrs["beta"]),
                       f32(attrs["bias"]))

    def run(self, inputs, outputs, workspace):
        launch_1d(kernel(SRC, self.kernel_name, self.dtype), self.n, *inputs, outputs[0], i32(self.n), *self.params)


def _batchnorm(attrs, ins, outs, handle):
    if not attrs["training"]:
        return BatchNormInference(attrs, ins[0])
    return Alternatives({"cupy_reduce": lambda: BatchNormTraining(attrs, ins[0], outs[0]),
                         "cudnn": lambda: CudnnBatchNorm("batchnorm", attrs, ins, outs, handle)})


def _batchnorm_bwd(attrs, ins, outs, handle):
    return Alternatives({"cupy_reduce": lambda: BatchNormBackward(attrs, ins),
                         "cudnn": lambda: CudnnBatchNorm("batchnorm_bwd", attrs, ins, outs, handle)})


OPS = {
    "batchnorm": _batchnorm,
    "batchnorm_bwd": _batchnorm_bwd,
    "bn_apply": lambda a, i, o, h: BatchNormApply(a, i[0]),
    "lrn": lambda a, i, o, h: Lrn("lrn", a, i[0]),
    "lrn_bwd": lambda a, i, o, h: Lrn("lrn_bwd", a, i[0]),
}
