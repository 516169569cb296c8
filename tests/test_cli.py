"""The `planner` command as a user runs it: exit codes, one-line errors, files written whole."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

MODELS = Path(__file__).parent / "models"
PLANS = Path(__file__).parent.parent / "plans"


def planner(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "planner.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_help_lists_every_command():
    out = planner("--help")
    assert out.returncode == 0
    for cmd in ("inspect", "profile", "solve", "run", "export", "schema", "bench"):
        assert cmd in out.stdout


def test_inspect_googlenet_training_json_and_graph_file(tmp_path):
    out = planner("inspect", MODELS / "googlenet.train.onnx", "--batch", 32, "--train", "--json", "--out",
                  tmp_path / "g.json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["batch"] == 32 and stats["training"]
    assert stats["ops_by_kind"]["conv_bwd_filter"] == 57
    graph = json.loads((tmp_path / "g.json").read_text())
    assert graph["kind"] == "graph" and graph["format_version"] == 1
    again = planner("inspect", tmp_path / "g.json", "--json")  # a written graph can be inspected again
    assert json.loads(again.stdout)["serial_peak_bytes"] == stats["serial_peak_bytes"]


def test_inspect_human_output():
    out = planner("inspect", MODELS / "resnet50.onnx", "--batch", 8, "--dtype", "fp16")
    assert out.returncode == 0
    for words in ("peak memory, serial order", "critical path", "width", "weights", "conv"):
        assert words in out.stdout


@pytest.mark.parametrize("name", ["graph", "profile", "plan"])
def test_schema(name):
    out = planner("schema", name)
    assert out.returncode == 0
    schema = json.loads(out.stdout)
    assert schema["properties"]["kind"]["const"] == name


def test_bad_inputs_fail_in_one_line_without_traceback(tmp_path):
    (tmp_path / "bad.onnx").write_bytes(b"\x00garbage")
    for args in (["inspect", tmp_path / "missing.onnx"], ["inspect", tmp_path / "bad.onnx"],
                 ["inspect", MODELS / "resnet50.train.onnx", "--train", "--out", tmp_path / "sub" / "g.json",
                  "--batch", "0"]):
        out = planner(*args)
        assert out.returncode != 0
        assert "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "sub").exists()
    out = planner("profile", MODELS / "googlenet.onnx", "--analytic", "h100", "--counters", "--store", tmp_path)
    assert out.returncode == 2 and "--counters" in out.stderr and "Traceback" not in out.stderr
    out = planner("inspect", tmp_path / "bad.onnx")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_unsupported_op_exit_code_2(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Tanh", ["x"], ["y"], name="t1")], "m",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(g), tmp_path / "m.onnx")
    out = planner("inspect", tmp_path / "m.onnx")
    assert out.returncode == 2 and "Tanh" in out.stderr and "t1" in out.stderr


def _tampered(tmp_path, change) -> Path:
    plan = json.loads((PLANS / "googlenet.train.b32.fp16.cap50.json").read_text())
    change(plan)
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(plan))
    return path


def _drop_a_cross_stream_wait(plan):
    stream = {o["node"]: o["stream"] for o in plan["ops"] if not o["recompute_of"]}
    op = next(o for o in plan["ops"] if o["wait_events"] and any(stream[d] != o["stream"] for d in o["deps"]))
    op["wait_events"] = []


def _cap_below_the_peak(plan):
    plan["totals"]["mem_cap_bytes"] = plan["totals"]["peak_bytes"] - 2**20


def _a_longer_op(plan):
    plan["ops"][5]["end_us"] += 50.0


@pytest.mark.parametrize("change, rule", [(_drop_a_cross_stream_wait, "before its dependency"),
                                          (_cap_below_the_peak, "exceeds the cap"),
                                          (_a_longer_op, "differs from the simulated")])
def test_check_rejects_a_tampered_plan_naming_each_violation_on_one_line(tmp_path, change, rule):
    assert planner("check", PLANS / "googlenet.train.b32.fp16.cap50.json").returncode == 0
    out = planner("check", _tampered(tmp_path, change))
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert any(rule in line for line in lines if line.startswith("violation: ")), lines
    assert lines[-1].startswith("error: ") and "violations in" in lines[-1]


@pytest.mark.parametrize("args", [("profile", MODELS / "googlenet.onnx", "--batch", 1),
                                  ("run", PLANS / "googlenet.infer.b1.fp16.json", "--model", MODELS / "googlenet.onnx")])
def test_without_a_gpu_profile_and_run_fail_in_one_line(args, tmp_path):
    from conftest import gpu_missing_reason

    if gpu_missing_reason() is None:
        pytest.skip("this machine has a GPU: the command would run")
    out = planner(*args, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert len(out.stderr.strip().splitlines()) == 1 and "GPU" in out.stderr
    assert not any(tmp_path.iterdir())  # no store, no report: nothing half-made


@pytest.mark.parametrize("args, words", [
    (("solve",), "Missing argument"),
    (("solve", MODELS / "googlenet.onnx", "--batch", 0), "--batch"),
    (("solve", MODELS / "googlenet.onnx", "--no-such-option"), "No such option"),
    (("export", MODELS / "googlenet.onnx", "--to", "png", "-o", "x"), "--to"),
    (("no-such-command",), "No such command"),
])
def test_usage_errors_are_one_line_naming_the_help_to_read(args, words):
    out = planner(*args)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].endswith("--help)"), lines


def test_planner_alone_prints_its_help():
    out = planner()
    assert "solve" in out.stdout and "profile" in out.stdout and out.stderr == ""


def test_device_picks_among_the_stores_measured_gpus(tmp_path):
    """profiles/store holds GoogLeNet b1 fp16 measured on an H100 and an H200: solve says which it took, --device
    takes the other, and a GPU the store lacks is one line and exit 2."""
    args = ["solve", MODELS / "googlenet.onnx", "-b", "1", "--dtype", "fp16", "--time-limit", "0"]
    first = planner(*args, "-o", tmp_path / "h100.json")
    assert first.returncode == 0, first.stderr
    assert "measured on NVIDIA H100 80GB HBM3 (profiles/store also holds NVIDIA H200" in first.stdout
    assert "on NVIDIA H100 80GB HBM3" in first.stdout
    h200 = planner(*args, "--device", "h200", "-o", tmp_path / "h200.json")
    assert h200.returncode == 0, h200.stderr
    assert "plan for googlenet b1 fp16 on NVIDIA H200" in h200.stdout and "also holds" not in h200.stdout
    assert json.loads((tmp_path / "h200.json").read_text())["device_fingerprint"] == "NVIDIA_H200-9.0-91900-132"
    missing = planner(*args, "--device", "a100", "-o", tmp_path / "a100.json")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "no measured profile of this graph on a 'a100' GPU (it holds: NVIDIA H100" in missing.stderr
    assert not (tmp_path / "a100.json").exists()
