"""Matrix products through cuBLAS (cublasGemmEx / cublasGemmStridedBatchedEx, fp32 accumulation), then ONNX
Gemm's + beta * C as one pointwise epilogue with C broadcast; alpha goes to cuBLAS. Transposes are operand flags,
not copies.

cuBLAS is called directly (ctypes) on a handle of our own: CuPy's wrappers refuse to run under CUDA-graph
capture, while cuBLAS itself captures fine once it is given an explicit workspace. Two candidates: no workspace,
and the 32 MiB cuBLAS recommends on Hopper (some algorithms need it).
"""

from __future__ import annotations

import ctypes
import math
from functools import lru_cache

from runner.gpu import gpu
from runner.ops.common import TensorSpec, broadcast_view, check_index_range, f32, i32, kernel, launch_1d

WORKSPACE_CANDIDATES = {"cublas": 0, "cublas_workspace_32MiB": 32 << 20}
CUDA_R_32F, CUDA_R_16F = 0, 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
OP_N, OP_T = 0, 1
DATA_TYPE = {"fp32": CUDA_R_32F, "fp16": CUDA_R_16F}

SRC = r"""
// y [M, N] += beta * c[m * sc0 + n * sc1]
extern "C" __global__ void gemm_add_c(T* y, const T* c, int n, int N, int sc0, int sc1, float beta) {
    GRID_LOOP(i, n) st(y, i, ld(y, i) + beta * ld(c, (long long)(i / N) * sc0 + (long long)(i % N) * sc1));
}
"""


@lru_cache(maxsize=1)
def _cublas():
    """libcublas as CuPy loaded it, and one handle for every GEMM op of this process."""
    import cupy_backends.cuda.libs.cublas  # noqa: F401 - loads libcublas into the process

    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "/libcublas.so" in line]
    lib = ctypes.CDLL(paths[0] if paths else "libcublas.so")
    handle = ctypes.c_void_p()
    _check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
    return lib, handle


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


class Gemm:
    """Y = alpha * op(A) op(B) (+ beta * C) for gemm, numpy matmul (batched, broadcast) for matmul, row-major."""

    unsupported: tuple = ()

    def __init__(self, attrs: dict, ins: list[TensorSpec], y: TensorSpec):
        check_index_range(*ins, y)
        a, b = ins[0].shape, ins[1].shape
        if max(len(a), len(b)) > 3 or min(len(a), len(b)) < 2:
            raise ValueError(f"products of {len(a)}-D and {len(b)}-D operands (2-D, or 3-D batches)")
        ta, tb = attrs.get("transA", 0), attrs.get("transB", 0)
        self.m, self.k = (a[-1], a[-2]) if ta else (a[-2], a[-1])
        self.n = b[-2] if tb else b[-1]
        self.batch = math.prod(y.shape[:-2])
        if len(a) == 3 and len(b) == 3 and a[0] != b[0]:
            raise ValueError(f"batched product of {a} and {b}: only one operand may broadcast")
        # row-major Y = A' B' is column-major Y^T = B'^T A'^T: cuBLAS's first operand is B
        self.ops = (OP_T if tb else OP_N, OP_T if ta else OP_N)
        self.lds = (b[-1], a[-1], self.n)
        self.strides = (b[-1] * b[-2] if len(b) == 3 else 0, a[-1] * a[-2] if len(a) == 3 else 0, self.m * self.n)
        self.alpha = ctypes.c_float(attrs.get("alpha", 1.0))
        self.zero = ctypes.c_float(0.0)
        beta = attrs.get("beta", 1.0)
        self.has_c = len(ins) > 2 and beta != 0.0
        self.dtype, self.numel = y.dtype, y.numel
        c_strides = broadcast_view(ins[2].shape, 2)[1] if self.has_c else [0, 0]
        self.c_params = (i32(self.n), i32(c_strides[0]), i32(c_strides[1]), f32(beta))
        self.candidates = list(WORKSPACE_CANDIDATES.items())

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        lib, handle = _cublas()
        a, b, y = inputs[0], inputs[1], outputs[0]
        _check(lib.cublasSetStream_v2(handle, ctypes.c_void_p(gpu().cp.cuda.get_current_stream().ptr)), "setStream")
        workspace_bytes = self.candidates[index][1]
        _check(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(workspace.data.ptr if workspace_bytes else 0),
                                         ctypes.c_size_t(workspace_bytes)), "setWorkspace")
        dt = DATA_TYPE[self.dtype]
        args = [handle, self.ops[0], self.ops[1], self.n, self.m, self.k, ctypes.byref(self.alpha),
                ctypes.c_void_p(b.data.ptr), dt, self.lds[0]]
        if self.batch == 1:
            args += [ctypes.c_void_p(a.data.ptr), dt, self.lds[1], ctypes.byref(self.zero),
                     ctypes.c_void_p(y.data.ptr), dt, self.lds[2], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT]
            _check(lib.cublasGemmEx(*args), "cublasGemmEx")
        else:
            args[-1:] = [self.lds[0], ctypes.c_longlong(self.strides[0])]
            args += [ctypes.c_void_p(a.data.ptr), dt, self.lds[1], ctypes.c_longlong(self.strides[1]),
                     ctypes.byref(self.zero), ctypes.c_void_p(y.data.ptr), dt, self.lds[2],
                     ctypes.c_longlong(self.strides[2]), self.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT]
            _check(lib.cublasGemmStridedBatchedEx(*args), "cublasGemmStridedBatchedEx")
        if self.has_c:
            launch_1d(kernel(SRC, "gemm_add_c", self.dtype), self.numel, y, inputs[2], i32(self.numel), *self.c_params)


OPS = {"gemm": lambda a, i, o, h: Gemm(a, i, o[0]), "matmul": lambda a, i, o, h: Gemm({}, i, o[0])}
