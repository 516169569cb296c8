"""Convolution and its gradients (float64), grouped and dilated, pads [t, l, b, r]."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def _windows(x, kernel, strides, pads, dilations):
    """[N, C, P, Q, kh, kw] view of the padded input: the taps each output position reads."""
    t, l, b, r = pads
    xp = np.pad(x, ((0, 0), (0, 0), (t, b), (l, r)))
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    view = sliding_window_view(xp, ((kh - 1) * dh + 1, (kw - 1) * dw + 1), axis=(2, 3))
    return view[:, :, ::sh, ::sw, ::dh, ::dw]


def _grouped(a, groups, axis=1):
    shape = list(a.shape)
    return a.reshape(shape[:axis] + [groups, shape[axis] // groups] + shape[axis + 1:])


def conv(inputs, attrs):
    x, w = inputs[0], inputs[1]
    g = attrs["groups"]
    win = _grouped(_windows(x, w.shape[2:], attrs["strides"], attrs["pads"], attrs["dilations"]), g)
    y = np.einsum("ngcpqij,gkcij->ngkpq", win, _grouped(w, g, axis=0), optimize=True)
    y = y.reshape(y.shape[0], -1, *y.shape[3:])
    if len(inputs) > 2:
        y = y + inputs[2].reshape(1, -1, 1, 1)
    return [y]


def conv_fused(inputs, attrs):
    """relu?(conv(x, w) + b + z): the residual z, when there is one, is the last input."""
    z = inputs[-1] if attrs["residual"] else 0.0
    (y,) = conv(inputs[:len(inputs) - attrs["residual"]], attrs)
    y = y + z
    return [np.maximum(y, 0.0) if attrs["relu"] else y]


def conv_bwd_data(inputs, attrs):
    dy, w = inputs
    g = attrs["groups"]
    n, c, h, wd = attrs["x_shape"]
    (t, l, b, r), (sh, sw), (dh, dw) = attrs["pads"], attrs["strides"], attrs["dilations"]
    kh, kw = w.shape[2:]
    cols = np.einsum("ngkpq,gkcij->ngcpqij", _grouped(dy, g), _grouped(w, g, axis=0), optimize=True)
    cols = cols.reshape(n, c, *cols.shape[3:])
    p, q = dy.shape[2:]
    dxp = np.zeros((n, c, h + t + b, wd + l + r))
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i * dh: i * dh + sh * (p - 1) + 1: sh, j * dw: j * dw + sw * (q - 1) + 1: sw] += cols[..., i, j]
    return [dxp[:, :, t: t + h, l: l + wd]]


def conv_bwd_filter(inputs, attrs):
    x, dy = inputs
    g = attrs["groups"]
    win = _grouped(_windows(x, attrs["w_shape"][2:], attrs["strides"], attrs["pads"], attrs["dilations"]), g)
    dw = np.einsum("ngkpq,ngcpqij->gkcij", _grouped(dy, g), win, optimize=True)
    return [dw.reshape(attrs["w_shape"])]


def bias_grad(inputs, attrs):
    dy = inputs[0]
    axes = tuple(a for a in range(dy.ndim) if a != attrs["axis"])
    return [dy.sum(axis=axes)]


KERNELS = {"conv": conv, "conv_fused": conv_fused, "conv_bwd_data": conv_bwd_data, "conv_bwd_filter": conv_bwd_filter, "bias_grad": bias_grad}
