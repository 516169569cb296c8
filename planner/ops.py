"""The op kinds of the IR: what each computes, its attributes, and its FLOP count.

One registry, one entry per kind. The ONNX importer maps ONNX ops onto the forward kinds, the training
builder adds the backward and update kinds, and the NumPy reference executor (planner/reference/) and the
GPU runner (runner/) implement them under the same names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class OpKind:
    name: str
    doc: str
    phase: str  # forward | loss | backward | update
    view: bool = False  # output is a view of input 0 (no kernel, no new storage)
    recomputable: bool = False  # may be recomputed in backward instead of kept (the solver weighs the cost)
    flops: Callable[[list[list[int]], list[list[int]], dict], int] = lambda i, o, a: sum(math.prod(s) for s in o)


def _numel(s):
    return math.prod(s)


def _conv_flops(ins, outs, a):
    """2 * N*K*P*Q * (C/g)*R*S: one multiply-add per output element and filter tap."""
    return 2 * _numel(outs[0]) * _numel(ins[1][1:])


def _gemm_flops(ins, outs, a):
    a_shape = ins[0]
    k = a_shape[0] if a.get("transA") else a_shape[-1]
    return 2 * _numel(outs[0]) * k


def _pool_flops(ins, outs, a):
    return _numel(outs[0]) * math.prod(a.get("kernel", [1]))


def pool_out_size(size: int, kernel: int, stride: int, dilation: int, pad_begin: int, pad_end: int,
                  ceil_mode: int) -> int:
    """Output length of a pooling window sweep (ONNX/PyTorch rule: with ceil_mode, a last window that would start
    in the end padding is dropped)."""
    span = (kernel - 1) * dilation + 1
    if not ceil_mode:
        return (size + pad_begin + pad_end - span) // stride + 1
    out = -(-(size + pad_begin + pad_end - span) // stride) + 1
    if (out - 1) * stride >= size + pad_begin:
        out -= 1
    return out


def conv_out_size(size: int, kernel: int, stride: int, dilation: int, pad_begin: int, pad_end: int) -> int:
    return pool_out_size(size, kernel, stride, dilation, pad_begin, pad_end, 0)


KINDS: dict[str, OpKind] = {}


def _k(name, doc, phase="forward", **kw):
    KINDS[name] = OpKind(name, doc, phase, **kw)


# forward
_k("conv", "[x, w, b?] -> [y]: 2-D cross-correlation (ONNX Conv); attrs strides, pads [t,l,b,r], dilations, groups",
   recomputable=True, flops=_conv_flops)
_k("conv_fused", "[x, w, b?, z?] -> [y]: relu?(conv(x, w) + b + z): an inference Conv with the residual Add "
   "(attr residual: z is the last input) and the ReLU (attr relu) that follow it, one op; attr concat_channels "
   "(optional): y is a channel slice of a concat_view's output with that many channels; other attrs as conv",
   flops=lambda i, o, a: _conv_flops(i, o, a) + (a["residual"] + a["relu"]) * _numel(o[0]))
_k("batchnorm", "[x, scale, bias, running_mean, running_var] -> [y] (training=False) or [y, running_mean', running_var', "
   "saved_mean, saved_invstd] (training=True: batch statistics, population variance, ONNX momentum rule, "
   "running stats updated in place); attrs epsilon, momentum, training; attr relu (training, optional): y is the "
   "ReLU of it (fuse.with_bn_relu); attr residual (optional, with relu): [x, scale, bias, running_mean, "
   "running_var, z] and y = relu(batchnorm(x) + z); attr concat_channels (optional, with relu): y is a channel "
   "slice of a concat_view's output with that many channels", recomputable=True,
   flops=lambda i, o, a: (4 + a.get("relu", 0) + a.get("residual", 0)) * _numel(i[0]))
_k("bn_apply", "[x, scale, bias, saved_mean, saved_invstd, z?] -> [y]: relu?(scale * (x - saved_mean) * saved_invstd "
   "+ bias + z): a training BatchNormalization (with the Add (attr residual) and ReLU (attr relu) after it) "
   "recomputed in the backward pass from the statistics its forward pass saved; made by "
   "ir.recompute_nodes, never imported", flops=lambda i, o, a: (4 + a.get("residual", 0) + a.get("relu", 0)) * _numel(o[0]))
_k("relu", "[x] -> [y]: max(x, 0); attr concat_channels (optional): y is a channel slice of a concat_view's output "
   "with that many channels", recomputable=True)
_k("clip", "[x] -> [y]: min(max(x, min), max) (ReLU6); attrs min, max", recomputable=True)
_k("sigmoid", "[x] -> [y]: 1 / (1 + exp(-x))", recomputable=True)
_k("add", "[a, b] -> [y]: a + b with numpy broadcasting", recomputable=True)
_k("mul", "[a, b] -> [y]: a * b with numpy broadcasting", recomputable=True)
_k("sum", "[g1, ..., gn] -> [g]: sum of same-shape tensors (gradient accumulation)", phase="backward")
_k("maxpool", "[x] -> [y]: max pooling; attrs kernel, strides, pads, dilations, ceil_mode", recomputable=True, flops=_pool_flops)
_k("avgpool", "[x] -> [y]: average pooling; attrs kernel, strides, pads, ceil_mode, count_include_pad", recomputable=True,
   flops=_pool_flops)
_k("globalavgpool", "[x] -> [y]: mean over H and W, keeping dims", recomputable=True, flops=lambda i, o, a: _numel(i[0]))
_k("concat", "[x1, ..., xn] -> [y]: concatenation along attr axis", recomputable=True)
_k("concat_view", "[x1, ..., xn] -> [y]: a channel Concat (NCHW axis 1) whose producers wrote each x_i in place as "
   "channels of y (x_i alias_of y, with channel_offset): no kernel; made by fuse.with_concat_views, never imported",
   view=True, flops=lambda i, o, a: 0)
_k("gemm", "[A, B, C?] -> [Y]: alpha * A' B' + beta * C (C broadcast); attrs transA, transB, alpha, beta", flops=_gemm_flops)
_k("matmul", "[A, B] -> [Y]: numpy matmul", flops=_gemm_flops)
_k("reshape", "[x] -> [y]: the same data seen with attr shape (Flatten, Reshape)", view=True, flops=lambda i, o, a: 0)
_k("dropout", "[x] -> [y, mask]: y = x * mask / (1 - ratio); mask (uint8) = dropout_keep(numel, ratio, seed); attrs ratio, seed", recomputable=False)
_k("softmax", "[x] -> [y]: softmax along attr axis (the last)", recomputable=True, flops=lambda i, o, a: 5 * _numel(i[0]))
_k("lrn", "[x] -> [y]: ONNX LRN across channels; attrs size, alpha, beta, bias", recomputable=True,
   flops=lambda i, o, a: (a["size"] + 4) * _numel(i[0]))
# loss
_k("softmax_xent", "[logits, labels] -> [loss, probs]: mean over the batch of -log softmax(logits)[label]; loss is fp32 of shape []",
   phase="loss", flops=lambda i, o, a: 6 * _numel(i[0]))
# backward
_k("softmax_xent_bwd", "[probs, labels] -> [dlogits]: (probs - onehot(labels)) * loss_scale / N", phase="backward")
_k("conv_bwd_data", "[dy, w] -> [dx]: data gradient of conv (the conv's attrs plus x_shape)", phase="backward",
   flops=lambda i, o, a: 2 * _numel(i[0]) * _numel(i[1][1:]))
_k("conv_bwd_filter", "[x, dy] -> [dw]: weight gradient of conv (the conv's attrs plus w_shape)", phase="backward",
   flops=lambda i, o, a: 2 * _numel(i[1]) * _numel(o[0][1:]))
_k("bias_grad", "[dy] -> [db]: sum of dy over every axis but attr axis (bias gradient of conv and gemm)", phase="backward", flops=lambda i, o, a: _numel(i[0]))
_k("reduce_to_shape", "[dy] -> [dx]: sum of dy over broadcast axes down to attr shape (gradient of a broadcast operand)", phase="backward",
   flops=lambda i, o, a: _numel(i[0]))
_k("batchnorm_bwd", "[x, dy, scale, saved_mean, saved_invstd] -> [dx, dscale, dbias]: backward through batch "
   "statistics; with attr relu, [x, dr, scale, saved_mean, saved_invstd, bias]: dy = dr * (scale * (x - saved_mean) * "
   "saved_invstd + bias > 0), the gradient through the ReLU the forward ran (fuse.with_bn_relu); attr "
   "concat_channels (optional, with relu): dr is a channel slice of a concat_view's gradient", phase="backward",
   flops=lambda i, o, a: (8 + a.get("relu", 0)) * _numel(i[0]))
_k("relu_bwd", "[y, dy, dy2?, ...] -> [dx]: (dy + dy2 + ...) * (y > 0) (more than one dy, up to 7: the gradient "
   "sum before it fused, fuse.with_relu_sums); attr concat_channels (optional): y and dy are channel slices of a "
   "concat_view's output and of its gradient, with that many channels", phase="backward")
_k("clip_bwd", "[x, dy] -> [dx]: dy * (min < x < max); attrs min, max", phase="backward")
_k("sigmoid_bwd", "[y, dy] -> [dx]: dy * y * (1 - y)", phase="backward")
_k("maxpool_bwd", "[x, dy] -> [dx]: routes each dy to the first maximum of its window of x; attrs as maxpool", phase="backward",
   flops=lambda i, o, a: _numel(i[1]) * math.prod(a["kernel"]))
_k("avgpool_bwd", "[dy] -> [dx]: spreads dy over each window as avgpool weighted it; attrs as avgpool plus x_shape", phase="backward",
   flops=lambda i, o, a: _numel(i[0]) * math.prod(a["kernel"]))
_k("globalavgpool_bwd", "[dy] -> [dx]: broadcast(dy) / (H*W); attr x_shape", phase="backward", flops=lambda i, o, a: _numel(o[0]))
_k("slice", "[dy] -> [dx]: slice [start, end) of dy along attr axis (gradient of concat)", phase="backward",
   flops=lambda i, o, a: _numel(o[0]))
_k("slice_view", "[dy] -> [dx]: a slice's channels [start, end) of dy (attrs as slice) read in place (dx alias_of dy, "
   "with channel_offset): no kernel; the gradient of a concat_view, made by fuse.with_concat_views", phase="backward",
   view=True, flops=lambda i, o, a: 0)
_k("dropout_bwd", "[dy, mask] -> [dx]: dy * mask / (1 - ratio); attr ratio", phase="backward")
_k("softmax_bwd", "[y, dy] -> [dx]: y * (dy - sum(dy * y, axis)); attr axis", phase="backward", flops=lambda i, o, a: 4 * _numel(i[0]))
_k("lrn_bwd", "[x, dy] -> [dx]: gradient of LRN; attrs as lrn", phase="backward",
   flops=lambda i, o, a: (2 * a["size"] + 8) * _numel(i[0]))
# update
_k("sgd", "[w, dw, v]... -> [w', v']...: one layer's weights, in place, v' = momentum*v + dw*grad_unscale + weight_decay*w "
   "(v fp32); w' = w - lr*v'; attrs lr, momentum, weight_decay, grad_unscale", phase="update",
   flops=lambda i, o, a: 4 * sum(_numel(s) for s in i[0::3]))


def flops(kind: str, in_shapes: list[list[int]], out_shapes: list[list[int]], attrs: dict) -> int:
    return int(KINDS[kind].flops(in_shapes, out_shapes, attrs))
