"""Max, average and global-average pooling with gradients; ONNX pads, ceil_mode, dilations, count_include_pad."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from planner.ops import pool_out_size


def _geometry(x_shape, a):
    kh, kw = a["kernel"]
    sh, sw = a["strides"]
    dh, dw = a.get("dilations", [1, 1])
    t, l, b, r = a["pads"]
    p = pool_out_size(x_shape[2], kh, sh, dh, t, b, a["ceil_mode"])
    q = pool_out_size(x_shape[3], kw, sw, dw, l, r, a["ceil_mode"])
    # rows/cols of padded input the windows need, beyond the explicit pads (ceil_mode may reach past them)
    need_h = (p - 1) * sh + (kh - 1) * dh + 1
    need_w = (q - 1) * sw + (kw - 1) * dw + 1
    extra_b = max(0, need_h - (x_shape[2] + t + b))
    extra_r = max(0, need_w - (x_shape[3] + l + r))
    return (kh, kw), (sh, sw), (dh, dw), (t, l, b + extra_b, r + extra_r), (p, q), (b, r)


def _windows(xp, kernel, strides, dilations, out):
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    view = sliding_window_view(xp, ((kh - 1) * dh + 1, (kw - 1) * dw + 1), axis=(2, 3))
    return view[:, :, ::sh, ::sw, ::dh, ::dw][:, :, : out[0], : out[1]]


def _pad(x, pads, value):
    t, l, b, r = pads
    return np.pad(x, ((0, 0), (0, 0), (t, b), (l, r)), constant_values=value)


def maxpool(inputs, a):
    x = inputs[0]
    kernel, strides, dil, pads, out, _ = _geometry(x.shape, a)
    win = _windows(_pad(x, pads, -np.inf), kernel, strides, dil, out)
    return [win.max(axis=(4, 5))]


def maxpool_bwd(inputs, a):
    x, dy = inputs
    kernel, strides, dil, pads, out, _ = _geometry(x.shape, a)
    xp = _pad(x, pads, -np.inf)
    win = _windows(xp, kernel, strides, dil, out)
    flat = win.reshape(*win.shape[:4], -1).argmax(axis=-1)  # first maximum of each window
    i, j = np.divmod(flat, kernel[1])
    n, c, p, q = np.indices(dy.shape)
    rows = p * strides[0] + i * dil[0]
    cols = q * strides[1] + j * dil[1]
    dxp = np.zeros_like(xp)
    np.add.at(dxp, (n, c, rows, cols), dy)
    t, l = pads[0], pads[1]
    return [dxp[:, :, t: t + x.shape[2], l: l + x.shape[3]]]


def _divisor(x_shape, a, geometry):
    """How many elements each window averages over."""
    kernel, strides, dil, pads, out, (b, r) = geometry
    t, l = pads[0], pads[1]
    ones = np.zeros((1, 1, x_shape[2] + pads[0] + pads[2], x_shape[3] + pads[1] + pads[3]))
    if a["count_include_pad"]:
        ones[:, :, : x_shape[2] + t + b, : x_shape[3] + l + r] = 1
    else:
        ones[:, :, t: t + x_shape[2], l: l + x_shape[3]] = 1
    return _windows(ones, kernel, strides, dil, out).sum(axis=(4, 5))


def avgpool(inputs, a):
    x = inputs[0]
    geometry = _geometry(x.shape, a)
    kernel, strides, dil, pads, out, _ = geometry
    win = _windows(_pad(x, pads, 0.0), kernel, strides, dil, out)
    return [win.sum(axis=(4, 5)) / _divisor(x.shape, a, geometry)]


def avgpool_bwd(inputs, a):
    dy = inputs[0]
    x_shape = a["x_shape"]
    geometry = _geometry(x_shape, a)
    (kh, kw), (sh, sw), (dh, dw), pads, (p, q), _ = geometry
    share = dy / _divisor(x_shape, a, geometry)
    dxp = np.zeros((x_shape[0], x_shape[1], x_shape[2] + pads[0] + pads[2], x_shape[3] + pads[1] + pads[3]))
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i * dh: i * dh + sh * (p - 1) + 1: sh, j * dw: j * dw + sw * (q - 1) + 1: sw] += share
    t, l = pads[0], pads[1]
    return [dxp[:, :, t: t + x_shape[2], l: l + x_shape[3]]]


KERNELS = {
    "maxpool": maxpool,
    "maxpool_bwd": maxpool_bwd,
    "avgpool": avgpool,
    "avgpool_bwd": avgpool_bwd,
    "globalavgpool": lambda ins, a: [ins[0].mean(axis=(2, 3), keepdims=True)],
    "globalavgpool_bwd": lambda ins, a: [np.broadcast_to(ins[0], a["x_shape"]) / (a["x_shape"][2] * a["x_shape"][3])],
}
