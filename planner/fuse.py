"""Inference fusion: a Conv, the residual Add and the ReLU right after it become one `conv_fused` op.

Run apart, a conv with a bias and a ReLU is three passes over its output (cuDNN plan, bias kernel, ReLU kernel);
fused, cuDNN can apply bias, residual and activation in the conv kernel's epilogue. The runner keeps the
unfused way as candidates of the same op (any conv plan followed by one epilogue kernel), so the profile and the
solver choose between them. Training graphs are left alone: there BatchNormalization sits between Conv and ReLU.

A channel Concat may also cost no copy: each producer writes its output straight into its channel slice of the
Concat's output, and the Concat becomes the view `concat_view`. At inference the producers are conv_fused ops
that only the Concat reads (cuDNN takes an NHWC output whose pixel stride is the Concat's channel count); in
training they are ReLUs that the Concat and their own backward read, and the Concat's backward `slice`s become
`slice_view`s of its gradient, so each `relu_bwd` reads both operands in place too. Whether that pays is measured
(on H100 most cuDNN engines wrap a strided conv in slice-copy kernels), so solve decides (all candidate Concats or
none) and the plan lists the ones it made views (`Plan.concat_views`).

Training fusion: a BatchNormalization that only a ReLU reads may run that ReLU itself (attr relu), and its
backward the ReLU's (the gradient masked where the ReLU's input, recomputed from x and the saved statistics, is
not positive: cuDNN fuses that pattern, and the backward needs no ReLU output), so neither the
BatchNormalization's output nor the gradient there is written and read once more, and two kernels fewer run per
layer (GoogLeNet training: 114 of its ops). Where a residual Add sits between them (ResNet's block ends), the
BatchNormalization adds the residual too and only the forward fuses: the ReLU's backward output is also the
residual's gradient, so it is written all the same. A ReLU backward may also add up the gradients that a `sum`
made for it alone (`with_relu_sums`: ResNet's block outputs). Solve fuses them where the profile measured the
fused ops (`Plan.bn_relu_fused`, `Plan.relu_sums_fused`).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from planner import ops
from planner.files import PlannerError
from planner.ir import ITEMSIZE, Graph, Node, finalize, record_saved_for_backward

SLICE_ALIGN_BYTES = 16


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
        add = graph.only_consumer(y, "add")
        if add is not None and add.name not in replace and (z := _residual(graph, add, y)) is not None:
            chain.append(add)
            inputs.append(z)
            attrs["residual"], y = True, add.outputs[0]
        relu = graph.only_consumer(y, "relu")
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


def _grad_slices(graph: Graph, concat: Node) -> dict[str, Node]:
    """Input -> the backward `slice` of the Concat's gradient that is its gradient (training graphs)."""
    starts = itertools.accumulate((graph.tensors[x].shape[1] for x in concat.inputs), initial=0)
    by_start = dict(zip(starts, concat.inputs))
    return {by_start[n.attrs["start"]]: n for n in graph.nodes
            if n.kind == "slice" and n.forward_of == concat.name and n.attrs["start"] in by_start}


def _writes_in_place(graph: Graph, concat: Node, x: str, grads: dict[str, Node]) -> bool:
    """Whether `x`'s producer can write it as a channel slice of the Concat's output, and its other readers read
    it there: a conv_fused read by nothing else; a ReLU read besides only by its relu_bwd, whose gradient operand
    is then the slice_view of the Concat's gradient (so both of its inputs have the same pitch); or a
    BatchNormalization running its ReLU, read by nothing else, whose backward then reads that slice_view."""
    producer = graph.node_by_name.get(graph.tensors[x].producer or "")
    if producer is None or x in graph.outputs:
        return False
    if producer.kind == "conv_fused":
        return graph.only_consumer(x, "concat") is concat
    readers = [graph.node_by_name[c] for c in graph.tensors[x].consumers if c != concat.name]
    if producer.kind == "relu":
        if not all(r.kind == "relu_bwd" and r.inputs[0] == x for r in readers) or len(readers) > 1:
            return False
        if not readers:
            return True
        backward = readers[0]
    elif producer.kind == "batchnorm" and producer.attrs.get("relu") and not readers:
        backward = next((n for n in graph.nodes if n.kind == "batchnorm_bwd" and n.forward_of == producer.name), None)
    else:
        return False
    grad = grads.get(x)
    if grad is None or backward is None or [backward.name] != graph.tensors[grad.outputs[0]].consumers:
        return False
    dy = graph.tensors[grad.inputs[0]]
    return backward.inputs[1] == grad.outputs[0] and graph.tensors[graph.storage_of(grad.inputs[0])].shape == dy.shape


