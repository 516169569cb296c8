"""Profile: per device and op signature, every candidate algorithm's measured (or estimated) cost vector."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints

from planner.files import FORMAT_VERSION

TIMING = "marginal"  # how runner.measure times candidates now (OpProfile.timing); older entries are measured again


class Kernel(BaseModel):
    """One GPU kernel a candidate launches (CUPTI activity record)."""

    name: str
    duration_us: float
    grid: list[int]
    block: list[int]
    registers_per_thread: int
    static_shared_bytes: int = 0
    dynamic_shared_bytes: int = 0
    blocks_per_sm: int = Field(0, description="resident blocks per SM from the occupancy rules")


class Counters(BaseModel):
    """Nsight Compute readings (--counters), duration-weighted over the candidate's kernels: stalls in warps
    stalled for that reason per issued instruction; throughputs in percent of the peak sustained rate."""

    stall_long_scoreboard: float = 0.0
    stall_barrier: float = 0.0
    stall_math_pipe_throttle: float = 0.0
    sm_throughput: float = 0.0
    dram_throughput: float = 0.0


class Candidate(BaseModel):
    name: str = Field(description="how the runner rebuilds exactly this implementation (e.g. a cuDNN plan name)")
    time_us: float
    workspace_bytes: int = 0
    registers_per_thread: int = 0
    shared_mem_bytes: int = 0
    threads_per_block: int = 0
    grid_blocks: int = 0
    sm_fraction: float = Field(1.0, description="share of the GPU's resident-block slots its grid fills (1 = nothing else fits)")
    dram_fraction: float = Field(0.0, description="minimum bytes moved / time / peak bandwidth")
    kernels: list[Kernel] = Field(default_factory=list)
    counters: Counters | None = None


class Unsupported(BaseModel):
    name: str
    reason: str


class OpProfile(BaseModel):
    signature: str
    kind: str
    describe: str = ""
    candidates: list[Candidate]
    measured_count: int = Field(0, description="candidates measured before pruning to the ones kept")
    unsupported: list[Unsupported] = Field(default_factory=list)
    estimated: bool = Field(False, description="costs from the analytic model (no GPU implementation measured yet)")
    timing: Literal["graph", "marginal"] = Field("graph", description="how time_us was measured: `graph`, a CUDA "
                                                 "graph of R launches over R (its launch's fixed cost included); "
                                                 "`marginal`, graphs of 2R and R launches, their difference over R")
    implementations: list[str] = Field(default_factory=list, description="the implementations beyond cuDNN's "
                                       "the runner offered for this op when it was measured (e.g. `stem`): a runner "
                                       "that offers one not listed measures the op again")


# mode[.b<batch>][.<dtype>][@<model>]
CALIBRATION_KEY = r"^(training|inference)(\.b[1-9][0-9]*)?(\.fp16|\.fp32)?(@\S+)?$"
CalibrationKey = Annotated[str, StringConstraints(pattern=CALIBRATION_KEY)]


def calibration_key(training: bool, batch: int | None = None, model: str | None = None,
                    dtype: str | None = None) -> str:
    """A mode's calibration key ("training", "inference"), or one batch's of it ("inference.b1"), one dtype's
    ("training.fp32", "training.b32.fp32") or one model's ("inference@googlenet", "inference.b1@googlenet")."""
    return ("training" if training else "inference") + (f".b{batch}" if batch is not None else "") + (
        f".{dtype}" if dtype is not None else "") + (f"@{model}" if model is not None else "")


def calibration_value(table: dict[str, float], training: bool, batch: int | None = None,
                      model: str | None = None, dtype: str | None = None) -> float:
    """The most specific calibrated value there is: the dtype's before any fitted without one, and among either
    the model's at this batch, the model's, the batch's, the mode's; else 0. What an op adds inside an iteration
    differs by batch and by network (H200 inference: k 1.17 and no dispatch time at b1, k 1.32 and 0.98 us an op
    at b32; on one stream at b1, GoogLeNet's serial plan needed no dispatch time, ResNet-50's 0.79 us an op) and
    by dtype (H100 GoogLeNet training b32: k 1.63 in fp16, 0.68 in fp32)."""
    batches, models = [batch, None] if batch is not None else [None], [model, None] if model is not None else [None]
    dtypes = [dtype, None] if dtype is not None else [None]
    for key in [calibration_key(training, b, m, d) for d in dtypes for m in models for b in batches]:
        if key in table:
            return table[key]
    return 0.0


