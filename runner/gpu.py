"""Lazy access to the GPU stack (CuPy, cuDNN frontend), so `import runner` works on any machine."""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace


@lru_cache(maxsize=1)
def gpu() -> SimpleNamespace:
    import cudnn
    import cupy

    return SimpleNamespace(cp=cupy, cudnn=cudnn)


def device_pointer(array) -> int:
    """A CuPy array's device address (0 for None). cuDNN frontend's execute takes addresses as they are; given
    an array it first asks whether it is a torch tensor, which imports torch wherever torch is installed."""
    return 0 if array is None else array.data.ptr


def cudnn_dtype(dtype: str):
    cudnn = gpu().cudnn
    return {"fp16": cudnn.data_type.HALF, "fp32": cudnn.data_type.FLOAT}[dtype]


def cupy_dtype(dtype: str):
    cp = gpu().cp
    return {"fp16": cp.float16, "fp32": cp.float32}[dtype]


def nhwc_empty(dims: list[int], dtype: str):
    """A CuPy array with logical NCHW dims laid out channels-last."""
    cp = gpu().cp
    n, c, h, w = dims
    return cp.empty((n, h, w, c), dtype=cupy_dtype(dtype)).transpose(0, 3, 1, 2)
