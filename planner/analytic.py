"""The analytic profile: roofline estimates of every op's candidates, so the solver has real trade-offs without a GPU.

Each candidate's time is max(compute, memory, one-wave latency) + a launch floor:
- compute = the work its algorithm does (tile padding included) / (peak rate x the family's efficiency);
- memory = (inputs + outputs + twice its workspace, written then read) / achievable bandwidth;
- latency = the block scheduler spreads a small grid one block per SM, and an SM without a block adds nothing,
  so a grid of fewer blocks than SMs only gets that share of the rate (a tiny conv does not get the whole GPU).
Every term grows with every dimension of the op, so within a family more work is never faster.

Conv-family ops (conv, conv_bwd_data, conv_bwd_filter) get the algorithm families of the cuDNN taxonomy: direct
(CUDA cores, no workspace), implicit GEMM (tensor cores, no workspace), explicit GEMM (im2col/col2im buffer),
Winograd F(4x4,3x3) (3x3, stride 1, dilation 1, groups 1) and FFT (kernels larger than 3, stride 1, dilation 1,
groups 1), both with large transform buffers. Other ops get one candidate, `cupy:<kind>`; views cost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.ir import Graph, Node
from planner.occupancy import blocks_per_sm, dram_fraction, sm_fraction
from planner.ops import KINDS
from planner.profile import (
    CONV_KINDS, Candidate, DeviceInfo, Kernel, OpProfile, Profile, Unsupported, conv_tensors, describe_op,
)
from planner.store import profiled_nodes

LAUNCH_US = 3.0  # launching one kernel and running its smallest version
EXTRA_KERNEL_US = 1.5  # each further kernel of a multi-kernel algorithm
SPLIT_K = 1024  # GEMM kernels split longer reductions over more blocks (cuBLAS/cuDNN split-K)
WINOGRAD_TILE = 4  # F(4x4, 3x3): 6x6 input tiles, 36 transform-domain GEMMs


@dataclass(frozen=True)
class Family:
    """One algorithm family: how well it uses the machine and what its main kernel's launch looks like."""

    name: str
    efficiency: float  # share of the peak rate its main kernel reaches
    tensor_cores: bool
    kernels: int
    threads: int
    registers: int
    shared_bytes: int
    tile_m: int
    tile_n: int
    tile_k: int


DIRECT = Family("direct", 0.40, False, 1, 128, 64, 8 << 10, 512, 1, 1)
IMPLICIT_GEMM = Family("implicit_gemm", 0.45, True, 1, 256, 128, 32 << 10, 128, 64, 32)
GEMM = Family("gemm", 0.70, True, 2, 256, 168, 40 << 10, 128, 128, 32)
WINOGRAD = Family("winograd", 0.45, True, 4, 256, 128, 32 << 10, 128, 64, 32)
FFT = Family("fft", 0.50, False, 4, 256, 64, 16 << 10, 32, 32, 8)
CONV_FAMILIES = (DIRECT, IMPLICIT_GEMM, GEMM, WINOGRAD, FFT)
CUPY_GEMM = Family("gemm", 0.60, True, 1, 256, 128, 32 << 10, 128, 64, 32)
CUPY_ELEMENTWISE = Family("elementwise", 0.50, False, 1, 128, 32, 0, 512, 1, 1)


@dataclass(frozen=True)
class ConvShape:
    """A conv-family op in conv terms: x [n, c, h, w], w [k, c/g, r, s], y [n, k, p, q]."""

    n: int
    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    p: int
    q: int
    groups: int
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pads: tuple[int, int, int, int]

    def gemm(self, kind: str) -> tuple[int, int, int]:
        """(M, N, K) of one group's GEMM: forward y = x_col w, data dx_col = dy w', filter dw = dy' x_col."""
        cg, kg = self.c // self.groups, self.k // self.groups
        pixels = self.n * self.p * self.q
        if kind in ("conv", "conv_fused"):
            return pixels, kg, cg * self.r * self.s
        if kind == "conv_bwd_data":
            return pixels, cg * self.r * self.s, kg
        return kg, cg * self.r * self.s, pixels


