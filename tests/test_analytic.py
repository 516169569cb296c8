"""The analytic profile: coverage of every op kind, roofline invariants, workspace formulas, algorithm rules."""

import json
import math
from pathlib import Path

import pytest

from planner.analytic import (
    LAUNCH_US,
    conv_shape,
    estimate_ops,
    estimate_profile,
    explicit_gemm_workspace_bytes,
    fft_workspace_bytes,
    winograd_workspace_bytes,
)
from planner.devices import BUILTIN, load_device
from planner.files import PlannerError, load_model, save_model
from planner.ir import Graph, Node, Tensor, finalize
from planner.onnx_import import import_onnx
from planner.ops import KINDS, flops
from planner.profile import Profile, describe_op
from planner.training import build_training

MODELS = Path(__file__).parent / "models"
H100 = load_device("h100")


def one_op_graph(kind, in_shapes, out_shapes, attrs=None, dtype="fp32", roles=None):
    """A graph holding a single op, for probing the model with any shape."""
    attrs = attrs or {}
    tensors = {}
    ins = [f"i{j}" for j in range(len(in_shapes))]
    outs = [f"o{j}" for j in range(len(out_shapes))]
    for j, (name, shape) in enumerate(zip(ins, in_shapes)):
        tensors[name] = Tensor(name=name, shape=shape, dtype=dtype, role=(roles or {}).get(j, "activation"))
    for name, shape in zip(outs, out_shapes):
        tensors[name] = Tensor(name=name, shape=shape, dtype=dtype, role="activation")
    node = Node(name="op", kind=kind, inputs=ins, outputs=outs, attrs=attrs, flops=flops(kind, in_shapes, out_shapes, attrs))
    graph = Graph(model_name="probe", source_sha256="0", batch=in_shapes[0][0] if in_shapes[0] else 1, dtype=dtype,
                  training=False, inputs=ins, outputs=outs, nodes=[node], tensors=tensors)
    return finalize(graph)


