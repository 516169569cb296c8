"""BatchNormalization (inference and training, ONNX semantics) and LRN, with gradients."""

import numpy as np


def _channel_view(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _stat_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def batchnorm(inputs, attrs):
    x, scale, bias, mean, var = inputs[:5]
    eps = attrs["epsilon"]
    cv = lambda v: _channel_view(v, x.ndim)  # noqa: E731
    if not attrs["training"]:
        return [cv(scale) * (x - cv(mean)) / np.sqrt(cv(var) + eps) + cv(bias)]
    axes = _stat_axes(x)
    batch_mean, batch_var = x.mean(axis=axes), x.var(axis=axes)
    invstd = 1.0 / np.sqrt(batch_var + eps)
    y = cv(scale) * (x - cv(batch_mean)) * cv(invstd) + cv(bias)
    m = attrs["momentum"]
    y = y + inputs[5] if attrs.get("residual") else y  # the Add and ReLU it runs (fuse.with_bn_relu)
    y = np.maximum(y, 0) if attrs.get("relu") else y
    return [y, mean * m + batch_mean * (1 - m), var * m + batch_var * (1 - m), batch_mean, invstd]


def bn_apply(inputs, attrs):
    x, scale, bias, mean, invstd = inputs[:5]
    cv = lambda v: _channel_view(v, x.ndim)  # noqa: E731
    y = cv(scale) * (x - cv(mean)) * cv(invstd) + cv(bias)
    if attrs["residual"]:
        y = y + inputs[5]
    return [np.maximum(y, 0) if attrs["relu"] else y]


def batchnorm_bwd(inputs, attrs):
    x, dy, scale, mean, invstd = inputs[:5]
    cv = lambda v: _channel_view(v, x.ndim)  # noqa: E731
    if attrs.get("relu"):  # dy is the ReLU's output gradient, inputs[5] the bias (fuse.with_bn_relu)
        dy = np.where(cv(scale) * (x - cv(mean)) * cv(invstd) + cv(inputs[5]) > 0, dy, 0)
    axes = _stat_axes(x)
    count = x.size // x.shape[1]
    xhat = (x - cv(mean)) * cv(invstd)
    dbias = dy.sum(axis=axes)
    dscale = (dy * xhat).sum(axis=axes)
    dx = cv(scale * invstd) / count * (count * dy - cv(dbias) - xhat * cv(dscale))
    return [dx, dscale, dbias]


def _window_sum(v, before, after):
    """s[:, c] = sum of v[:, c-before .. c+after] over channels, clipped to the valid range."""
    c = v.shape[1]
    padded = np.concatenate([np.zeros_like(v[:, :1])] + [v], axis=1).cumsum(axis=1)
    hi = np.minimum(np.arange(c) + after, c - 1) + 1
    lo = np.maximum(np.arange(c) - before, 0)
    return padded[:, hi] - padded[:, lo]


def _lrn_scale(x, attrs):
    size = attrs["size"]
    sq = _window_sum(x * x, (size - 1) // 2, size // 2)  # ONNX: floor((size-1)/2) before, ceil after
    return attrs["bias"] + attrs["alpha"] / size * sq


def lrn(inputs, attrs):
    x = inputs[0]
    return [x * _lrn_scale(x, attrs) ** -attrs["beta"]]


def lrn_bwd(inputs, attrs):
    x, dy = inputs
    size, beta = attrs["size"], attrs["beta"]
    s = _lrn_scale(x, attrs)
    t = dy * x * s ** (-beta - 1)
    # x_j enters the window of channel c when c - floor((size-1)/2) <= j <= c + ceil((size-1)/2)
    back = _window_sum(t, size // 2, (size - 1) // 2)
    return [dy * s ** -beta - 2 * beta * attrs["alpha"] / size * x * back]


KERNELS = {"batchnorm": batchnorm, "bn_apply": bn_apply, "batchnorm_bwd": batchnorm_bwd, "lrn": lrn, "lrn_bwd": lrn_bwd}