def conv_shape(graph: Graph, node: Node) -> ConvShape:
    x, w, y = (graph.tensors[t].shape for t in conv_tensors(node))
    a = node.attrs
    return ConvShape(n=x[0], c=x[1], h=x[2], w=x[3], k=w[0], r=w[2], s=w[3], p=y[2], q=y[3],
                     groups=a.get("groups", 1), stride=tuple(a.get("strides", [1, 1])),
                     dilation=tuple(a.get("dilations", [1, 1])), pads=tuple(a.get("pads", [0, 0, 0, 0])))


def _fast_fft_size(n: int) -> int:
    """Smallest size >= n with only factors 2, 3, 5, 7 (the sizes cuFFT runs fastest)."""
    while True:
        m = n
        for f in (2, 3, 5, 7):
            while m % f == 0:
                m //= f
        if m == 1:
            return n
        n += 1


def explicit_gemm_workspace_bytes(cs: ConvShape, itemsize: int) -> int:
    """The whole batch's im2col (forward, filter) or col2im (data) matrix: n * c*r*s * p*q elements."""
    return cs.n * cs.c * cs.r * cs.s * cs.p * cs.q * itemsize


def winograd_tiles(cs: ConvShape) -> int:
    return cs.n * math.ceil(cs.p / WINOGRAD_TILE) * math.ceil(cs.q / WINOGRAD_TILE)


def winograd_workspace_bytes(cs: ConvShape, itemsize: int) -> int:
    """Transformed input and output tiles (6x6 each) plus the transformed filter, in the compute type."""
    a = (WINOGRAD_TILE + 2) ** 2
    return a * (winograd_tiles(cs) * (cs.c + cs.k) + cs.k * cs.c) * itemsize


def fft_size(cs: ConvShape) -> tuple[int, int]:
    return (_fast_fft_size(cs.h + cs.pads[0] + cs.pads[2]), _fast_fft_size(cs.w + cs.pads[1] + cs.pads[3]))


