"""The NumPy reference executor against onnx.reference.ReferenceEvaluator, and its gradients against finite
differences, op kind by op kind and on the shipped GoogLeNet and ResNet-50."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from planner import reference
from planner.onnx_import import import_onnx
from planner.reference import KERNELS, dropout_keep, run

MODELS = Path(__file__).parent / "models"
RNG = np.random.default_rng(0)


def _single_op_model(tmp_path, nodes, inits, x_shape, extra_outputs=()):
    graph = helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)]
        + [helper.make_tensor_value_info(o, TensorProto.DOUBLE, None) for o in extra_outputs],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return model, path


def _compare(tmp_path, nodes, init_arrays, x_shape, training=False, outputs=("y",)):
    """Run the same model through ReferenceEvaluator and our importer + executor; compare given outputs."""
    inits = [numpy_helper.from_array(v, k) for k, v in init_arrays.items()]
    model, path = _single_op_model(tmp_path, nodes, inits, x_shape, outputs[1:])
    x = RNG.standard_normal(x_shape)
    expected = ReferenceEvaluator(model).run(list(outputs), {"x": x})
    g = import_onnx(path, batch=x_shape[0], training=training)
    env = run(g, {"x": x, **{k: v.astype(np.float64) for k, v in init_arrays.items()}})
    return [(env[o], e) for o, e in zip(outputs, expected)]


def _close(pairs, rtol=1e-10):
    for got, want in pairs:
        assert got.shape == np.shape(want)
        assert np.allclose(got, want, rtol=rtol, atol=rtol), np.abs(got - want).max()


CONV_CASES = [
    dict(w=(6, 4, 3, 3), attrs=dict(pads=[1, 1, 1, 1])),
    dict(w=(6, 4, 3, 3), attrs=dict(strides=[2, 2], pads=[0, 1, 1, 0])),
    dict(w=(4, 1, 3, 3), attrs=dict(group=4, pads=[1, 1, 1, 1])),  # depthwise
    dict(w=(6, 2, 3, 3), attrs=dict(group=2, dilations=[2, 2], pads=[2, 2, 2, 2])),
    dict(w=(5, 4, 1, 1), attrs=dict(strides=[2, 2]), bias=True),
    dict(w=(6, 4, 3, 3), attrs=dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    dict(w=(6, 4, 7, 7), attrs=dict(pads=[3, 3, 3, 3], strides=[2, 2]), bias=True),
]


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv(tmp_path, case):
    inits = {"w": RNG.standard_normal(case["w"])}
    ins = ["x", "w"]
    if case.get("bias"):
        inits["b"] = RNG.standard_normal(case["w"][0])
        ins.append("b")
    _close(_compare(tmp_path, [helper.make_node("Conv", ins, ["y"], **case["attrs"])], inits, (2, 4, 9, 9)))


@pytest.mark.parametrize("training", [False, True])
def test_batchnorm(tmp_path, training):
    c = 3
    inits = {"s": RNG.uniform(0.5, 1.5, c), "b": RNG.standard_normal(c), "m": RNG.standard_normal(c),
             "v": RNG.uniform(0.5, 1.5, c)}
    outs = ["y", "rm", "rv"] if training else ["y"]
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], outs, epsilon=1e-3, momentum=0.8,
                            training_mode=int(training))
    _close(_compare(tmp_path, [node], inits, (4, c, 5, 5), training=training)[:1])


def test_batchnorm_running_statistics(tmp_path):
    c = 3
    inits = {"s": RNG.uniform(0.5, 1.5, c), "b": RNG.standard_normal(c), "m": RNG.standard_normal(c),
             "v": RNG.uniform(0.5, 1.5, c)}
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], epsilon=1e-3,
                            momentum=0.8, training_mode=1)
    model, _ = _single_op_model(tmp_path, [node], [numpy_helper.from_array(v, k) for k, v in inits.items()],
                                (4, c, 5, 5), ["rm", "rv"])
    x = RNG.standard_normal((4, c, 5, 5))
    y, rm, rv = ReferenceEvaluator(model).run(["y", "rm", "rv"], {"x": x})
    del model.graph.output[1:]
    onnx.save(model, tmp_path / "y_only.onnx")
    g = import_onnx(tmp_path / "y_only.onnx", batch=4, training=True)
    env = run(g, {"x": x, **inits})
    bn = g.nodes[0]
    _close([(env[bn.outputs[0]], y), (env[bn.outputs[1]], rm), (env[bn.outputs[2]], rv)])


def _lrn_spec(x, size, alpha, beta, bias):
    """ONNX LRN written from the spec (onnx.reference's LRN loops over the batch axis instead of channels)."""
    square_sum = np.zeros_like(x)
    for c in range(x.shape[1]):
        lo, hi = max(0, c - (size - 1) // 2), min(x.shape[1], c + -(-(size - 1) // 2) + 1)
        square_sum[:, c] = (x[:, lo:hi] ** 2).sum(axis=1)
    return x / (bias + alpha / size * square_sum) ** beta


@pytest.mark.parametrize("size,alpha,beta,bias", [(5, 1e-2, 0.75, 2.0), (4, 1e-1, 0.5, 1.0)])
def test_lrn(tmp_path, size, alpha, beta, bias):
    node = helper.make_node("LRN", ["x"], ["y"], size=size, alpha=alpha, beta=beta, bias=bias)
    _, path = _single_op_model(tmp_path, [node], [], (2, 6, 3, 3))
    x = RNG.standard_normal((2, 6, 3, 3))
    g = import_onnx(path, batch=2)
    f32 = [float(np.float32(v)) for v in (alpha, beta, bias)]  # ONNX stores float attributes as float32
    _close([(run(g, {"x": x})["y"], _lrn_spec(x, size, *f32))])


POINTWISE = [
    helper.make_node("Relu", ["x"], ["y"]),
    helper.make_node("Sigmoid", ["x"], ["y"]),
    helper.make_node("Clip", ["x", "lo", "hi"], ["y"]),
    helper.make_node("Softmax", ["x"], ["y"], axis=-1),
    helper.make_node("GlobalAveragePool", ["x"], ["y"]),
    helper.make_node("Flatten", ["x"], ["y"], axis=1),
]


@pytest.mark.parametrize("node", POINTWISE, ids=lambda n: n.op_type + str(len(n.attribute)))
def test_pointwise_and_shape_ops(tmp_path, node):
    inits = {"lo": np.array(-0.5), "hi": np.array(0.7)} if node.op_type == "Clip" else {}
    _close(_compare(tmp_path, [node], inits, (2, 6, 5, 5)))


POOLS = [
    ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ("MaxPool", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])),
    ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2], pads=[0, 0, 1, 1], dilations=[2, 2])),
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=1)),
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=0)),
    ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2])),
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
]


