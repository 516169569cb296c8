"""File formats: version and model checks on load, atomic writes, clear errors."""

import json
import os
from pathlib import Path

import pytest

from planner.files import PlannerError, atomic_write_text, load_model, save_model
from planner.ir import Graph
from planner.onnx_import import import_onnx
from planner.plan import Plan, Totals

MODELS = Path(__file__).parent / "models"


@pytest.fixture(scope="module")
def graph():
    return import_onnx(MODELS / "squeezenet.op17.onnx", batch=1)


def _plan(graph_sha):
    totals = Totals(makespan_us=1, peak_bytes=1, mem_cap_bytes=2, lower_bound_us=1, baseline_makespan_us=1,
                    status="OPTIMAL", gap=0, solve_time_s=0)
    return Plan(graph_sha256=graph_sha, model_name="m", batch=1, dtype="fp32", training=False,
                device_fingerprint="d", estimated=True, compute_streams=1, ops=[], totals=totals)


def test_other_format_version_is_refused(tmp_path, graph):
    save_model(graph, tmp_path / "g.json")
    raw = json.loads((tmp_path / "g.json").read_text())
    raw["format_version"] = 99
    (tmp_path / "g.json").write_text(json.dumps(raw))
    with pytest.raises(PlannerError, match="format version 99"):
        load_model(Graph, tmp_path / "g.json")


def test_a_plan_of_format_1_is_refused(tmp_path, graph):
    """Plans of format 1 held weight gradients in the resident bytes; format 2 lists them as tensors with
    lifetimes, so the runner and the check cannot read the older ones: they are refused, not misread."""
    save_model(_plan(graph.graph_sha256), tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["format_version"] == 2
    raw["format_version"] = 1
    (tmp_path / "p.json").write_text(json.dumps(raw))
    with pytest.raises(PlannerError, match="plan format version 1 is not supported .this planner reads version 2"):
        load_model(Plan, tmp_path / "p.json")
    save_model(graph, tmp_path / "g.json")  # graphs stay at format 1
    assert load_model(Graph, tmp_path / "g.json").format_version == 1


def test_file_for_another_model_is_refused(tmp_path, graph):
    save_model(_plan(graph.graph_sha256), tmp_path / "p.json")
    assert load_model(Plan, tmp_path / "p.json", expect_graph_sha256=graph.graph_sha256)
    other = import_onnx(MODELS / "squeezenet.op17.onnx", batch=2)
    with pytest.raises(PlannerError, match="another model graph"):
        load_model(Plan, tmp_path / "p.json", expect_graph_sha256=other.graph_sha256)


def test_wrong_kind_and_broken_json(tmp_path, graph):
    save_model(graph, tmp_path / "g.json")
    with pytest.raises(PlannerError, match="expected a plan file"):
        load_model(Plan, tmp_path / "g.json")
    (tmp_path / "t.json").write_text('{"kind": "graph", "format_version": 1, "nodes": [')
    with pytest.raises(PlannerError, match="not a readable JSON"):
        load_model(Graph, tmp_path / "t.json")
    (tmp_path / "v.json").write_text('{"kind": "graph", "format_version": 1}')
    with pytest.raises(PlannerError, match="invalid graph file"):
        load_model(Graph, tmp_path / "v.json")


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    target = tmp_path / "f.json"
    atomic_write_text(target, "old")

    class Boom(str):
        def encode(self, *a, **k):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write_text(target, Boom("new"))
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_graph_sha_changes_with_content(graph):
    other = graph.model_copy(deep=True)
    other.nodes[0].attrs["strides"] = [3, 3]
    other.__dict__.pop("graph_sha256", None)
    assert other.graph_sha256 != graph.graph_sha256
