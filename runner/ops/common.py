"""What every GPU op shares: tensor specs, the memory layout, device buffers, and CUDA kernels compiled per dtype.

Layout: a 4-D tensor has logical NCHW dims and lives channels-last (NHWC) in memory; every other tensor is
row-major. A kernel works on the "physical" view (the dims in memory order), so a 4-D tensor's physical dims are
(N, H, W, C) and it is contiguous there. CuPy arrays of 4-D tensors are NCHW-shaped views with NHWC strides.

Kernels are CUDA C compiled by NVRTC (through CuPy) once per storage type: `T` is `float` or the raw bits of an
IEEE half (`half_bits`), loaded and stored through `ld`/`st`, which convert to and from fp32, so every kernel
accumulates in fp32 and needs no fp16 headers.
"""

from __future__ import annotations

import hashlib
import math
import os
from abc import ABC, abstractmethod
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from planner.files import atomic_write_bytes
from runner.gpu import gpu

NUMPY_DTYPE = {"fp16": np.float16, "fp32": np.float32, "int64": np.int64, "uint8": np.uint8}
KERNEL_TYPE = {"fp16": "half_bits", "fp32": "float"}
THREADS = 256
MAX_BLOCKS = 1 << 20  # grid-stride loops cover the rest
INDEX_LIMIT = 1 << 31  # kernels index with 32-bit ints

# The executor builds only the candidate a plan names (building every cuDNN engine of every op costs minutes)
WANTED_ALGORITHM: ContextVar[str | None] = ContextVar("WANTED_ALGORITHM", default=None)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and storage dtype of one operand, all a factory needs to build an op."""

    shape: tuple[int, ...]
    dtype: str
    row_channels: int | None = None  # a channel slice of an NHWC buffer with this many channels (concat_view)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def spec(shape, dtype: str, row_channels: int | None = None) -> TensorSpec:
    return TensorSpec(tuple(int(d) for d in shape), dtype, row_channels)


def physical(shape) -> tuple[int, ...]:
    """Dims in memory order: (N, H, W, C) for 4-D, the logical dims otherwise."""
    shape = tuple(shape)
    return (shape[0], shape[2], shape[3], shape[1]) if len(shape) == 4 else shape


def logical_strides(shape) -> list[int]:
    """Element stride of each logical dim in memory (NHWC for 4-D, row-major otherwise)."""
    if len(shape) == 4:
        n, c, h, w = shape
        return [h * w * c, 1, w * c, c]
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def broadcast_view(shape, rank: int) -> tuple[list[int], list[int]]:
    """(physical dims, physical element strides) of an operand broadcast to `rank` logical dims, stride 0 where
    it broadcasts: numpy right-aligns the dims, then a rank-4 result is seen in NHWC order."""
    pad = rank - len(shape)
    dims = [1] * pad + list(shape)
    strides = [0] * pad + logical_strides(shape)
    strides = [s if d > 1 else 0 for d, s in zip(dims, strides)]
    order = [0, 2, 3, 1] if rank == 4 else list(range(rank))
    return [dims[i] for i in order], [strides[i] for i in order]


def physical_axis(axis: int, rank: int) -> int:
    """Where logical `axis` sits among the physical dims."""
    return [0, 3, 1, 2][axis] if rank == 4 else axis


def device_empty(s: TensorSpec):
    """An uninitialised device tensor in the runner's layout (NHWC strides for 4-D)."""
    cp = gpu().cp
    dtype = NUMPY_DTYPE[s.dtype]
    if len(s.shape) == 4:
        n, c, h, w = s.shape
        return cp.empty((n, h, w, s.row_channels or c), dtype=dtype)[..., :c].transpose(0, 3, 1, 2)
    return cp.empty(s.shape, dtype=dtype)


def to_device(host: np.ndarray, s: TensorSpec):
    arr = device_empty(s)
    arr[...] = gpu().cp.asarray(np.ascontiguousarray(host).astype(NUMPY_DTYPE[s.dtype]))
    return arr


def check_index_range(*specs: TensorSpec) -> None:
    for s in specs:
        if s.numel >= INDEX_LIMIT:
            raise ValueError(f"tensor of {s.numel} elements is beyond the kernels' 32-bit indexing")


