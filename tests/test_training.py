"""Training iteration: structure of the backward DAG, and gradients against central finite differences."""

import io
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console

from planner.files import PlannerError
from planner.onnx_import import import_onnx
from planner.training import LOSS, build_training

MODELS = Path(__file__).parent / "models"


def test_googlenet_iteration_structure():
    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=4, training=True))
    phases = [n.phase for n in g.nodes]
    assert phases.index("loss") > max(i for i, p in enumerate(phases) if p == "forward")
    kinds = [n.kind for n in g.nodes]
    convs = kinds.count("conv")
    assert kinds.count("conv_bwd_filter") == convs
    assert kinds.count("conv_bwd_data") == convs - 1  # the first conv reads the data input: no gradient needed
    weights = [t for t in g.tensors.values() if t.role == "weight" and t.alias_of is None]
    updated = [w for n in g.nodes if n.kind == "sgd" for w in n.inputs[0::3]]
    assert sorted(updated) == sorted(t.name for t in weights)  # each weight once
    assert kinds.count("sgd") == convs + 1  # one launch per layer: a conv and its BatchNormalization, and fc
    assert g.outputs == [LOSS] and "labels" in g.inputs
    # each concat's gradient is sliced back to its branches
    assert kinds.count("slice") == sum(len(n.inputs) for n in g.nodes if n.kind == "concat")


def test_weight_gradients_live_from_their_op_to_their_update():
    """Only weights, state and momentum are resident; a weight gradient is a tensor from the backward op that
    writes it to the layer's SGD update that reads it, so the update frees it."""
    from planner.analytic import estimate_profile
    from planner.devices import H100
    from planner.problem import build_problem

    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=1, training=True))
    p = build_problem(g, estimate_profile(g, H100))
    resident = {"weight", "state", "optimizer_state", "constant"}
    assert p.resident_bytes == sum(t.bytes for t in g.tensors.values() if t.alias_of is None and t.role in resident)
    uses = {u.name: u for u in p.tensors}
    gradients = [name for name, t in g.tensors.items() if t.role == "weight_gradient"]
    assert len(gradients) == 173
    for name in gradients:
        u = uses[name]
        assert p.ops[u.producer].phase == "backward" and not u.choosable
        assert [p.ops[c].kind for c in u.early + u.late] == ["sgd"]


def test_conv_data_and_weight_gradients_are_independent_nodes():
    g = build_training(import_onnx(MODELS / "resnet50.train.onnx", batch=2, training=True))
    preds = g.predecessors()
    for n in g.nodes:
        if n.kind != "conv_bwd_data":
            continue
        twin = next(m for m in g.nodes if m.kind == "conv_bwd_filter" and m.forward_of == n.forward_of)
        assert twin.name not in preds[n.name] and n.name not in preds[twin.name]
        assert n.inputs[0] == twin.inputs[1]  # both read the same output gradient


def test_saved_for_backward_and_gradient_accumulation():
    g = build_training(import_onnx(MODELS / "resnet50.train.onnx", batch=2, training=True))
    by_name = g.node_by_name
    # the stem's conv input is kept for the weight gradient
    first = g.nodes[0]
    assert first.kind == "conv"
    assert any(by_name[c].kind == "conv_bwd_filter" for c in g.tensors[first.inputs[0]].saved_for_backward)
    # a ReLU output read by the next conv (weight gradient) and its own backward (mask)
    relu = next(n for n in g.nodes if n.kind == "relu"
                and any(by_name[c].kind == "conv" for c in g.tensors[n.outputs[0]].consumers))
    readers = {by_name[c].kind for c in g.tensors[relu.outputs[0]].saved_for_backward}
    assert {"relu_bwd", "conv_bwd_filter"} <= readers
    # residual joins: a block input feeds the branch and the shortcut, so its gradient is summed
    sums = [n for n in g.nodes if n.kind == "sum"]
    assert len(sums) == 16 and all(len(n.inputs) == 2 for n in sums)
    # backward ops never feed forward ops
    phase = {n.name: n.phase for n in g.nodes}
    for n in g.nodes:
        if n.phase == "forward":
            assert all(phase.get(g.tensors[t].producer, "forward") == "forward" for t in n.inputs)


