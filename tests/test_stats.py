"""Graph statistics: serial peak memory, critical path and width on graphs whose answers are known."""

import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from planner.onnx_import import import_onnx
from planner.stats import critical_path, graph_stats, serial_peak_bytes, width
from planner.training import build_training

MODELS = Path(__file__).parent / "models"


def _chain_model(tmp_path, branches: int):
    """x -> relu -> `branches` parallel 1x1 convs -> concat -> relu."""
    inits, nodes, outs = [], [helper.make_node("Relu", ["x"], ["r"])], []
    for i in range(branches):
        inits.append(numpy_helper.from_array(np.ones((2, 4, 1, 1), np.float32), f"w{i}"))
        nodes.append(helper.make_node("Conv", ["r", f"w{i}"], [f"c{i}"], name=f"conv{i}"))
        outs.append(f"c{i}")
    nodes += [helper.make_node("Concat", outs, ["cat"], axis=1), helper.make_node("Relu", ["cat"], ["y"])]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("branches", [1, 3, 5])
def test_width_and_critical_path_of_parallel_branches(tmp_path, branches):
    g = import_onnx(_chain_model(tmp_path, branches), batch=2)
    assert width(g) == branches
    ops_on_path, flops = critical_path(g)
    assert ops_on_path == 4  # relu, one conv, concat, relu
    assert flops == g.nodes[0].flops + g.nodes[1].flops + g.nodes[-2].flops + g.nodes[-1].flops


def _random_dag_model(tmp_path, inputs: list[tuple[int, int]]):
    """Op i is Relu of an earlier output (x's or an op's, picked by a) or, where b picks another, Add of the two;
    outputs nothing reads are the graph's outputs."""
    names, nodes, read = ["x"], [], set()
    for i, (a, b) in enumerate(inputs):
        a, b = names[a % len(names)], names[b % len(names)]
        nodes.append(helper.make_node("Relu", [a], [f"y{i}"]) if a == b else helper.make_node("Add", [a, b], [f"y{i}"]))
        read |= {a, b}
        names.append(f"y{i}")
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names[1:] if n not in read]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 2, 2])],
                              outputs)
    path = tmp_path / "dag.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), min_size=1, max_size=10))
def test_width_is_the_largest_set_of_ops_no_path_joins(tmp_path_factory, inputs):
    g = import_onnx(_random_dag_model(tmp_path_factory.mktemp("dag"), inputs), batch=2)
    preds = g.predecessors()
    names = [n.name for n in g.nodes]
    ancestors: dict[str, set[str]] = {}
    for name in names:  # nodes are in topological order
        ancestors[name] = set(preds[name]).union(*(ancestors[p] for p in preds[name]))
    joined = lambda a, b: a in ancestors[b] or b in ancestors[a]  # noqa: E731
    largest = max(k for k in range(1, len(names) + 1) for group in itertools.combinations(names, k)
                  if not any(joined(a, b) for a, b in itertools.combinations(group, 2)))
    assert width(g) == largest


def test_serial_peak_by_hand(tmp_path):
    g = import_onnx(_chain_model(tmp_path, 3), batch=2)
    x = r = 2 * 4 * 8 * 8 * 4  # bytes
    branch = 2 * 2 * 8 * 8 * 4
    cat = y = 3 * branch
    weights = 3 * 2 * 4 * 4
    live_per_op = [x + r, r + branch, r + 2 * branch, r + 3 * branch, 3 * branch + cat, cat + y]
    assert serial_peak_bytes(g) == weights + max(live_per_op)


def test_googlenet_inference_width_is_the_four_inception_branches():
    g = import_onnx(MODELS / "googlenet.onnx", batch=1)
    assert width(g) == 4


def test_training_stats_googlenet():
    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=32, training=True))
    s = graph_stats(g)
    assert s.weight_gradient_bytes == s.weight_bytes == s.optimizer_state_bytes
    assert 0 < s.saved_for_backward_bytes < s.activation_bytes
    assert s.serial_peak_bytes > s.persistent_bytes + s.saved_for_backward_bytes * 0.9
    assert s.width_ops >= 4 and s.critical_path_ops > 100
