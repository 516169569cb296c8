"""Inference fusion: a Conv, the residual Add and the ReLU right after it become one `conv_fused` op.

Run apart, a conv with a bias and a ReLU is three passes over its output (cuDNN plan, bias kernel, ReLU kernel);
fused, cuDNN can apply bias, residual and activation in the conv kernel's epilogue. The runner keeps the
unfused way as candidates of the same op (any conv plan followed by one epilogue kernel), so the profile and the
solver choose between them. Training graphs are left alone: there BatchNormalization sits between Conv and ReLU.

A channel Concat of conv_fused outputs that only it reads may also cost no copy: each conv writes its output
straight into its channel slice of the Concat's output (cuDNN takes an NHWC output whose pixel stride is the
Concat's channel count), and the Concat becomes the view `concat_view`. Whether that pays is measured (on H100
most cuDNN engines then wrap the conv in slice-copy kernels), so solve decides (all candidate Concats or none)
and the plan lists the ones it made views (`Plan.concat_views`).
"""

from __future__ import annotations

import itertools

from planner import ops
from planner.files import PlannerError
from planner.ir import ITEMSIZE, Graph, Node, finalize

SLICE_ALIGN_BYTES = 16


def _only_consumer(graph: Graph, tensor: str, kind: str) -> Node | None:
    """The node of `kind` that alone reads `tensor`, unless the tensor is also a graph output."""
    t = graph.tensors[tensor]
    if tensor in graph.outputs or len(t.consumers) != 1:
        return None
    node = graph.node_by_name[t.consumers[0]]
    return node if node.kind == kind else None


def _residual(graph: Graph, add: Node, y: str) -> str | None:
    """The other operand of `add` when it is a plain same-shape, same-dtype tensor (no broadcast)."""
    if len(add.inputs) != 2 or add.inputs.count(y) != 1:
        return None
    z = add.inputs[1 - add.inputs.index(y)]
    same = graph.tensors[z].shape == graph.tensors[y].shape and graph.tensors[z].dtype == graph.tensors[y].dtype
    return z if same else None


def fuse_conv_epilogues(graph: Graph) -> Graph:
    """Conv [-> Add(residual)] [-> Relu] chains as single conv_fused ops (a biased Conv alone also becomes one,
    so its bias runs inside cuDNN). The fused op takes the place of the chain's last node, where every input,
    the residual included, is already computed; the chain's inner tensors disappear."""
    replace: dict[str, Node | None] = {}
    for conv in graph.nodes:
        if conv.kind != "conv" or conv.name in replace:
            continue
        chain, inputs, y = [conv], list(conv.inputs), conv.outputs[0]
        attrs = dict(conv.attrs, residual=False, relu=False)
        add = _only_consumer(graph, y, "add")
        if add is not None and add.name not in replace and (z := _residual(graph, add, y)) is not None:
            chain.append(add)
            inputs.append(z)
            attrs["residual"], y = True, add.outputs[0]
        relu = _only_consumer(graph, y, "relu")
        if relu is not None and relu.name not in replace:
            chain.append(relu)
            attrs["relu"], y = True, relu.outputs[0]
        if len(chain) == 1 and len(conv.inputs) == 2:
            continue
        for node in chain[:-1]:
            replace[node.name] = None
        replace[chain[-1].name] = Node(name=conv.name, kind="conv_fused", inputs=inputs, outputs=[y], attrs=attrs)
        for node in chain[:-1]:
            del graph.tensors[node.outputs[0]]
    graph.nodes = [replace.get(n.name, n) for n in graph.nodes if replace.get(n.name, n) is not None]
    finalize(graph)
    for n in graph.nodes:
        if n.kind == "conv_fused":
            n.flops = ops.flops(n.kind, [graph.tensors[t].shape for t in n.inputs], [graph.tensors[n.outputs[0]].shape], n.attrs)
    return graph


def concat_view_candidates(graph: Graph) -> list[str]:
    """Concats along channels (4-D, axis 1) whose inputs are distinct conv_fused outputs read by nothing else,
    each starting on a 16-byte boundary (cuDNN assumes aligned tensors): those that can be concat_views."""
    names = []
    for node in graph.nodes:
        y = graph.tensors[node.outputs[0]]
        if node.kind != "concat" or node.attrs.get("axis") != 1 or len(y.shape) != 4:
            continue
        if len(set(node.inputs)) != len(node.inputs):
            continue
        producers = [graph.node_by_name.get(graph.tensors[x].producer or "") for x in node.inputs]
        if not all(p is not None and p.kind == "conv_fused" and _only_consumer(graph, x, "concat") is node
                   for p, x in zip(producers, node.inputs)):
            continue
        starts = itertools.accumulate((graph.tensors[x].shape[1] for x in node.inputs), initial=0)
        if all(c * ITEMSIZE[y.dtype] % SLICE_ALIGN_BYTES == 0 for c in starts):
            names.append(node.name)
    return names


def with_concat_views(graph: Graph, names: list[str]) -> Graph:
    """A copy of the graph in which the named concats are concat_views: input i is `alias_of` the output at
    `channel_offset`, and its conv_fused carries `concat_channels`, so the profile measures it writing with that
    pixel stride. The graph itself when `names` is empty."""
    if not names:
        return graph
    unknown = set(names) - set(concat_view_candidates(graph))
    if unknown:
        raise PlannerError(f"concat {sorted(unknown)[0]!r} cannot be written in place in {graph.model_name} "
                           "(the plan was made for another graph)")
    graph = graph.model_copy(deep=True)
    for name in names:
        node = graph.node_by_name[name]
        y, offset = graph.tensors[node.outputs[0]], 0
        node.kind, node.attrs = "concat_view", {}
        for x in node.inputs:
            producer = graph.node_by_name[graph.tensors[x].producer]
            graph.tensors[x].alias_of, graph.tensors[x].channel_offset = node.outputs[0], offset
            producer.attrs = dict(producer.attrs, concat_channels=y.shape[1])
            offset += graph.tensors[x].shape[1]
    return finalize(graph)


def concat_view_nodes(graph: Graph) -> list[Node]:
    """The conv_fused nodes as they would be with every candidate concat a view: the profile measures them
    beside the graph's own, so solve can weigh writing in place (no concat copy, a strided conv) against not."""
    viewed = with_concat_views(graph, concat_view_candidates(graph))
    return [n for n in viewed.nodes if n.kind == "conv_fused" and "concat_channels" in n.attrs]