@pytest.mark.parametrize("op,attrs", POOLS)
def test_pooling(tmp_path, op, attrs):
    _close(_compare(tmp_path, [helper.make_node(op, ["x"], ["y"], **attrs)], {}, (2, 3, 9, 9)))


def test_binary_concat_gemm_matmul(tmp_path):
    """Add/Mul with broadcasting, Concat, and Gemm/MatMul after a Flatten, in one graph."""
    inits = {"w1": RNG.standard_normal((4, 3, 1, 1)), "w2": RNG.standard_normal((2, 3, 1, 1)),
             "scale": RNG.standard_normal((1, 4, 1, 1)), "fc": RNG.standard_normal((5, 6 * 16)),
             "fb": RNG.standard_normal(5), "mm": RNG.standard_normal((5, 7))}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]), helper.make_node("Conv", ["x", "w1"], ["a2"]),
        helper.make_node("Mul", ["a", "scale"], ["m"]), helper.make_node("Add", ["m", "a2"], ["s"]),
        helper.make_node("Conv", ["x", "w2"], ["b"]),
        helper.make_node("Concat", ["s", "b"], ["c"], axis=1),
        helper.make_node("Flatten", ["c"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fb"], ["g"], transB=1, alpha=0.5, beta=2.0),
        helper.make_node("MatMul", ["g", "mm"], ["y"]),
    ]
    _close(_compare(tmp_path, nodes, inits, (3, 3, 4, 4)))


def test_gemm_transposes_against_numpy():
    a, b, c = RNG.standard_normal((4, 3)), RNG.standard_normal((5, 4)), RNG.standard_normal(5)
    (y,) = KERNELS["gemm"]([a, b, c], dict(transA=1, transB=1, alpha=2.0, beta=0.5))
    assert np.allclose(y, 2.0 * a.T @ b.T + 0.5 * c)


def _oracle_model(path: Path, values: dict, hw: tuple[int, int], batch: int) -> onnx.ModelProto:
    """The graph-only model with every initializer given our values, at our input size.

    onnx.reference's MaxPool gets ceil_mode wrong when pads are present (an 8x8 input, 3x3/1 window, pad 1 gives
    10x10); where ceil_mode and floor mode agree on the output size we hand it floor mode, which it gets right.
    """
    model = onnx.load(path, load_external_data=False)
    for init in model.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(values[init.name].astype(np.float32), init.name))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    for d, v in zip(dims, (batch, 3) + hw):
        d.Clear()
        d.dim_value = v
    model.graph.output[0].type.tensor_type.ClearField("shape")
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in onnx.shape_inference.infer_shapes(model).graph.value_info}
    for node in model.graph.node:
        if node.op_type == "MaxPool" and node.input[0] in shapes:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            size, k, st = shapes[node.input[0]][2], attrs["kernel_shape"][0], attrs.get("strides", [1, 1])[0]
            pads = attrs.get("pads", [0] * 4)
            if (size + pads[0] + pads[2] - k) % st == 0:
                for a in node.attribute:
                    if a.name == "ceil_mode":
                        a.i = 0
    return model


