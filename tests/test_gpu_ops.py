"""Every GPU op kind (runner/ops) against the float64 reference, forward and backward, fp32 and fp16: each
candidate runs eagerly and again from a captured CUDA graph, on NHWC tensors, in place where the IR updates in
place; then the profiler measures a small training graph with every kind measured. Skipped without a GPU."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner.onnx_import import import_onnx
from planner.ops import KINDS
from planner.reference import KERNELS as REFERENCE
from planner.training import build_training
from runner.graphs import capture
from runner.measure import TOLERANCE  # relative L2 error: the bar the profiler admits a candidate by (fp32: TF32)

X = (2, 6, 9, 7)  # N, C, H, W all different, so a layout mix-up shows
POOL_X = (2, 6, 10, 8)


def _pool(kind, kernel, strides, pads, ceil_mode=0, dilations=(1, 1), count_include_pad=0, x=POOL_X):
    attrs = {"kernel": list(kernel), "strides": list(strides), "pads": list(pads), "ceil_mode": ceil_mode}
    if kind == "max":
        attrs["dilations"] = list(dilations)
    else:
        attrs["count_include_pad"] = count_include_pad
    return attrs, x


def _pool_cases():
    geometries = [
        _pool("max", (3, 3), (2, 2), (0, 0, 0, 0), ceil_mode=1),
        _pool("max", (3, 3), (1, 1), (1, 1, 1, 1)),
        _pool("max", (3, 3), (1, 2), (0, 1, 1, 0), dilations=(2, 2)),
        _pool("max", (2, 2), (2, 2), (0, 0, 0, 0), ceil_mode=1, x=(2, 6, 9, 7)),
        _pool("max", (3, 3), (2, 2), (0, 0, 0, 0), ceil_mode=1, x=(2, 16, 11, 9)),  # C allows 16-byte groups
        _pool("max", (3, 3), (1, 1), (1, 1, 1, 1), x=(2, 24, 7, 6)),
        _pool("max", (2, 2), (3, 3), (1, 0, 0, 1), x=(2, 16, 10, 11)),  # rows and columns no window covers
        _pool("avg", (3, 3), (1, 1), (1, 1, 1, 1)),
        _pool("avg", (3, 3), (1, 1), (1, 1, 1, 1), count_include_pad=1),
        _pool("avg", (3, 3), (2, 2), (1, 1, 1, 1), ceil_mode=1, count_include_pad=1, x=(2, 6, 10, 9)),
        _pool("avg", (2, 2), (2, 2), (0, 0, 0, 0)),
        _pool("avg", (3, 3), (1, 1), (1, 1, 1, 1), count_include_pad=1, x=(2, 16, 7, 6)),  # 16-byte groups
        _pool("avg", (2, 2), (2, 2), (0, 0, 0, 0), x=(2, 24, 8, 6)),
        _pool("avg", (3, 3), (2, 2), (1, 0, 0, 1), ceil_mode=1, x=(2, 16, 10, 11)),
        _pool("avg", (5, 3), (2, 1), (2, 1, 2, 1), count_include_pad=1, x=(2, 16, 9, 7)),  # the general window
    ]
    cases = []
    for attrs, x in geometries:
        kind = "maxpool" if "dilations" in attrs else "avgpool"
        y = REFERENCE[kind]([np.zeros(x)], attrs)[0].shape
        cases.append((kind, attrs, [x]))
        if kind == "maxpool":
            cases.append(("maxpool_bwd", attrs, [x, y]))
        else:
            cases.append(("avgpool_bwd", {**attrs, "x_shape": list(x)}, [y]))
    return cases


BN = {"epsilon": 1e-3, "momentum": 0.9}
LRN = {"size": 5, "alpha": 0.5, "beta": 0.75, "bias": 2.0}
CONV = {"strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "groups": 1}
CONV_S2 = {"strides": [2, 2], "pads": [0, 1, 1, 0], "dilations": [1, 1], "groups": 1}
STEM7 = {"strides": [2, 2], "pads": [3, 3, 3, 3], "dilations": [1, 1], "groups": 1}
STEM3 = {"strides": [2, 2], "pads": [0, 0, 0, 0], "dilations": [1, 1], "groups": 1}
# convs the stem kernels take in fp16 (runner/ops/stem.py): 7x7/s2 and 3x3/s2 on 3 channels, 8 channels at
# stride 1, inference's conv_fused with and without bias and ReLU, asymmetric pads; widths that leave a partial
# 16-pixel chunk. The last three stay out of CASES: one of cuDNN's fp32 weight-gradient engines returns a wrong
# result for the two cases before the last (the profiler drops such candidates), and cuDNN's engines have not been
# checked on the last.
STEM_CASES = [
    ("conv", STEM7, [(2, 3, 20, 18), (16, 3, 7, 7)]),
    ("conv_bwd_filter", {**STEM7, "w_shape": [16, 3, 7, 7]}, [(2, 3, 20, 18), (2, 16, 10, 9)]),
    ("conv", STEM3, [(2, 3, 17, 37), (32, 3, 3, 3)]),
    ("conv_bwd_filter", {**STEM3, "w_shape": [32, 3, 3, 3]}, [(2, 3, 17, 37), (2, 32, 8, 18)]),
    ("conv", CONV, [(2, 8, 9, 7), (16, 8, 3, 3)]),
    ("conv_bwd_filter", {**CONV, "w_shape": [16, 8, 3, 3]}, [(2, 8, 9, 7), (2, 16, 9, 7)]),
    ("conv_fused", {**STEM7, "residual": False, "relu": True}, [(2, 3, 20, 18), (16, 3, 7, 7), (16,)]),
    ("conv_fused", {**STEM3, "residual": False, "relu": True}, [(2, 3, 17, 37), (32, 3, 3, 3)]),
    ("conv_fused", {**CONV, "residual": False, "relu": False}, [(2, 8, 9, 7), (16, 8, 3, 3), (16,)]),
    # 64 output channels: on Hopper also the wgmma forward (runner/ops/stem_wgmma.py)
    ("conv", STEM7, [(2, 3, 20, 24), (64, 3, 7, 7)]),
    ("conv_fused", {**STEM7, "residual": False, "relu": True}, [(2, 3, 20, 24), (64, 3, 7, 7), (64,)]),
    ("conv", CONV_S2, [(3, 3, 9, 8), (64, 3, 3, 3)]),
    ("conv", CONV_S2, [(3, 3, 9, 7), (16, 3, 3, 3)]),
    ("conv_bwd_filter", {**CONV_S2, "w_shape": [16, 3, 3, 3]}, [(3, 3, 9, 7), (3, 16, 4, 3)]),
    ("conv_bwd_filter", {**STEM7, "w_shape": [64, 3, 7, 7]}, [(2, 3, 20, 24), (2, 64, 10, 12)]),
]

# (kind, attrs, input shapes); input dtypes from DTYPES_IN ("x" is the case's activation dtype)
CASES = [
    ("relu", {}, [X]), ("relu_bwd", {}, [X, X]),
    ("clip", {"min": 0.0, "max": 0.5}, [X]), ("clip_bwd", {"min": 0.0, "max": 0.5}, [X, X]),
    ("clip", {"min": float("-inf"), "max": 0.3}, [(4, 50)]),
    ("sigmoid", {}, [X]), ("sigmoid_bwd", {}, [X, X]),
    ("add", {}, [X, X]), ("add", {}, [X, (1, 6, 1, 1)]), ("add", {}, [(6, 1, 1), X]), ("add", {}, [(3, 5), (5,)]),
    ("mul", {}, [X, (2, 6, 1, 1)]), ("mul", {}, [X, X]), ("mul", {}, [(4, 1), (1, 7)]),
    ("sum", {}, [X, X, X]), ("sum", {}, [X] * 11), ("sum", {}, [(3, 5, 7)] * 9),
    ("relu_bwd", {}, [(2, 16, 5, 4)] * 2), ("add", {}, [(105,), (105,)]),
    ("relu_bwd", {}, [X, X, X]), ("relu_bwd", {}, [(2, 16, 5, 4)] * 8),
    ("dropout", {"ratio": 0.3, "seed": 5}, [X]), ("dropout", {"ratio": 0.5, "seed": 7}, [(4, 50)]),
    ("dropout_bwd", {"ratio": 0.3}, [X, X]),
    ("concat", {"axis": 1}, [(2, 3, 5, 4), (2, 5, 5, 4), (2, 8, 5, 4)]),
    ("concat", {"axis": 1}, [(2, 8, 5, 4), (2, 16, 5, 4)]),
    ("concat", {"axis": 1}, [(3, 4), (3, 6)]), ("concat", {"axis": 2}, [(2, 3, 5, 4), (2, 3, 2, 4)]),
    ("slice", {"axis": 1, "start": 3, "end": 8}, [(2, 16, 5, 4)]),
    ("slice", {"axis": 1, "start": 8, "end": 16}, [(2, 16, 5, 4)]),
    ("bias_grad", {"axis": 1}, [X]), ("bias_grad", {"axis": 1}, [(4, 10)]),
    ("bias_grad", {"axis": 1}, [(8, 32, 28, 28)]),
    ("reduce_to_shape", {"shape": [1, 6, 1, 1]}, [X]), ("reduce_to_shape", {"shape": [6, 1, 1]}, [X]),
    ("reduce_to_shape", {"shape": [2, 6, 1, 1]}, [X]), ("reduce_to_shape", {"shape": [1]}, [X]),
    ("reduce_to_shape", {"shape": [1, 6, 9, 1]}, [X]), ("reduce_to_shape", {"shape": [10]}, [(4, 10)]),
    ("reduce_to_shape", {"shape": [4, 1]}, [(4, 10)]),
    *_pool_cases(),
    ("globalavgpool", {}, [X]), ("globalavgpool", {}, [(2, 16, 56, 56)]), ("globalavgpool", {}, [(8, 64, 7, 7)]),
    ("globalavgpool_bwd", {"x_shape": list(X)}, [(2, 6, 1, 1)]),
    ("gemm", {"transA": 0, "transB": 1, "alpha": 1.0, "beta": 1.0}, [(4, 20), (10, 20), (10,)]),
    ("gemm", {"transA": 1, "transB": 0, "alpha": 0.5, "beta": 2.0}, [(20, 4), (20, 10), (4, 10)]),
    ("gemm", {"transA": 0, "transB": 0, "alpha": 1.0, "beta": 0.0}, [(32, 1024), (1024, 100)]),
    ("gemm", {"transA": 1, "transB": 1, "alpha": 1.0, "beta": 1.0}, [(20, 4), (10, 20), (1, 10)]),
    ("matmul", {}, [(4, 20), (20, 10)]), ("matmul", {}, [(3, 4, 5), (5, 6)]), ("matmul", {}, [(4, 5), (3, 5, 6)]),
    ("matmul", {}, [(3, 4, 5), (3, 5, 6)]),
    ("softmax", {"axis": 1}, [(4, 37)]), ("softmax", {"axis": 3}, [(2, 6, 5, 9)]), ("softmax", {"axis": 1}, [(3, 1000)]),
    ("softmax_bwd", {"axis": 1}, [(4, 37), (4, 37)]), ("softmax_bwd", {"axis": 3}, [(2, 6, 5, 9), (2, 6, 5, 9)]),
    ("softmax_xent", {}, [(8, 1000), (8,)]), ("softmax_xent", {}, [(5, 10), (5,)]),
    ("softmax_xent_bwd", {}, [(8, 1000), (8,)]),
    ("batchnorm", {**BN, "training": False}, [X, (6,), (6,), (6,), (6,)]),
    ("batchnorm", {**BN, "training": True}, [X, (6,), (6,), (6,), (6,)]),
    ("batchnorm", {**BN, "training": True}, [(8, 32, 14, 14), (32,), (32,), (32,), (32,)]),
    ("batchnorm", {**BN, "training": True}, [(16, 6), (6,), (6,), (6,), (6,)]),
    ("bn_apply", {"relu": 1, "residual": 0}, [X, (6,), (6,), (6,), (6,)]),
    ("bn_apply", {"relu": 1, "residual": 1}, [(8, 32, 14, 14), (32,), (32,), (32,), (32,), (8, 32, 14, 14)]),
    ("bn_apply", {"relu": 0, "residual": 1}, [X, (6,), (6,), (6,), (6,), X]),
    ("batchnorm_bwd", {"epsilon": 1e-3}, [X, X, (6,), (6,), (6,)]),
    ("batchnorm_bwd", {"epsilon": 1e-3}, [(8, 32, 14, 14), (8, 32, 14, 14), (32,), (32,), (32,)]),
    ("batchnorm", {**BN, "training": True, "relu": 1}, [X, (6,), (6,), (6,), (6,)]),
    ("batchnorm", {**BN, "training": True, "relu": 1}, [(8, 32, 14, 14), (32,), (32,), (32,), (32,)]),
    ("batchnorm", {**BN, "training": True, "relu": 1, "residual": 1}, [X, (6,), (6,), (6,), (6,), X]),
    ("batchnorm", {**BN, "training": True, "relu": 1, "residual": 1},
     [(8, 32, 14, 14), (32,), (32,), (32,), (32,), (8, 32, 14, 14)]),
    ("batchnorm_bwd", {"epsilon": 1e-3, "relu": 1}, [X, X, (6,), (6,), (6,), (6,)]),
    ("batchnorm_bwd", {"epsilon": 1e-3, "relu": 1}, [(8, 32, 14, 14), (8, 32, 14, 14), (32,), (32,), (32,), (32,)]),
    ("lrn", LRN, [X]), ("lrn", {**LRN, "size": 4}, [X]), ("lrn_bwd", LRN, [X, X]), ("lrn_bwd", {**LRN, "size": 4}, [X, X]),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "grad_unscale": 1 / 1024}, [(6, 4, 3, 3)] * 3),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}, [(6,)] * 3),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "grad_unscale": 1 / 1024}, [(128, 64, 3, 3)] * 3 + [(128,)] * 6),
    ("conv", CONV, [(2, 4, 9, 7), (6, 4, 3, 3)]), ("conv", CONV_S2, [(2, 4, 9, 7), (6, 4, 3, 3), (6,)]),
    ("conv_fused", {**CONV, "residual": False, "relu": True}, [(2, 4, 9, 7), (6, 4, 3, 3), (6,)]),
    ("conv_fused", {**CONV, "residual": True, "relu": True}, [(2, 4, 9, 7), (6, 4, 3, 3), (6,), (2, 6, 9, 7)]),
    ("conv_fused", {**CONV_S2, "residual": True, "relu": False}, [(2, 4, 9, 7), (6, 4, 3, 3), (2, 6, 4, 3)]),
    ("conv_fused", {**CONV, "residual": True, "relu": True}, [(4, 32, 14, 14), (64, 32, 3, 3), (64,), (4, 64, 14, 14)]),
    ("conv_bwd_data", {**CONV, "x_shape": [2, 4, 9, 7]}, [(2, 6, 9, 7), (6, 4, 3, 3)]),
    ("conv_bwd_filter", {**CONV, "w_shape": [6, 4, 3, 3]}, [(2, 4, 9, 7), (2, 6, 9, 7)]),
    *STEM_CASES[:-3],
]
DTYPES_IN = {"batchnorm": "xffff", "bn_apply": "xffffx", "batchnorm_bwd": "xxffff", "softmax_xent": "xi", "softmax_xent_bwd": "fi",
             "dropout_bwd": "xu"}
DTYPES_OUT = {"batchnorm": "xffff", "batchnorm_bwd": "xff", "softmax_xent": "ff", "dropout": "xu"}
IN_PLACE = {"batchnorm": {1: 3, 2: 4}}
CODES = {"f": "fp32", "i": "int64", "u": "uint8"}


def _dtypes(codes: str, n: int, dtype: str) -> list[str]:
    return [dtype if c == "x" else CODES[c] for c in (codes or "").ljust(n, "x")]


@pytest.fixture(scope="module")
def gpu_ctx():
    from runner.gpu import gpu

    g = gpu()
    handle = g.cudnn.create_handle()
    stream = g.cp.cuda.Stream(non_blocking=True)
    g.cudnn.set_stream(handle=handle, stream=stream.ptr)
    return g.cp, handle, stream


def _check(outputs, want, specs, dtype, what):
    from runner.gpu import gpu

    cp = gpu().cp
    assert len(outputs) == len(want)
    for j, (arr, expected, s) in enumerate(zip(outputs, want, specs)):
        got = cp.asnumpy(arr)
        assert got.shape == np.shape(expected), (what, j)
        if s.dtype in ("int64", "uint8"):
            assert np.array_equal(got, expected), (what, j)
            continue
        expected = np.asarray(expected, dtype=np.float64)
        err = np.linalg.norm(got.astype(np.float64) - expected) / max(np.linalg.norm(expected), 1e-30)
        assert err <= TOLERANCE[dtype], (what, j, err)


def run_case(ctx, kind, attrs, shapes, dtype, in_place=None, prefix=""):
    """Every candidate of one op (or those named `prefix`...) against the reference: eagerly, then replayed from a
    captured CUDA graph."""
    from runner.ops import OPS, host_inputs
    from runner.ops.common import device_empty, spec, to_device

    cp, handle, stream = ctx
    in_specs = [spec(s, d) for s, d in zip(shapes, _dtypes(DTYPES_IN.get(kind), len(shapes), dtype))]
    if kind == "sgd":  # (w, dw, v) per weight: v fp32, and a BatchNormalization's (1-D) weights fp32 in every graph
        in_specs = [spec(shapes[i], "fp32" if i % 3 == 2 or len(shapes[i]) == 1 else dtype) for i in range(len(shapes))]
    hosts = host_inputs(kind, in_specs, np.random.default_rng(0))
    want = REFERENCE[kind]([h.astype(np.float64) if h.dtype.kind == "f" else h for h in hosts], attrs)
    out_dtypes = _dtypes(DTYPES_OUT.get(kind) if attrs.get("training", True) else None, len(want), in_specs[0].dtype)
    out_specs = [spec(np.shape(w), d) for w, d in zip(want, out_dtypes)]
    updates = IN_PLACE.get(kind, {})
    if kind == "sgd":  # w' and v' of each (w, dw, v), in place
        updates = {j: j // 2 * 3 + j % 2 * 2 for j in range(len(want))}
        out_specs = [in_specs[i] for i in updates.values()]
    in_place = updates if in_place is None else in_place
    if kind == "batchnorm" and not attrs["training"]:
        in_place = {}
    op = OPS[kind](attrs, in_specs, out_specs, handle)
    assert op.candidates, op.unsupported
    for index, (name, workspace_bytes) in enumerate(op.candidates):
        if not name.startswith(prefix):
            continue
        inputs = [to_device(h, s) for h, s in zip(hosts, in_specs)]
        outputs = [inputs[in_place[j]] if j in in_place else device_empty(s) for j, s in enumerate(out_specs)]
        workspace = cp.full(max(workspace_bytes, 1), 0xFF, cp.uint8)  # garbage: kernels must not expect zeros

        def reset():
            for j, s in enumerate(out_specs):
                if j not in in_place:
                    outputs[j].fill(np.nan if s.dtype.startswith("fp") else 2)
            for j in in_place.values():
                inputs[j][...] = cp.asarray(hosts[j])

        with stream:
            reset()
            op.launch(index, inputs, outputs, workspace)
            stream.synchronize()
            _check(outputs, want, out_specs, dtype, (kind, name, "eager"))
            reset()
            graph = capture(stream, lambda: op.launch(index, inputs, outputs, workspace))  # as the runner
            reset()
            graph.launch(stream)
            stream.synchronize()
            _check(outputs, want, out_specs, dtype, (kind, name, "graph"))
    return op


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("kind,attrs,shapes", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_op_matches_reference(gpu_ctx, kind, attrs, shapes, dtype):
    run_case(gpu_ctx, kind, attrs, shapes, dtype)


def test_every_kind_is_covered():
    """Runs without a GPU: the registry imports without CuPy and these cases exercise all of it."""
    from runner.ops import OPS

    assert {c[0] for c in CASES} == set(OPS) == {k for k, v in KINDS.items() if not v.view}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sgd", "batchnorm"])
def test_in_place_kinds_also_write_separate_outputs(gpu_ctx, kind):
    case = next(c for c in CASES if c[0] == kind and c[1].get("training", True))
    run_case(gpu_ctx, *case, "fp32", in_place={})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("channels", [16, 6], ids=["words", "elements"])
@pytest.mark.parametrize("strides,pads", [((1, 1), (1, 1, 1, 1)), ((2, 2), (0, 0, 0, 0))], ids=["s1", "s2"])
def test_max_pooling_ties_and_nans_follow_the_reference(gpu_ctx, dtype, channels, strides, pads):
    """After a ReLU most windows hold several equal maxima: the gradient goes to the first (the reference's argmax),
    never to two, in every gradient candidate; a NaN in a window makes its maximum NaN, as numpy's max. Both on 16-byte
    words and one element a thread."""
    from runner.ops import OPS
    from runner.ops.common import device_empty, spec, to_device

    cp, handle, stream = gpu_ctx
    attrs = {"kernel": [3, 3], "strides": list(strides), "pads": list(pads), "ceil_mode": 1, "dilations": [1, 1]}
    rng = np.random.default_rng(3)
    x = np.maximum(rng.standard_normal((2, channels, 9, 8)), 0).round(1)  # zeros and repeated values
    y_shape = REFERENCE["maxpool"]([x], attrs)[0].shape
    dy = rng.standard_normal(y_shape).round(2)
    x_spec, y_spec = spec(x.shape, dtype), spec(y_shape, dtype)
    xs = x.astype(np.float16 if dtype == "fp16" else np.float32).astype(np.float64)
    nan_x = xs.copy()
    nan_x[0, :, 4, 3] = np.nan
    for values, check_bwd in ((xs, True), (nan_x, False)):
        fwd = OPS["maxpool"](attrs, [x_spec], [y_spec], handle)
        bwd = OPS["maxpool_bwd"](attrs, [x_spec, y_spec], [x_spec], handle)
        xd, dyd = to_device(values, x_spec), to_device(dy, y_spec)
        y, dx = device_empty(y_spec), device_empty(x_spec)
        with stream:
            fwd.launch(0, [xd], [y], None)
            stream.synchronize()
        want_y = REFERENCE["maxpool"]([values], attrs)[0]
        got_y = cp.asnumpy(y).astype(np.float64)
        assert np.array_equal(np.isnan(got_y), np.isnan(want_y)) and np.any(np.isnan(want_y)) != check_bwd
        assert np.array_equal(got_y[~np.isnan(want_y)], want_y[~np.isnan(want_y)])
        if not check_bwd:
            continue
        dy_rounded = cp.asnumpy(dyd).astype(np.float64)
        want_dx = REFERENCE["maxpool_bwd"]([values, dy_rounded], attrs)[0]
        assert len(bwd.candidates) == 2  # these windows also offer the 2x2 blocks
        for index, (_, workspace_bytes) in enumerate(bwd.candidates):
            with stream:
                bwd.launch(index, [xd, dyd], [dx], cp.full(workspace_bytes, 0xFF, cp.uint8))
                stream.synchronize()
            np.testing.assert_allclose(cp.asnumpy(dx).astype(np.float64), want_dx, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,attrs,shapes", STEM_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(STEM_CASES)])
def test_few_channel_convs_offer_the_stem_kernels(gpu_ctx, kind, attrs, shapes):
    """In fp16 a conv, conv_fused or weight gradient with at most 8 input channels offers the stem kernels beside
    cuDNN's engines, and they match the reference (cuDNN's are checked in test_op_matches_reference); in fp32 it offers
    cuDNN's alone."""
    from runner.ops import OPS
    from runner.ops.common import spec

    names = [n for n, _ in run_case(gpu_ctx, kind, attrs, shapes, "fp16", prefix="stem:").candidates]
    assert any(n.startswith("stem:") for n in names) and any(not n.startswith("stem:") for n in names), names
    out = REFERENCE[kind]([np.zeros(s) for s in shapes], attrs)[0].shape
    op = OPS[kind](attrs, [spec(s, "fp32") for s in shapes], [spec(out, "fp32")], gpu_ctx[1])
    assert not any(n.startswith("stem:") for n, _ in op.candidates), op.candidates


