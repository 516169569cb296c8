"""`planner calibrate`: the per-op dispatch time fitted from run reports and the copy slowdown from run traces, stored
in profiles and used by solve."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.analytic import estimate_profile
from planner.calibrate import (Calibrated, co_running_rows, fit, fit_dispatch_us,
                               simulated_makespan_us, traced_slowdowns)
from planner.check import check_plan
from planner.cli import app
from planner.devices import load_device
from planner.files import PlannerError, load_model, save_model
from planner.onnx_import import import_onnx
from planner.problem import build_problem
from planner.profile import Profile
from planner.report import OpTiming, RunReport
from planner.solve import Options, solve_plan
from planner.stats import serial_peak_bytes
from planner.training import build_training

MODELS = Path(__file__).parent / "models"


@pytest.fixture(scope="module")
def solved():
    g = import_onnx(MODELS / "googlenet.onnx", batch=1, dtype="fp16")
    prof = estimate_profile(g, load_device("h100"))
    return g, prof, solve_plan(g, prof, prof.device.memory_bytes, Options(time_limit_s=2, workers=2))


def _report(plan, plan_file: Path, measured_us: float) -> RunReport:
    return RunReport(plan_file=str(plan_file), model_name=plan.model_name, batch=plan.batch, dtype=plan.dtype,
                     training=plan.training, device="test", mode="graph", iterations=1,
                     measured_median_us=measured_us, measured_min_us=measured_us, measured_max_us=measured_us,
                     predicted_us=plan.totals.predicted_us, error=0.0, measured_peak_bytes=0, arena_bytes=0,
                     persistent_bytes=0, predicted_peak_bytes=0, cap_bytes=0, d2h_bytes=0, h2d_bytes=0,
                     validated=False)


def _calibrated(solved, tmp_path: Path, *flags: str) -> Path:
    """The profile file `planner calibrate --write ... FLAGS` wrote from a run of the solved plan at 2 us an op."""
    _, prof, plan = solved
    plan_file, profile_file = tmp_path / "plan.json", tmp_path / "profile.json"
    save_model(plan, plan_file)
    save_model(prof, profile_file)
    save_model(_report(plan, plan_file, simulated_makespan_us(plan, 2.0)), tmp_path / "run.json")
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "run.json"), "--write", str(profile_file), *flags])
    assert result.exit_code == 0, result.output
    return profile_file


def test_per_batch_calibration_is_that_batchs_own_and_solve_prefers_it(solved, tmp_path):
    """`--per-batch` writes the runs' batch's values ("inference.b1"); solve prices that batch with them and other
    batches with the mode's. With `--per-model` too, the model's at that batch ("inference.b1@googlenet"), which
    come first, then the model's, the batch's and the mode's."""
    g, prof, plan = solved
    profile_file = _calibrated(solved, tmp_path, "--per-batch")
    calibrated = load_model(Profile, profile_file)
    assert set(calibrated.device.dispatch_us) == {"inference.b1"}
    calibrated.device.dispatch_us["inference"] = 5.0
    assert calibrated.device.dispatch_for(False, 4, batch=1) == pytest.approx(2.0, abs=0.02)
    assert calibrated.device.dispatch_for(False, 4, batch=32) == 5.0 == calibrated.device.dispatch_for(False, 4)
    again = solve_plan(g, calibrated, calibrated.device.memory_bytes, Options(time_limit_s=0))
    assert again.totals.dispatch_us == calibrated.device.dispatch_us["inference.b1"]
    with pytest.raises(ValueError):
        calibrated.device.dispatch_us.update({"inference.b0": 1.0})
        Profile.model_validate(calibrated.model_dump())
    save_model(prof, profile_file)
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "run.json"), "--write", str(profile_file),
                                      "--per-batch", "--per-model"])
    assert result.exit_code == 0, result.output
    device = load_model(Profile, profile_file).device
    assert set(device.dispatch_us) == {"inference.b1@googlenet"}
    device.dispatch_us.update({"inference.b1": 5.0, "inference@googlenet": 7.0})
    assert device.dispatch_for(False, 4, 1, "googlenet") == pytest.approx(2.0, abs=0.02)
    assert device.dispatch_for(False, 4, 32, "googlenet") == 7.0 and device.dispatch_for(False, 4, 1, "resnet50") == 5.0


