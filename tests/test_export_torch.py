"""Standalone PyTorch export: the module runs without planner and matches the NumPy reference."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from planner.export_torch import torch_module_source
from planner.onnx_import import import_onnx
from planner.training import LOSS, build_training

MODELS = Path(__file__).parent / "models"


def _load(source: str, tmp_path: Path):
    path = tmp_path / "exported.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("exported", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_source_is_standalone_and_documents_limits():
    source = torch_module_source(import_onnx(MODELS / "googlenet.onnx", batch=1))
    compile(source, "exported.py", "exec")
    assert "import planner" not in source and "from planner" not in source
    assert "cannot express" in source and "cuDNN engine" in source


@pytest.mark.parametrize("model", ["googlenet.onnx", "resnet50.train.onnx", "mobilenet_v2.op17.onnx",
                                   "inception_v3.op17.onnx", "squeezenet.op13.onnx"])
def test_inference_matches_reference(tmp_path, model):
    torch = pytest.importorskip("torch")
    reference = pytest.importorskip("planner.reference")
    hw = (96, 96) if model.startswith("inception") else (64, 64)
    g = import_onnx(MODELS / model, batch=2, input_hw=hw)
    values = {**reference.random_parameters(g, seed=0), **reference.random_inputs(g, seed=1)}
    expected = reference.run(g, values)[g.outputs[0]]
    net = _load(torch_module_source(g), tmp_path).PlannedNet(None, device="cpu", dtype=torch.float64,
                                                              values=values)
    with torch.no_grad():
        got = net(torch.from_numpy(values[g.inputs[0]])).numpy()
    assert np.abs(got - expected).max() <= 1e-8 * max(1.0, np.abs(expected).max())


def test_training_step_loss_matches_reference(tmp_path):
    torch = pytest.importorskip("torch")
    reference = pytest.importorskip("planner.reference")
    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=2, training=True, input_hw=(64, 64)))
    values = {**reference.random_parameters(g, seed=0), **reference.random_inputs(g, seed=1)}
    for name, t in g.tensors.items():  # torch.optim.SGD starts its momentum buffers from zero
        if t.role == "optimizer_state" and name in values:
            values[name] = np.zeros_like(values[name])
    out = reference.run(g, values)
    net = _load(torch_module_source(g), tmp_path).PlannedNet(None, device="cpu", dtype=torch.float64,
                                                              values=values)
    loss = net.train_step(torch.from_numpy(values["input"]), torch.from_numpy(values["labels"]))
    assert float(loss) == pytest.approx(float(out[LOSS]), rel=1e-9)
    # the SGD update matches too, for the classifier weight
    fc = next(n for n in g.nodes if n.kind == "sgd" and n.inputs[0].startswith("fc.weight"))
    index = list(net.buffers_).index(fc.inputs[0])
    updated = list(net.buffers_.values())[index].detach().numpy()
    assert np.allclose(updated, out[fc.outputs[0]], rtol=1e-7, atol=1e-10)


def test_a_plans_order_holds_every_forward_node_views_after_their_producer(tmp_path):
    """Plans schedule no views (Flatten); the exported order puts each right after the op that makes its input,
    and the module exported with the plan computes what the reference does."""
    from planner.analytic import estimate_profile
    from planner.devices import load_device
    from planner.export_torch import plan_dict
    from planner.fuse import with_concat_views
    from planner.solve import Options, solve_plan

    g = import_onnx(MODELS / "googlenet.onnx", batch=2, input_hw=(64, 64))
    h100 = load_device("h100")
    plan = solve_plan(g, estimate_profile(g, h100), h100.memory_bytes, Options(time_limit_s=2, workers=2))
    assert plan.concat_views  # the analytic profile prices a strided conv like a packed one: no copy wins
    runs = with_concat_views(g, plan.concat_views)
    exported = plan_dict(runs, plan)
    order = exported["order"]
    assert sorted(order) == sorted(n.name for n in runs.nodes)
    for n in runs.nodes:
        producer = runs.tensors[n.inputs[0]].producer
        if n.kind == "reshape":
            assert order.index(n.name) == order.index(producer) + 1
        assert all(order.index(runs.tensors[t].producer) < order.index(n.name) for t in n.inputs
                   if runs.tensors[t].producer)
        if n.kind == "concat_view":  # a copying torch.cat there: its readers on other streams wait for it
            stream = exported["streams"][n.name]
            for reader in runs.tensors[n.outputs[0]].consumers:
                if exported["streams"][reader] != stream:
                    assert f"view:{n.name}" in exported["waits"][reader]
    torch = pytest.importorskip("torch")
    reference = pytest.importorskip("planner.reference")
    values = {**reference.random_parameters(g, seed=0), **reference.random_inputs(g, seed=1)}
    net = _load(torch_module_source(g, plan), tmp_path).PlannedNet(None, device="cpu", dtype=torch.float64,
                                                                    values=values)
    with torch.no_grad():
        got = net(torch.from_numpy(values[g.inputs[0]])).numpy()
    expected = reference.run(g, values)[g.outputs[0]]
    assert np.abs(got - expected).max() <= 1e-8 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("model,fused,residual", [("googlenet", 57, 0), ("resnet50", 49, 16)])
def test_a_plan_with_fused_batchnorms_exports_the_same_training_step(tmp_path, model, fused, residual):
    """A training plan whose BatchNormalizations run their ReLUs, and ResNet-50's the residual Add before it too
    (fuse.with_bn_relu), exports each as PyTorch's batch_norm, add, relu, and the step computes the reference's
    loss."""
    from planner.analytic import estimate_profile
    from planner.devices import load_device
    from planner.solve import Options, solve_plan

    g = build_training(import_onnx(MODELS / f"{model}.train.onnx", batch=2, training=True, input_hw=(64, 64)))
    h100 = load_device("h100")
    plan = solve_plan(g, estimate_profile(g, h100), h100.memory_bytes, Options(time_limit_s=0))
    assert len(plan.bn_relu_fused) == fused
    source = torch_module_source(g, plan)
    assert source.count("'relu': 1") == fused and source.count("'residual': 1") == residual
    torch = pytest.importorskip("torch")
    reference = pytest.importorskip("planner.reference")
    values = {**reference.random_parameters(g, seed=0), **reference.random_inputs(g, seed=1)}
    for name, t in g.tensors.items():  # torch.optim.SGD starts its momentum buffers from zero
        if t.role == "optimizer_state" and name in values:
            values[name] = np.zeros_like(values[name])
    out = reference.run(g, values)
    net = _load(source, tmp_path).PlannedNet(None, device="cpu", dtype=torch.float64, values=values)
    loss = net.train_step(torch.from_numpy(values["input"]), torch.from_numpy(values["labels"]))
    assert float(loss) == pytest.approx(float(out[LOSS]), rel=1e-9)
