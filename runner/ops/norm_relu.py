"""CUDA source of the training BatchNormalization that runs its ReLU and of its backward (attr relu,
fuse.with_bn_relu), compiled with norm.py's SRC, whose `ld_channels` and `store_partial` it uses: the forward
applies the ReLU in its apply pass; the backward masks the ReLU's output gradient where the ReLU's input,
recomputed from x and the saved statistics as the forward computed it, is not positive, in its column sums and in
its apply pass."""

FUSED_RELU_SRC = r"""
// bn_partial's backward sums through the ReLU a BatchNormalization ran (attr relu): dy = dr where the ReLU's input
// x * (scale * invstd) + bias - mean * scale * invstd, as the forward pass computed it, is positive; dr may be a
// channel slice of a wider NHWC buffer (pixels pd apart)
extern "C" __global__ void bn_relu_partial(const T* x, const T* dr, const float* scale, const float* bias,
                                           const float* mean, const float* invstd, int M, int C, int S, int pd,
                                           float* p1, float* p2) {
    int c = blockIdx.x * 32 + threadIdx.x, s = blockIdx.y;
    int rows = (M + S - 1) / S, r0 = s * rows, r1 = min(M, r0 + rows);
    float a = 0.f, b = 0.f;
    if (c < C) {
        float m = mean[c], g = scale[c] * invstd[c], g0 = bias[c] - m * g;
        for (int row = r0 + threadIdx.y; row < r1; row += 8) {
            float v = ld(x, (long long)row * C + c);
            float d = v * g + g0 > 0.f ? ld(dr, (long long)row * pd + c) : 0.f;
            a += d;
            b += d * (v - m);
        }
    }
    store_partial(a, b, c, C, s, p1, p2);
}

// The fused ReLU's passes (attr relu): element i is channel c = i % C of pixel i / C; y and dr may be channel
// slices of wider buffers (pixels py, pd apart). VEC channels a thread for the first nv * VEC elements, when
// C and the pitches are multiples of VEC and every array is 16-byte aligned; one a thread for the rest.

// the affine map y = x * a + b the saved statistics give VEC channels from c: a = scale * invstd, b = bias - mean * a
__device__ __forceinline__ void saved_affine(const float* scale, const float* bias, const float* mean,
                                             const float* invstd, int c, float* a, float* b) {
    float g[VEC], m[VEC], s[VEC];
    ld_channels(scale, c, g);
    ld_channels(bias, c, b);
    ld_channels(mean, c, m);
    ld_channels(invstd, c, s);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        a[e] = s[e] * g[e];
        b[e] = b[e] - m[e] * a[e];
    }
}

// y = max(x * k1 + k0, 0)
extern "C" __global__ void bn_relu_apply(const T* x, T* y, const float* k1, const float* k0, int n, int nv, int C,
                                         int py) {
    int t = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    for (int j = t; j < nv; j += stride) {
        int i = j * VEC, row = i / C, c = i - row * C;
        float v[VEC], a[VEC], b[VEC];
        ldv<VEC>(x, i, v);
        ld_channels(k1, c, a);
        ld_channels(k0, c, b);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[e] = fmaxf(v[e] * a[e] + b[e], 0.f);
        stv<VEC>(y, (long long)row * py + c, v);
    }
    for (int i = nv * VEC + t; i < n; i += stride) {
        int row = i / C, c = i - row * C;
        st(y, (long long)row * py + c, fmaxf(ld(x, i) * k1[c] + k0[c], 0.f));
    }
}

// dx = k2 * dy + k1 * x + k0, dy = dr where the ReLU's input (as in bn_relu_partial) is positive
extern "C" __global__ void bn_relu_bwd_apply(const T* x, const T* dr, T* dx, const float* k2, const float* k1,
                                             const float* k0, const float* scale, const float* bias,
                                             const float* mean, const float* invstd, int n, int nv, int C, int pd) {
    int t = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    for (int j = t; j < nv; j += stride) {
        int i = j * VEC, row = i / C, c = i - row * C;
        float v[VEC], d[VEC], a2[VEC], a1[VEC], a0[VEC], a[VEC], b[VEC];
        ldv<VEC>(x, i, v);
        ldv<VEC>(dr, (long long)row * pd + c, d);
        ld_channels(k2, c, a2);
        ld_channels(k1, c, a1);
        ld_channels(k0, c, a0);
        saved_affine(scale, bias, mean, invstd, c, a, b);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[e] = (v[e] * a[e] + b[e] > 0.f ? d[e] : 0.f) * a2[e] + v[e] * a1[e] + a0[e];
        stv<VEC>(dx, i, v);
    }
    for (int i = nv * VEC + t; i < n; i += stride) {
        int row = i / C, c = i - row * C;
        float v = ld(x, i), w = scale[c] * invstd[c];
        float d = v * w + (bias[c] - mean[c] * w) > 0.f ? ld(dr, (long long)row * pd + c) : 0.f;
        st(dx, i, d * k2[c] + v * k1[c] + k0[c]);
    }
}
"""