@pytest.mark.parametrize("name,training", [("googlenet.onnx", False), ("resnet50.onnx", False),
                                           ("resnet50.train.onnx", True)])
def test_whole_models_match_onnx_reference(name, training):
    hw, batch = (64, 64), 2
    g = import_onnx(MODELS / name, batch=batch, training=training, input_hw=hw)
    values = {**reference.random_parameters(g, seed=0), **reference.random_inputs(g, seed=1)}
    # the exporter ties equal-valued weights through Identity; tie them in our values too
    for node in onnx.load(MODELS / name, load_external_data=False).graph.node:
        if node.op_type == "Identity" and node.output[0] in values:
            values[node.output[0]] = values.setdefault(node.input[0], values[node.output[0]])
    ours = run(g, values)[g.outputs[0]]
    oracle = _oracle_model(MODELS / name, values, hw, batch)
    (theirs,) = ReferenceEvaluator(oracle).run(None, {"input": values["input"].astype(np.float32)})
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(ours).max()  # the oracle computes in float32


def test_dropout_mask_is_deterministic_and_has_the_right_rate():
    keep = dropout_keep(200_000, 0.3, seed=7)
    assert abs(keep.mean() - 0.7) < 0.005
    assert np.array_equal(keep, dropout_keep(200_000, 0.3, seed=7))
    assert not np.array_equal(keep, dropout_keep(200_000, 0.3, seed=8))


# Backward kernels against central differences of their forward kernels.

def _directional_check(forward, inputs, index, attrs, grad_of_input, dy, eps=1e-6):
    direction = RNG.standard_normal(inputs[index].shape)
    plus = [v.copy() for v in inputs]
    minus = [v.copy() for v in inputs]
    plus[index] += eps * direction
    minus[index] -= eps * direction
    numeric = ((forward(plus, attrs)[0] - forward(minus, attrs)[0]) * dy).sum() / (2 * eps)
    analytic = (grad_of_input * direction).sum()
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (numeric, analytic)


@pytest.mark.parametrize("attrs", [dict(strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], groups=1),
                                   dict(strides=[2, 2], pads=[0, 1, 1, 0], dilations=[1, 1], groups=2),
                                   dict(strides=[1, 2], pads=[2, 2, 2, 2], dilations=[2, 1], groups=4)])
def test_conv_gradients(attrs):
    x, w = RNG.standard_normal((2, 4, 7, 7)), RNG.standard_normal((8, 4 // attrs["groups"], 3, 3))
    (y,) = KERNELS["conv"]([x, w], attrs)
    dy = RNG.standard_normal(y.shape)
    (dx,) = KERNELS["conv_bwd_data"]([dy, w], {**attrs, "x_shape": list(x.shape)})
    (dw,) = KERNELS["conv_bwd_filter"]([x, dy], {**attrs, "w_shape": list(w.shape)})
    _directional_check(KERNELS["conv"], [x, w], 0, attrs, dx, dy)
    _directional_check(KERNELS["conv"], [x, w], 1, attrs, dw, dy)
    (db,) = KERNELS["bias_grad"]([dy], {"axis": 1})
    _directional_check(KERNELS["conv"], [x, w, np.zeros(8)], 2, attrs, db, dy)


POOL_GRADS = [
    ("maxpool", dict(kernel=[3, 3], strides=[2, 2], pads=[0, 0, 0, 0], dilations=[1, 1], ceil_mode=1)),
    ("maxpool", dict(kernel=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], ceil_mode=0)),
    ("avgpool", dict(kernel=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], ceil_mode=0, count_include_pad=0)),
    ("avgpool", dict(kernel=[3, 3], strides=[2, 2], pads=[0, 0, 0, 0], ceil_mode=1, count_include_pad=1)),
]