def test_per_dtype_calibration_comes_before_any_without_a_dtype(solved, tmp_path):
    """`--per-dtype` writes the runs' dtype's values ("inference.fp16"): solve prices that dtype with them even where
    the batch has its own values fitted without one, and the other dtype as before."""
    g, prof, plan = solved
    profile_file = _calibrated(solved, tmp_path, "--per-dtype")
    device = load_model(Profile, profile_file).device
    assert set(device.dispatch_us) == {"inference.fp16"}
    device.dispatch_us.update({"inference.b1": 5.0, "inference.b1.fp32@googlenet": 7.0})
    assert device.dispatch_for(False, 4, 1, "googlenet", "fp16") == pytest.approx(2.0, abs=0.02)
    assert device.dispatch_for(False, 4, 1, "googlenet", "fp32") == 7.0
    assert device.dispatch_for(False, 4, 1, "resnet50", "fp32") == 5.0 == device.dispatch_for(False, 4, 1)
    calibrated = load_model(Profile, profile_file)
    again = solve_plan(g, calibrated, calibrated.device.memory_bytes, Options(time_limit_s=0))
    assert again.totals.dispatch_us == calibrated.device.dispatch_us["inference.fp16"]


def test_per_batch_refuses_runs_of_two_batches_per_model_takes_them(solved, tmp_path):
    _, _, plan = solved
    g2 = import_onnx(MODELS / "googlenet.onnx", batch=2, dtype="fp16")
    prof2 = estimate_profile(g2, load_device("h100"))
    plan2 = solve_plan(g2, prof2, prof2.device.memory_bytes, Options(time_limit_s=0))
    for name, p in (("b1", plan), ("b2", plan2)):
        save_model(p, tmp_path / f"{name}.plan.json")
        save_model(_report(p, tmp_path / f"{name}.plan.json", p.totals.predicted_us), tmp_path / f"{name}.json")
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "b1.json"), str(tmp_path / "b2.json"),
                                      "--per-batch"])
    assert isinstance(result.exception, PlannerError) and "batches [1, 2]" in str(result.exception)
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "b1.json"), str(tmp_path / "b2.json"),
                                      "--per-model"])
    assert result.exit_code == 0, result.output
    assert "inference@googlenet" in result.output
    spaced = plan.model_copy(update={"model_name": "my net"})
    save_model(spaced, tmp_path / "spaced.plan.json")
    save_model(_report(spaced, tmp_path / "spaced.plan.json", spaced.totals.predicted_us), tmp_path / "spaced.json")
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "spaced.json"), "--per-model"])
    assert isinstance(result.exception, PlannerError) and "white space" in str(result.exception)


def test_the_fit_recovers_the_dispatch_time_that_made_the_measurement(solved):
    _, _, plan = solved
    assert simulated_makespan_us(plan, 0.0) == pytest.approx(plan.totals.makespan_us, rel=1e-6)
    runs = [Calibrated("a", plan, simulated_makespan_us(plan, 3.0))]
    assert fit_dispatch_us(runs) == pytest.approx(3.0, abs=0.02)
    assert runs[0].fitted_us == pytest.approx(runs[0].measured_us, rel=1e-3)
    assert fit_dispatch_us([Calibrated("b", plan, plan.totals.makespan_us * 0.9)]) == 0.0  # over-predicted


def test_calibrate_writes_the_profile_and_solve_then_prices_every_op_with_it(solved, tmp_path):
    g, _, _ = solved
    calibrated = load_model(Profile, _calibrated(solved, tmp_path))
    assert calibrated.device.dispatch_us["inference"] == pytest.approx(2.0, abs=0.02)
    assert "training" not in calibrated.device.dispatch_us
    again = solve_plan(g, calibrated, calibrated.device.memory_bytes, Options(time_limit_s=2, workers=2))
    assert again.totals.dispatch_us == calibrated.device.dispatch_us["inference"]
    assert all(op.end_us - op.start_us >= 2.0 for op in again.ops)
    assert check_plan(again).ok  # the check replays the same durations: the prediction still agrees


