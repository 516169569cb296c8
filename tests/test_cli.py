"""The `planner` command as a user runs it: exit codes, one-line errors, files written whole."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

MODELS = Path(__file__).parent / "models"


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
