"""Mean softmax cross-entropy over the batch and its gradient."""

import numpy as np


def softmax_xent(inputs, a):
    logits, labels = inputs
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    n = logits.shape[0]
    loss = -log_probs[np.arange(n), labels].mean()
    return [np.asarray(loss), np.exp(log_probs)]


def softmax_xent_bwd(inputs, a):
    probs, labels = inputs
    n = probs.shape[0]
    d = probs.copy()
    d[np.arange(n), labels] -= 1
    return [d * a.get("loss_scale", 1.0) / n]


KERNELS = {"softmax_xent": softmax_xent, "softmax_xent_bwd": softmax_xent_bwd}
