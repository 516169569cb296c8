"""SGD with momentum (PyTorch's rule, dampening 0) over a layer's (w, dw, v) triples, applied in place in the IR's
view."""


def sgd(inputs, a):
    out = []
    for w, dw, v in zip(inputs[0::3], inputs[1::3], inputs[2::3]):
        v_new = a["momentum"] * v + dw * a.get("grad_unscale", 1.0) + a["weight_decay"] * w
        out += [w - a["lr"] * v_new, v_new]
    return out


KERNELS = {"sgd": sgd}
