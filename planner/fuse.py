"""Inference fusion: a Conv, the residual Add and the ReLU right after it become one `conv_fused` op.

Run apart, a conv with a bias and a ReLU is three passes over its output (cuDNN plan, bias kernel, ReLU kernel);
fused, cuDNN can apply bias, residual and activation in the conv kernel's epilogue. The runner keeps the
unfused way as candidates of the same op (any conv plan followed by one epilogue kernel), so the profile and the
solver choose between them. Training graphs are left alone: there BatchNormalization sits between Conv and ReLU.
"""

from __future__ import annotations

from planner import ops
from planner.ir import Graph, Node, finalize


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
