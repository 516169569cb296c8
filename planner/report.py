"""RunReport: what `planner run` measured for a plan, beside what the plan predicted (the file of --report)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from planner.files import FORMAT_VERSION


class OpTiming(BaseModel):
    node: str
    algorithm: str
    stream: int
    predicted_us: float
    measured_us: float = Field(description="the time the op's kernels keep the GPU busy (the union of their CUPTI "
                                           "intervals), the op run alone")


class Check(BaseModel):
    tensor: str
    what: Literal["output", "loss", "activation", "weight_gradient", "updated_weight", "round_trip"]
    relative_error: float
    tolerance: float
    passed: bool


class RunReport(BaseModel):
    kind: Literal["run_report"] = "run_report"
    format_version: int = FORMAT_VERSION
    plan_file: str
    model_name: str
    batch: int
    dtype: str
    training: bool
    device: str
    mode: Literal["graph", "eager"]
    iterations: int
    measured_median_us: float
    measured_min_us: float
    measured_max_us: float
    predicted_us: float
    error: float = Field(description="(measured median - predicted) / predicted")
    measured_peak_bytes: int = Field(description="device memory the plan's buffers took, as the CUDA driver "
                                     "reports it (cudaMemGetInfo before and after the arena and persistent tensors)")
    runtime_bytes: int = Field(0, description="further device memory the process took while running: kernel "
                               "modules, the instantiated CUDA graph, library state (not part of the plan)")
    arena_bytes: int
    persistent_bytes: int
    predicted_peak_bytes: int
    cap_bytes: int
    d2h_bytes: int
    h2d_bytes: int
    validated: bool
    checks: list[Check] = Field(default_factory=list)
    ops: list[OpTiming] = Field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)