PRELUDE = r"""
typedef unsigned short half_bits;
__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const half_bits* p, long long i) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i])); return f;
}
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(half_bits* p, long long i, float v) {
    half_bits h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); p[i] = h;
}
#define NEG_INF __int_as_float(0xff800000)
#define GRID_LOOP(i, n) for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += gridDim.x * blockDim.x)

// V consecutive elements at p + i as floats: V = 1, or VEC with p + i 16-byte aligned (one 16-byte access)
#define VEC (16 / (int)sizeof(T))
union Pack { uint4 u; T e[VEC]; };
template <int V> __device__ __forceinline__ void ldv(const T* p, long long i, float* f) {
    if (V == 1) {
        f[0] = ld(p, i);
    } else {
        Pack k;
        k.u = *reinterpret_cast<const uint4*>(p + i);
#pragma unroll
        for (int e = 0; e < V; ++e) f[e] = ld(k.e, e);
    }
}
template <int V> __device__ __forceinline__ void stv(T* p, long long i, const float* f) {
    if (V == 1) {
        st(p, i, f[0]);
    } else {
        Pack k;
#pragma unroll
        for (int e = 0; e < V; ++e) st(k.e, e, f[e]);
        *reinterpret_cast<uint4*>(p + i) = k.u;
    }
}
// y = f(a[, b]) over flat memory, VEC elements a thread for the first nv * VEC, one a thread for the rest
template <int K, class F> __device__ __forceinline__ void map_flat(const T* a, const T* b, T* y, int n, int nv, F f) {
    int t = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    for (int j = t; j < nv; j += stride) {
        float u[VEC], v[VEC] = {};
        ldv<VEC>(a, (long long)j * VEC, u);
        if (K == 2) ldv<VEC>(b, (long long)j * VEC, v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) u[e] = f(u[e], v[e]);
        stv<VEC>(y, (long long)j * VEC, u);
    }
    for (int i = nv * VEC + t; i < n; i += stride) st(y, i, f(ld(a, i), K == 2 ? ld(b, i) : 0.f));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// blockDim.x a multiple of 32; every thread gets the block's total (MAX: the block's maximum)
template <bool MAX> __device__ float block_reduce(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : (MAX ? NEG_INF : 0.f);
    if (warp == 0) v = MAX ? warp_max(v) : warp_sum(v);
    if (threadIdx.x == 0) part[0] = v;
    __syncthreads();
    v = part[0];
    __syncthreads();
    return v;
}
__device__ float block_sum(float v) { return block_reduce<false>(v); }
__device__ float block_max(float v) { return block_reduce<true>(v); }
"""


@lru_cache(maxsize=None)
def _module(source: str, ctype: str):
    cp = gpu().cp
    return cp.RawModule(code=f"#define T {ctype}\n{PRELUDE}\n{source}", options=("--std=c++14",))


def kernel(source: str, name: str, dtype: str = "fp32"):
    """Kernel `name` of `source` with T = the storage type of `dtype` (compiled once per process and dtype)."""
    return _module(source, KERNEL_TYPE[dtype]).get_function(name)


@lru_cache(maxsize=None)
def hopper_kernel(source: str, name: str):
    """Kernel `name` of `source` (fp16 storage) for sm_90a, the target Hopper's wgmma instructions need (CuPy
    compiles for sm_90): NVRTC directly, the cubin loaded as a module; a source it refuses raises ValueError.
    Cubins are kept in CuPy's kernel cache directory (CUPY_CACHE_DIR) by source, options and NVRTC version: each
    compiles in about 2 s, which every `planner run` of a plan with them paid."""
    from cupy_backends.cuda.libs import nvrtc

    cp = gpu().cp
    text = f"#define T half_bits\n{PRELUDE}\n{source}"
    options = ["--gpu-architecture=sm_90a", "--std=c++14", "-ftz=true"]
    key = hashlib.sha256(repr((text, options, nvrtc.getVersion())).encode()).hexdigest()
    path = Path(os.environ.get("CUPY_CACHE_DIR", "~/.cupy/kernel_cache")).expanduser() / f"hopper_{key}.cubin"
    try:
        cubin = path.read_bytes()
    except OSError:
        cubin = None
    if not cubin:
        program = nvrtc.createProgram(text, f"{name}.cu", [], [])
        try:
            nvrtc.compileProgram(program, options)
            cubin = nvrtc.getCUBIN(program)
        except nvrtc.NVRTCError as e:
            raise ValueError(f"{name}: {e}: {nvrtc.getProgramLog(program)[:500]}") from e
        finally:
            nvrtc.destroyProgram(program)
        try:
            atomic_write_bytes(path, cubin)
        except OSError:
            pass  # a cache that cannot be written: compiled again next time
    module = cp.cuda.function.Module()
    module.load(cubin)
    return module.get_function(name)  # the Function holds its module