@pytest.mark.parametrize("kind,attrs", POOL_GRADS)
def test_pool_gradients(kind, attrs):
    x = RNG.standard_normal((2, 3, 8, 8))
    (y,) = KERNELS[kind]([x], attrs)
    dy = RNG.standard_normal(y.shape)
    if kind == "maxpool":
        (dx,) = KERNELS["maxpool_bwd"]([x, dy], attrs)
    else:
        (dx,) = KERNELS["avgpool_bwd"]([dy], {**attrs, "x_shape": list(x.shape)})
    _directional_check(KERNELS[kind], [x], 0, attrs, dx, dy)


@pytest.mark.parametrize("kind,saves_output,attrs", [
    ("relu", True, {}), ("sigmoid", True, {}), ("softmax", True, {"axis": 1}),
    ("clip", False, {"min": -0.3, "max": 0.4}), ("lrn", False, {"size": 3, "alpha": 0.3, "beta": 0.75, "bias": 1.0}),
    ("lrn", False, {"size": 4, "alpha": 0.2, "beta": 0.5, "bias": 2.0}),
])
def test_activation_gradients(kind, saves_output, attrs):
    x = RNG.standard_normal((2, 6, 3, 3))
    (y,) = KERNELS[kind]([x], attrs)
    dy = RNG.standard_normal(y.shape)
    (dx,) = KERNELS[f"{kind}_bwd"]([y if saves_output else x, dy], attrs)
    _directional_check(KERNELS[kind], [x], 0, attrs, dx, dy)


def test_batchnorm_gradients():
    x = RNG.standard_normal((4, 3, 5, 5))
    params = [RNG.uniform(0.5, 1.5, 3), RNG.standard_normal(3), np.zeros(3), np.ones(3)]
    attrs = {"epsilon": 1e-5, "momentum": 0.9, "training": True}
    y, _, _, mean, invstd = KERNELS["batchnorm"]([x, *params], attrs)
    dy = RNG.standard_normal(y.shape)
    dx, dscale, dbias = KERNELS["batchnorm_bwd"]([x, dy, params[0], mean, invstd], {"epsilon": 1e-5})
    for index, grad in ((0, dx), (1, dscale), (2, dbias)):
        _directional_check(KERNELS["batchnorm"], [x, *params], index, attrs, grad, dy)


def test_loss_slice_unbroadcast_and_sgd():
    logits, labels = RNG.standard_normal((4, 7)), RNG.integers(0, 7, 4)
    loss, probs = KERNELS["softmax_xent"]([logits, labels], {})
    (dlogits,) = KERNELS["softmax_xent_bwd"]([probs, labels], {})
    _directional_check(lambda ins, a: KERNELS["softmax_xent"]([ins[0], labels], a), [logits], 0, {}, dlogits,
                       np.array(1.0))
    dy = RNG.standard_normal((2, 5, 3, 3))
    (part,) = KERNELS["slice"]([dy], {"axis": 1, "start": 1, "end": 4})
    assert np.array_equal(part, dy[:, 1:4])
    (reduced,) = KERNELS["reduce_to_shape"]([dy], {"shape": [1, 5, 1, 1]})
    assert np.allclose(reduced, dy.sum(axis=(0, 2, 3), keepdims=True))
    w, dw, v, b, db, vb = (RNG.standard_normal(3) for _ in range(6))
    w2, v2, b2, vb2 = KERNELS["sgd"]([w, dw, v, b, db, vb], {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01})
    assert np.allclose(v2, 0.9 * v + dw + 0.01 * w) and np.allclose(w2, w - 0.1 * v2)
    assert np.allclose(vb2, 0.9 * vb + db + 0.01 * b) and np.allclose(b2, b - 0.1 * vb2)
