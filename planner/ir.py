"""The op DAG every stage works on: nodes (ops) and tensors with exact shapes, bytes and roles.

A Graph is both the in-memory IR and the `graph.json` file. Nodes are stored in a topological order.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.files import FORMAT_VERSION, sha256_json
from planner.ops import KINDS

DType = Literal["fp32", "fp16", "int64", "uint8"]
ITEMSIZE = {"fp32": 4, "fp16": 2, "int64": 8, "uint8": 1}

Role = Literal[
    "input",  # the network's data input
    "label",  # class indices for the loss (training)
    "weight",  # trainable parameter
    "state",  # non-trainable persistent buffer (BatchNormalization running statistics)
    "activation",  # forward intermediate or output
    "gradient",  # gradient of an activation (backward intermediate)
    "weight_gradient",  # gradient of a weight
    "optimizer_state",  # SGD momentum buffer
    "constant",  # small constant folded from the ONNX file; its values are in `value`
]
# On the device throughout. A weight gradient is not: it lives from the op that writes it to its SGD update, as
# PyTorch frees .grad between iterations; kept resident, it took ResNet-50 training b32 fp16 49 MiB of every
# cap (at 448 MiB on the H200, 11188 us predicted against 8218).
PERSISTENT_ROLES = ("weight", "state", "optimizer_state", "constant")

Phase = Literal["forward", "loss", "backward", "update"]


class Tensor(BaseModel):
    model_config = ConfigDict(frozen=False)

    name: str
    shape: list[int]
    dtype: DType
    role: Role
    producer: str | None = None
    consumers: list[str] = Field(default_factory=list)
    alias_of: str | None = Field(None, description="shares storage with this tensor (a view, or an in-place update)")
    channel_offset: int | None = Field(
        None, description="a channel slice of alias_of starting at this channel: its producer writes straight "
        "into a Concat's output (concat_view)")
    saved_for_backward: list[str] = Field(
        default_factory=list, description="backward ops that read this forward tensor"
    )
    value: list[float] | None = Field(None, description="values of a small constant (role constant)")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    @property
    def persistent(self) -> bool:
        return self.role in PERSISTENT_ROLES


class Node(BaseModel):
    name: str
    kind: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = Field(default_factory=dict)
    phase: Phase = "forward"
    forward_of: str | None = Field(None, description="for backward ops: the forward op they differentiate")
    flops: int = 0
    signature: str = ""


class Graph(BaseModel):
    kind: Literal["graph"] = "graph"
    format_version: int = FORMAT_VERSION
    model_name: str
    source_sha256: str = Field(description="sha256 of the ONNX file this graph was imported from")
    batch: int
    dtype: Literal["fp32", "fp16"]
    training: bool
    inputs: list[str]
    outputs: list[str]
    nodes: list[Node]
    tensors: dict[str, Tensor]

    @cached_property
    def graph_sha256(self) -> str:
        """Identity of the graph's content; plans and profiles made for it carry it. A tensor that is no channel
        slice hashes as before channel slices existed, so older plans and profiles still match."""
        content = self.model_dump(mode="json", exclude={"format_version"})
        for t in content["tensors"].values():
            if t["channel_offset"] is None:
                del t["channel_offset"]
        return sha256_json(content)

    @cached_property
    def node_by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def only_consumer(self, tensor: str, kind: str) -> Node | None:
        """The node of `kind` that alone reads `tensor`, unless the tensor is also a graph output."""
        t = self.tensors[tensor]
        if tensor in self.outputs or len(t.consumers) != 1:
            return None
        node = self.node_by_name[t.consumers[0]]
        return node if node.kind == kind else None

    def storage_of(self, tensor: str) -> str:
        """The tensor that owns the memory a (possibly aliased) tensor lives in."""
        while (alias := self.tensors[tensor].alias_of) is not None:
            tensor = alias
        return tensor

    def predecessors(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in self.nodes:
            prods = {self.tensors[t].producer for t in n.inputs}
            out[n.name] = sorted(p for p in prods if p is not None)
        return out

    def successors(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for name, preds in self.predecessors().items():
            for p in preds:
                out[p].append(name)
        return out


def op_signature(kind: str, attrs: dict, in_shapes: list[list[int]], out_shapes: list[list[int]], dtype: str) -> str:
    """Stable key of what an op computes (not where it sits), so identical layers share one measurement."""
    return sha256_json([kind, attrs, in_shapes, out_shapes, dtype])[:20]


def finalize(graph: Graph) -> Graph:
    """Recompute producers, consumers and op signatures from the node list."""
    for t in graph.tensors.values():
        t.producer, t.consumers = None, []
    for n in graph.nodes:
        for t in n.inputs:
            if n.name not in graph.tensors[t].consumers:
                graph.tensors[t].consumers.append(n.name)
        for t in n.outputs:
            graph.tensors[t].producer = n.name
        n.signature = op_signature(
            n.kind,
            n.attrs,
            [graph.tensors[t].shape for t in n.inputs],
            [graph.tensors[t].shape for t in n.outputs],
            graph.dtype,
        )
    graph.__dict__.pop("graph_sha256", None)
    graph.__dict__.pop("node_by_name", None)
    return graph


def record_saved_for_backward(graph: Graph) -> None:
    """For each forward tensor, the backward ops that read it (what must survive until backward)."""
    phase = {n.name: n.phase for n in graph.nodes}
    for t in graph.tensors.values():
        producer_phase = phase.get(t.producer, "forward") if t.producer else "forward"
        if producer_phase == "forward":
            t.saved_for_backward = [c for c in t.consumers if phase[c] == "backward"]


def recompute_nodes(graph: Graph) -> dict[tuple[str, ...], Node]:
    """The fused recomputations of a training graph, keyed by the forward chain each replaces: a training
    BatchNormalization and the ReLU after it ([bn, relu]), or the Add of a residual and the ReLU after that
    ([bn, add, relu]), as one `bn_apply` node that reads the saved statistics and writes the ReLU's output. They
    are not part of the graph; the profiler measures them and the solver prices a recomputation with them. A
    BatchNormalization that runs its ReLU itself (attr relu, fuse.with_bn_relu; its residual, attr residual, is
    its last input) is a chain of one ([bn])."""
    if not graph.training:
        return {}
    by_name = graph.node_by_name

    def only_forward_consumer(tensor: str) -> Node | None:
        consumers = [by_name[c] for c in graph.tensors[tensor].consumers if by_name[c].phase == "forward"]
        return consumers[0] if len(consumers) == 1 else None

    out: dict[tuple[str, ...], Node] = {}
    for bn in graph.nodes:
        if bn.kind != "batchnorm" or not bn.attrs.get("training") or bn.phase != "forward":
            continue
        inputs = [*bn.inputs[:3], *bn.outputs[3:5]]
        chain, residual, nxt = [bn], bn.inputs[5:], bn
        if not bn.attrs.get("relu"):
            nxt = only_forward_consumer(bn.outputs[0])
            if nxt is not None and nxt.kind == "add":
                residual = [t for t in nxt.inputs if t != bn.outputs[0]]
                chain.append(nxt)
                nxt = only_forward_consumer(nxt.outputs[0])
            if nxt is None or nxt.kind != "relu" or len(residual) > 1:
                continue
            chain.append(nxt)
        attrs = {"relu": 1, "residual": len(residual)}
        ins, outs = inputs + residual, nxt.outputs[:1]
        in_shapes, out_shapes = [graph.tensors[t].shape for t in ins], [graph.tensors[t].shape for t in outs]
        node = Node(name=f"{nxt.name}:recompute", kind="bn_apply", inputs=ins, outputs=outs, attrs=attrs,
                    flops=KINDS["bn_apply"].flops(in_shapes, out_shapes, attrs),
                    signature=op_signature("bn_apply", attrs, in_shapes, out_shapes, graph.dtype))
        out[tuple(n.name for n in chain)] = node
    return out
