"""Reading an ONNX file for the importer: load and hash it, fix the input's batch (and size), infer every shape,
and evaluate the small constant subgraphs (shapes, Constant nodes) the importer folds."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper, shape_inference

from planner.files import PlannerError


def load_onnx(path: str | Path) -> tuple[onnx.ModelProto, str]:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PlannerError(f"{path}: no such file") from None
    except OSError as e:
        raise PlannerError(f"{path}: cannot read ({e.strerror})") from None
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise PlannerError(f"{path}: not a valid ONNX model ({type(e).__name__}: {str(e)[:80]})") from None
    if not model.graph.node:
        raise PlannerError(f"{path}: not a valid ONNX model (the graph has no nodes; truncated or empty file?)")
    return model, hashlib.sha256(data).hexdigest()


def fix_input_shapes(model: onnx.ModelProto, batch: int, input_hw: tuple[int, int] | None) -> None:
    init_names = {i.name for i in model.graph.initializer}
    data_inputs = [i for i in model.graph.input if i.name not in init_names]
    if len(data_inputs) != 1:
        raise PlannerError(f"expected one data input, found {len(data_inputs)}: {[i.name for i in data_inputs]}")
    dims = data_inputs[0].type.tensor_type.shape.dim
    if len(dims) != 4:
        raise PlannerError(f"input {data_inputs[0].name!r} has rank {len(dims)}; cnn-planner expects NCHW images")
    dims[0].Clear()
    dims[0].dim_value = batch
    if input_hw is not None:
        for d, v in zip(dims[2:], input_hw):
            d.Clear()
            d.dim_value = v
    for d in dims:
        if not d.HasField("dim_value"):
            raise PlannerError(f"input {data_inputs[0].name!r} has a dynamic dimension other than the batch")
    for o in model.graph.output:
        o.type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]


def infer_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    try:
        inferred = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as e:
        raise PlannerError(f"ONNX shape inference failed: {str(e).splitlines()[0][:200]}") from None
    shapes = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = [d.dim_value for d in dims]
    for init in inferred.graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def node_attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def fold_node(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    inputs = [n for n in node.input if n]
    g = onnx.helper.make_graph(
        [node], "fold",
        [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(consts[n].dtype), consts[n].shape)
         for n in inputs],
        [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output],
    )
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    return ReferenceEvaluator(m).run(None, {n: consts[n] for n in inputs})


def has_typed_data(init: onnx.TensorProto) -> bool:
    return any(len(getattr(init, f)) for f in ("float_data", "int32_data", "int64_data", "double_data"))


def constant_value(node: onnx.NodeProto, a: dict) -> np.ndarray:
    if "value" in a:
        return numpy_helper.to_array(a["value"])
    for key in ("value_float", "value_int"):
        if key in a:
            return np.array(a[key])
    for key in ("value_floats", "value_ints"):
        if key in a:
            return np.array(list(a[key]))
    raise PlannerError(f"Constant node {node.name!r}: unsupported value kind {sorted(a)}")