class DeviceInfo(BaseModel):
    name: str
    sm_count: int
    memory_bytes: int
    sm_clock_mhz: int = 0
    memory_clock_mhz: int = 0
    compute_capability: str = ""
    driver_version: str = ""
    cuda_version: str = ""
    cudnn_version: str = ""
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    registers_per_sm: int = 65536
    shared_mem_per_sm_bytes: int = 233472
    max_threads_per_block: int = 1024
    registers_per_block: int = 65536
    shared_mem_per_block_optin_bytes: int = Field(232448, description="largest shared memory one block may opt into")
    reserved_shared_mem_per_block_bytes: int = Field(1024, description="shared memory the driver keeps per block (sm_80+)")
    warp_size: int = 32
    peak_dram_bytes_per_s: float = 0.0
    peak_flops_fp32: float = Field(0.0, description="CUDA-core FP32 rate")
    peak_flops_tf32: float = Field(0.0, description="tensor-core TF32 rate (0: none, FP32 convs use peak_flops_fp32)")
    peak_flops_fp16: float = Field(0.0, description="tensor-core FP16 rate with FP32 accumulation")
    d2d_bytes_per_s: float = Field(0.0, description="device-to-device copy rate counting bytes read and written")
    h2d_bytes_per_s: float = 0.0
    d2h_bytes_per_s: float = 0.0
    copy_latency_us: float = 0.0
    copy_overlaps_compute: bool = True
    bidirectional_copies: bool = True
    dispatch_us: dict[CalibrationKey, float] = Field(
        default_factory=dict, description="what each op adds to an iteration beyond its profiled time (dependency "
        "resolution in the CUDA graph, co-running slowdown), per mode (`inference`), and where fitted so per batch "
        "(`inference.b1`), model (`inference@googlenet`) or both, the most specific preferred; fitted from "
        "measured runs by `planner calibrate`, 0 until then")

    copy_slowdown: dict[Literal["d2h", "h2d"], float] = Field(
        default_factory=dict, description="a host copy's time inside an iteration over its time alone (it shares "
        "the memory system with running kernels), per direction; fitted from run traces by `planner calibrate "
        "--trace`, 1 until then")

    copy_interference: float = Field(
        0.0, description="compute time an iteration loses per unit of host-copy time: kernels beside a copy run "
        "slower and the ops waiting on a copy chain fall behind (H100 ResNet-50 training: forward 9% slower "
        "while offloads run); fitted from measured runs by `planner calibrate`, 0 until then")

    one_stream_dispatch_us: dict[CalibrationKey, float] = Field(
        default_factory=dict, description="the same in a plan on one compute stream, where no op runs beside another "
        "(H100 training b32: 0, serial plans ran 1-6% under their ops' times alone); fitted from one-stream runs "
        "by `planner calibrate`, 0 until then")

    co_running: dict[CalibrationKey, float] = Field(
        default_factory=dict, description="k of the co-running slowdown, per mode (and batch or model) as "
        "dispatch_us: in a plan on several compute streams each op runs 1 + k x the SM share of the ops beside it "
        "times its priced duration (planner.co_running; H200 inference b32: 1.05); fitted with the dispatch time by "
        "`planner calibrate`, 0 until then")

    def dispatch_for(self, training: bool, streams: int = 2, batch: int | None = None,
                     model: str | None = None, dtype: str | None = None) -> float:
        """What each op adds to its profiled time in a plan on `streams` compute streams."""
        table = self.one_stream_dispatch_us if streams == 1 else self.dispatch_us
        return calibration_value(table, training, batch, model, dtype)

    def co_running_for(self, training: bool, streams: int = 2, batch: int | None = None,
                       model: str | None = None, dtype: str | None = None) -> float:
        """k of the co-running slowdown in a plan on `streams` compute streams (none on one)."""
        return 0.0 if streams == 1 else calibration_value(self.co_running, training, batch, model, dtype)

    def calibrate(self, mode: str, dispatch_us: float | None,
                  copy_slowdown: dict[str, float], copy_interference: float | None,
                  one_stream_dispatch_us: float | None = None, co_running: float | None = None) -> None:
        """Record what `planner calibrate` fitted: the dispatch time on several streams and on one and the
        co-running slowdown of a mode (or of one batch or model of it: calibration_key), the directions' copy
        slowdown and the copy interference (None: nothing to fit it from, keep it)."""
        if dispatch_us is not None:
            self.dispatch_us[mode] = dispatch_us
        if co_running is not None:
            self.co_running[mode] = co_running
        if one_stream_dispatch_us is not None:
            self.one_stream_dispatch_us[mode] = one_stream_dispatch_us
        self.copy_slowdown.update(copy_slowdown)
        if copy_interference is not None:
            self.copy_interference = copy_interference

    def copy_us(self, direction: Literal["d2h", "h2d"], nbytes: int) -> float:
        """A host copy's duration inside an iteration: latency plus bytes at the rate measured alone, slowed
        down as calibrated."""
        rate = self.d2h_bytes_per_s if direction == "d2h" else self.h2d_bytes_per_s
        return (self.copy_latency_us + nbytes / rate * 1e6) * self.copy_slowdown.get(direction, 1.0)

    @property
    def fingerprint(self) -> str:
        """Profiles are only valid for the same GPU model and software stack."""
        parts = [self.name, self.compute_capability, self.cudnn_version or "analytic", str(self.sm_count)]
        return "-".join(p.replace(" ", "_") for p in parts)