def blocks_for(n: int, threads: int = THREADS) -> int:
    return max(1, min(-(-n // threads), MAX_BLOCKS))


def launch_1d(fn, n: int, *args) -> None:
    """One thread per element (grid-stride beyond MAX_BLOCKS blocks); `args` follow the kernel's signature."""
    fn((blocks_for(n),), (THREADS,), args)


def vector_width(dtype: str, *arrays) -> int:
    """Elements per 16-byte access (the kernels' VEC) when every array starts 16-byte aligned, else 1."""
    if any(a.data.ptr % 16 for a in arrays):
        return 1
    return 16 // np.dtype(NUMPY_DTYPE[dtype]).itemsize


def launch_flat(fn, n: int, dtype: str, arrays: list, *params) -> None:
    """A `map_flat` kernel fn(arrays..., n, nv, params...): one thread per VEC elements where alignment allows."""
    width = vector_width(dtype, *arrays)
    nv = n // width if width > 1 else 0
    launch_1d(fn, max(nv, n - nv * width), *arrays, i32(n), i32(nv), *params)


def launch_rows(fn, n: int, channels: int, dtype: str, arrays: list, pitches: list[int]) -> None:
    """A kernel over channel slices of NHWC buffers, fn(arrays..., n, nv, channels, pitches...): VEC channels a
    thread for the first nv * VEC elements where the channel count, every pitch and every array's alignment
    allow (nv = 0 otherwise), one a thread for the rest."""
    width = vector_width(dtype, *arrays)
    if any(v % width for v in (channels, *pitches)):
        width = 1
    nv = n // width if width > 1 else 0
    launch_1d(fn, max(nv, n - nv * width), *arrays, i32(n), i32(nv), i32(channels), *(i32(p) for p in pitches))


def i32(v) -> np.int32:
    return np.int32(v)


def f32(v) -> np.float32:
    return np.float32(v)


class SingleKernelOp(ABC):
    """An op with one implementation: subclasses set `name` (and `workspace_bytes` if they need scratch) and
    define `run`. `launch` writes into preallocated outputs and allocates nothing, so it can be graph-captured."""

    name = "cupy_kernel"
    workspace_bytes = 0
    unsupported: tuple[tuple[str, str], ...] = ()

    @property
    def candidates(self) -> list[tuple[str, int]]:
        return [(self.name, self.workspace_bytes)]

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        assert index == 0, index
        self.run(inputs, outputs, workspace)

    @abstractmethod
    def run(self, inputs: list, outputs: list, workspace) -> None:
        """Launch the kernels on the current stream."""


class Alternatives:
    """Every implementation of one node that builds, their candidates listed one after another. Candidate names
    start with their implementation's name and a colon, except the `bare` implementation's (cuDNN's plan names
    predate the others)."""

    def __init__(self, builders: dict, bare: str | None = None):
        self.candidates: list[tuple[str, int]] = []
        self.unsupported: list[tuple[str, str]] = []
        self._route = []
        wanted = WANTED_ALGORITHM.get()
        named = {name for name in builders if wanted is not None and (wanted == name or wanted.startswith(name + ":"))}
        for name, build in builders.items():
            if wanted is not None and name not in named and (name != bare or named):
                continue
            try:
                impl = build()
            except Exception as e:  # noqa: BLE001 - an implementation that cannot take this node is recorded
                self.unsupported.append((name, f"{type(e).__name__}: {str(e)[:160]}"))
                continue
            self.unsupported.extend(impl.unsupported)
            for k, candidate in enumerate(impl.candidates):
                self.candidates.append(candidate)
                self._route.append((impl, k))
        if not self.candidates:
            raise ValueError("; ".join(f"{n}: {r}" for n, r in self.unsupported))

    def launch(self, index: int, inputs: list, outputs: list, workspace) -> None:
        impl, k = self._route[index]
        impl.launch(k, inputs, outputs, workspace)