def test_a_report_of_another_plan_is_refused(solved, tmp_path):
    _, _, plan = solved
    save_model(plan, tmp_path / "plan.json")
    report = _report(plan, tmp_path / "plan.json", 100.0)
    report.predicted_us += 50
    save_model(report, tmp_path / "run.json")
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "run.json")])
    assert result.exit_code != 0 and isinstance(result.exception, PlannerError)
    assert "not the plan that was run" in str(result.exception)


@pytest.fixture(scope="module")
def offloading():
    """A training plan that offloads (recomputation off), from the heuristic alone."""
    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=8, dtype="fp16", training=True))
    prof = estimate_profile(g, load_device("h100"))
    resident = build_problem(g, prof).resident_bytes
    cap = resident + int((serial_peak_bytes(g) - resident) * 0.7)
    plan = solve_plan(g, prof, cap, Options(time_limit_s=0, recompute=False))
    assert plan.copies
    return g, prof, cap, plan


def _trace(plan, slowdown: float) -> dict:
    """What `planner run --trace` writes for the plan's copies, each `slowdown` times its planned duration."""
    return {"traceEvents": [{"name": f"{c.direction} {c.tensor}", "cat": "memcpy", "ph": "X", "ts": c.start_us,
                             "dur": (c.end_us - c.start_us) * slowdown, "args": {"bytes": c.bytes}}
                            for c in plan.copies]}


def test_traces_fit_the_copy_slowdown_and_solve_then_prices_every_copy_with_it(offloading, tmp_path):
    g, prof, cap, plan = offloading
    plan_file, profile_file, trace_file = tmp_path / "plan.json", tmp_path / "profile.json", tmp_path / "trace.json"
    save_model(plan, plan_file)
    save_model(prof, profile_file)
    trace_file.write_text(json.dumps(_trace(plan, 1.25)))
    measured = simulated_makespan_us(plan, 1.0, {"d2h": 1.25, "h2d": 1.25})
    assert measured >= simulated_makespan_us(plan, 1.0)
    save_model(_report(plan, plan_file, measured), tmp_path / "run.json")
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "run.json"), "--trace", str(trace_file),
                                      "--write", str(profile_file)])
    assert result.exit_code == 0, result.output
    device = load_model(Profile, profile_file).device
    assert device.copy_slowdown == pytest.approx({"d2h": 1.25, "h2d": 1.25}, abs=0.002)
    assert device.dispatch_us["training"] == pytest.approx(1.0, abs=0.02)
    assert device.copy_interference == pytest.approx(0.0, abs=0.002)  # the slowdown explains the whole run
    again = solve_plan(g, load_model(Profile, profile_file), cap, Options(time_limit_s=0, recompute=False))
    assert again.totals.copy_slowdown == device.copy_slowdown
    for c in again.copies:  # but a graph input's copy out, which copies nothing
        batch = c.direction == "d2h" and c.tensor in g.inputs
        assert c.end_us - c.start_us == pytest.approx(0.0 if batch else device.copy_us(c.direction, c.bytes), abs=0.2)
    assert check_plan(again).ok


def test_the_fit_recovers_the_copy_interference_from_runs_with_and_without_copies(solved, offloading):
    """The dispatch time comes from the run without copies; what the replay leaves unexplained in the run with
    copies, per microsecond of copy, is the interference."""
    plain, copying = solved[2], offloading[3]
    copy_us = sum(c.end_us - c.start_us for c in copying.copies)
    runs = [Calibrated("plain", plain, simulated_makespan_us(plain, 2.0)),
            Calibrated("copying", copying, simulated_makespan_us(copying, 2.0) + 0.08 * copy_us)]
    fitted = fit(runs)
    assert fitted.dispatch_us == pytest.approx(2.0, abs=0.02)
    assert fitted.copy_interference == pytest.approx(0.08, abs=0.002)
    assert fitted.one_stream_dispatch_us is None  # no run on one stream
    assert fitted.co_running is None  # one run without copies on several streams: k and the dispatch time are one
    assert all(r.fitted_us == pytest.approx(r.measured_us, rel=2e-3) for r in runs)
    runs[1].measured_us = simulated_makespan_us(copying, 2.0) - 0.05 * copy_us  # copies never speed compute up
    assert fit(runs).copy_interference == 0.0


