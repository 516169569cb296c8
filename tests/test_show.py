"""`planner show`: the per-stream timeline and where a plan's makespan goes by SM share."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.files import load_model
from planner.plan import Plan
from planner.export_trace import memory_counter
from planner.show import draw_timeline, passes_us, sm_share_in_use, sm_time_us

PLANS = Path(__file__).parent.parent / "plans"


def _idle_sm_us(plan: Plan) -> float:
    """The idle SM share integrated over the makespan, by a sweep over the ops' starts and ends."""
    events = sorted([(o.start_us, o.sm_fraction) for o in plan.ops] + [(o.end_us, -o.sm_fraction) for o in plan.ops])
    idle, share, at = 0.0, 0.0, 0.0
    for t, change in events:
        idle += (t - at) * max(0.0, 1.0 - share)
        share, at = share + change, t
    return idle + (plan.totals.makespan_us - at)


@pytest.mark.parametrize("name", ["googlenet.train.b32.fp16.cap50", "googlenet.train.b32.fp16.full",
                                  "resnet50.train.b32.fp16.cap50"])
def test_the_parts_sum_to_the_makespan_and_idle_is_what_the_sms_leave(name):
    plan = load_model(Plan, PLANS / f"{name}.json")
    parts = sm_time_us(plan)
    assert sum(parts.values()) == pytest.approx(plan.totals.makespan_us)
    assert parts["idle SMs"] == pytest.approx(_idle_sm_us(plan), abs=0.01)
    assert (parts["recomputations"] > 0) == (plan.totals.recomputed_bytes > 0)
    if plan.compute_streams > 1:
        assert parts["least-area work"] == plan.totals.bounds_us["sm_work"]
        assert parts["wider algorithms"] >= 0
    else:  # one stream: its ops are priced apart from the bound's
        assert "least-area work" not in parts and parts["ops' work"] > 0


@pytest.mark.parametrize("name", ["googlenet.train.b32.fp16.cap50", "resnet50.train.b32.fp16.cap30",
                                  "googlenet.infer.b1.fp16"])
def test_a_training_plan_splits_at_the_loss_into_two_passes_that_add_up(name):
    plan = load_model(Plan, PLANS / f"{name}.json")
    passes = passes_us(plan)
    assert len(passes) == (2 if plan.training else 0)
    if passes:
        (_, a, b), (_, c, d) = passes
        assert a == 0.0 and b == c and d == plan.totals.makespan_us
        whole = sm_time_us(plan)
        halves = [sm_time_us(plan, since, until) for _, since, until in passes]
        for part in ("recomputations", "idle SMs"):
            assert sum(h[part] for h in halves) == pytest.approx(whole[part])
        ops_work = whole.get("ops' work") or (whole["least-area work"] + whole["wider algorithms"]  # several streams
                                              + whole.get("co-running slowdown", 0.0))
        assert sum(h["ops' work"] for h in halves) == pytest.approx(ops_work)
        assert halves[1]["recomputations"] > halves[0]["recomputations"]  # they serve the backward pass


def test_show_prints_the_split_and_each_stream():
    path = PLANS / "googlenet.train.b32.fp16.cap35.json"  # with copies
    out = subprocess.run([sys.executable, "-m", "planner.cli", "show", path], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    parts = sm_time_us(load_model(Plan, path))
    assert f"{parts['idle SMs']:.1f} idle SMs" in out.stdout
    assert f"{parts['recomputations']:.1f} recomputations" in out.stdout
    assert "before the loss: " in out.stdout and "from the loss on: " in out.stdout
    assert "compute 0" in out.stdout and "copy h2d" in out.stdout


@pytest.mark.parametrize("name", ["googlenet.train.b32.fp16.cap50", "resnet50.train.b32.fp16.cap30"])
def test_the_drawn_curves_stay_within_the_sms_and_peak_at_the_plans_peak(name):
    plan = load_model(Plan, PLANS / f"{name}.json")
    assert max(share for _, share in sm_share_in_use(plan)) <= 1.0 + 1e-9
    assert plan.totals.resident_bytes + max(b for _, b in memory_counter(plan)) == plan.totals.peak_bytes


def test_the_timeline_png_is_written_whole(tmp_path):
    pytest.importorskip("matplotlib")
    draw_timeline(load_model(Plan, PLANS / "googlenet.train.b32.fp16.cap50.json"), tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["t.png"]