def concat_view_candidates(graph: Graph) -> list[str]:
    """Concats along channels (4-D, axis 1) whose inputs are distinct tensors their producers can write in place
    (`_writes_in_place`), each starting on a 16-byte boundary (cuDNN and the 16-byte pointwise kernels assume
    aligned tensors): those that can be concat_views."""
    names = []
    for node in graph.nodes:
        y = graph.tensors[node.outputs[0]]
        if node.kind != "concat" or node.attrs.get("axis") != 1 or len(y.shape) != 4:
            continue
        if len(set(node.inputs)) != len(node.inputs):
            continue
        grads = _grad_slices(graph, node)
        if not all(_writes_in_place(graph, node, x, grads) for x in node.inputs):
            continue
        starts = itertools.accumulate((graph.tensors[x].shape[1] for x in node.inputs), initial=0)
        if all(c * ITEMSIZE[y.dtype] % SLICE_ALIGN_BYTES == 0 for c in starts):
            names.append(node.name)
    return names


def with_concat_views(graph: Graph, names: list[str]) -> Graph:
    """A copy of the graph in which the named concats are concat_views: input i is `alias_of` the output at
    `channel_offset`, and its producer (and a ReLU's backward) carries `concat_channels`, so the profile measures
    it writing (reading) with that pixel stride; in training the Concat's gradient slices become slice_views. The
    graph itself when `names` is empty."""
    if not names:
        return graph
    unknown = set(names) - set(concat_view_candidates(graph))
    if unknown:
        raise PlannerError(f"concat {sorted(unknown)[0]!r} cannot be written in place in {graph.model_name} "
                           "(the plan was made for another graph)")
    graph = graph.model_copy(deep=True)
    for name in names:
        node = graph.node_by_name[name]
        y, offset, grads = graph.tensors[node.outputs[0]], 0, _grad_slices(graph, node)
        node.kind, node.attrs = "concat_view", {}
        for x in node.inputs:
            producer = graph.node_by_name[graph.tensors[x].producer]
            readers = [graph.node_by_name[c] for c in graph.tensors[x].consumers if c != name]
            graph.tensors[x].alias_of, graph.tensors[x].channel_offset = node.outputs[0], offset
            for n in [producer, *readers]:
                n.attrs = dict(n.attrs, concat_channels=y.shape[1])
            if x in grads:
                grad = grads[x]
                for n in graph.tensors[grad.outputs[0]].consumers:  # the producer's backward reads it in place
                    reader = graph.node_by_name[n]
                    reader.attrs = dict(reader.attrs, concat_channels=y.shape[1])
                grad.kind = "slice_view"
                dx = graph.tensors[grad.outputs[0]]
                dx.alias_of, dx.channel_offset = grad.inputs[0], offset
            offset += graph.tensors[x].shape[1]
    return finalize(graph)


def concat_view_nodes(graph: Graph) -> list[Node]:
    """The nodes that read or write a channel slice when every candidate concat is a view (strided convs, ReLUs
    and ReLU backwards): the profile measures them beside the graph's own, so solve can weigh writing in place
    (no concat copy, strided kernels) against not."""
    viewed = with_concat_views(graph, concat_view_candidates(graph))
    return [n for n in viewed.nodes if "concat_channels" in n.attrs]


