"""GPU implementations of every IR op kind, one registry shared by the profiler and the executor.

`OPS[kind](attrs, in_specs, out_specs, handle)` builds, for one node, an object with
- `candidates`: list of (name, workspace bytes), one per implementation the planner may choose;
- `unsupported`: list of (name, reason) for implementations that could not take this node;
- `launch(index, inputs, outputs, workspace)`: run candidate `index` on the current stream, reading the input
  arrays and writing the preallocated outputs (in-place updates pass the same array as input and output),
  allocating nothing, so it can be captured in a CUDA graph and run from an arena.

Views (reshape) have no kernel and no entry. One file per op family; every 4-D tensor is NHWC in memory.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from planner.ops import KINDS
from runner.ops import conv, elementwise, gemm, loss, norm, optim, pool
from runner.ops.common import NUMPY_DTYPE, WANTED_ALGORITHM, TensorSpec, spec

OPS = {}
for _family in (conv, elementwise, gemm, loss, norm, optim, pool):
    OPS.update(_family.OPS)
assert set(OPS) == {k for k, v in KINDS.items() if not v.view}, set(OPS) ^ {k for k, v in KINDS.items() if not v.view}

# inputs that must be positive: a variance and an inverse standard deviation
POSITIVE_INPUTS = {("batchnorm", 4), ("batchnorm_bwd", 4), ("bn_apply", 4)}

__all__ = ["OPS", "TensorSpec", "build_op", "host_inputs", "implementations", "in_place", "node_specs", "specs_of"]


def specs_of(graph, names: list[str]) -> list[TensorSpec]:
    return [spec(graph.tensors[t].shape, graph.tensors[t].dtype) for t in names]


# the operands a node with `concat_channels` reads or writes as channel slices of a concat_view's output (or of
# its gradient): (input indices, output indices)
SLICED_OPERANDS = {"conv_fused": ((), (0,)), "relu": ((), (0,)), "relu_bwd": ((0, 1), ()), "batchnorm": ((), (0,)),
                   "batchnorm_bwd": ((1,), ())}


def node_specs(graph, node) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """A node's input and output specs; a node with `concat_channels` reads or writes channel slices of a tensor
    that wide (SLICED_OPERANDS), whether `graph` has its concat as a concat_view (a plan) or not (the profiler
    measuring it)."""
    ins, outs = specs_of(graph, node.inputs), specs_of(graph, node.outputs)
    pitch = node.attrs.get("concat_channels")
    if pitch is not None:
        sliced_ins, sliced_outs = SLICED_OPERANDS[node.kind]
        ins = [replace(s, row_channels=pitch) if i in sliced_ins else s for i, s in enumerate(ins)]
        outs = [replace(s, row_channels=pitch) if i in sliced_outs else s for i, s in enumerate(outs)]
    return ins, outs


def implementations(graph, node) -> list[str]:
    """The implementations the registry offers a node only where they apply (the stem kernels beside cuDNN's
    engines, the pooling gradients' 2x2 blocks): a profile entry measured before one of them existed is measured
    again (OpProfile.implementations)."""
    specs = node_specs(graph, node)
    return conv.offered(node.kind, node.attrs, *specs) + pool.offered(node.kind, node.attrs, *specs)


def build_op(graph, node, handle, algorithm: str | None = None):
    """The GPU op of a graph node (a cuDNN handle for the kinds that build cuDNN graphs); with `algorithm`,
    only that candidate needs to be among its candidates."""
    token = WANTED_ALGORITHM.set(algorithm)
    try:
        return OPS[node.kind](node.attrs, *node_specs(graph, node), handle)
    finally:
        WANTED_ALGORITHM.reset(token)


def in_place(graph, node) -> dict[int, int]:
    """Output index -> index of the input whose storage it updates in place (sgd, batchnorm running stats)."""
    return {j: node.inputs.index(graph.tensors[t].alias_of) for j, t in enumerate(node.outputs)
            if graph.tensors[t].alias_of in node.inputs}


def host_inputs(kind: str, specs: list[TensorSpec], rng: np.random.Generator) -> list[np.ndarray]:
    """Random inputs for one node in their storage dtypes: standard normal values, positive ones where the op
    takes a square root or a reciprocal, class indices for labels, 0/1 for dropout masks."""
    values = []
    for i, s in enumerate(specs):
        if s.dtype == "int64":
            values.append(rng.integers(0, specs[0].shape[-1], s.shape))
        elif s.dtype == "uint8":
            values.append(rng.integers(0, 2, s.shape).astype(np.uint8))
        elif (kind, i) in POSITIVE_INPUTS:
            values.append(rng.uniform(0.5, 1.5, s.shape).astype(NUMPY_DTYPE[s.dtype]))
        else:
            values.append(rng.standard_normal(s.shape, dtype=np.float32).astype(NUMPY_DTYPE[s.dtype]))
    return values
