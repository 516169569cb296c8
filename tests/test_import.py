"""ONNX import: every shipped torchvision export, shapes, folding, attribute normalisation, clear errors."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner.files import PlannerError
from planner.ir import Graph
from planner.onnx_import import UnsupportedOps, import_onnx

MODELS = Path(__file__).parent / "models"
ALL_MODELS = sorted(p.name for p in MODELS.glob("*.onnx"))
CONVS = {"conv", "conv_fused"}
CNNS = {"googlenet", "inception_v3", "resnet50", "resnext50", "densenet121", "mobilenet_v2", "squeezenet"}


def test_every_required_architecture_is_shipped_in_both_modes_and_opsets():
    stems = {name.split(".")[0] for name in ALL_MODELS}
    assert CNNS <= stems
    for cnn in CNNS - {"googlenet", "resnet50"}:
        for suffix in (".op13.onnx", ".op17.onnx", ".train.op13.onnx", ".train.op17.onnx"):
            assert (MODELS / f"{cnn}{suffix}").exists()


@pytest.mark.parametrize("name", ALL_MODELS)
@pytest.mark.parametrize("training", [False, True])
def test_shipped_models_import(name, training):
    g = import_onnx(MODELS / name, batch=4, training=training)
    assert g.nodes and g.outputs
    logits = g.tensors[g.outputs[0]]
    assert logits.shape == [4, 1000]
    assert g.tensors[g.inputs[0]].shape[0] == 4
    kinds = {n.kind for n in g.nodes}
    assert kinds & CONVS
    # folded and dropped: nothing shape-computing or Identity survives
    assert kinds <= {"conv", "conv_fused", "batchnorm", "relu", "clip", "maxpool", "avgpool", "globalavgpool", "concat",
                     "concat_view", "add",
                     "gemm", "reshape", "dropout"}
    with_dropout = ("googlenet", "inception_v3", "mobilenet_v2", "squeezenet")
    assert ("dropout" in kinds) == (training and ".train" in name and name.startswith(with_dropout))
    if "batchnorm" in kinds:
        assert all(n.attrs["training"] == training for n in g.nodes if n.kind == "batchnorm")
    for n in g.nodes:
        assert n.signature and n.flops >= 0
        for t in n.inputs + n.outputs:
            assert all(d > 0 for d in g.tensors[t].shape)


def test_batch_sets_every_activation_and_keeps_weights():
    g1 = import_onnx(MODELS / "googlenet.onnx", batch=1)
    g32 = import_onnx(MODELS / "googlenet.onnx", batch=32)
    act = [t for t in g1.tensors if g1.tensors[t].role == "activation"]
    for t in act:
        assert g32.tensors[t].shape == [32] + g1.tensors[t].shape[1:]
    w = [t for t in g1.tensors if g1.tensors[t].role == "weight"]
    assert all(g32.tensors[t].shape == g1.tensors[t].shape for t in w)
    assert g1.graph_sha256 != g32.graph_sha256


def test_googlenet_shapes_and_weight_count():
    train = import_onnx(MODELS / "googlenet.train.onnx", batch=2, training=True)
    assert sum(t.numel for t in train.tensors.values() if t.role == "weight") == 6_624_904  # torchvision's count
    g = import_onnx(MODELS / "googlenet.onnx", batch=2)
    params = sum(t.numel for t in g.tensors.values() if t.role == "weight")
    bn_channels = sum(g.tensors[n.outputs[0]].shape[1] for n in g.nodes if n.kind in CONVS)
    assert params == 6_624_904 - bn_channels  # BN folded: one bias per channel instead of scale and shift
    concat_outs = [g.tensors[n.outputs[0]].shape for n in g.nodes if n.kind == "concat"]
    assert concat_outs[0] == [2, 256, 28, 28] and concat_outs[-1] == [2, 1024, 7, 7]


def test_googlenet_concats_can_be_written_in_place():
    """Every inception block's four branches end in a conv_fused that can write its channel slice of the
    Concat's output: as a concat_view the Concat is a view, its inputs take no memory of their own, and every
    reader of the Concat wait for all four convs. Importing alone changes nothing (solve decides)."""
    from planner.analytic import estimate_profile
    from planner.devices import load_device
    from planner.fuse import concat_view_candidates, with_concat_views
    from planner.problem import build_problem

    copying = import_onnx(MODELS / "googlenet.onnx", batch=2)
    names = concat_view_candidates(copying)
    g = with_concat_views(copying, names)
    assert len(names) == 9 and all(copying.node_by_name[n].kind == "concat" for n in names)
    views = [n for n in g.nodes if n.kind == "concat_view"]
    assert [n.name for n in views] == names and not any(n.kind == "concat" for n in g.nodes)
    for n in views:
        y = g.tensors[n.outputs[0]]
        offsets = [g.tensors[x].channel_offset for x in n.inputs]
        assert offsets == [0, *np.cumsum([g.tensors[x].shape[1] for x in n.inputs])[:-1]]
        assert all(g.storage_of(x) == n.outputs[0] for x in n.inputs)
        assert all(g.node_by_name[g.tensors[x].producer].attrs["concat_channels"] == y.shape[1] for x in n.inputs)
    stored = lambda graph: sum(t.bytes for t in graph.tensors.values() if t.alias_of is None)  # noqa: E731
    assert stored(copying) - stored(g) == sum(g.tensors[x].bytes for n in views for x in n.inputs)
    p = build_problem(g, estimate_profile(g, load_device("h100")))
    index = p.op_index
    writers = sorted(index[g.tensors[x].producer] for x in views[0].inputs)
    use = next(t for t in p.tensors if t.name == views[0].outputs[0])
    assert use.writers == writers and use.producer == writers[-1]
    for reader in g.tensors[views[0].outputs[0]].consumers:
        assert set(writers) <= set(p.ops[index[reader]].preds)
    with pytest.raises(PlannerError, match="cannot be written in place"):
        with_concat_views(import_onnx(MODELS / "resnet50.onnx", batch=2), names[:1])


def test_inference_fuses_conv_residual_relu():
    """Every ReLU of torchvision's GoogLeNet/ResNet-50 follows a Conv (or a Conv's residual Add): all fused."""
    g = import_onnx(MODELS / "resnet50.onnx", batch=2)
    fused = [n for n in g.nodes if n.kind == "conv_fused"]
    assert {n.kind for n in g.nodes}.isdisjoint({"conv", "relu", "add"})
    assert sum(n.attrs["residual"] for n in fused) == 16 and sum(n.attrs["relu"] for n in fused) == 49
    for n in fused:
        assert len(n.inputs) == 3 + n.attrs["residual"]  # x, w, folded-BN bias, residual
        if n.attrs["residual"]:
            z = g.tensors[n.inputs[-1]]
            assert z.shape == g.tensors[n.outputs[0]].shape and g.node_by_name[z.producer].name != n.name
    unfused = import_onnx(MODELS / "resnet50.onnx", batch=2, fuse=False)
    assert sum(n.flops for n in g.nodes) == sum(n.flops for n in unfused.nodes)
    assert len(unfused.nodes) - len(g.nodes) == 16 + 49


def test_fused_graph_computes_what_the_unfused_one_does(tmp_path):
    """conv -> add -> relu and a second conv feeding the add: the reference gives the same output either way."""
    from planner.reference import run

    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((4, 3, 3, 3)), rng.standard_normal((4, 3, 1, 1))
    b1, b2 = rng.standard_normal(4), rng.standard_normal(4)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w2", "b2"], ["c2"]),
             helper.make_node("Add", ["c1", "c2"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in
             (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2))]
    path = _save(tmp_path, nodes, inits)
    fused, plain = import_onnx(path, batch=2), import_onnx(path, batch=2, fuse=False)
    assert [n.kind for n in fused.nodes] == ["conv_fused", "conv_fused"]
    assert [n.attrs["residual"] for n in fused.nodes] == [False, True]
    x = rng.standard_normal((2, 3, 8, 8))
    values = {"w1": w1, "w2": w2, "b1": b1, "b2": b2}
    got = run(fused, {"x": x, **values})["y"]
    want = run(plain, {"x": x, **values})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert (want == 0).any() and (want > 0).any()


def test_fp16_halves_activation_and_weight_bytes_but_not_bn_params():
    g32 = import_onnx(MODELS / "resnet50.train.onnx", batch=2, dtype="fp32", training=True)
    g16 = import_onnx(MODELS / "resnet50.train.onnx", batch=2, dtype="fp16", training=True)
    conv_w = next(n.inputs[1] for n in g16.nodes if n.kind in CONVS)
    assert g16.tensors[conv_w].bytes * 2 == g32.tensors[conv_w].bytes
    bn = next(n for n in g16.nodes if n.kind == "batchnorm")
    assert g16.tensors[bn.inputs[1]].dtype == "fp32"


def test_identical_layers_share_a_signature():
    g = import_onnx(MODELS / "resnet50.onnx", batch=8)
    sigs = [n.signature for n in g.nodes if n.kind in CONVS]
    assert len(set(sigs)) < len(sigs)  # the repeated bottleneck blocks
    g2 = import_onnx(MODELS / "resnext50.op17.onnx", batch=8)
    assert {n.signature for n in g.nodes if n.kind in CONVS} != {n.signature for n in g2.nodes if n.kind in CONVS}


def test_training_mode_bn_and_dropout():
    g = import_onnx(MODELS / "googlenet.train.onnx", batch=2, training=True)
    bn = next(n for n in g.nodes if n.kind == "batchnorm")
    assert len(bn.outputs) == 5
    assert g.tensors[bn.outputs[1]].alias_of == bn.inputs[3]  # running mean updated in place
    drop = next(n for n in g.nodes if n.kind == "dropout")
    assert drop.attrs["ratio"] == pytest.approx(0.2)
    assert g.tensors[drop.outputs[1]].dtype == "uint8"
    # the same file imported for inference: no dropout, BN uses running statistics
    g_inf = import_onnx(MODELS / "googlenet.train.onnx", batch=2, training=False)
    assert "dropout" not in {n.kind for n in g_inf.nodes}
    assert not any(n.attrs["training"] for n in g_inf.nodes if n.kind == "batchnorm")


def test_exporter_deduplicated_weights_are_untied():
    g = import_onnx(MODELS / "resnet50.onnx", batch=1)
    weights = [n.inputs[1] for n in g.nodes if n.kind in CONVS]
    assert len(set(weights)) == len(weights)


def test_mobilenet_relu6_constants_folded():
    g = import_onnx(MODELS / "mobilenet_v2.op17.onnx", batch=1)
    clips = [n for n in g.nodes if n.kind == "clip"]
    assert clips and all(n.attrs == {"min": 0.0, "max": 6.0} for n in clips)
    assert all(len(n.inputs) == 1 for n in clips)
    groups = {n.attrs["groups"] for n in g.nodes if n.kind in CONVS}
    assert max(groups) > 1  # depthwise convolutions


def _save(tmp_path, nodes, inits, inp_shape=("N", 3, 8, 8), out="y", opset=17, extra_outputs=()):
    graph = helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(inp_shape))],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)] + list(extra_outputs),
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return path


def test_auto_pad_and_shape_subgraph_folding(tmp_path):
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], auto_pad="SAME_UPPER", strides=[2, 2], name="conv"),
        helper.make_node("Shape", ["c"], ["s"]),
        helper.make_node("Constant", [], ["i0"], value=numpy_helper.from_array(np.array(0, np.int64))),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Constant", [], ["m1"], value=numpy_helper.from_array(np.array([-1], np.int64))),
        helper.make_node("Unsqueeze", ["n", "zero"], ["n1"]),
        helper.make_node("Concat", ["n1", "m1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["c", "shape"], ["y"], name="flat"),
    ]
    zero = numpy_helper.from_array(np.array([0], np.int64), "zero")
    g = import_onnx(_save(tmp_path, nodes, [w, zero]), batch=3)
    conv = next(n for n in g.nodes if n.kind in CONVS)
    assert conv.attrs["pads"] == [0, 0, 1, 1]  # SAME_UPPER puts the odd pad at the end
    assert g.tensors["c"].shape == [3, 4, 4, 4]
    assert [n.kind for n in g.nodes] == ["conv", "reshape"]
    assert g.tensors["y"].shape == [3, 64] and g.tensors["y"].alias_of == "c"


def test_identity_and_noop_reshape_dropped(tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Identity", ["r"], ["i"]),
        helper.make_node("Flatten", ["i"], ["f"], axis=0),
        helper.make_node("Reshape", ["f", "shape"], ["y"]),
    ]
    shape = numpy_helper.from_array(np.array([2, 3, 8, 8], np.int64), "shape")
    g = import_onnx(_save(tmp_path, nodes, [shape]), batch=2)
    assert [n.kind for n in g.nodes] == ["relu", "reshape", "reshape"]
    nodes[3] = helper.make_node("Relu", ["i"], ["y"])
    g = import_onnx(_save(tmp_path, nodes[:2] + [nodes[3]], []), batch=2)
    assert [n.kind for n in g.nodes] == ["relu", "relu"]
    assert g.nodes[1].inputs == ["r"]


def test_unsupported_ops_are_all_named(tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Tanh", ["a"], ["b"], name="my_tanh"),
        helper.make_node("Erf", ["b"], ["c"], name="my_erf"),
        helper.make_node("Tanh", ["c"], ["y"], name="other_tanh"),
    ]
    with pytest.raises(UnsupportedOps) as e:
        import_onnx(_save(tmp_path, nodes, []), batch=1)
    msg = str(e.value)
    assert "Tanh" in msg and "Erf" in msg and "my_tanh" in msg and "my_erf" in msg
    assert e.value.exit_code == 2 and "\n" not in msg


@pytest.mark.parametrize("content", [b"", b"not an onnx file at all", None])
def test_malformed_files_give_one_line_errors(tmp_path, content):
    path = tmp_path / "bad.onnx"
    if content is None:
        content = (MODELS / "googlenet.onnx").read_bytes()[:5000]
    path.write_bytes(content)
    with pytest.raises(PlannerError) as e:
        import_onnx(path)
    assert "\n" not in str(e.value)


def test_graph_round_trips_through_json(tmp_path):
    from planner.files import load_model, save_model

    g = import_onnx(MODELS / "squeezenet.op17.onnx", batch=2)
    save_model(g, tmp_path / "g.json")
    back = load_model(Graph, tmp_path / "g.json")
    assert back == g and back.graph_sha256 == g.graph_sha256