CONV_KINDS = ("conv", "conv_fused", "conv_bwd_data", "conv_bwd_filter")


def conv_tensors(node) -> tuple[str, str, str]:
    """(x, w, y) tensor names of a conv-family op, whichever of them it reads or writes."""
    if node.kind in ("conv", "conv_fused"):
        return node.inputs[0], node.inputs[1], node.outputs[0]
    if node.kind == "conv_bwd_data":
        return node.outputs[0], node.inputs[1], node.inputs[0]
    return node.inputs[0], node.outputs[0], node.inputs[1]


def describe_op(node, graph) -> str:
    """One short line per op (`conv 3x3/s2 64->128 56x56 n8`), shared by the analytic model, the runner and reports."""
    if node.kind in CONV_KINDS:
        x, w, _ = (graph.tensors[t].shape for t in conv_tensors(node))
        stride = node.attrs.get("strides", [1, 1])[0]
        groups = node.attrs.get("groups", 1)
        text = f"{node.kind} {w[2]}x{w[3]}/s{stride} {x[1]}->{w[0]} {x[2]}x{x[3]} n{x[0]}"
        epilogue = "".join(f" +{k}" for k in ("residual", "relu") if node.attrs.get(k))
        return text + (f" g{groups}" if groups > 1 else "") + epilogue
    shapes = [graph.tensors[t].shape for t in node.inputs]
    return f"{node.kind} " + " ".join("x".join(map(str, s)) or "scalar" for s in shapes)


class Profile(BaseModel):
    kind: Literal["profile"] = "profile"
    format_version: int = FORMAT_VERSION
    estimated: bool = Field(False, description="True when costs come from the analytic model, not the GPU")
    device: DeviceInfo
    dtype: Literal["fp32", "fp16"]
    graph_sha256: str | None = Field(None, description="the graph this profile was assembled for, if any")
    ops: dict[str, OpProfile] = Field(default_factory=dict, description="keyed by op signature")


def prune_candidates(candidates: list[Candidate], keep_fastest: int = 3) -> list[Candidate]:
    """The Pareto front over (time, workspace, sm_fraction) plus the fastest few, fastest first.

    Shipped profiles stay small, and no candidate the solver could prefer is lost.
    """
    def dominated(c: Candidate) -> bool:
        return any(o is not c and o.time_us <= c.time_us and o.workspace_bytes <= c.workspace_bytes
                   and o.sm_fraction <= c.sm_fraction
                   and (o.time_us, o.workspace_bytes, o.sm_fraction) != (c.time_us, c.workspace_bytes, c.sm_fraction)
                   for o in candidates)

    by_time = sorted(candidates, key=lambda c: c.time_us)
    keep = {id(c) for c in by_time[:keep_fastest]} | {id(c) for c in candidates if not dominated(c)}
    return [c for c in by_time if id(c) in keep]
