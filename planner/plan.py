"""Plan: the solver's decisions in executable form (algorithms, streams, events, copies, residency)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from planner.files import PLAN_FORMAT_VERSION

FUSED_RECOMPUTE = "bn_apply:"  # prefix of a recomputation's algorithm when it runs as one fused bn_apply kernel


class ScheduledOp(BaseModel):
    node: str
    algorithm: str = Field(description="Candidate.name from the profile")
    stream: int
    start_us: float
    end_us: float
    workspace_bytes: int = 0
    sm_fraction: float = 1.0
    dram_fraction: float = Field(0.0, description="share of the measured DRAM bandwidth it needs")
    recompute_of: str | None = Field(None, description="set when this entry recomputes a dropped tensor")
    recompute_nodes: list[str] = Field(default_factory=list, description="the ops a recomputation re-runs, in "
                                       "order (BatchNormalization with its saved batch statistics)")
    record_event: str | None = None
    wait_events: list[str] = Field(default_factory=list)
    reads: list[str] = Field(default_factory=list, description="non-persistent tensors (storages) it reads")
    writes: list[str] = Field(default_factory=list, description="non-persistent tensors (storages) it creates")
    deps: list[str] = Field(default_factory=list, description="ops that must end before it starts (graph edges)")
    slowdown: float = Field(1.0, description="its duration over its priced time alone: what the ops beside it "
                            "cost it (planner.co_running)")

    @property
    def trace_label(self) -> str:
        """Its name in `planner run --trace` files."""
        return f"recompute {self.recompute_of} ({self.node})" if self.recompute_of else self.node


class Copy(BaseModel):
    tensor: str
    direction: Literal["d2h", "h2d"]
    stream: int
    start_us: float
    end_us: float
    bytes: int
    record_event: str | None = None
    wait_events: list[str] = Field(default_factory=list)

    @property
    def trace_label(self) -> str:
        """Its name in `planner run --trace` files."""
        return f"{self.direction} {self.tensor}"


class Residency(BaseModel):
    tensor: str
    bytes: int
    decision: Literal["keep", "offload", "recompute"] = "keep"
    intervals_us: list[tuple[float, float]] = Field(description="when the tensor occupies device memory")
    late_readers: list[str] = Field(default_factory=list, description="readers served by the second residency "
                                                                      "(after the copy back or the recomputation)")
    is_output: bool = Field(False, description="a graph output: lives to the end of the iteration")

    def second_serves(self, op: ScheduledOp) -> bool:
        """Whether `op` finds this tensor in its second residency: the recomputation that makes it again, and,
        when it is not kept, its backward readers and the recomputations that read it."""
        if op.recompute_of == self.tensor:
            return True
        return self.decision != "keep" and (op.node in self.late_readers if op.recompute_of is None
                                            else self.tensor in op.reads)


class Totals(BaseModel):
    makespan_us: float = Field(description="predicted iteration time: the plan's streams and waits, replayed")
    peak_bytes: int = Field(description="predicted peak device memory, resident bytes included")
    mem_cap_bytes: int
    resident_bytes: int = Field(0, description="weights, state, optimizer state")
    lower_bound_us: float = Field(description="no plan the solve considers is shorter: the largest bound on plans "
                                  "of several streams, or `one_stream` where that is less")
    bounds_us: dict[str, float] = Field(default_factory=dict, description="each lower bound on the iteration time "
                                        "of plans on several streams, and `one_stream`: that of plans on one "
                                        "stream (the framework-style serial plan where it fits the cap, else the "
                                        "search's plan in serial form), which the solve also offers (their ops "
                                        "priced without running side by side)")
    solver_makespan_us: float = Field(0.0, description="the makespan in the solver's time grid")
    baseline_makespan_us: float
    baseline_peak_bytes: int = 0
    status: str
    gap: float
    solve_time_s: float
    first_plan_s: float = Field(0.0, description="seconds from the start of the solve to its first valid plan")
    streams_used: int = 0
    events_used: int = 0
    offloaded_bytes: int = 0
    recomputed_bytes: int = 0
    tick_us: float = 0.1
    dispatch_us: float = Field(0.0, description="the profile's per-op dispatch time, included in every op's duration")
    co_running: float = Field(0.0, description="k of the profile's co-running slowdown, which every op's duration "
                              "includes as its `slowdown`")
    copy_slowdown: dict[Literal["d2h", "h2d"], float] = Field(
        default_factory=dict, description="the profile's calibrated copy slowdown, included in every copy's duration")
    copy_interference_us: float = Field(
        0.0, description="compute time the plan's host copies are expected to cost the ops beside them: the "
        "profile's calibrated copy_interference times the copies' summed duration (not in the makespan)")
    simplifications: list[str] = Field(default_factory=list)

    @property
    def predicted_us(self) -> float:
        """The iteration time `planner run` is expected to measure: the replayed makespan plus copy interference."""
        return self.makespan_us + self.copy_interference_us

    def gap_to_bound(self) -> float:
        """What `gap` holds: 1 - lower bound / predicted time (0 when nothing is predicted)."""
        return max(0.0, 1 - self.lower_bound_us / self.predicted_us) if self.predicted_us else 0.0


class Plan(BaseModel):
    kind: Literal["plan"] = "plan"
    format_version: int = PLAN_FORMAT_VERSION
    graph_sha256: str
    model_name: str
    batch: int
    dtype: Literal["fp32", "fp16"]
    training: bool
    device_fingerprint: str
    estimated: bool = Field(description="made from an analytic (estimated) profile")
    compute_streams: int
    concat_views: list[str] = Field(default_factory=list, description="concats run as concat_view: their "
                                    "producers write into the output's channel slices (fuse.with_concat_views)")
    bn_relu_fused: list[str] = Field(default_factory=list, description="training BatchNormalizations that run the "
                                     "ReLU after them (and a residual Add between), their backwards the ReLU's "
                                     "where no Add is (fuse.with_bn_relu; applied before concat_views)")
    relu_sums_fused: list[str] = Field(default_factory=list, description="ReLU backwards that add up the "
                                       "gradients a sum made for them (fuse.with_relu_sums; applied after "
                                       "bn_relu_fused)")
    ops: list[ScheduledOp]
    copies: list[Copy] = Field(default_factory=list)
    tensors: list[Residency] = Field(default_factory=list)
    totals: Totals