def conv_graph(kind="conv", n=8, c=64, h=28, w=28, k=64, r=3, s=3, stride=1, pad=None, groups=1, dilation=1, dtype="fp32"):
    pad = (r // 2) if pad is None else pad
    p = (h + 2 * pad - dilation * (r - 1) - 1) // stride + 1
    q = (w + 2 * pad - dilation * (s - 1) - 1) // stride + 1
    x, wt, y = [n, c, h, w], [k, c // groups, r, s], [n, k, p, q]
    attrs = {"strides": [stride, stride], "pads": [pad] * 4, "dilations": [dilation, dilation], "groups": groups}
    ins, outs = {"conv": ([x, wt], [y]), "conv_fused": ([x, wt, [k], y], [y]), "conv_bwd_data": ([y, wt], [x]),
                 "conv_bwd_filter": ([x, y], [wt])}[kind]
    if kind == "conv_fused":
        attrs |= {"residual": True, "relu": True}
    return one_op_graph(kind, ins, outs, attrs, dtype)


def candidates(graph, device=H100):
    (op,) = estimate_ops(graph, device)
    return {c.name.split(":")[-1]: c for c in op.candidates}, op


@pytest.fixture(scope="module")
def training_graphs():
    out = []
    for name in ("googlenet.train.op13.onnx", "mobilenet_v2.train.op13.onnx", "squeezenet.train.op13.onnx"):
        out.append(build_training(import_onnx(MODELS / name, batch=2, training=True)))
    return out


def test_every_node_of_real_models_gets_an_estimate(training_graphs):
    for graph in training_graphs:
        profile = estimate_profile(graph, H100)
        assert profile.estimated and profile.graph_sha256 == graph.graph_sha256
        for node in graph.nodes:
            op = profile.ops[node.signature]
            assert op.candidates and op.kind == node.kind
            for c in op.candidates:
                if KINDS[node.kind].view:
                    assert c.time_us == 0 and c.name == "view"
                else:
                    assert c.time_us >= LAUNCH_US
                    assert 0 < c.sm_fraction <= 1 and 0 <= c.dram_fraction <= 1
                    assert c.kernels and c.kernels[0].blocks_per_sm > 0


ELEMENTWISE_SHAPES = {
    "batchnorm": ([[2, 8, 4, 4], [8], [8], [8], [8]], [[2, 8, 4, 4]]),
    "batchnorm_bwd": ([[2, 8, 4, 4], [2, 8, 4, 4], [8], [8], [8]], [[2, 8, 4, 4], [8], [8]]),
    "softmax_xent": ([[2, 10], [2]], [[], [2, 10]]),
    "softmax_xent_bwd": ([[2, 10], [2]], [[2, 10]]),
    "gemm": ([[2, 16], [10, 16], [10]], [[2, 10]]),
    "matmul": ([[2, 16], [16, 10]], [[2, 10]]),
    "concat": ([[2, 8, 4, 4], [2, 8, 4, 4]], [[2, 16, 4, 4]]),
    "sum": ([[2, 8, 4, 4], [2, 8, 4, 4]], [[2, 8, 4, 4]]),
    "sgd": ([[8, 4], [8, 4], [8, 4]], [[8, 4], [8, 4]]),
    "dropout": ([[2, 16]], [[2, 16], [2, 16]]),
    "reshape": ([[2, 8, 1, 1]], [[2, 8]]),
}
ATTRS = {"lrn": {"size": 5}, "lrn_bwd": {"size": 5}, "maxpool": {"kernel": [3, 3]}, "maxpool_bwd": {"kernel": [3, 3]},
         "avgpool": {"kernel": [3, 3]}, "avgpool_bwd": {"kernel": [3, 3]}, "gemm": {"transB": 1}}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_op_kind_is_covered(kind):
    if kind in ("conv", "conv_fused", "conv_bwd_data", "conv_bwd_filter"):
        graph = conv_graph(kind)
    else:
        ins, outs = ELEMENTWISE_SHAPES.get(kind, ([[2, 8, 4, 4], [2, 8, 4, 4]], [[2, 8, 4, 4]]))
        graph = one_op_graph(kind, ins, outs, ATTRS.get(kind, {}))
    cands, op = candidates(graph)
    assert op.describe.startswith(kind)
    if kind.startswith("conv"):
        assert {"direct", "implicit_gemm", "gemm", "winograd"} <= set(cands)
    elif KINDS[kind].view:
        assert [(c.name, c.time_us) for c in op.candidates] == [("view", 0.0)]
    else:
        assert [c.name for c in op.candidates] == [f"cupy:{kind}"]


def test_fused_conv_costs_its_epilogue_traffic():
    """A conv with a residual read and a ReLU is never cheaper than the bare conv, family by family."""
    bare, _ = candidates(conv_graph("conv", n=32, h=56, w=56))
    fused, op = candidates(conv_graph("conv_fused", n=32, h=56, w=56))
    assert set(fused) == set(bare) and op.describe.endswith("+residual +relu")
    for name in bare:
        assert fused[name].time_us >= bare[name].time_us
        assert fused[name].workspace_bytes == bare[name].workspace_bytes


GROW = {"n": 2, "c": 2, "k": 2, "h": 2, "w": 2}


@pytest.mark.parametrize("kind", ["conv", "conv_bwd_data", "conv_bwd_filter"])
@pytest.mark.parametrize("base", [
    dict(n=1, c=16, h=14, w=14, k=32, r=3, s=3),
    dict(n=8, c=64, h=28, w=28, k=64, r=3, s=3),
    dict(n=4, c=32, h=17, w=17, k=48, r=5, s=5),
    dict(n=2, c=256, h=7, w=7, k=512, r=1, s=1),
    dict(n=16, c=128, h=56, w=56, k=128, r=3, s=3, stride=2),
    dict(n=1, c=32, h=112, w=112, k=32, r=3, s=3, groups=32),
])
def test_more_work_is_never_faster_within_a_family(kind, base):
    """Growing any dimension of a conv (more FLOPs and more bytes) never makes a family's estimate faster."""
    before, op = candidates(conv_graph(kind, **base))
    for dim, factor in GROW.items():
        if dim in ("c", "k") and base.get("groups", 1) > 1:
            continue
        grown = dict(base, **{dim: base[dim] * factor})
        after, op2 = candidates(conv_graph(kind, **grown))
        for family, c in before.items():
            if family in after:
                assert after[family].time_us >= c.time_us * (1 - 1e-12), (family, dim)


def test_bigger_filters_cost_more():
    for family in ("direct", "implicit_gemm", "gemm"):
        small = candidates(conv_graph(r=3, s=3))[0][family]
        big = candidates(conv_graph(r=5, s=5))[0][family]
        assert big.time_us > small.time_us


def test_estimates_respect_the_roofline():
    """No candidate beats peak compute or peak bandwidth (Winograd/FFT do less arithmetic, so only the memory bound)."""
    for kind in ("conv", "conv_bwd_data", "conv_bwd_filter"):
        graph = conv_graph(kind, n=32, c=256, h=28, w=28, k=256)
        node = graph.nodes[0]
        io = sum(graph.tensors[t].bytes for t in node.inputs + node.outputs)
        cands, _ = candidates(graph)
        for name, c in cands.items():
            assert c.time_us * 1e-6 >= io / H100.peak_dram_bytes_per_s
            if name not in ("winograd", "fft"):
                assert c.time_us * 1e-6 >= node.flops / H100.peak_flops_tf32


def test_workspace_formulas():
    graph = conv_graph(n=8, c=64, h=28, w=28, k=128, r=3, s=3)
    cands, _ = candidates(graph)
    assert cands["direct"].workspace_bytes == 0
    assert cands["implicit_gemm"].workspace_bytes == 0
    assert cands["gemm"].workspace_bytes == 8 * 64 * 3 * 3 * 28 * 28 * 4  # the whole batch's im2col matrix
    tiles = 8 * 7 * 7  # 4x4 output tiles of 28x28
    assert cands["winograd"].workspace_bytes == 36 * (tiles * (64 + 128) + 128 * 64) * 4
    cs = conv_shape(graph, graph.nodes[0])
    assert explicit_gemm_workspace_bytes(cs, 2) * 2 == explicit_gemm_workspace_bytes(cs, 4)
    assert winograd_workspace_bytes(cs, 2) * 2 == winograd_workspace_bytes(cs, 4)
    five = conv_graph(n=4, c=32, h=17, w=17, k=48, r=5, s=5)
    fft = candidates(five)[0]["fft"].workspace_bytes
    bins = 21 * (21 // 2 + 1)  # 17 + 2 + 2 = 21 = 3 * 7, already a fast FFT size
    assert fft == bins * (4 * 32 + 48 * 32 + 4 * 48) * 2 * 4
    assert fft_workspace_bytes(conv_shape(five, five.nodes[0]), 4) == fft


@pytest.mark.parametrize("kind", ["conv", "conv_bwd_data", "conv_bwd_filter"])
def test_algorithm_rules(kind):
    def families(**kw):
        cands, op = candidates(conv_graph(kind, **kw))
        return set(cands), {u.name.split(":")[1]: u.reason for u in op.unsupported}

    ok, no = families(r=3, s=3)
    assert "winograd" in ok and "fft" not in ok and "larger than 3" in no["fft"]
    ok, no = families(r=3, s=3, stride=2)
    assert not {"winograd", "fft"} & ok and "stride 1" in no["winograd"] and "stride 1" in no["fft"]
    ok, no = families(r=5, s=5)
    assert "fft" in ok and "winograd" not in ok and "3x3" in no["winograd"]
    ok, no = families(r=7, s=7, stride=2, pad=3)
    assert not {"winograd", "fft"} & ok
    ok, _ = families(r=1, s=1, pad=0)
    assert ok == {"direct", "implicit_gemm", "gemm"}
    ok, no = families(groups=32)
    assert "winograd" not in ok and "groups" in no["winograd"]
    ok, no = families(dilation=2, pad=2)
    assert "winograd" not in ok and "dilation" in no["winograd"]


def test_dtype_picks_the_peak_rate():
    big = dict(n=32, c=256, h=28, w=28, k=256)
    fp32 = candidates(conv_graph(**big))[0]["implicit_gemm"].time_us
    fp16 = candidates(conv_graph(dtype="fp16", **big))[0]["implicit_gemm"].time_us
    assert fp16 < 0.6 * fp32  # tensor-core FP16 is twice TF32
    k40 = load_device("k40")  # no tensor cores: FP16 computes at the FP32 rate, only moves fewer bytes
    k32 = candidates(conv_graph(**big), k40)[0]["implicit_gemm"].time_us
    k16 = candidates(conv_graph(dtype="fp16", **big), k40)[0]["implicit_gemm"].time_us
    assert k16 == pytest.approx(k32, rel=0.05)


def test_small_grids_leave_room_and_tradeoffs_exist(training_graphs):
    tiny, _ = candidates(conv_graph(n=1, c=16, h=7, w=7, k=16))
    assert tiny["implicit_gemm"].sm_fraction < 0.1
    big, _ = candidates(conv_graph(n=32, c=256, h=56, w=56, k=256))
    assert big["implicit_gemm"].sm_fraction == 1.0
    k40 = estimate_profile(build_training(import_onnx(MODELS / "resnet50.train.op13.onnx", batch=8, training=True)),
                           load_device("k40"))
    tradeoffs = [op for op in k40.ops.values()
                 if op.candidates[0].workspace_bytes > min(c.workspace_bytes for c in op.candidates)]
    assert len(tradeoffs) >= 10  # the fastest candidate often needs workspace: a real time-memory choice


def test_profile_round_trip(tmp_path):
    graph = import_onnx(MODELS / "squeezenet.op17.onnx", batch=1)
    profile = estimate_profile(graph, H100)
    save_model(profile, tmp_path / "p.json")
    loaded = load_model(Profile, tmp_path / "p.json", expect_graph_sha256=graph.graph_sha256)
    assert loaded == profile and loaded.estimated
    assert json.loads((tmp_path / "p.json").read_text())["estimated"] is True


def test_devices(tmp_path):
    assert set(BUILTIN) == {"h100", "h200", "a100", "v100", "k40"}
    h100 = load_device("H100")
    assert h100.sm_count == 132 and h100.peak_dram_bytes_per_s == pytest.approx(3.35e12)
    assert "analytic" in h100.fingerprint
    load_device("h100").sm_count = 1
    assert load_device("h100").sm_count == 132  # built-ins are copies
    spec = tmp_path / "d.json"
    spec.write_text(json.dumps({"base": "h100", "name": "H100 NVL", "sm_count": 114}))
    custom = load_device(spec)
    assert custom.sm_count == 114 and custom.peak_flops_fp16 == h100.peak_flops_fp16
    assert custom.fingerprint != h100.fingerprint
    spec.write_text(json.dumps(h100.model_dump()))
    assert load_device(spec) == h100
    with pytest.raises(PlannerError, match="unknown device"):
        load_device("h200x")
    spec.write_text(json.dumps({"name": "x"}))
    with pytest.raises(PlannerError, match="invalid device spec"):
        load_device(spec)
    spec.write_text(json.dumps({"base": "h100", "peak_dram_bytes_per_s": 0}))
    with pytest.raises(PlannerError, match="needs peak"):
        load_device(spec)


def test_h200_is_an_h100_with_faster_memory():
    """Same SMs and peaks, more bandwidth: no conv candidate estimates slower on the H200, and a memory-bound ReLU
    is faster by at most the bandwidth ratio."""
    h200 = load_device("h200")
    conv = conv_graph(n=32, c=256, h=28, w=28, k=256, dtype="fp16")
    on_h100 = {c.name: c.time_us for c in candidates(conv)[1].candidates}
    assert all(c.time_us <= on_h100[c.name] for c in candidates(conv, h200)[1].candidates)
    relu = one_op_graph("relu", [[32, 256, 56, 56]], [[32, 256, 56, 56]], dtype="fp16")
    fast, slow = (min(c.time_us for c in candidates(relu, d)[1].candidates) for d in (h200, H100))
    assert slow * H100.peak_dram_bytes_per_s / h200.peak_dram_bytes_per_s <= fast < 0.9 * slow


def test_describe_conv():
    g = conv_graph("conv_bwd_filter", n=8, c=64, h=56, w=56, k=128, stride=2)
    assert describe_op(g.nodes[0], g) == "conv_bwd_filter 3x3/s2 64->128 56x56 n8"
    assert math.isclose(g.nodes[0].flops, 2 * 8 * 128 * 28 * 28 * 64 * 9)


@pytest.mark.parametrize("device", ["h100", "k40"])
def test_dominating_shapes_are_never_faster_random(device):
    """Random pairs where one conv is at least as big in every dimension: per family, it is never faster."""
    import random

    rng = random.Random(7)
    dev = load_device(device)
    for _ in range(150):
        kind = rng.choice(["conv", "conv_bwd_data", "conv_bwd_filter"])
        r = rng.choice([1, 3, 5])
        small = dict(n=rng.randint(1, 8), c=rng.randint(1, 96), h=rng.randint(r, 40), k=rng.randint(1, 96), r=r, s=r,
                     stride=rng.choice([1, 2]), dtype=rng.choice(["fp32", "fp16"]))
        small["w"] = small["h"]
        big = dict(small)
        for dim in ("n", "c", "h", "k"):
            big[dim] = small[dim] + rng.randint(0, small[dim])
        big["w"] = big["h"]
        a, _ = candidates(conv_graph(kind, **small), dev)
        b, _ = candidates(conv_graph(kind, **big), dev)
        for family in a.keys() & b.keys():
            assert b[family].time_us >= a[family].time_us * (1 - 1e-12), (kind, family, small, big)
