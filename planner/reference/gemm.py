"""Matrix products: ONNX Gemm and MatMul."""

import numpy as np


def gemm(inputs, a):
    x, w = inputs[0], inputs[1]
    y = a["alpha"] * ((x.T if a["transA"] else x) @ (w.T if a["transB"] else w))
    return [y + a["beta"] * inputs[2] if len(inputs) > 2 else y]


KERNELS = {"gemm": gemm, "matmul": lambda ins, a: [np.matmul(ins[0], ins[1])]}