def test_add_fans_out_without_a_copy():
    g = build_training(import_onnx(MODELS / "resnet50.train.onnx", batch=2, training=True))
    add = next(n for n in g.nodes if n.kind == "add")
    (dy,) = [t for t in g.tensors if t.startswith(f"grad:{add.outputs[0]}")]
    readers = [g.node_by_name[c] for c in g.tensors[dy].consumers]
    assert len(readers) == 2  # the branch's BN backward and the shortcut's gradient sum read the same tensor
    assert {r.kind for r in readers} <= {"batchnorm_bwd", "sum"}


def test_inference_mode_bn_is_refused():
    with pytest.raises(PlannerError):
        build_training(import_onnx(MODELS / "resnet50.train.onnx", batch=2, training=False))


def test_every_shipped_model_builds_an_iteration():
    for path in sorted(MODELS.glob("*.op17.onnx")):
        g = build_training(import_onnx(path, batch=2, training=True))
        names = [n.name for n in g.nodes]
        assert len(set(names)) == len(names)
        produced = set(g.inputs) | {t for t, v in g.tensors.items() if v.persistent}
        for n in g.nodes:  # stored order is topological
            assert all(t in produced for t in n.inputs), (path.name, n.name)
            produced.update(n.outputs)


# Gradient checks on small hand-built blocks (float64 NumPy reference, central differences).

def _conv(name, x, cin, cout, k, rng, inits, pad=None, stride=1):
    w = numpy_helper.from_array(rng.standard_normal((cout, cin, k, k)).astype(np.float32), f"{name}.w")
    inits.append(w)
    p = k // 2 if pad is None else pad
    return helper.make_node("Conv", [x, w.name], [name], pads=[p] * 4, strides=[stride] * 2, name=name)


def _bn(name, x, c, inits):
    params = [numpy_helper.from_array(np.ones(c, np.float32), f"{name}.{p}") for p in ("s", "b", "m", "v")]
    inits.extend(params)
    return helper.make_node("BatchNormalization", [x] + [p.name for p in params], [name], training_mode=1,
                            epsilon=1e-5, momentum=0.9, name=name)


def _head(x, c, classes, inits, rng):
    w = numpy_helper.from_array(rng.standard_normal((classes, c)).astype(np.float32), "fc.w")
    b = numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "fc.b")
    inits += [w, b]
    return [helper.make_node("GlobalAveragePool", [x], ["gap"]),
            helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
            helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], transB=1)]