def test_runs_on_one_stream_get_a_dispatch_time_of_their_own(solved, tmp_path):
    """A plan on one compute stream runs nothing side by side: its runs are fitted apart, stored apart, and solve
    prices one-stream plans with that time."""
    g, prof, several = solved
    assert several.compute_streams > 1
    serial = solve_plan(g, prof, prof.device.memory_bytes, Options(streams=1, time_limit_s=0))
    assert serial.compute_streams == 1
    runs = [Calibrated("several", several, simulated_makespan_us(several, 3.0)),
            Calibrated("serial", serial, simulated_makespan_us(serial, 0.5))]
    fitted = fit(runs)
    assert fitted.dispatch_us == pytest.approx(3.0, abs=0.02)
    assert fitted.one_stream_dispatch_us == pytest.approx(0.5, abs=0.02)
    profile_file = tmp_path / "profile.json"
    save_model(prof, profile_file)
    for name, plan, measured in (("several", several, simulated_makespan_us(several, 3.0)),
                                 ("serial", serial, simulated_makespan_us(serial, 0.5))):
        save_model(plan, tmp_path / f"{name}.plan.json")
        save_model(_report(plan, tmp_path / f"{name}.plan.json", measured), tmp_path / f"{name}.json")
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "several.json"), str(tmp_path / "serial.json"),
                                      "--write", str(profile_file)])
    assert result.exit_code == 0, result.output
    assert "0.50 us on one stream" in result.output
    device = load_model(Profile, profile_file).device
    assert device.dispatch_us["inference"] == pytest.approx(3.0, abs=0.02)
    assert device.one_stream_dispatch_us["inference"] == pytest.approx(0.5, abs=0.02)
    again = solve_plan(g, load_model(Profile, profile_file), prof.device.memory_bytes,
                       Options(streams=1, time_limit_s=0))
    assert again.totals.dispatch_us == device.one_stream_dispatch_us["inference"]
    assert check_plan(again).ok


def test_a_trace_without_the_plans_copies_is_refused(offloading, tmp_path):
    _, _, _, plan = offloading
    save_model(plan, tmp_path / "plan.json")
    save_model(_report(plan, tmp_path / "plan.json", plan.totals.makespan_us), tmp_path / "run.json")
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": []}))
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "run.json"), "--trace", str(tmp_path / "trace.json")])
    assert result.exit_code != 0 and "no copy of the plan in the trace" in str(result.exception)


def test_traces_show_how_much_slower_ops_run_beside_others(solved, tmp_path):
    """A narrow op whose kernel runs beside a wide one for twice its time alone, and an op run alone at its time:
    the table puts each in its row (the wide op too is alone: the narrow one beside it takes under 5%)."""
    _, _, plan = solved
    ops = sorted(plan.ops, key=lambda o: o.sm_fraction)
    narrow, lone, wide = ops[0], ops[len(ops) // 2], ops[-1]
    assert narrow.sm_fraction < 0.05 and wide.sm_fraction >= 0.3
    kernels = [(narrow, 0.0, 10.0, 0), (wide, 0.0, 10.0, 1), (lone, 20.0, 5.0, 0)]
    trace = {"traceEvents": [{"name": o.node, "cat": "kernel", "ph": "X", "ts": ts, "dur": dur, "tid": tid,
                              "args": {}} for o, ts, dur, tid in kernels]}
    alone_us = {narrow.node: 5.0, wide.node: 8.0, lone.node: 5.0}  # the others untimed, as a run times all in order
    report = _report(plan, tmp_path / "plan.json", plan.totals.predicted_us).model_copy(update={"ops": [
        OpTiming(node=o.node, algorithm=o.algorithm, stream=o.stream, predicted_us=1.0,
                 measured_us=alone_us.get(o.node, 0.0)) for o in plan.ops]})
    beside = traced_slowdowns(trace, plan, report)
    others_share = {narrow.node: wide.sm_fraction, wide.node: narrow.sm_fraction, lone.node: 0.0}
    assert [b.beside for b in beside] == pytest.approx([others_share[o.node] for o in plan.ops if o.node in alone_us])
    rows = co_running_rows(beside)
    assert rows == [("alone", 2, 13.0, 15.0), ("beside others, on 0%-20% of the SMs", 1, 5.0, 10.0)]
    save_model(plan, tmp_path / "plan.json")
    save_model(report, tmp_path / "run.json")
    (tmp_path / "trace.json").write_text(json.dumps(trace))
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "run.json"), "--trace", str(tmp_path / "trace.json")])
    assert result.exit_code == 0, result.output
    assert "x1.15" in result.output and "x2.00" in result.output  # 15 us against 13, 10 against 5


