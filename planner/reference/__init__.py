"""NumPy reference executor (float64, CPU): the numerical ground truth of the project.

One registry keyed by IR op kind (planner/ops.py), one file per op family. A kernel maps a list of input
arrays and the node's attrs to a list of output arrays.
"""

from __future__ import annotations

import math

import numpy as np

from planner import ops
from planner.ir import Graph
from planner.reference import activation, conv, elementwise, gemm, loss, norm, optim, pool
from planner.reference.elementwise import dropout_keep

KERNELS = {}
for _family in (activation, conv, elementwise, gemm, loss, norm, optim, pool):
    KERNELS.update(_family.KERNELS)
assert set(KERNELS) == set(ops.KINDS), set(ops.KINDS) ^ set(KERNELS)

__all__ = ["KERNELS", "dropout_keep", "random_inputs", "random_parameters", "run"]


def random_parameters(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Values for every persistent tensor, scaled so activations stay O(1) through deep networks."""
    rng = np.random.default_rng(seed)
    bn = {}
    for n in graph.nodes:
        if n.kind == "batchnorm":
            bn.update({n.inputs[1]: "scale", n.inputs[2]: "bias", n.inputs[3]: "mean", n.inputs[4]: "var"})
    values = {}
    for name, t in graph.tensors.items():
        if t.alias_of is not None or t.role not in ("weight", "state", "optimizer_state", "constant"):
            continue
        shape = t.shape
        if t.role == "constant":
            values[name] = np.asarray(t.value, dtype=np.float64).reshape(shape)
        elif bn.get(name) in ("scale", "var"):
            values[name] = rng.uniform(0.5, 1.5, shape)
        elif bn.get(name) in ("bias", "mean") or len(shape) <= 1:
            values[name] = rng.normal(0, 0.1, shape)
        elif t.role == "optimizer_state":
            values[name] = rng.normal(0, 0.01, shape)
        else:
            values[name] = rng.normal(0, math.sqrt(2.0 / math.prod(shape[1:])), shape)
    return values


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = {}
    classes = next((graph.tensors[n.inputs[0]].shape[-1] for n in graph.nodes if n.kind == "softmax_xent"), 1)
    for name in graph.inputs:
        t = graph.tensors[name]
        if t.role == "label":
            values[name] = rng.integers(0, classes, t.shape)
        else:
            values[name] = rng.standard_normal(t.shape)
    return values


STORAGE = {"fp16": np.float16, "fp32": np.float32}


def run(graph: Graph, values: dict[str, np.ndarray], round_to_storage: bool = False) -> dict[str, np.ndarray]:
    """Execute every node in order; returns all tensors (the given values included).

    With `round_to_storage`, every op's outputs are rounded to their tensor's dtype (kept in float64), so the
    reference runs the same program the device runs: fp16 activations and gradients stored in fp16 at every
    op. Without it, the comparison also measures how fp16 rounding compounds through a deep network, which
    says nothing about whether the device's kernels are right."""
    env = dict(values)
    for n in graph.nodes:
        outs = KERNELS[n.kind]([env[t] for t in n.inputs], n.attrs)
        for name, value in zip(n.outputs, outs):
            storage = STORAGE.get(graph.tensors[name].dtype) if round_to_storage else None
            env[name] = value.astype(storage).astype(np.float64) if storage and value.dtype.kind == "f" else value
    return env
