"""Broadcasting arithmetic, gradient sums and unbroadcasts, concat/slice, views and dropout."""

import math

import numpy as np


def _fmix32(h):
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & np.uint64(0xFFFFFFFF)
    return h ^ (h >> np.uint64(16))


def dropout_keep(numel: int, ratio: float, seed: int) -> np.ndarray:
    """Counter-based mask, reproducible on any device: keep[i] = fmix32(i*0x9E3779B1 + seed*0x85EBCA77) >= ratio*2^32."""
    i = np.arange(numel, dtype=np.uint64)
    h = (i * np.uint64(0x9E3779B1) + np.uint64((seed * 0x85EBCA77) & 0xFFFFFFFF)) & np.uint64(0xFFFFFFFF)
    return _fmix32(h) >= np.uint64(math.floor(ratio * 2**32))


def reduce_to_shape(dy, shape):
    """Sum dy over the axes numpy broadcasting added or stretched, giving `shape`."""
    extra = dy.ndim - len(shape)
    out = dy.sum(axis=tuple(range(extra))) if extra else dy
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and out.shape[i] != 1)
    return out.sum(axis=stretched, keepdims=True) if stretched else out


def dropout(inputs, a):
    x = inputs[0]
    keep = dropout_keep(x.size, a["ratio"], a["seed"]).reshape(x.shape)
    return [x * keep / (1 - a["ratio"]), keep.astype(np.uint8)]


def slice_(inputs, a):
    index = [slice(None)] * inputs[0].ndim
    index[a["axis"]] = slice(a["start"], a["end"])
    return [inputs[0][tuple(index)]]


KERNELS = {
    "add": lambda ins, a: [ins[0] + ins[1]],
    "mul": lambda ins, a: [ins[0] * ins[1]],
    "sum": lambda ins, a: [sum(ins[1:], ins[0])],
    "reduce_to_shape": lambda ins, a: [reduce_to_shape(ins[0], a["shape"])],
    "concat": lambda ins, a: [np.concatenate(ins, axis=a["axis"])],
    "concat_view": lambda ins, a: [np.concatenate(ins, axis=1)],
    "slice": slice_,
    "slice_view": slice_,
    "reshape": lambda ins, a: [ins[0].reshape(a["shape"])],
    "dropout": dropout,
    "dropout_bwd": lambda ins, a: [ins[0] * ins[1] / (1 - a["ratio"])],
}