def test_a_trace_with_a_kernel_missing_its_duration_is_refused(solved, tmp_path):
    _, _, plan = solved
    save_model(plan, tmp_path / "plan.json")
    save_model(_report(plan, tmp_path / "plan.json", plan.totals.makespan_us), tmp_path / "run.json")
    broken = {"traceEvents": [{"name": plan.ops[0].node, "cat": "kernel", "ph": "X", "ts": 0.0}]}
    (tmp_path / "trace.json").write_text(json.dumps(broken))
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path / "run.json"), "--trace", str(tmp_path / "trace.json")])
    assert result.exit_code != 0 and "not a readable trace" in str(result.exception)


def test_runs_of_two_modes_are_refused_before_their_traces_are_read(solved, offloading, tmp_path):
    for name, plan in (("inference", solved[2]), ("training", offloading[3])):
        save_model(plan, tmp_path / f"{name}.plan.json")
        save_model(_report(plan, tmp_path / f"{name}.plan.json", plan.totals.makespan_us), tmp_path / f"{name}.json")
        (tmp_path / f"{name}.trace.json").write_text("not json")
    result = CliRunner().invoke(app, ["calibrate", *(str(tmp_path / f"{n}.json") for n in ("inference", "training")),
                                      *(a for n in ("inference", "training")
                                        for a in ("--trace", str(tmp_path / f"{n}.trace.json")))])
    assert result.exit_code != 0 and "mix devices or training with inference" in str(result.exception)


@pytest.mark.parametrize("capped", [False, True])
def test_solve_offers_the_serial_plan_when_running_side_by_side_is_priced_dearer(solved, offloading, capped):
    """Ops on several streams pay the calibrated dispatch time, which stands in for their slowing each other; one
    stream runs nothing side by side. When that price outweighs what the streams overlap, the plan is the
    framework-style serial one where it fits the cap, and under a cap it does not fit the search's plan in serial
    form (its offloads kept); the lower bound covers it."""
    g, prof, cap = (*offloading[:3],) if capped else (*solved[:2], solved[1].device.memory_bytes)
    mode = "training" if g.training else "inference"
    dear = prof.model_copy(deep=True)
    dear.device.dispatch_us[mode], dear.device.one_stream_dispatch_us[mode] = 40.0, 0.0
    plan = solve_plan(g, dear, cap, Options(time_limit_s=0, recompute=not capped))
    t = plan.totals
    assert plan.compute_streams == 1 and t.dispatch_us == 0.0
    assert t.lower_bound_us == min(t.bounds_us["one_stream"],
                                   max(v for k, v in t.bounds_us.items() if k != "one_stream"))
    if capped:
        assert "the plan's serial form" in t.status and plan.copies and t.peak_bytes <= cap
        assert t.bounds_us["one_stream"] < t.makespan_us
    else:
        assert "serial (one stream, every tensor kept)" in t.status
        assert t.bounds_us["one_stream"] == pytest.approx(t.makespan_us)
        assert t.makespan_us <= t.baseline_makespan_us  # concats as views, or the baseline itself
    assert t.lower_bound_us <= t.predicted_us
    assert check_plan(plan).ok


def test_where_the_serial_plans_arena_passes_the_cap_its_serial_form_is_offered(offloading):
    """A cap at the serial plan's peak, under the arena it takes (driver pages): the serial baseline does not fit,
    the search's plan in serial form does, and with running side by side priced dear it is the answer."""
    from planner.heuristic import serial_baseline
    from planner.solve import serial_device_bytes

    g, prof, _, _ = offloading
    dear = prof.model_copy(deep=True)
    dear.device.dispatch_us["training"], dear.device.one_stream_dispatch_us["training"] = 40.0, 0.0
    serial_peak = serial_baseline(build_problem(g, dear, streams=1))[2]
    assert serial_peak < serial_device_bytes(g, dear)
    plan = solve_plan(g, dear, serial_peak, Options(time_limit_s=0, concat="copy", bn_relu="apart"))  # fused: fits
    assert plan.compute_streams == 1 and "the plan's serial form" in plan.totals.status
    assert check_plan(plan).ok
