"""Plan: the solver's decisions in executable form (algorithms, streams, events, copies, residency)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from planner.files import FORMAT_VERSION


class ScheduledOp(BaseModel):
    node: str
    algorithm: str = Field(description="Candidate.name from the profile")
    stream: int
    start_us: float
    end_us: float
    workspace_bytes: int = 0
    sm_fraction: float = 1.0
    recompute_of: str | None = Field(None, description="set when this entry recomputes a dropped tensor")
    record_event: str | None = None
    wait_events: list[str] = Field(default_factory=list)


class Copy(BaseModel):
    tensor: str
    direction: Literal["d2h", "h2d"]
    stream: int
    start_us: float
    end_us: float
    bytes: int
    record_event: str | None = None
    wait_events: list[str] = Field(default_factory=list)


class Residency(BaseModel):
    tensor: str
    bytes: int
    decision: Literal["keep", "offload", "recompute"] = "keep"
    intervals_us: list[tuple[float, float]] = Field(description="when the tensor occupies device memory")


class Totals(BaseModel):
    makespan_us: float
    peak_bytes: int
    mem_cap_bytes: int
    lower_bound_us: float
    baseline_makespan_us: float
    status: str
    gap: float
    solve_time_s: float
    streams_used: int = 0
    events_used: int = 0
    offloaded_bytes: int = 0
    simplifications: list[str] = Field(default_factory=list)


class Plan(BaseModel):
    kind: Literal["plan"] = "plan"
    format_version: int = FORMAT_VERSION
    graph_sha256: str
    model_name: str
    batch: int
    dtype: Literal["fp32", "fp16"]
    training: bool
    device_fingerprint: str
    estimated: bool = Field(description="made from an analytic (estimated) profile")
    compute_streams: int
    ops: list[ScheduledOp]
    copies: list[Copy] = Field(default_factory=list)
    tensors: list[Residency] = Field(default_factory=list)
    totals: Totals