class _BnRelu(NamedTuple):
    """A BatchNormalization that can run the ReLU after it, the residual Add between them if any, and the
    backwards: with no Add, both backwards fuse too; with one, the ReLU's backward stays (its gradient is also
    the residual's)."""

    bn: Node
    add: Node | None
    relu: Node
    relu_bwd: Node
    bn_bwd: Node


def _bn_relu_chains(graph: Graph) -> dict[str, _BnRelu]:
    """BatchNormalization name -> its chain (`_BnRelu`) where the ReLU can run inside it: a training graph's
    BatchNormalization whose output only the ReLU reads, or only an Add of a same-shape residual that only the
    ReLU reads, and whose gradient the ReLU's backward makes (and, without the Add, only its own backward reads).
    An Add of two BatchNormalizations' outputs goes to the first."""
    grads = {n.forward_of: n for n in graph.nodes if n.kind in ("relu_bwd", "batchnorm_bwd")}
    chains, adds = {}, set()
    for bn in graph.nodes:
        if bn.kind != "batchnorm" or not bn.attrs.get("training") or bn.attrs.get("relu") or bn.phase != "forward":
            continue
        y, add = bn.outputs[0], graph.only_consumer(bn.outputs[0], "add")
        if add is not None and (add.name in adds or _residual(graph, add, y) is None):
            continue
        relu = graph.only_consumer(add.outputs[0] if add else y, "relu")
        relu_bwd, bn_bwd = grads.get(relu.name) if relu else None, grads.get(bn.name)
        if relu is None or relu.attrs or relu_bwd is None or bn_bwd is None or relu_bwd.inputs[0] != relu.outputs[0]:
            continue
        dy = relu_bwd.outputs[0]
        if bn_bwd.inputs[1] == dy and (add is not None or graph.tensors[dy].consumers == [bn_bwd.name]):
            chains[bn.name] = _BnRelu(bn, add, relu, relu_bwd, bn_bwd)
            adds |= {add.name} if add else set()
    return chains


def bn_relu_candidates(graph: Graph) -> list[str]:
    """The BatchNormalizations that can run the ReLU after them (`with_bn_relu`), in graph order."""
    return list(_bn_relu_chains(graph))


def with_bn_relu(graph: Graph, names: list[str]) -> Graph:
    """A copy of the graph in which each named BatchNormalization writes its ReLU's output (attr relu). Without
    a residual Add between them, its backward takes the ReLU's output gradient and the bias ([x, dr, scale,
    saved_mean, saved_invstd, bias], attr relu), and the ReLU, its backward and the two tensors between them go.
    With one, it also takes the residual (attr residual: relu(bn(x) + z), z its last input) and takes the place
    of the ReLU, where z is computed; the Add, the ReLU and their outputs go, and the ReLU's backward now
    differentiates it. The graph itself when `names` is empty."""
    if not names:
        return graph
    chains = _bn_relu_chains(graph)
    unknown = [n for n in names if n not in chains]
    if unknown:
        raise PlannerError(f"batchnorm {unknown[0]!r} cannot run its ReLU in {graph.model_name} "
                           "(the plan was made for another graph)")
    graph = graph.model_copy(deep=True)
    by_name, dropped, moved = graph.node_by_name, set(), {}
    for name in names:
        bn, add, relu, relu_bwd, bn_bwd = (by_name[n.name] if n else None for n in chains[name])
        y, r = bn.outputs[0], relu.outputs[0]
        bn.outputs[0], bn.attrs = r, dict(bn.attrs, relu=1)
        if add is not None:
            bn.inputs.append(_residual(graph, add, y))
            bn.attrs["residual"] = 1
            relu_bwd.forward_of, moved[relu.name] = bn.name, bn
            dropped |= {bn.name, add.name}
            del graph.tensors[y], graph.tensors[add.outputs[0]]
            continue
        dy, dr = relu_bwd.outputs[0], relu_bwd.inputs[1]
        bn_bwd.inputs = [bn_bwd.inputs[0], dr, *bn_bwd.inputs[2:5], bn.inputs[2]]
        bn_bwd.attrs = dict(bn_bwd.attrs, relu=1)
        dropped |= {relu.name, relu_bwd.name}
        del graph.tensors[y], graph.tensors[dy]
    graph.nodes = [moved.get(n.name, n) for n in graph.nodes if n.name not in dropped]
    finalize(graph)
    record_saved_for_backward(graph)
    for n in graph.nodes:
        if n.kind in ("batchnorm", "batchnorm_bwd") and n.attrs.get("relu"):
            n.flops = ops.flops(n.kind, [graph.tensors[t].shape for t in n.inputs],
                                [graph.tensors[t].shape for t in n.outputs], n.attrs)
    return graph


