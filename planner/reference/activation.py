"""Pointwise activations and softmax, with gradients."""

import numpy as np


def _sigmoid(x):
    return 0.5 * (1 + np.tanh(0.5 * x))


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


KERNELS = {
    "relu": lambda ins, a: [np.maximum(ins[0], 0)],
    "relu_bwd": lambda ins, a: [sum(ins[2:], ins[1]) * (ins[0] > 0)],
    "clip": lambda ins, a: [np.clip(ins[0], a["min"], a["max"])],
    "clip_bwd": lambda ins, a: [ins[1] * ((ins[0] > a["min"]) & (ins[0] < a["max"]))],
    "sigmoid": lambda ins, a: [_sigmoid(ins[0])],
    "sigmoid_bwd": lambda ins, a: [ins[1] * ins[0] * (1 - ins[0])],
    "softmax": lambda ins, a: [_softmax(ins[0], a["axis"])],
    "softmax_bwd": lambda ins, a: [ins[0] * (ins[1] - (ins[1] * ins[0]).sum(axis=a["axis"], keepdims=True))],
}
