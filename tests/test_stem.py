"""Which convolutions the stem kernels take (runner/ops/stem.py), and the shared-memory layout they rely on:
checked without a GPU (tests/test_gpu_ops.py runs the kernels against the reference)."""

import pytest

from runner.ops.common import spec
from runner.ops.conv import offered
from runner.ops.stem import SHARED_LIMIT_BYTES, applies, stem_shape
from runner.ops.stem_wgmma import applies as wgmma_applies
from runner.ops.stem_wgmma import pixels, shared_bytes

S2P3 = {"strides": [2, 2], "pads": [3, 3, 3, 3], "dilations": [1, 1], "groups": 1}
S2P0 = {"strides": [2, 2], "pads": [0, 0, 0, 0], "dilations": [1, 1], "groups": 1}
S1P1 = {"strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "groups": 1}
STEMS = [  # (attrs, x, w, y): GoogLeNet's and ResNet-50's stem, Inception v3's, 8 channels at stride 1, batch 1
    (S2P3, [32, 3, 224, 224], [64, 3, 7, 7], [32, 64, 112, 112]),
    (S2P0, [32, 3, 299, 299], [32, 3, 3, 3], [32, 32, 149, 149]),
    (S1P1, [2, 8, 9, 7], [16, 8, 3, 3], [2, 16, 9, 7]),
    (S2P3, [1, 3, 224, 224], [64, 3, 7, 7], [1, 64, 112, 112]),
]


@pytest.mark.parametrize("attrs,x,w,y", STEMS)
def test_stems_are_taken_forward_and_backward_in_fp16_only(attrs, x, w, y):
    for kind in ("conv", "conv_bwd_filter"):
        assert applies(kind, attrs, x, w, y, "fp16") and not applies(kind, attrs, x, w, y, "fp32")
    assert not applies("conv_bwd_data", attrs, x, w, y, "fp16")


@pytest.mark.parametrize("change", [
    {"x": [2, 16, 9, 7], "w": [16, 16, 3, 3]},  # 16 input channels: cuDNN's own kernels are fast there
    {"w": [24, 8, 3, 3], "y": [2, 24, 9, 7]},  # output channels not a multiple of 16
    {"attrs": {**S1P1, "dilations": [2, 2]}},
    {"attrs": {**S1P1, "groups": 2}},
])
def test_other_convs_are_left_to_cudnn(change):
    case = {"attrs": S1P1, "x": [2, 8, 9, 7], "w": [16, 8, 3, 3], "y": [2, 16, 9, 7], **change}
    assert not applies("conv", case["attrs"], case["x"], case["w"], case["y"], "fp16")


@pytest.mark.parametrize("attrs,x,w,y", STEMS)
def test_patch_rows_are_ldmatrix_operands_inside_the_rows_held(attrs, x, w, y):
    """Every 8x8 matrix row ldmatrix reads starts on a 16-byte boundary, the last 16-pixel chunk's patches stay
    inside the input columns held, and both kernels fit the shared memory a block gets without opting in."""
    shape = stem_shape(attrs, x, w, y)
    m = shape.layout
    assert m["LDM"] % 8 == 0 and m["XS_ROW"] % 8 == 0 and m["KS"] % 8 == 0 and m["JP"] % 16 == 0
    assert m["SW"] * (m["QP"] - 1) + m["JP"] // m["CP"] <= m["WSM"]
    assert m["CP"] >= shape.c and m["JP"] >= shape.s * m["CP"] and m["QP"] >= shape.q
    assert m["GR"] * m["RPW"] >= m["RT"] and m["GR"] * m["WC"] <= m["WARPS"]
    assert max(shape.shared_bytes("conv"), shape.shared_bytes("conv_bwd_filter")) <= SHARED_LIMIT_BYTES


@pytest.mark.parametrize("attrs,x,w,y", STEMS)
def test_inference_stems_fold_bias_and_relu_but_not_a_residual(attrs, x, w, y):
    """conv_fused [x, w, b] -> [y] takes the stem kernels with its bias and ReLU; with a residual, or writing a
    channel slice of a concat, it stays with cuDNN's fused and unfused candidates."""
    ins, out = [spec(x, "fp16"), spec(w, "fp16"), spec([w[0]], "fp16")], spec(y, "fp16")
    fused = {**attrs, "relu": True, "residual": False}
    assert offered("conv_fused", fused, ins, [out]) == (["stem", "stem_wgmma"] if w[0] == 64 else ["stem"])
    assert offered("conv_fused", {**fused, "residual": True}, [*ins, spec(y, "fp16")], [out]) == []
    assert offered("conv_fused", fused, ins, [spec(y, "fp16", row_channels=2 * y[1])]) == []
    assert offered("conv_fused", fused, [spec(s, "fp32") for s in (x, w, [w[0]])], [spec(y, "fp32")]) == []


@pytest.mark.parametrize("attrs,x,w,y", STEMS)
def test_the_wgmma_kernels_take_64_output_channels_with_pixels_16_bytes_apart(attrs, x, w, y):
    """runner/ops/stem_wgmma.py: GoogLeNet's and ResNet-50's stem (64 output channels, 3 channels padded to 4 at
    stride 2: patch rows 16 bytes apart, wgmma's core-matrix row stride), forward with or without a bias and the
    weight gradient; Inception v3's (32 output channels) and the 16-channel case stay with the mma.sync kernels."""
    shape = stem_shape(attrs, x, w, y)
    takes = w[0] == 64
    for kind, bias in (("conv", False), ("conv", True), ("conv_bwd_filter", False)):
        assert wgmma_applies(kind, shape, bias) == takes
    assert not wgmma_applies("conv_bwd_data", shape)
    both = ["stem", "stem_wgmma"] if takes else ["stem"]
    assert offered("conv", attrs, [spec(x, "fp16"), spec(w, "fp16")], [spec(y, "fp16")]) == both
    assert offered("conv_bwd_filter", {**attrs, "w_shape": w}, [spec(x, "fp16"), spec(y, "fp16")],
                   [spec(w, "fp16")]) == both
    if takes:
        m = shape.layout
        assert shape.sw * m["CP"] * 2 == 16 and pixels(shape) >= shape.q and pixels(shape) % 16 == 0
        assert m["SW"] * (pixels(shape) - 1) + m["JP"] // m["CP"] <= m["WSM"]  # every patch read is held
        assert shared_bytes(shape) <= SHARED_LIMIT_BYTES


def test_the_wgmma_forward_needs_a_padding_channel_for_a_bias():
    """With 8 input channels at stride 1 (patch rows 16 bytes apart too) there is no free channel to carry the
    bias as a product, so only the bias-free conv is taken."""
    shape = stem_shape(S1P1, [2, 8, 9, 8], [64, 8, 3, 3], [2, 64, 9, 8])
    assert wgmma_applies("conv", shape) and not wgmma_applies("conv", shape, bias=True)