def bn_relu_nodes(fused: Graph) -> list[Node]:
    """The BatchNormalizations running their ReLUs, and their backwards, in a graph `with_bn_relu` made: the
    profile measures them beside the graph's own, and solve fuses where it did."""
    return [n for n in fused.nodes if n.kind in ("batchnorm", "batchnorm_bwd") and n.attrs.get("relu")]


MAX_SUMMED_GRADIENTS = 7  # runner/ops/elementwise.py relu_bwd_sum's operands


def relu_sum_candidates(graph: Graph) -> list[str]:
    """The ReLU backwards whose output gradient a `sum` of at most 7 same-shape gradients makes for them alone:
    those that can add them up themselves (`with_relu_sums`; ResNet's block outputs, read by the next block's
    conv and residual Add)."""
    names = []
    for n in graph.nodes:
        total = graph.node_by_name.get(graph.tensors[n.inputs[-1]].producer or "") if n.kind == "relu_bwd" else None
        if (total is None or total.kind != "sum" or len(n.inputs) != 2 or n.attrs
                or graph.tensors[total.outputs[0]].consumers != [n.name]
                or len(total.inputs) > MAX_SUMMED_GRADIENTS
                or any(graph.tensors[t].shape != graph.tensors[n.inputs[1]].shape for t in total.inputs)):
            continue
        names.append(n.name)
    return names


def with_relu_sums(graph: Graph, names: list[str]) -> Graph:
    """A copy of the graph in which each named ReLU backward takes the gradients the `sum` before it added up
    ([y, dy1, ..., dyk]: one pass that reads them once, where the sum wrote its total and the ReLU's backward read
    it back); the sum and its total go. The graph itself when `names` is empty."""
    if not names:
        return graph
    unknown = set(names) - set(relu_sum_candidates(graph))
    if unknown:
        raise PlannerError(f"ReLU backward {sorted(unknown)[0]!r} cannot add up its gradients in "
                           f"{graph.model_name} (the plan was made for another graph)")
    graph = graph.model_copy(deep=True)
    dropped = set()
    for name in names:
        relu_bwd = graph.node_by_name[name]
        total = graph.node_by_name[graph.tensors[relu_bwd.inputs[1]].producer]
        relu_bwd.inputs = [relu_bwd.inputs[0], *total.inputs]
        dropped.add(total.name)
        del graph.tensors[total.outputs[0]]
    graph.nodes = [n for n in graph.nodes if n.name not in dropped]
    return finalize(graph)


def relu_sum_nodes(summed: Graph) -> list[Node]:
    """The ReLU backwards that add up their gradients in a graph `with_relu_sums` made (for the profile)."""
    return [n for n in summed.nodes if n.kind == "relu_bwd" and len(n.inputs) > 2]


def as_planned(graph: Graph, bn_relu_fused: list[str], concat_views: list[str], relu_sums: list[str]) -> Graph:
    """The graph as a plan runs it: its BatchNormalizations fused with their ReLUs, its ReLU backwards adding up
    their gradients, then its concats as views."""
    return with_concat_views(with_relu_sums(with_bn_relu(graph, bn_relu_fused), relu_sums), concat_views)
