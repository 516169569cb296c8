"""SGD with momentum (PyTorch's rule, dampening 0), applied in place in the IR's view."""


def sgd(inputs, a):
    w, dw, v = inputs
    v_new = a["momentum"] * v + dw * a.get("grad_unscale", 1.0) + a["weight_decay"] * w
    return [w - a["lr"] * v_new, v_new]


KERNELS = {"sgd": sgd}