def _inception_block(rng, inits):
    return [
        _conv("stem", "x", 3, 6, 3, rng, inits), helper.make_node("Relu", ["stem"], ["s"]),
        _conv("b1", "s", 6, 4, 1, rng, inits), helper.make_node("Relu", ["b1"], ["r1"]),
        _conv("b2a", "s", 6, 3, 1, rng, inits), helper.make_node("Relu", ["b2a"], ["r2a"]),
        _conv("b2b", "r2a", 3, 4, 3, rng, inits), helper.make_node("Relu", ["b2b"], ["r2"]),
        helper.make_node("MaxPool", ["s"], ["p3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1]),
        _conv("b3", "p3", 6, 2, 1, rng, inits), helper.make_node("Relu", ["b3"], ["r3"]),
        helper.make_node("AveragePool", ["s"], ["p4"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1]),
        _conv("b4", "p4", 6, 2, 1, rng, inits), helper.make_node("Relu", ["b4"], ["r4"]),
        helper.make_node("Concat", ["r1", "r2", "r3", "r4"], ["cat"], axis=1),
    ], "cat", 12


def _residual_block(rng, inits):
    return [
        _conv("stem", "x", 3, 4, 3, rng, inits), _bn("bn0", "stem", 4, inits), helper.make_node("Relu", ["bn0"], ["s"]),
        _conv("c1", "s", 4, 4, 3, rng, inits), _bn("bn1", "c1", 4, inits), helper.make_node("Relu", ["bn1"], ["r1"]),
        _conv("c2", "r1", 4, 4, 3, rng, inits), _bn("bn2", "c2", 4, inits),
        helper.make_node("Add", ["bn2", "s"], ["sum"]), helper.make_node("Relu", ["sum"], ["out"]),
    ], "out", 4


def _two_residual_blocks(rng, inits):
    """The residual block, then another reading its output twice (conv and residual Add): that output's gradient
    is a sum."""
    nodes, out, c = _residual_block(rng, inits)
    return nodes + [
        _conv("c3", out, c, c, 3, rng, inits), _bn("bn3", "c3", c, inits), helper.make_node("Relu", ["bn3"], ["r3"]),
        _conv("c4", "r3", c, c, 3, rng, inits), _bn("bn4", "c4", c, inits),
        helper.make_node("Add", ["bn4", out], ["sum2"]), helper.make_node("Relu", ["sum2"], ["out2"]),
    ], "out2", c


def _dense_block(rng, inits):
    nodes = [_conv("stem", "x", 3, 4, 3, rng, inits)]
    feats, c = ["stem"], 4
    for i in range(3):
        cat = f"cat{i}"
        nodes.append(helper.make_node("Concat", feats, [cat], axis=1) if len(feats) > 1
                     else helper.make_node("Identity", feats, [cat]))
        nodes += [_bn(f"bn{i}", cat, c, inits), helper.make_node("Relu", [f"bn{i}"], [f"r{i}"]),
                  _conv(f"c{i}", f"r{i}", c, 2, 3, rng, inits)]
        feats.append(f"c{i}")
        c += 2
    nodes.append(helper.make_node("Concat", feats, ["out"], axis=1))
    nodes.append(helper.make_node("Dropout", ["out", "ratio", "train"], ["drop", "mask"]))
    inits += [numpy_helper.from_array(np.array(0.3, np.float32), "ratio"),
              numpy_helper.from_array(np.array(True), "train")]
    return nodes, "drop", c


def _block_model(tmp_path, make):
    rng = np.random.default_rng(0)
    inits = []
    nodes, out, c = make(rng, inits)
    nodes += _head(out, c, 5, inits, rng)
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializer=inits)
    path = tmp_path / "block.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("make", [_inception_block, _residual_block, _dense_block])
def test_gradients_match_central_differences(tmp_path, make):
    reference = pytest.importorskip("planner.reference")
    g = build_training(import_onnx(_block_model(tmp_path, make), batch=3, training=True))
    values = {**reference.random_parameters(g, seed=1), **reference.random_inputs(g, seed=2)}
    out = reference.run(g, values)
    sgd = [n for n in g.nodes if n.kind == "sgd"]
    assert sgd
    rng = np.random.default_rng(3)

    def loss_at(weight, direction, eps):
        shifted = dict(values)
        shifted[weight] = values[weight] + eps * direction
        return float(reference.run(g, shifted)[LOSS])

    for w, dw in ((w, dw) for n in sgd for w, dw in zip(n.inputs[0::3], n.inputs[1::3])):
        grad = out[dw].reshape(values[w].shape)
        direction = rng.standard_normal(values[w].shape)
        analytic = float((grad * direction).sum())
        eps = 1e-6
        numeric = (loss_at(w, direction, eps) - loss_at(w, direction, -eps)) / (2 * eps)
        assert abs(analytic - numeric) <= 1e-5 * max(abs(numeric), 1e-3), (w, analytic, numeric)


def _aligned_inception_block(rng, inits):
    """Branches of 4, 8 and 4 channels: every channel slice of the Concat starts on a 16-byte boundary in fp32."""
    return [
        _conv("stem", "x", 3, 6, 3, rng, inits), helper.make_node("Relu", ["stem"], ["s"]),
        _conv("b1", "s", 6, 4, 1, rng, inits), _bn("n1", "b1", 4, inits), helper.make_node("Relu", ["n1"], ["r1"]),
        _conv("b2", "s", 6, 8, 3, rng, inits), _bn("n2", "b2", 8, inits), helper.make_node("Relu", ["n2"], ["r2"]),
        helper.make_node("MaxPool", ["s"], ["p3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1]),
        _conv("b3", "p3", 6, 4, 1, rng, inits), _bn("n3", "b3", 4, inits), helper.make_node("Relu", ["n3"], ["r3"]),
        helper.make_node("Concat", ["r1", "r2", "r3"], ["cat"], axis=1),
    ], "cat", 16


def test_training_concats_become_views_with_slice_view_gradients(tmp_path):
    """In training a Concat of ReLUs can cost no copy: each ReLU writes its channel slice, each relu_bwd reads y
    and dy in place, and the Concat's gradient slices become slice_views; the iteration computes the same loss,
    gradients and updates, and solve's plan with the view passes the independent check; its baseline is the
    framework's serial run, which copies."""
    from planner import reference
    from planner.analytic import estimate_profile
    from planner.check import check_plan
    from planner.devices import load_device
    from planner.fuse import concat_view_candidates, with_concat_views
    from planner.solve import Options, solve_plan

    g = build_training(import_onnx(_block_model(tmp_path, _aligned_inception_block), batch=2, training=True))
    names = concat_view_candidates(g)
    assert names == [n.name for n in g.nodes if n.kind == "concat"]
    v = with_concat_views(g, names)
    slices = [n for n in v.nodes if n.kind == "slice_view"]
    assert len(slices) == 3 and not any(n.kind in ("concat", "slice") for n in v.nodes)
    assert sorted(v.tensors[n.outputs[0]].channel_offset for n in slices) == [0, 4, 12]
    assert all(n.attrs["concat_channels"] == 16 for n in v.nodes if n.kind in ("relu", "relu_bwd")
               and v.tensors[(n.outputs if n.kind == "relu" else n.inputs)[0]].alias_of == "cat")
    values = {**reference.random_parameters(g, seed=1), **reference.random_inputs(g, seed=2)}
    copied, viewed = reference.run(g, dict(values)), reference.run(v, dict(values))
    assert copied.keys() == viewed.keys()
    assert all(np.array_equal(copied[k], viewed[k]) for k in copied)

    profile = estimate_profile(g, load_device("h100"))
    plan = solve_plan(g, profile, profile.device.memory_bytes, Options(time_limit_s=0, concat="view"))
    assert plan.concat_views == names and check_plan(plan).violations == []
    serial = solve_plan(g, profile, profile.device.memory_bytes, Options(baseline=True))  # a framework's: copies
    assert (plan.totals.baseline_makespan_us, plan.totals.baseline_peak_bytes) == \
        (serial.totals.makespan_us, serial.totals.baseline_peak_bytes)
    cat = next(r for r in plan.tensors if r.tensor == "cat")
    assert cat.decision == "keep"


def test_batchnorms_run_their_relus_and_compute_the_same_iteration(tmp_path):
    """fuse.with_bn_relu: each BatchNormalization that only a ReLU reads writes the ReLU's output and its backward
    masks the ReLU's output gradient itself; the iteration computes the same loss, gradients and updates with two
    ops a layer fewer. Its concats can still be views (the fused BatchNormalizations write the slices), solve fuses
    where the profile has the fused ops, and the plan, as the runner sees it, passes the independent check."""
    from planner import reference
    from planner.analytic import estimate_profile
    from planner.check import check_plan
    from planner.devices import load_device
    from planner.fuse import as_planned, bn_relu_candidates, bn_relu_nodes, concat_view_candidates, with_bn_relu
    from planner.solve import Options, solve_plan

    g = build_training(import_onnx(_block_model(tmp_path, _aligned_inception_block), batch=2, training=True))
    names = bn_relu_candidates(g)
    assert names == [n.name for n in g.nodes if n.kind == "batchnorm"]
    f = with_bn_relu(g, names)
    kinds = lambda graph: [n.kind for n in graph.nodes]  # noqa: E731
    assert len(f.nodes) == len(g.nodes) - 2 * len(names)
    assert kinds(f).count("relu") == kinds(g).count("relu") - 3 and kinds(f).count("relu_bwd") == 1  # the stem's
    bwd = [n for n in f.nodes if n.kind == "batchnorm_bwd"]
    bias = {n.name: n.inputs[2] for n in f.nodes if n.kind == "batchnorm"}
    assert all(n.attrs["relu"] == 1 and n.inputs[5] == bias[n.forward_of] for n in bwd)  # the mask from x and bias
    assert all(not f.tensors[t].saved_for_backward for t in ("r1", "r2", "r3"))  # read by the Concat alone
    assert f.tensors["r1"].producer == "n1" and "n1" not in f.tensors  # the unfused BN output is gone
    assert concat_view_candidates(f) == concat_view_candidates(g)
    values = {**reference.random_parameters(g, seed=1), **reference.random_inputs(g, seed=2)}
    apart, fused = reference.run(g, dict(values)), reference.run(f, dict(values))
    assert fused.keys() <= apart.keys() and len(apart) - len(fused) == 2 * len(names)
    assert all(np.allclose(fused[k], apart[k], rtol=1e-12, atol=1e-15) for k in fused)

    profile = estimate_profile(g, load_device("h100"))
    assert {n.signature for n in bn_relu_nodes(f)} <= profile.ops.keys()  # estimated with the graph's own
    plan = solve_plan(g, profile, profile.device.memory_bytes, Options(time_limit_s=0))
    assert plan.bn_relu_fused == names and plan.graph_sha256 == g.graph_sha256 and check_plan(plan).ok
    runs = as_planned(g, plan.bn_relu_fused, plan.concat_views, plan.relu_sums_fused)
    assert {op.node for op in plan.ops if not op.recompute_of} <= set(runs.node_by_name)
    unfused = profile.model_copy(update={"ops": {k: v for k, v in profile.ops.items()
                                                 if k not in {n.signature for n in bn_relu_nodes(f)}}})
    assert not solve_plan(g, unfused, profile.device.memory_bytes, Options(time_limit_s=0)).bn_relu_fused
    with pytest.raises(PlannerError, match="--bn-relu fused: the profile has not measured 6 fused ops"):
        solve_plan(g, unfused, profile.device.memory_bytes, Options(time_limit_s=0, bn_relu="fused"))
    apart_plan = solve_plan(g, profile, profile.device.memory_bytes, Options(time_limit_s=0, bn_relu="apart"))
    assert not apart_plan.bn_relu_fused and apart_plan.totals.makespan_us > plan.totals.makespan_us
    assert (plan.totals.baseline_makespan_us, plan.totals.baseline_peak_bytes) == \
        (apart_plan.totals.baseline_makespan_us, apart_plan.totals.baseline_peak_bytes)


def test_batchnorms_run_the_residual_add_and_relu_after_them(tmp_path):
    """fuse.with_bn_relu at a residual block's end: the BatchNormalization adds the residual and runs the ReLU
    (attr residual, the residual its last input) where the ReLU was; the ReLU's backward stays, now its backward,
    and its output is both gradients still; it adds up its output's gradients itself where a sum made them for
    it alone. Same iteration; solve fuses each chain the profile measured."""
    from planner import reference
    from planner.analytic import estimate_profile
    from planner.check import check_plan
    from planner.devices import load_device
    from planner.fuse import (as_planned, bn_relu_candidates, bn_relu_nodes, relu_sum_candidates, relu_sum_nodes,
                              with_bn_relu, with_relu_sums)
    from planner.ir import recompute_nodes
    from planner.solve import Options, solve_plan
    from planner.solve_report import print_plan_summary

    g = build_training(import_onnx(_block_model(tmp_path, _two_residual_blocks), batch=2, training=True))
    names = bn_relu_candidates(g)
    assert names == [n.name for n in g.nodes if n.kind == "batchnorm"]
    b = with_bn_relu(g, names)
    bn2 = b.node_by_name["bn2"]
    assert bn2.attrs["residual"] == 1 and bn2.inputs[5] == "s" and bn2.outputs[0] == "out"
    assert not any(n.kind == "add" and n.phase == "forward" for n in b.nodes) and "sum" not in b.tensors
    relu_bwd = {n.forward_of: n for n in b.nodes if n.kind == "relu_bwd"}
    assert relu_bwd.keys() == {"bn2", "bn4"} and relu_bwd["bn2"].inputs[0] == "out"
    sums = relu_sum_candidates(b)
    assert sums == [relu_bwd["bn2"].name] and set(relu_sum_candidates(g)) == {*sums, "relu_bwd:s"}  # unfused too
    f = with_relu_sums(b, sums)
    summed = f.node_by_name[sums[0]]
    assert summed.inputs[1:] == g.node_by_name["sum:out"].inputs and "sum:out" not in f.node_by_name
    assert relu_sum_nodes(f) == [summed] and summed.signature != relu_bwd["bn4"].signature
    assert summed.outputs[0] == f.node_by_name["batchnorm_bwd:bn2"].inputs[1]
    assert "relu" not in f.node_by_name["batchnorm_bwd:bn2"].attrs
    assert [n.name for n in f.nodes].index("bn2") > [n.name for n in f.nodes].index("bn0")
    assert recompute_nodes(f)[("bn2",)].signature == recompute_nodes(g)[("bn2", "sum", "out")].signature
    values = {**reference.random_parameters(g, seed=1), **reference.random_inputs(g, seed=2)}
    apart, fused = reference.run(g, dict(values)), reference.run(f, dict(values))
    assert fused.keys() <= apart.keys()
    assert all(np.allclose(fused[k], apart[k], rtol=1e-12, atol=1e-15) for k in fused)

    profile = estimate_profile(g, load_device("h100"))
    plan = solve_plan(g, profile, profile.device.memory_bytes, Options(time_limit_s=0))
    assert plan.bn_relu_fused == names and plan.relu_sums_fused == sums and check_plan(plan).ok
    console = Console(file=io.StringIO(), width=200)
    print_plan_summary(plan, console)
    summary = console.file.getvalue()
    assert re.search(rf"BatchNormalizations running their ReLUs\s*│\s*{len(names)}\b", summary)
    assert re.search(r"ReLU backwards adding up their gradients\s*│\s*1\b", summary)
    planned = {op.node for op in plan.ops if not op.recompute_of}
    assert summed.name in planned <= set(as_planned(g, names, [], sums).node_by_name) and "sum:out" not in planned
    residual = {n.signature for n in bn_relu_nodes(f) if n.attrs.get("residual")}
    partial = profile.model_copy(update={"ops": {k: v for k, v in profile.ops.items()
                                                 if k not in residual | {summed.signature}}})
    plan = solve_plan(g, partial, profile.device.memory_bytes, Options(time_limit_s=0))
    assert plan.bn_relu_fused == [n for n in names if n not in ("bn2", "bn4")] and plan.relu_sums_fused == []


def test_relu_backwards_leave_their_sums_apart_under_a_costly_cap(tmp_path, monkeypatch):
    """A fused gradient sum holds the gradients beside the ReLU's output: `--bn-relu auto` leaves the sums apart
    where the cap is costly (`solve._costly_cap`, never without a cap) and says so; `--bn-relu fused` insists."""
    from planner import solve
    from planner.analytic import estimate_profile
    from planner.devices import load_device
    from planner.fuse import bn_relu_candidates, relu_sum_candidates, with_bn_relu, with_relu_sums
    from planner.heuristic import Work

    g = build_training(import_onnx(_block_model(tmp_path, _two_residual_blocks), batch=2, training=True))
    profile = estimate_profile(g, load_device("h100"))
    fused = with_bn_relu(g, bn_relu_candidates(g))
    sums = relu_sum_candidates(fused)
    summed = with_relu_sums(fused, sums)
    anonymous = profile.model_copy(update={"graph_sha256": None})
    assert sums and not solve._costly_cap(summed, anonymous, profile.device.memory_bytes, solve.Options(), Work())
    monkeypatch.setattr(solve, "_costly_cap", lambda *args: True)
    plan = solve.solve_plan(g, profile, profile.device.memory_bytes, solve.Options(time_limit_s=0))
    assert plan.relu_sums_fused == [] and "leave their gradients' sums apart" in plan.totals.status
    plan = solve.solve_plan(g, profile, profile.device.memory_bytes, solve.Options(time_limit_s=0, bn_relu="fused"))
    assert plan.relu_sums_fused == sums