@pytest.mark.gpu
def test_the_wgmma_stem_runs_rows_across_images(gpu_ctx):
    """runner/ops/stem_wgmma.py: each CTA takes a contiguous run of output rows and reuses the input rows they
    share; with few CTAs the runs cross images. Forward and weight gradient equal the mma.sync stem kernels' for
    one CTA, a few and one a row, and an sm_90 device's stem conv and weight gradient list the wgmma candidates."""
    from runner.ops import OPS
    from runner.ops.common import spec
    from runner.ops.stem import StemConv, stem_shape
    from runner.ops.stem_wgmma import StemWgmma

    cp, handle, stream = gpu_ctx
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma needs compute capability 9.0")
    attrs = {**STEM7, "residual": False, "relu": True}
    x_dims, w_dims, y_dims = [3, 3, 40, 48], [64, 3, 7, 7], [3, 64, 20, 24]
    names = [n for n, _ in OPS["conv_fused"](attrs, [spec(x_dims, "fp16"), spec(w_dims, "fp16"), spec([64], "fp16")],
                                             [spec(y_dims, "fp16")], handle).candidates]
    names += [n for n, _ in OPS["conv_bwd_filter"]({**STEM7, "w_shape": w_dims}, [spec(x_dims, "fp16"),
                                                   spec(y_dims, "fp16")], [spec(w_dims, "fp16")], handle).candidates]
    assert {"stem:wgmma", "stem:wgmma:1x"} <= set(names), names
    rng = np.random.default_rng(0)

    def nhwc(dims, scale):
        n, c, h, w = dims
        return cp.asarray((rng.standard_normal((n, h, w, c)) * scale).astype(np.float16)).transpose(0, 3, 1, 2)

    x, w, y, dy, dw = nhwc(x_dims, 1.0), nhwc(w_dims, 0.2), nhwc(y_dims, 1.0), nhwc(y_dims, 0.5), nhwc(w_dims, 1.0)
    bias = cp.asarray(rng.standard_normal(64).astype(np.float16))
    shape = stem_shape(attrs, x_dims, w_dims, y_dims)
    mma_wgrad = StemConv("conv_bwd_filter", attrs, x_dims, w_dims, y_dims, "fp16")
    with stream:
        StemConv("conv", attrs, x_dims, w_dims, y_dims, "fp16", bias=True, relu=True).launch(0, x, w, y, None, bias)
        mma_wgrad.launch(0, x, dy, dw, cp.empty(mma_wgrad.workspace_bytes(0), cp.uint8))
        stream.synchronize()
    want_y, want_dw = cp.asnumpy(y).astype(np.float64), cp.asnumpy(dw).astype(np.float64)
    forward = StemWgmma("conv", shape, True, True)
    backward = StemWgmma("conv_bwd_filter", shape, sum_partials=mma_wgrad.sum_partials)
    assert forward.units == backward.units == 60
    for grid in (1, 7, 60):
        forward.grids = backward.grids = [grid]
        with stream:
            y.fill(np.nan)
            dw.fill(np.nan)
            forward.launch(0, x, w, y, None, bias)
            backward.launch(0, x, dy, dw, cp.empty(grid * backward.partial_bytes, cp.uint8))
            stream.synchronize()
        np.testing.assert_allclose(cp.asnumpy(y).astype(np.float64), want_y, rtol=2e-3, atol=2e-3, err_msg=str(grid))
        np.testing.assert_allclose(cp.asnumpy(dw).astype(np.float64), want_dw, rtol=2e-3, atol=5e-3, err_msg=str(grid))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_batchnorm_offers_cupy_and_cudnn(gpu_ctx, dtype):
    for kind, attrs, shapes in [c for c in CASES if c[0] in ("batchnorm", "batchnorm_bwd") and c[2][0][1] == 32]:
        op = run_case(gpu_ctx, kind, attrs, shapes, dtype)
        names = [n for n, _ in op.candidates]
        assert names[0] == "cupy_reduce" and any(n.startswith("cudnn:") for n in names), (names, op.unsupported)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fused_conv_offers_fused_and_unfused_engines(gpu_ctx, dtype):
    """At a layer-like shape cuDNN fuses bias, residual and ReLU into the conv: both kinds of candidate exist
    (run_case checks each against the reference)."""
    case = next(c for c in CASES if c[0] == "conv_fused" and c[2][0][1] == 32)
    op = run_case(gpu_ctx, *case, dtype)
    prefixes = {n.split(":")[0] for n, _ in op.candidates}
    assert prefixes == {"fused", "unfused"}, op.unsupported


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fused_conv_writes_its_channel_slice_of_a_concat(gpu_ctx, dtype):
    """conv_fused with concat_channels (concat_view): every candidate, fused and unfused, writes exactly its
    channels [16, 80) of a 96-channel NHWC buffer, eagerly and from a captured graph, and nothing else."""
    from runner.ops import OPS, host_inputs
    from runner.ops.common import NUMPY_DTYPE, spec, to_device

    cp, handle, stream = gpu_ctx
    kind, attrs, shapes = next(c for c in CASES if c[0] == "conv_fused" and c[2][0][1] == 32)
    attrs = {**attrs, "residual": False, "concat_channels": 96}
    shapes = shapes[:3]
    in_specs = [spec(s, dtype) for s in shapes]
    hosts = host_inputs(kind, in_specs, np.random.default_rng(0))
    want = REFERENCE[kind]([h.astype(np.float64) for h in hosts], attrs)[0]
    n, c, h, w = want.shape
    op = OPS[kind](attrs, in_specs, [spec(want.shape, dtype, 96)], handle)
    assert {name.split(":")[0] for name, _ in op.candidates} == {"fused", "unfused"}, op.unsupported
    inputs = [to_device(x, s) for x, s in zip(hosts, in_specs)]
    whole = cp.empty((n, h, w, 96), NUMPY_DTYPE[dtype])
    y = whole[..., 16:16 + c].transpose(0, 3, 1, 2)
    for index, (name, workspace_bytes) in enumerate(op.candidates):
        workspace = cp.full(max(workspace_bytes, 1), 0xFF, cp.uint8)
        with stream:
            whole.fill(7)
            op.launch(index, inputs, [y], workspace)
            stream.synchronize()
            _check([y], [want], [spec(want.shape, dtype)], dtype, (name, "eager"))
            graph = capture(stream, lambda: op.launch(index, inputs, [y], workspace))
            whole.fill(7)
            graph.launch(stream)
            stream.synchronize()
        _check([y], [want], [spec(want.shape, dtype)], dtype, (name, "graph"))
        outside = cp.concatenate([whole[..., :16].ravel(), whole[..., 16 + c:].ravel()])
        assert bool((outside == 7).all()), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("channels,offset,pitch", [(64, 16, 96), (20, 8, 36)], ids=["vector", "scalar"])
