"""GPU profiling of a small inception block: every kept candidate was run, checked against the reference and
timed; every plan name can be rebuilt. Skipped without a GPU."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner.onnx_import import import_onnx
from planner.training import build_training

pytestmark = pytest.mark.gpu


def _inception(tmp_path: Path) -> Path:
    """An inception block (1x1, 3x3, 5x5 and pooled branches of Conv+ReLU, channel Concat), global pool and a
    Gemm: [N, 10] logits, so it also trains. He-scaled weights keep activations O(1) for validated runs."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def conv(name, x, cin, cout, k):
        w = rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))
        inits.append(numpy_helper.from_array(w.astype(np.float32), name + ".w"))
        nodes.append(helper.make_node("Conv", [x, name + ".w"], [name], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [name], [name + ".r"]))
        return name + ".r"

    b1 = conv("b1", "x", 64, 32, 1)
    b2 = conv("b2b", conv("b2a", "x", 64, 48, 1), 48, 64, 3)
    b3 = conv("b3b", conv("b3a", "x", 64, 16, 1), 16, 32, 5)
    nodes.append(helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], pads=[1] * 4))
    b4 = conv("b4", "p", 64, 32, 1)
    nodes.append(helper.make_node("Concat", [b1, b2, b3, b4], ["cat"], axis=1))
    inits.append(numpy_helper.from_array(rng.standard_normal((10, 160)).astype(np.float32), "fc"))
    nodes += [helper.make_node("GlobalAveragePool", ["cat"], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
              helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "inception", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64, 28, 28])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    path = tmp_path / "inception.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_inception_block_training_profile(tmp_path, dtype):
    from runner.ops.conv import CONV_KINDS, ConvOp
    from runner.profiler import measure_ops, probe_device

    graph = build_training(import_onnx(_inception(tmp_path), batch=8, dtype=dtype, training=True))
    device = probe_device()
    assert device.sm_count > 0 and device.h2d_bytes_per_s > 1e9
    nodes = list({n.signature: n for n in graph.nodes}.values())
    profiles = {p.signature: p for p in measure_ops(graph, nodes, device)}
    convs = [n for n in nodes if n.kind in CONV_KINDS]
    assert {"conv", "conv_bwd_data", "conv_bwd_filter"} <= {n.kind for n in convs}
    for node in convs:
        prof = profiles[node.signature]
        assert not prof.estimated and len(prof.candidates) >= 2, (node.name, prof.unsupported)
        times = [c.time_us for c in prof.candidates]
        assert all(0.5 < t < 50_000 for t in times)
    # a candidate's name rebuilds exactly that plan
    node = next(n for n in convs if n.kind == "conv")
    x, w, y = (graph.tensors[t].shape for t in (node.inputs[0], node.inputs[1], node.outputs[0]))
    from runner.gpu import gpu

    handle = gpu().cudnn.create_handle()
    names = [c[1] for c in ConvOp("conv", node.attrs, x, w, y, dtype, handle).candidates]
    assert {c.name for c in profiles[node.signature].candidates} <= set(names)


def test_inception_block_inference_profile_fuses(tmp_path):
    """Inference: each Conv+ReLU is one conv_fused op, measured over fused and unfused engines; a kept
    candidate's name rebuilds exactly that candidate."""
    from runner.gpu import gpu
    from runner.ops import build_op
    from runner.profiler import measure_ops, probe_device

    graph = import_onnx(_inception(tmp_path), batch=8, dtype="fp16")
    fused = list({n.signature: n for n in graph.nodes if n.kind == "conv_fused"}.values())
    assert len(fused) == 5 and "relu" not in {n.kind for n in graph.nodes}  # b1 and b4 share a signature
    profiles = list(measure_ops(graph, fused, probe_device()))
    for node, prof in zip(fused, profiles):
        assert not prof.estimated and prof.measured_count >= 2, (node.name, prof.unsupported)
    handle = gpu().cudnn.create_handle()
    for node, prof in zip(fused, profiles):
        for c in prof.candidates[:2]:
            op = build_op(graph, node, handle, algorithm=c.name)
            assert c.name in [name for name, _ in op.candidates]
