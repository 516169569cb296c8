"""ONNX -> forward op DAG.

Works on graph-only files whose external weight data is absent: shapes come from initializer dims and
ONNX shape inference at a fixed batch size. Constant and shape-computing subgraphs are folded, Identity and
no-op reshapes dropped, Dropout dropped for inference and kept for training.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from planner import ops
from planner.ops import conv_out_size, pool_out_size
from planner.files import PlannerError
from planner.fuse import fuse_conv_epilogues
from planner.ir import Graph, Node, Tensor, finalize
from planner.onnx_load import (constant_value, fix_input_shapes, fold_node, has_typed_data, infer_shapes, load_onnx,
                               node_attrs)

SUPPORTED = {
    "Conv", "BatchNormalization", "Relu", "Clip", "Sigmoid", "Mul", "Add", "MaxPool", "AveragePool",
    "GlobalAveragePool", "Concat", "Gemm", "MatMul", "Flatten", "Reshape", "Dropout", "Softmax", "LRN",
    "Constant", "Identity",
}
# Ops that only ever compute shapes or constants; fine while all their inputs fold to constants.
FOLDABLE = {"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Slice", "Mul", "Add", "Sub", "Div",
            "ConstantOfShape", "Range", "ReduceProd", "Equal", "Where", "Expand", "Reshape", "Flatten"}
SMALL_CONSTANT_ELEMS = 4096


class UnsupportedOps(PlannerError):
    exit_code = 2


def _spatial_pads(attrs: dict, x_shape: list[int], kernel: list[int], strides: list[int], dilations: list[int]):
    """Explicit [t, l, b, r] pads, resolving auto_pad SAME_UPPER / SAME_LOWER / VALID."""
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("NOTSET", ""):
        return list(attrs.get("pads", [0] * 4))
    if auto == "VALID":
        return [0, 0, 0, 0]
    begin, end = [], []
    for size, k, s, d in zip(x_shape[2:], kernel, strides, dilations):
        out = -(-size // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        small, large = total // 2, total - total // 2
        begin.append(small if auto == "SAME_UPPER" else large)
        end.append(large if auto == "SAME_UPPER" else small)
    return begin + end


def import_onnx(
    path: str | Path,
    batch: int = 1,
    dtype: str = "fp32",
    training: bool = False,
    input_hw: tuple[int, int] | None = None,
    fuse: bool = True,
) -> Graph:
    """Import an ONNX CNN as a forward Graph at a fixed batch size (training=True keeps training behaviour;
    otherwise, with `fuse`, Conv -> Add -> ReLU chains become conv_fused ops, planner/fuse.py)."""
    if batch < 1:
        raise PlannerError(f"batch must be at least 1, got {batch}")
    if dtype not in ("fp32", "fp16"):
        raise PlannerError(f"dtype must be fp32 or fp16, got {dtype!r}")
    model, sha = load_onnx(path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < 7:
        raise PlannerError(f"{path}: unsupported ONNX opset {opset}")

    unsupported = [(n.op_type, n.name or n.output[0]) for n in model.graph.node
                   if n.domain not in ("", "ai.onnx") or (n.op_type not in SUPPORTED and n.op_type not in FOLDABLE)]
    if unsupported:
        kinds = sorted({k for k, _ in unsupported})
        detail = ", ".join(f"{k} (e.g. node {next(n for kk, n in unsupported if kk == k)!r})" for k in kinds)
        raise UnsupportedOps(f"{path}: unsupported ONNX op types: {detail}")

    fix_input_shapes(model, batch, input_hw)
    shapes = infer_shapes(model)
    b = _Builder(dtype, training, shapes, opset)

    init_names = {i.name for i in model.graph.initializer}
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL and (init.raw_data or has_typed_data(init)):
            value = numpy_helper.to_array(init)
            if value.dtype.kind in "iub" or value.size <= 1:
                b.consts[init.name] = value
        b.initializer_dims[init.name] = list(init.dims)
    data_input = next(i.name for i in model.graph.input if i.name not in init_names)
    b.tensor(data_input, shapes[data_input], "input", dtype)
    b.graph_inputs.append(data_input)

    for node in model.graph.node:
        b.add(node)

    outputs = [b.resolve(o.name) for o in model.graph.output]
    for o in outputs:
        if o not in b.tensors:
            raise PlannerError(f"graph output {o!r} is a constant; nothing to compute")
    b.prune(outputs)
    graph = Graph(
        model_name=Path(path).name.removesuffix(".onnx"), source_sha256=sha, batch=batch, dtype=dtype,
        training=training, inputs=b.graph_inputs, outputs=outputs, nodes=b.nodes, tensors=b.tensors,
    )
    finalize(graph)
    for n in graph.nodes:
        n.flops = ops.flops(n.kind, [graph.tensors[t].shape for t in n.inputs],
                            [graph.tensors[t].shape for t in n.outputs], n.attrs)
    return graph if training or not fuse else fuse_conv_epilogues(graph)


class _Builder:
    """Walks ONNX nodes in order, folding constants and emitting IR nodes."""

    def __init__(self, dtype: str, training: bool, shapes: dict[str, list[int]], opset: int):
        self.dtype, self.training, self.shapes, self.opset = dtype, training, shapes, opset
        self.consts: dict[str, np.ndarray] = {}
        self.initializer_dims: dict[str, list[int]] = {}
        self.renamed: dict[str, str] = {}
        self.tensors: dict[str, Tensor] = {}
        self.nodes: list[Node] = []
        self.graph_inputs: list[str] = []

    def resolve(self, name: str) -> str:
        while name in self.renamed:
            name = self.renamed[name]
        return name

    def tensor(self, name, shape, role, dtype=None, value=None) -> str:
        if name not in self.tensors:
            self.tensors[name] = Tensor(name=name, shape=[int(d) for d in shape], dtype=dtype or self.dtype, role=role)
            if value is not None:
                self.tensors[name].value = [float(v) for v in np.asarray(value).ravel()]
        return name

    def operand(self, name: str, role: str = "weight", dtype: str | None = None) -> str:
        """An input of a compute op: an existing tensor, an initializer, or a folded constant."""
        name = self.resolve(name)
        if name in self.tensors:
            return name
        if name in self.consts:
            value = self.consts[name]
            if value.size > SMALL_CONSTANT_ELEMS:
                raise PlannerError(f"constant {name!r} with {value.size} elements feeds a compute op; not supported")
            return self.tensor(name, list(value.shape), "constant", dtype, value=value)
        if name in self.initializer_dims:
            return self.tensor(name, self.initializer_dims[name], role, dtype)
        raise PlannerError(f"tensor {name!r} has no producer")

    def const(self, name: str, what: str) -> np.ndarray:
        name = self.resolve(name)
        if name not in self.consts:
            raise PlannerError(f"{what} must be a constant with a value; {name!r} is not (external data absent?)")
        return self.consts[name]

    def shape(self, name: str) -> list[int]:
        name = self.resolve(name)
        if name in self.tensors:
            return self.tensors[name].shape
        if name not in self.shapes:
            raise PlannerError(f"could not infer a static shape for tensor {name!r}")
        return self.shapes[name]

    def emit(self, kind: str, onnx_node: onnx.NodeProto, inputs: list[str], outputs: list[tuple[str, str, str]],
             attrs: dict | None = None) -> None:
        """outputs: (onnx name, role, dtype)."""
        out_names = []
        for name, role, dt in outputs:
            if name not in self.shapes:
                raise PlannerError(f"could not infer a static shape for {name!r} (output of {onnx_node.op_type} "
                                   f"node {onnx_node.name!r})")
            out_names.append(self.tensor(name, self.shapes[name], role, dt))
        node_name = onnx_node.name or out_names[0]
        if any(n.name == node_name for n in self.nodes[-1:]) or node_name in {n.name for n in self.nodes}:
            node_name = f"{node_name}#{len(self.nodes)}"
        self.nodes.append(Node(name=node_name, kind=kind, inputs=inputs, outputs=out_names, attrs=attrs or {}))

    def add(self, node: onnx.NodeProto) -> None:
        t = node.op_type
        a = node_attrs(node)
        ins = [self.resolve(i) if i else "" for i in node.input]
        if t == "Constant":
            self.consts[node.output[0]] = constant_value(node, a)
            return
        if t == "Identity":
            if ins[0] in self.initializer_dims and ins[0] not in self.consts:
                # The exporter deduplicates equal-valued parameters behind Identity; they are distinct weights.
                self.initializer_dims[node.output[0]] = self.initializer_dims[ins[0]]
            else:
                self.renamed[node.output[0]] = ins[0]
            return
        # Fold anything whose inputs are all known constants (or shape queries of known shapes).
        if t == "Shape" and ins[0] in self.tensors | self.shapes.keys():
            shape = np.array(self.shape(ins[0]), dtype=np.int64)
            start, end = a.get("start", 0), a.get("end", None)
            self.consts[node.output[0]] = shape[start:end]
            return
        if all((i in self.consts) for i in ins if i) and t not in ("Dropout",):
            for o, v in zip(node.output, fold_node(node, self.consts)):
                self.consts[o] = np.asarray(v)
            return
        if t not in SUPPORTED:
            raise UnsupportedOps(f"unsupported ONNX op {t} (node {node.name!r}) on a non-constant input")
        getattr(self, f"_{t}")(node, a, ins)

    # One handler per supported ONNX op.

    def _Conv(self, node, a, ins):
        w_shape = self.shape(ins[1])
        x_shape = self.shape(ins[0])
        kernel = list(a.get("kernel_shape", w_shape[2:]))
        if len(kernel) != 2:
            raise PlannerError(f"Conv node {node.name!r}: only 2-D convolutions are supported")
        strides = list(a.get("strides", [1, 1]))
        dilations = list(a.get("dilations", [1, 1]))
        attrs = {"strides": strides, "pads": _spatial_pads(a, x_shape, kernel, strides, dilations),
                 "dilations": dilations, "groups": int(a.get("group", 1))}
        pads = attrs["pads"]
        self.shapes.setdefault(node.output[0], [x_shape[0], w_shape[0]] + [
            conv_out_size(x_shape[2 + i], kernel[i], strides[i], dilations[i], pads[i], pads[2 + i]) for i in (0, 1)])
        inputs = [self.operand(i) for i in ins if i]
        self.emit("conv", node, inputs, [(node.output[0], "activation", self.dtype)], attrs)

    def _BatchNormalization(self, node, a, ins):
        training = self.training  # training uses batch statistics, whichever mode the file was exported in
        params = [self.operand(ins[1], "weight", "fp32"), self.operand(ins[2], "weight", "fp32"),
                  self.operand(ins[3], "state", "fp32"), self.operand(ins[4], "state", "fp32")]
        attrs = {"epsilon": float(a.get("epsilon", 1e-5)), "momentum": float(a.get("momentum", 0.9)),
                 "training": training}
        self.shapes.setdefault(node.output[0], self.shape(ins[0]))  # inference may give up on training_mode=1
        outputs = [(node.output[0], "activation", self.dtype)]
        if training:
            c = self.shape(ins[0])[1]
            stem = node.output[0]
            for suffix, role in (("running_mean", "state"), ("running_var", "state"), ("saved_mean", "activation"),
                                 ("saved_invstd", "activation")):
                self.shapes[f"{stem}.{suffix}"] = [c]
                outputs.append((f"{stem}.{suffix}", role, "fp32"))
        self.emit("batchnorm", node, [ins[0]] + params, outputs, attrs)
        if training:  # running statistics are updated in place
            self.tensors[f"{node.output[0]}.running_mean"].alias_of = params[2]
            self.tensors[f"{node.output[0]}.running_var"].alias_of = params[3]

    def _unary(self, kind, node, ins, attrs=None):
        if kind not in ("maxpool", "avgpool", "globalavgpool"):
            self.shapes.setdefault(node.output[0], self.shape(ins[0]))
        self.emit(kind, node, [ins[0]], [(node.output[0], "activation", self.dtype)], attrs)

    def _Relu(self, node, a, ins):
        self._unary("relu", node, ins)

    def _Sigmoid(self, node, a, ins):
        self._unary("sigmoid", node, ins)

    def _Clip(self, node, a, ins):
        lo, hi = a.get("min", -math.inf), a.get("max", math.inf)
        if len(ins) > 1 and ins[1]:
            lo = float(self.const(ins[1], f"Clip min of node {node.name!r}"))
        if len(ins) > 2 and ins[2]:
            hi = float(self.const(ins[2], f"Clip max of node {node.name!r}"))
        self._unary("clip", node, ins, {"min": float(lo), "max": float(hi)})

    def _binary(self, kind, node, ins):
        operands = [self.operand(i, "constant") for i in ins]
        self.shapes.setdefault(node.output[0], list(np.broadcast_shapes(*(tuple(self.shape(o)) for o in operands))))
        self.emit(kind, node, operands, [(node.output[0], "activation", self.dtype)])

    def _Add(self, node, a, ins):
        self._binary("add", node, ins)

    def _Mul(self, node, a, ins):
        self._binary("mul", node, ins)

    def _pool(self, kind, node, a, ins):
        if a.get("storage_order", 0):
            raise PlannerError(f"{node.op_type} node {node.name!r}: storage_order=1 is not supported")
        kernel = list(a["kernel_shape"])
        strides = list(a.get("strides", [1] * len(kernel)))
        dilations = list(a.get("dilations", [1] * len(kernel)))
        if len(kernel) != 2:
            raise PlannerError(f"{node.op_type} node {node.name!r}: only 2-D pooling is supported")
        attrs = {"kernel": kernel, "strides": strides,
                 "pads": _spatial_pads(a, self.shape(ins[0]), kernel, strides, dilations),
                 "ceil_mode": int(a.get("ceil_mode", 0))}
        x_shape, pads = self.shape(ins[0]), attrs["pads"]
        self.shapes.setdefault(node.output[0], x_shape[:2] + [
            pool_out_size(x_shape[2 + i], kernel[i], strides[i], dilations[i], pads[i], pads[2 + i], attrs["ceil_mode"])
            for i in (0, 1)])
        if kind == "maxpool":
            attrs["dilations"] = dilations
        else:
            if dilations != [1, 1]:
                raise PlannerError(f"AveragePool node {node.name!r}: dilations are not supported")
            attrs["count_include_pad"] = int(a.get("count_include_pad", 0))
        self._unary(kind, node, ins, attrs)

    def _MaxPool(self, node, a, ins):
        if len([o for o in node.output if o]) > 1:
            raise PlannerError(f"MaxPool node {node.name!r}: the Indices output is not supported")
        self._pool("maxpool", node, a, ins)

    def _AveragePool(self, node, a, ins):
        self._pool("avgpool", node, a, ins)

    def _GlobalAveragePool(self, node, a, ins):
        self.shapes.setdefault(node.output[0], self.shape(ins[0])[:2] + [1, 1])
        self._unary("globalavgpool", node, ins)

    def _Concat(self, node, a, ins):
        operands = [self.operand(i, "constant") for i in ins]
        axis = int(a["axis"]) % len(self.shape(ins[0]))
        shape = list(self.shape(operands[0]))
        shape[axis] = sum(self.shape(o)[axis] for o in operands)
        self.shapes.setdefault(node.output[0], shape)
        self.emit("concat", node, operands, [(node.output[0], "activation", self.dtype)], {"axis": axis})

    def _Gemm(self, node, a, ins):
        operands = [self.operand(i) for i in ins if i]
        a_shape, b_shape = self.shape(operands[0]), self.shape(operands[1])
        self.shapes.setdefault(node.output[0], [a_shape[1 if a.get("transA") else 0], b_shape[0 if a.get("transB") else 1]])
        attrs = {"transA": int(a.get("transA", 0)), "transB": int(a.get("transB", 0)),
                 "alpha": float(a.get("alpha", 1.0)), "beta": float(a.get("beta", 1.0))}
        self.emit("gemm", node, operands, [(node.output[0], "activation", self.dtype)], attrs)

    def _MatMul(self, node, a, ins):
        self.emit("matmul", node, [self.operand(i) for i in ins], [(node.output[0], "activation", self.dtype)])

    def _view(self, node, ins):
        out_shape = self.shapes.get(node.output[0])
        if out_shape is None:
            raise PlannerError(f"could not infer a static shape for {node.output[0]!r} ({node.op_type} node "
                               f"{node.name!r})")
        if out_shape == self.shape(ins[0]):
            self.renamed[node.output[0]] = ins[0]
            return
        self.emit("reshape", node, [ins[0]], [(node.output[0], "activation", self.dtype)], {"shape": out_shape})
        self.tensors[self.nodes[-1].outputs[0]].alias_of = ins[0]

    def _Flatten(self, node, a, ins):
        shape = self.shape(ins[0])
        axis = int(a.get("axis", 1)) % (len(shape) + 1)
        self.shapes.setdefault(node.output[0], [math.prod(shape[:axis]), math.prod(shape[axis:])])
        self._view(node, ins)

    def _Reshape(self, node, a, ins):
        if node.output[0] not in self.shapes:  # shape inference may miss a shape computed at run time: fold it
            target = self.const(ins[1], f"Reshape shape of node {node.name!r}")
            self.shapes[node.output[0]] = list(np.empty(self.shape(ins[0]), dtype=np.uint8)
                                               .reshape([int(d) for d in target]).shape)
        self._view(node, ins)

    def _Dropout(self, node, a, ins):
        ratio = float(a.get("ratio", 0.5))
        if len(ins) > 1 and ins[1]:
            ratio = float(self.const(ins[1], f"Dropout ratio of node {node.name!r}"))
        if self.opset >= 12:  # training_mode is an input, False when absent
            mode = len(ins) > 2 and ins[2] != "" and bool(self.const(ins[2], "Dropout training_mode"))
        else:  # before opset 12 the runtime decides: training exports ask for the mask
            mode = len([o for o in node.output if o]) > 1
        active = self.training and mode and ratio > 0
        if not active:
            self.renamed[node.output[0]] = ins[0]
            return
        mask = f"{node.output[0]}.mask"
        self.shapes[mask] = self.shape(ins[0])
        self.shapes.setdefault(node.output[0], self.shape(ins[0]))
        self.emit("dropout", node, [ins[0]], [(node.output[0], "activation", self.dtype), (mask, "activation", "uint8")],
                  {"ratio": ratio, "seed": len(self.nodes)})

    def _Softmax(self, node, a, ins):
        rank = len(self.shape(ins[0]))
        axis = int(a.get("axis", -1 if self.opset >= 13 else 1)) % rank
        if axis != rank - 1:
            raise PlannerError(f"Softmax node {node.name!r}: only the last axis is supported")
        self._unary("softmax", node, ins, {"axis": axis})

    def _LRN(self, node, a, ins):
        self._unary("lrn", node, ins, {"size": int(a["size"]), "alpha": float(a.get("alpha", 1e-4)),
                                       "beta": float(a.get("beta", 0.75)), "bias": float(a.get("bias", 1.0))})

    def prune(self, outputs: list[str]) -> None:
        """Drop ops whose results reach no graph output."""
        live = set(outputs)
        kept = []
        for n in reversed(self.nodes):
            if any(o in live for o in n.outputs):
                kept.append(n)
                live.update(n.inputs)
        self.nodes = kept[::-1]
        used = live | {o for n in self.nodes for o in n.outputs}
        self.tensors = {k: v for k, v in self.tensors.items() if k in used}