def test_relu_and_its_backward_work_in_place_on_channel_slices(gpu_ctx, dtype, channels, offset, pitch):
    """Training concat_views: relu with concat_channels writes exactly its channel slice of a wider NHWC buffer,
    and relu_bwd reads y and dy from such slices (16-byte vectors where channels and pitch allow, else one
    element a thread), eagerly and from a captured graph."""
    from runner.ops import OPS
    from runner.ops.common import NUMPY_DTYPE, device_empty, spec, to_device

    cp, handle, stream = gpu_ctx
    rng = np.random.default_rng(0)
    shape, attrs = (2, channels, 5, 3), {"concat_channels": pitch}
    packed, wide = spec(shape, dtype), spec(shape, dtype, pitch)

    def sliced(host=None, fill=7.0):
        whole = cp.full((shape[0], shape[2], shape[3], pitch), fill, NUMPY_DTYPE[dtype])
        view = whole[..., offset:offset + channels].transpose(0, 3, 1, 2)
        if host is not None:
            view[...] = cp.asarray(host.astype(NUMPY_DTYPE[dtype]))
        return whole, view

    x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
    y_want = REFERENCE["relu"]([x.astype(NUMPY_DTYPE[dtype]).astype(np.float64)], {})[0]
    whole_y, y = sliced()
    whole_yin, y_in = sliced(y_want)
    _, dy_in = sliced(dy)
    dx_want = REFERENCE["relu_bwd"]([y_want, dy.astype(NUMPY_DTYPE[dtype]).astype(np.float64)], {})[0]
    dx = device_empty(packed)
    cases = [(OPS["relu"](attrs, [packed], [wide], handle), [to_device(x, packed)], y, y_want),
             (OPS["relu_bwd"](attrs, [wide, wide], [packed], handle), [y_in, dy_in], dx, dx_want)]
    for op, inputs, out, want in cases:
        with stream:
            for mode in ("eager", "graph"):
                whole_y.fill(7)
                dx.fill(np.nan)
                if mode == "eager":
                    op.launch(0, inputs, [out], None)
                else:
                    capture(stream, lambda: op.launch(0, inputs, [out], None)).launch(stream)
                stream.synchronize()
                _check([out], [want], [packed], dtype, (mode, channels))
    outside = cp.concatenate([whole_y[..., :offset].ravel(), whole_y[..., offset + channels:].ravel()])
    assert bool((outside == 7).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("channels,offset,pitch", [(64, 16, 96), (20, 8, 36)], ids=["vector", "scalar"])
def test_batchnorm_running_its_relu_works_on_channel_slices(gpu_ctx, dtype, channels, offset, pitch):
    """Training concat_views of fused BatchNormalizations (fuse.with_bn_relu): every candidate of the forward
    writes exactly its channel slice of a wider NHWC buffer, and of the backward reads dr from such a slice,
    eagerly and from a captured graph."""
    from runner.ops import OPS, host_inputs
    from runner.ops.common import NUMPY_DTYPE, device_empty, spec, to_device

    cp, handle, stream = gpu_ctx
    shape, chan = (4, channels, 5, 3), (channels,)
    attrs = {**BN, "training": True, "relu": 1, "concat_channels": pitch}
    packed, wide, stats = spec(shape, dtype), spec(shape, dtype, pitch), spec(chan, "fp32")
    hosts = host_inputs("batchnorm", [packed] + [stats] * 4, np.random.default_rng(0))
    fwd_want = REFERENCE["batchnorm"]([h.astype(np.float64) for h in hosts], attrs)
    dr = np.random.default_rng(1).standard_normal(shape)
    bwd_in = [hosts[0].astype(np.float64), dr.astype(NUMPY_DTYPE[dtype]).astype(np.float64), hosts[1],
              fwd_want[3].astype(np.float32), fwd_want[4].astype(np.float32), hosts[2]]
    bwd_want = REFERENCE["batchnorm_bwd"]([v.astype(np.float64) for v in bwd_in], {"epsilon": 1e-3, "relu": 1})

    def sliced(host=None):
        whole = cp.full((shape[0], shape[2], shape[3], pitch), 7.0, NUMPY_DTYPE[dtype])
        view = whole[..., offset:offset + channels].transpose(0, 3, 1, 2)
        if host is not None:
            view[...] = cp.asarray(host.astype(NUMPY_DTYPE[dtype]))
        return whole, view

    whole_y, y = sliced()
    fwd = OPS["batchnorm"](attrs, [packed] + [stats] * 4, [wide] + [stats] * 4, handle)
    bwd = OPS["batchnorm_bwd"]({"epsilon": 1e-3, "relu": 1, "concat_channels": pitch},
                               [packed, wide, stats, stats, stats, stats], [packed, stats, stats], handle)
    bwd_inputs = [to_device(bwd_in[0], packed), sliced(dr)[1], *(to_device(v, stats) for v in bwd_in[2:])]
    for op, name in ((fwd, "batchnorm"), (bwd, "batchnorm_bwd")):
        for index, (candidate, workspace_bytes) in enumerate(op.candidates):
            workspace = cp.full(max(workspace_bytes, 1), 0xFF, cp.uint8)
            for mode in ("eager", "graph"):
                if name == "batchnorm":
                    inputs = [to_device(h, s) for h, s in zip(hosts, [packed] + [stats] * 4)]
                    outputs, want, specs = [y] + [device_empty(stats) for _ in range(4)], fwd_want, [packed] + [stats] * 4
                    whole_y.fill(7)
                else:
                    inputs, want, specs = bwd_inputs, bwd_want, [packed, stats, stats]
                    outputs = [device_empty(s) for s in specs]
                with stream:
                    if mode == "eager":
                        op.launch(index, inputs, outputs, workspace)
                    else:
                        capture(stream, lambda: op.launch(index, inputs, outputs, workspace)).launch(stream)
                    stream.synchronize()
                _check(outputs[:1] + outputs[-2:] if name == "batchnorm" else outputs,
                       want[:1] + want[-2:] if name == "batchnorm" else want,
                       specs[:1] + specs[-2:] if name == "batchnorm" else specs, dtype, (candidate, mode))
                if name == "batchnorm":
                    outside = cp.concatenate([whole_y[..., :offset].ravel(), whole_y[..., offset + channels:].ravel()])
                    assert bool((outside == 7).all()), (candidate, mode)


def _small_training_model(tmp_path: Path) -> Path:
    """Conv/BN/ReLU stem, ceil-mode max pool, a residual Add, a ReLU6 branch, LRN, average pool, an SE-style
    Sigmoid/Mul, channel Concat, global pool, Flatten, Dropout and a biased Gemm."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def param(name, shape):
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
        return name

    def conv_bn(name, x, cin, cout, k, act="Relu"):
        nodes.append(helper.make_node("Conv", [x, param(name + ".w", (cout, cin, k, k))], [name], pads=[k // 2] * 4))
        bn = [param(f"{name}.{p}", (cout,)) for p in ("s", "b", "m", "v")]
        nodes.append(helper.make_node("BatchNormalization", [name] + bn, [name + ".bn"], training_mode=1))
        if act == "Clip":
            nodes.append(helper.make_node("Clip", [name + ".bn", "zero", "six"], [name + ".a"]))
        else:
            nodes.append(helper.make_node(act, [name + ".bn"], [name + ".a"]))
        return name + ".a"

    inits += [numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
              numpy_helper.from_array(np.array(6.0, np.float32), "six")]
    stem = conv_bn("stem", "x", 3, 16, 3)
    nodes.append(helper.make_node("MaxPool", [stem], ["pool"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1))
    res = conv_bn("res", "pool", 16, 16, 3)
    nodes.append(helper.make_node("Add", ["pool", res], ["sum"]))
    six = conv_bn("r6", "sum", 16, 8, 1, act="Clip")
    nodes.append(helper.make_node("LRN", ["sum"], ["lrn"], size=5, alpha=1e-2, beta=0.75, bias=1.0))
    nodes.append(helper.make_node("AveragePool", ["lrn"], ["avg"], kernel_shape=[3, 3], pads=[1] * 4))
    nodes.append(helper.make_node("GlobalAveragePool", ["avg"], ["se.g"]))
    nodes.append(helper.make_node("Conv", ["se.g", param("se.w", (16, 16, 1, 1)), param("se.b", (16,))], ["se.c"]))
    nodes.append(helper.make_node("Sigmoid", ["se.c"], ["se.s"]))
    nodes.append(helper.make_node("Mul", ["avg", "se.s"], ["se"]))
    nodes.append(helper.make_node("Concat", [six, "se"], ["cat"], axis=1))
    nodes.append(helper.make_node("GlobalAveragePool", ["cat"], ["gap"]))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"]))
    nodes.append(helper.make_node("Dropout", ["flat", "ratio", "train"], ["drop", "mask"]))
    inits += [numpy_helper.from_array(np.array(0.2, np.float32), "ratio"),
              numpy_helper.from_array(np.array(True), "train")]
    nodes.append(helper.make_node("Gemm", ["drop", param("fc.w", (10, 24)), param("fc.b", (10,))], ["y"], transB=1))
    g = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    path = tmp_path / "small.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_profiler_measures_every_kind_of_a_training_graph(tmp_path, dtype):
    from runner.profiler import measure_ops, probe_device

    graph = build_training(import_onnx(_small_training_model(tmp_path), batch=4, dtype=dtype, training=True))
    nodes = [n for n in {n.signature: n for n in graph.nodes}.values() if not KINDS[n.kind].view]
    kinds = {n.kind for n in nodes}
    assert {"batchnorm", "batchnorm_bwd", "maxpool_bwd", "avgpool_bwd", "lrn_bwd", "clip_bwd", "sigmoid_bwd",
            "dropout", "dropout_bwd", "slice", "sum", "reduce_to_shape", "bias_grad", "gemm", "sgd",
            "softmax_xent", "softmax_xent_bwd", "globalavgpool_bwd", "mul", "add"} <= kinds
    profiles = list(measure_ops(graph, nodes, probe_device()))
    assert len(profiles) == len(nodes)
    for prof in profiles:
        assert not prof.estimated and prof.candidates, (prof.kind, prof.describe, prof.unsupported)
        for c in prof.candidates:
            assert 0.5 < c.time_us < 50_000 and c.kernels, (prof.kind, c.name)