def fft_workspace_bytes(cs: ConvShape, itemsize: int) -> int:
    """Spectra of the input, filter and output (real-to-complex: h x (w/2+1) bins, complex of the compute type)."""
    fh, fw = fft_size(cs)
    bins = fh * (fw // 2 + 1)
    return bins * (cs.n * cs.c + cs.k * cs.c + cs.n * cs.k) * 2 * itemsize


def unsupported_reason(family: Family, cs: ConvShape) -> str | None:
    """Why cuDNN-style Winograd/FFT cannot run this conv (None when they can)."""
    if family not in (WINOGRAD, FFT):
        return None
    if cs.stride != (1, 1):
        return f"{family.name} needs stride 1 (got {cs.stride[0]}x{cs.stride[1]})"
    if cs.dilation != (1, 1):
        return f"{family.name} needs dilation 1"
    if cs.groups != 1:
        return f"{family.name} needs groups 1 (got {cs.groups})"
    if family is WINOGRAD and (cs.r, cs.s) != (3, 3):
        return f"winograd is for 3x3 filters (got {cs.r}x{cs.s})"
    if family is FFT and max(cs.r, cs.s) <= 3:
        return f"fft is for filters larger than 3 (got {cs.r}x{cs.s})"
    return None


class Rates:
    """The device's peak rates for one compute dtype, and what its kernels can stream."""

    def __init__(self, device: DeviceInfo, dtype: str):
        self.device = device
        self.cuda_core = device.peak_flops_fp32
        tensor = device.peak_flops_fp16 if dtype == "fp16" else device.peak_flops_tf32
        self.tensor = tensor if tensor > 0 else self.cuda_core
        self.bandwidth = device.d2d_bytes_per_s or 0.85 * device.peak_dram_bytes_per_s

    def flops_per_s(self, family: Family) -> float:
        return (self.tensor if family.tensor_cores else self.cuda_core) * family.efficiency


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def _padded_gemm(family: Family, groups: int, m: int, n: int, k: int) -> tuple[float, float, int]:
    """(work in FLOPs incl. tile padding, fractional block count, integer grid) of `groups` GEMMs of m x n x k.

    Dimensions below the family's tile get the next power-of-two tile (at least 16, as kernels for skinny
    problems do); the padding and the per-block work both still grow with every dimension.
    """
    tm, tn = min(family.tile_m, _pow2_at_least(m)), min(family.tile_n, _pow2_at_least(n))
    mp, np_, kp = max(m, tm), max(n, tn), max(k, family.tile_k)
    splits = max(1.0, kp / SPLIT_K)
    blocks = groups * (mp / tm) * (np_ / tn) * splits
    grid = groups * math.ceil(mp / tm) * math.ceil(np_ / tn) * math.ceil(splits)
    return 2.0 * groups * mp * np_ * kp, blocks, grid


def _candidate(name: str, family: Family, rates: Rates, work_flops: float, blocks: float, grid: int,
               min_bytes: int, workspace_bytes: int) -> Candidate:
    device = rates.device
    # a device too small for the family's launch still runs a smaller variant of it: count one block per SM
    bps = max(blocks_per_sm(device, family.threads, family.registers, family.shared_bytes), 1)
    rate = rates.flops_per_s(family)
    compute_us = work_flops / rate * 1e6
    memory_us = (min_bytes + 2 * workspace_bytes) / rates.bandwidth * 1e6
    latency_us = compute_us * device.sm_count / max(blocks, 1.0) if blocks < device.sm_count else 0.0
    kernel_us = max(compute_us, memory_us, latency_us)
    time_us = kernel_us + LAUNCH_US + EXTRA_KERNEL_US * (family.kernels - 1)
    kernel = Kernel(name=f"analytic:{family.name}", duration_us=kernel_us, grid=[grid, 1, 1],
                    block=[family.threads, 1, 1], registers_per_thread=family.registers,
                    dynamic_shared_bytes=family.shared_bytes, blocks_per_sm=bps)
    return Candidate(name=name, time_us=time_us, workspace_bytes=workspace_bytes,
                     registers_per_thread=family.registers, shared_mem_bytes=family.shared_bytes,
                     threads_per_block=family.threads, grid_blocks=grid,
                     sm_fraction=sm_fraction(device, grid, bps), dram_fraction=dram_fraction(device, min_bytes, time_us),
                     kernels=[kernel])


def io_bytes(graph: Graph, node: Node) -> int:
    """The least traffic an op can cause: every input read once, every output written once."""
    return sum(graph.tensors[t].bytes for t in node.inputs) + sum(graph.tensors[t].bytes for t in node.outputs)


def conv_candidates(graph: Graph, node: Node, rates: Rates) -> tuple[list[Candidate], list[Unsupported]]:
    """One candidate per applicable family; the rest are listed as unsupported with the rule that excludes them."""
    cs = conv_shape(graph, node)
    itemsize = 2 if graph.dtype == "fp16" else 4
    min_bytes = io_bytes(graph, node)
    m, n, k = cs.gemm(node.kind)
    candidates, unsupported = [], []
    for family in CONV_FAMILIES:
        name = f"analytic:{family.name}"
        if (reason := unsupported_reason(family, cs)) is not None:
            unsupported.append(Unsupported(name=name, reason=reason))
            continue
        if family is DIRECT:
            work, blocks, grid = _padded_gemm(family, 1, cs.groups * m * n, 1, k)
            workspace = 0
        elif family is WINOGRAD:
            a = (WINOGRAD_TILE + 2) ** 2
            cin, cout = (cs.k, cs.c) if node.kind == "conv_bwd_data" else (cs.c, cs.k)
            if node.kind == "conv_bwd_filter":
                work, blocks, grid = _padded_gemm(family, a, cs.k, cs.c, winograd_tiles(cs))
            else:
                work, blocks, grid = _padded_gemm(family, a, winograd_tiles(cs), cout, cin)
            workspace = winograd_workspace_bytes(cs, itemsize)
        elif family is FFT:
            fh, fw = fft_size(cs)
            bins = fh * (fw // 2 + 1)
            transforms = 2.5 * fh * fw * math.log2(fh * fw) * (cs.n * cs.c + cs.k * cs.c + cs.n * cs.k)
            pointwise, blocks, grid = _padded_gemm(family, bins, *{
                "conv": (cs.n, cs.k, cs.c), "conv_fused": (cs.n, cs.k, cs.c), "conv_bwd_data": (cs.n, cs.c, cs.k), "conv_bwd_filter": (cs.k, cs.c, cs.n),
            }[node.kind])
            work = 4 * pointwise + transforms  # complex multiply-add = 4 real ones
            workspace = fft_workspace_bytes(cs, itemsize)
        else:
            work, blocks, grid = _padded_gemm(family, cs.groups, m, n, k)
            workspace = explicit_gemm_workspace_bytes(cs, itemsize) if family is GEMM else 0
        if workspace > rates.device.memory_bytes:
            unsupported.append(Unsupported(name=name, reason="workspace larger than the device memory"))
            continue
        candidates.append(_candidate(name, family, rates, work, blocks, grid, min_bytes, workspace))
    return candidates, unsupported


def other_candidate(graph: Graph, node: Node, rates: Rates) -> Candidate:
    """One CuPy kernel: GEMMs on tensor cores, everything else streams its tensors on CUDA cores."""
    name = f"cupy:{node.kind}"
    if KINDS[node.kind].view:
        return Candidate(name="view", time_us=0.0, sm_fraction=0.0)
    min_bytes = io_bytes(graph, node)
    if node.kind in ("gemm", "matmul"):
        a, y = graph.tensors[node.inputs[0]].shape, graph.tensors[node.outputs[0]].shape
        k = a[0] if node.attrs.get("transA") else a[-1]
        batch = math.prod(y[:-2]) if len(y) > 2 else 1
        work, blocks, grid = _padded_gemm(CUPY_GEMM, batch, y[-2] if len(y) > 1 else 1, y[-1], k)
        return _candidate(name, CUPY_GEMM, rates, work, blocks, grid, min_bytes, 0)
    elements = max([graph.tensors[t].numel for t in node.inputs + node.outputs] + [1])
    fam = CUPY_ELEMENTWISE
    return _candidate(name, fam, rates, float(node.flops), max(elements / fam.tile_m, 1.0),
                      math.ceil(elements / fam.tile_m), min_bytes, 0)


def estimate_op(graph: Graph, node: Node, rates: Rates) -> OpProfile:
    if node.kind in CONV_KINDS:
        candidates, unsupported = conv_candidates(graph, node, rates)
    else:
        candidates, unsupported = [other_candidate(graph, node, rates)], []
    candidates.sort(key=lambda c: c.time_us)
    return OpProfile(signature=node.signature, kind=node.kind, describe=describe_op(node, graph),
                     candidates=candidates, measured_count=len(candidates), unsupported=unsupported)


def estimate_ops(graph: Graph, device: DeviceInfo, nodes: list[Node] | None = None) -> list[OpProfile]:
    """Estimates for the given nodes (default: one per distinct signature of the graph)."""
    rates = Rates(device, graph.dtype)
    if nodes is None:
        nodes = list({n.signature: n for n in profiled_nodes(graph)}.values())
    return [estimate_op(graph, n, rates) for n in nodes]


def estimate_profile(graph: Graph, device: DeviceInfo) -> Profile:
    """The whole graph's estimated profile (no store involved)."""
    ops = {op.signature: op for op in estimate_ops(graph, device)}
    return Profile(estimated=True, device=device, dtype=graph.dtype, graph_sha256=graph.graph_sha256, ops=ops)


def profile_analytic(graph: Graph, device: DeviceInfo, store_dir=None, force: bool = False) -> tuple[Profile, int]:
    """`planner profile --analytic`: estimate what the store lacks (everything without a store) and assemble."""
    if store_dir is None:
        profile = estimate_profile(graph, device)
        return profile, sum(1 for op in profile.ops.values() if op.candidates and op.candidates[0].name != "view")
    from planner.store import ProfileStore, profile_graph

    store = ProfileStore(store_dir, device, estimated=True)
    return profile_graph(graph, store, lambda nodes: estimate_ops(graph, device, nodes), force=force)
