"""`planner bench` without a GPU: options, interleaving, ratios, the table, JSON and chart from a synthetic report,
the one-line error where there is no GPU, and the PyTorch peers' checkpointed and save_on_cpu forwards on CPU."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from planner.bench import (BenchReport, Environment, Settings, Variant, add_ratios, cap_for,
                           equivalence_checks, interleave, make_row, parse_batches, parse_dtypes)
from planner.bench_report import print_report, save_outputs
from planner.files import PlannerError

MODELS = Path(__file__).parent / "models"


def test_options_parse_and_bad_ones_are_one_line_errors():
    assert parse_batches("1,32") == [1, 32] and parse_batches(" 8 , 8,") == [8]
    assert parse_dtypes("fp16,FP32") == ["fp16", "fp32"]
    for bad in ("", "0", "1,x", "-1", "1.5"):
        with pytest.raises(PlannerError, match="--batch"):
            parse_batches(bad)
    with pytest.raises(PlannerError, match="--dtype"):
        parse_dtypes("fp16,bf16")
    assert cap_for(None, 1000) is None
    assert cap_for("50%", 1000) == 500  # a percentage is of our serial plan's peak, not of the device
    assert cap_for("2GiB", 1000) == 2 << 30
    with pytest.raises(PlannerError):
        cap_for("1GB,2GB", 1000)
    with pytest.raises(PlannerError, match="at least 50"):
        Settings(batches=[1], dtypes=["fp16"], rounds=4, iterations=5)
    with pytest.raises(PlannerError, match="memory size"):
        Settings(batches=[1], dtypes=["fp16"], mem="lots")


def _fake(name, framework, base_us, log, peak=1 << 20):
    def time_us(n):
        log.append(name)
        return [base_us + (i % 3) for i in range(n)]
    return Variant(name, framework, time_us, lambda: peak)


def test_interleave_rotates_the_order_and_collects_every_iteration():
    log = []
    variants = [_fake(n, "ours", 10.0, log) for n in "abc"]
    samples = interleave(variants, rounds=3, iterations=5)
    assert log == list("abc" + "bca" + "cab")  # no variant always follows the same one
    assert all(len(t) == 15 for t in samples.values())


def _rows(cap=None):
    key = ("googlenet", 32, "fp16", True)
    spec = [("ours planned", "ours", 700.0, 3 << 30), ("ours serial", "ours", 1000.0, 6 << 30),
            ("torch eager", "torch", 1200.0, 7 << 30), ("torch graph", "torch", 900.0, 7 << 30),
            ("torch checkpoint", "torch", 1400.0, 2 << 30), ("torchvision eager", "torch", 1180.0, 7 << 30)]
    log = []
    return [make_row(key, _fake(n, f, t, log, peak), [t + d for d in range(-25, 25)], cap) for n, f, t, peak in spec]


def test_rows_ratios_and_the_torchvision_check():
    rows = _rows()
    add_ratios(rows)
    by = {r.variant: r for r in rows}
    assert by["ours planned"].median_us == pytest.approx(699.5) and by["ours planned"].iterations == 50
    assert by["ours planned"].p10_us < by["ours planned"].median_us < by["ours planned"].p90_us
    assert by["ours planned"].best_torch == "torch graph"
    assert by["ours planned"].ratio_vs_best_torch == pytest.approx(699.5 / 899.5)
    (check,) = equivalence_checks(rows)
    assert check.passed and check.mode == "eager" and check.ratio == pytest.approx(1179.9 / 1159.9)  # lower deciles
    capped = _rows(cap=4 << 30)  # under a cap, the best PyTorch variant is the fastest one that stayed under it
    add_ratios(capped)
    assert {r.best_torch for r in capped} == {"torch checkpoint"}


def test_the_torchvision_check_fails_only_a_slower_peer():
    """Our IR's build is the PyTorch peer: faster than torchvision's only makes the comparison harder for us."""
    rows = _rows()
    tv = next(r for r in rows if r.variant == "torchvision eager")
    ours = next(r for r in rows if r.variant == "torch eager")
    for tv_p10_us, passed in ((ours.p10_us / 0.90, True), (ours.p10_us / 1.04, True), (ours.p10_us / 1.08, False)):
        tv.p10_us = tv_p10_us
        (check,) = equivalence_checks(rows)
        assert check.passed is passed


def test_no_torch_rows_no_ratios():
    rows = [r for r in _rows() if r.framework == "ours"]
    add_ratios(rows)
    assert all(r.ratio_vs_best_torch is None for r in rows) and not equivalence_checks(rows)


def _report():
    rows = _rows()
    add_ratios(rows)
    env = Environment(gpu="NVIDIA H100 80GB HBM3", compute_capability="9.0",
                      versions={"driver": "13000", "cudnn": "91900", "torch": "2.11.0"}, tf32="convs only")
    return BenchReport(environment=env, rounds=10, iterations_per_round=5, rows=rows,
                       checks=equivalence_checks(rows), notes=["an example note"])


def test_table_names_every_variant_with_numbers_and_versions():
    console = Console(record=True, width=220)
    print_report(_report(), console)
    text = console.export_text()
    for words in ("NVIDIA H100", "driver 13000", "cudnn 91900", "torch 2.11.0", "TF32", "googlenet:",
                  "b32 fp16 train", "ours planned", "torch checkpoint", "0.700", "0.78x", "6.00 GiB",
                  "2% slower", "an example note"):
        assert words in text, words


def test_json_is_written_whole_and_reads_back(tmp_path, monkeypatch):
    import planner.show

    def no_matplotlib():
        raise PlannerError("drawing PNGs needs matplotlib")
    monkeypatch.setattr(planner.show, "_pyplot", no_matplotlib)
    console = Console(record=True, width=200)
    out = tmp_path / "sub" / "bench.json"
    save_outputs(_report(), out, tmp_path / "bench.png", console)  # no chart is a note, never a failure
    again = BenchReport.model_validate_json(out.read_text())
    assert again == _report() and json.loads(out.read_text())["kind"] == "bench_report"
    assert "no chart" in console.export_text() and not (tmp_path / "bench.png").exists()
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]  # no temporary file left behind


def test_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    save_outputs(_report(), tmp_path / "b.json", tmp_path / "b.png", Console(record=True))
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_a_gpu_bench_fails_in_one_line():
    from conftest import gpu_missing_reason

    if gpu_missing_reason() is None:
        pytest.skip("this machine has a GPU: bench would run")
    out = subprocess.run([sys.executable, "-m", "planner.cli", "bench", str(MODELS / "googlenet.onnx"), "--batch",
                          "1,32", "--dtype", "fp16"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr + out.stdout
    assert len(out.stderr.strip().splitlines()) == 1 and "GPU" in out.stderr


@pytest.mark.parametrize("extra, words", [
    (["--train", "--mem", "50%"], "--plan brings its own cap"),  # the plan's cap applies
    ([], "add --train"),  # a training plan with an inference bench
])
def test_bench_plan_mismatch_fails_in_one_line(extra, words):
    plan = Path(__file__).parent.parent / "plans" / "googlenet.train.b32.fp16.cap50.json"
    out = subprocess.run([sys.executable, "-m", "planner.cli", "bench", str(MODELS / "googlenet.train.onnx"), "--plan",
                          str(plan), *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr + out.stdout
    assert len(out.stderr.strip().splitlines()) == 1 and words in out.stderr


def test_bench_is_listed_in_help():
    out = subprocess.run([sys.executable, "-m", "planner.cli", "bench", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--batch" in out.stdout and "--mem" in out.stdout


def _googlenet_training():
    from planner.onnx_import import import_onnx
    from planner.training import build_training

    return build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=2, training=True, input_hw=(64, 64)))


def test_checkpoint_segments_carry_exactly_what_later_ops_read():
    pytest.importorskip("torch")
    from runner.torch_peer import checkpoint_segments, peer_module

    graph = _googlenet_training()
    module = peer_module(graph)
    persistent = {t for t, v in graph.tensors.items() if v.persistent}
    segments = checkpoint_segments(module, persistent)
    order = module.PLAN["order"]
    assert [op for ops, *_ in segments for op in ops] == order
    assert {len(ops) for ops, *_ in segments[:-1]} == {math.ceil(math.sqrt(len(order)))}  # 15 of 197 ops
    available = {module.GRAPH["inputs"][0]}
    for ops, ins, outs, after in segments:
        assert set(ins) <= available and not set(ins) & persistent
        available = set(outs) | (available & after)
        for t in after - set(outs):
            assert t in available
    assert segments[-1][2] == module.GRAPH["outputs"]


def test_serial_checkpointed_and_save_on_cpu_training_steps_match_the_modules_own():
    torch = pytest.importorskip("torch")
    from planner import reference
    from runner.torch_peer import _checkpointed, _saved_on_cpu, peer_module, serial_forward

    graph = _googlenet_training()
    values = {**reference.random_parameters(graph, seed=0), **reference.random_inputs(graph, seed=1)}
    module = peer_module(graph)
    results = []
    for wrap in (None, lambda net: serial_forward(module, net), lambda net: _checkpointed(module, net),
                 lambda net: _saved_on_cpu(serial_forward(module, net))):
        net = module.PlannedNet(None, device="cpu", dtype=torch.float64, values=copy.deepcopy(values))
        if wrap is not None:
            net.forward = wrap(net)
        loss = net.train_step(torch.from_numpy(values["input"]), torch.from_numpy(values["labels"]))
        results.append((float(loss), [p.detach().numpy().copy() for p in net.params.values()]))
    (loss, weights), *others = results
    for other_loss, other_weights in others:
        assert other_loss == pytest.approx(loss, rel=1e-12)
        assert all(np.allclose(a, b, rtol=1e-10, atol=1e-14) for a, b in zip(other_weights, weights))
