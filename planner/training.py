"""Forward DAG -> one training iteration: loss, a backward op per forward op, SGD-with-momentum updates.

Backward ops are explicit nodes so the solver can schedule them like any other: a convolution's data
gradient and weight gradient are separate, independent nodes; a tensor read by several ops gets its
gradients summed by one `sum` node; Add fans its gradient out without a copy.
"""

from __future__ import annotations

from planner import ops
from planner.files import PlannerError
from planner.ir import Graph, Node, Tensor, finalize, record_saved_for_backward

LABELS = "labels"
LOSS = "loss"
LOSS_OP = "softmax_xent"  # the loss node: training plans split into the passes before it and from it on


def grad_name(tensor: str) -> str:
    return f"grad:{tensor}"


LOSS_SCALE = {"fp16": 1024.0, "fp32": 1.0}


def build_training(forward: Graph, lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0,
                   loss_scale: float | None = None) -> Graph:
    """One iteration (forward, softmax cross-entropy loss, backward, update) from a forward graph.

    fp16 gradients are computed for the loss times `loss_scale` (static loss scaling, default 1024 for fp16)
    and unscaled by the SGD update: unscaled, the output gradient (softmax - onehot) / batch is mostly below
    fp16's normal range and deep layers' gradients lose most of their bits (measured on ResNet-50 b32: weight
    gradients up to 65% off the float64 reference). The momentum buffers are fp32 (master optimizer state)."""
    if any(n.phase != "forward" for n in forward.nodes):
        raise PlannerError("graph already holds a training iteration")
    bad = [n.name for n in forward.nodes if n.kind == "batchnorm" and not n.attrs["training"]]
    if bad:
        raise PlannerError(f"BatchNormalization {bad[0]!r} is in inference mode; import the model with training=True")
    if len(forward.outputs) != 1 or len(forward.tensors[forward.outputs[0]].shape) != 2:
        raise PlannerError("training needs a single [batch, classes] logits output")
    scale = LOSS_SCALE[forward.dtype] if loss_scale is None else loss_scale
    return _Backward(forward, lr, momentum, weight_decay, scale).build()


class _Backward:
    def __init__(self, fwd: Graph, lr: float, momentum: float, weight_decay: float, loss_scale: float):
        self.fwd = fwd
        self.loss_scale = loss_scale
        self.sgd_attrs = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "grad_unscale": 1 / loss_scale}
        self.tensors = {k: v.model_copy(deep=True) for k, v in fwd.tensors.items()}
        self.nodes = [n.model_copy(deep=True) for n in fwd.nodes]
        self.contributions: dict[str, list[str]] = {}
        self.needs_grad = self._needs_grad()

    def _needs_grad(self) -> dict[str, bool]:
        """A tensor needs a gradient if it is a weight or computed from one."""
        need = {name: t.role == "weight" for name, t in self.tensors.items()}
        for n in self.fwd.nodes:
            flag = any(need[i] for i in n.inputs)
            for o in n.outputs:
                need[o] = flag and self.tensors[o].role == "activation" and self.tensors[o].dtype != "uint8"
        return need

    def new_tensor(self, name: str, like: str, role: str | None = None, shape=None, alias_of=None) -> str:
        src = self.tensors[like]
        if role is None:
            role = "weight_gradient" if src.role == "weight" else "gradient"
        self.tensors[name] = Tensor(name=name, shape=list(shape or src.shape), dtype=src.dtype, role=role,
                                    alias_of=alias_of)
        return name

    def emit(self, kind: str, inputs: list[str], outputs: list[str], attrs: dict, forward_of: str | None,
             phase: str = "backward", suffix: str = "", name: str | None = None) -> None:
        name = name or f"{kind}:{forward_of}{suffix}"
        self.nodes.append(Node(name=name, kind=kind, inputs=inputs, outputs=outputs, attrs=attrs, phase=phase,
                               forward_of=forward_of))

    def contribute(self, tensor: str, grad: str) -> None:
        if self.needs_grad.get(tensor):
            self.contributions.setdefault(tensor, []).append(grad)

    def gradient(self, tensor: str) -> str | None:
        """The gradient of `tensor`, summing its contributions with one `sum` node if there are several."""
        parts = self.contributions.get(tensor)
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        total = self.new_tensor(grad_name(tensor), tensor)
        self.emit("sum", parts, [total], {}, None, name=f"sum:{tensor}")
        return total

    def out_grad(self, node: Node, input_index: int) -> str:
        """A new tensor for the gradient of node.inputs[input_index] that this node's backward produces."""
        x = node.inputs[input_index]
        where = node.name if node.inputs.count(x) == 1 else f"{node.name}/{input_index}"
        return self.new_tensor(f"{grad_name(x)}@{where}", x)

    def build(self) -> Graph:
        fwd = self.fwd
        logits = fwd.outputs[0]
        batch = self.tensors[logits].shape[0]
        self.tensors[LABELS] = Tensor(name=LABELS, shape=[batch], dtype="int64", role="label")
        self.tensors[LOSS] = Tensor(name=LOSS, shape=[], dtype="fp32", role="activation")
        probs = self.new_tensor(f"{logits}.probs", logits, role="activation")
        self.tensors[probs].dtype = "fp32"
        self.emit("softmax_xent", [logits, LABELS], [LOSS, probs], {}, None, phase="loss", name=LOSS_OP)
        d_logits = self.new_tensor(f"{grad_name(logits)}@softmax_xent", logits)
        self.emit("softmax_xent_bwd", [probs, LABELS], [d_logits], {"loss_scale": self.loss_scale}, None,
                  name="softmax_xent_bwd")
        self.contribute(logits, d_logits)

        for node in reversed(fwd.nodes):
            dys = [self.gradient(o) for o in node.outputs]
            if dys[0] is None or not any(self.needs_grad.get(i) for i in node.inputs):
                continue
            getattr(self, f"_{node.kind}")(node, dys[0])

        self._updates()
        graph = Graph(model_name=fwd.model_name, source_sha256=fwd.source_sha256, batch=fwd.batch, dtype=fwd.dtype,
                      training=True, inputs=fwd.inputs + [LABELS], outputs=[LOSS], nodes=self.nodes,
                      tensors=self.tensors)
        finalize(graph)
        for n in graph.nodes:
            n.flops = ops.flops(n.kind, [graph.tensors[t].shape for t in n.inputs],
                                [graph.tensors[t].shape for t in n.outputs], n.attrs)
        record_saved_for_backward(graph)
        return graph

    def _updates(self) -> None:
        """One `sgd` op per layer, updating all its weights in one launch: a conv's weights and those of the
        BatchNormalization right after it, or one node's weights. Per weight, GoogLeNet would have 173 launches
        of a few microseconds each, every one holding a stream."""
        layers: dict[str, list[tuple[str, str]]] = {}
        for name, t in list(self.tensors.items()):
            if t.role == "weight" and (dw := self.gradient(name)) is not None:
                layers.setdefault(self._layer_of(name), []).append((name, dw))
        for layer, weights in layers.items():
            inputs, outputs = [], []
            for name, dw in weights:
                v = self.new_tensor(f"momentum:{name}", name, role="optimizer_state")
                w_new = self.new_tensor(f"{name}.updated", name, role="weight", alias_of=name)
                v_new = self.new_tensor(f"momentum:{name}.updated", name, role="optimizer_state", alias_of=v)
                self.tensors[v].dtype = self.tensors[v_new].dtype = "fp32"
                inputs += [name, dw, v]
                outputs += [w_new, v_new]
            self.emit("sgd", inputs, outputs, dict(self.sgd_attrs), None, phase="update", name=f"sgd:{layer}")

    def _layer_of(self, weight: str) -> str:
        """The forward node whose layer `weight` belongs to: the first node reading it, or the conv whose output
        alone feeds that BatchNormalization."""
        fwd = self.fwd
        node = fwd.node_by_name[fwd.tensors[weight].consumers[0]]
        conv = fwd.node_by_name.get(fwd.tensors[node.inputs[0]].producer) if node.kind == "batchnorm" else None
        if conv is not None and conv.kind == "conv" and fwd.only_consumer(conv.outputs[0], "batchnorm") is node:
            return conv.name
        return node.name

    # One backward rule per forward op kind.

    def _conv(self, n: Node, dy: str) -> None:
        x, w = n.inputs[0], n.inputs[1]
        if self.needs_grad[x]:
            dx = self.out_grad(n, 0)
            self.emit("conv_bwd_data", [dy, w], [dx], {**n.attrs, "x_shape": self.tensors[x].shape}, n.name)
            self.contribute(x, dx)
        if self.needs_grad[w]:
            dw = self.out_grad(n, 1)
            self.emit("conv_bwd_filter", [x, dy], [dw], {**n.attrs, "w_shape": self.tensors[w].shape}, n.name)
            self.contribute(w, dw)
        if len(n.inputs) > 2 and self.needs_grad[n.inputs[2]]:
            db = self.out_grad(n, 2)
            self.emit("bias_grad", [dy], [db], {"axis": 1}, n.name)
            self.contribute(n.inputs[2], db)

    def _batchnorm(self, n: Node, dy: str) -> None:
        x, scale, bias = n.inputs[:3]
        saved_mean, saved_invstd = n.outputs[3], n.outputs[4]
        grads = [self.out_grad(n, 0), self.out_grad(n, 1), self.out_grad(n, 2)]
        self.emit("batchnorm_bwd", [x, dy, scale, saved_mean, saved_invstd], grads,
                  {"epsilon": n.attrs["epsilon"]}, n.name)
        for t, g in zip((x, scale, bias), grads):
            self.contribute(t, g)

    def _pointwise_bwd(self, kind: str, n: Node, saved: str, dy: str, attrs: dict | None = None) -> None:
        dx = self.out_grad(n, 0)
        self.emit(kind, [saved, dy], [dx], attrs or {}, n.name)
        self.contribute(n.inputs[0], dx)

    def _relu(self, n, dy):
        self._pointwise_bwd("relu_bwd", n, n.outputs[0], dy)

    def _clip(self, n, dy):
        self._pointwise_bwd("clip_bwd", n, n.inputs[0], dy, dict(n.attrs))

    def _sigmoid(self, n, dy):
        self._pointwise_bwd("sigmoid_bwd", n, n.outputs[0], dy)

    def _softmax(self, n, dy):
        self._pointwise_bwd("softmax_bwd", n, n.outputs[0], dy, dict(n.attrs))

    def _lrn(self, n, dy):
        self._pointwise_bwd("lrn_bwd", n, n.inputs[0], dy, dict(n.attrs))

    def _maxpool(self, n, dy):
        self._pointwise_bwd("maxpool_bwd", n, n.inputs[0], dy, dict(n.attrs))

    def _dropout(self, n, dy):
        dx = self.out_grad(n, 0)
        self.emit("dropout_bwd", [dy, n.outputs[1]], [dx], {"ratio": n.attrs["ratio"]}, n.name)
        self.contribute(n.inputs[0], dx)

    def _shape_only_bwd(self, kind: str, n: Node, dy: str, attrs: dict) -> None:
        dx = self.out_grad(n, 0)
        self.emit(kind, [dy], [dx], attrs, n.name)
        self.contribute(n.inputs[0], dx)

    def _avgpool(self, n, dy):
        self._shape_only_bwd("avgpool_bwd", n, dy, {**n.attrs, "x_shape": self.tensors[n.inputs[0]].shape})

    def _globalavgpool(self, n, dy):
        self._shape_only_bwd("globalavgpool_bwd", n, dy, {"x_shape": self.tensors[n.inputs[0]].shape})

    def _reshape(self, n, dy):
        x = n.inputs[0]
        dx = self.new_tensor(f"{grad_name(x)}@{n.name}", x, alias_of=dy)
        self.emit("reshape", [dy], [dx], {"shape": self.tensors[x].shape}, n.name)
        self.contribute(x, dx)

    def _concat(self, n, dy):
        axis, start = n.attrs["axis"], 0
        for i, x in enumerate(n.inputs):
            end = start + self.tensors[x].shape[axis]
            if self.needs_grad[x]:
                dx = self.out_grad(n, i)
                self.emit("slice", [dy], [dx], {"axis": axis, "start": start, "end": end}, n.name, suffix=f"/{i}")
                self.contribute(x, dx)
            start = end

    def _unbroadcast(self, n: Node, index: int, grad: str, suffix: str) -> None:
        """Contribute `grad` (shaped like the output) to input `index`, summing broadcast axes if needed."""
        x = n.inputs[index]
        if self.tensors[grad].shape != self.tensors[x].shape:
            reduced = self.out_grad(n, index)
            self.emit("reduce_to_shape", [grad], [reduced], {"shape": self.tensors[x].shape}, n.name, suffix=suffix)
            grad = reduced
        self.contribute(x, grad)

    def _add(self, n, dy):
        for i, x in enumerate(n.inputs):
            if self.needs_grad[x]:
                self._unbroadcast(n, i, dy, f"/{i}")

    def _mul(self, n, dy):
        for i, x in enumerate(n.inputs):
            if not self.needs_grad[x]:
                continue
            other = n.inputs[1 - i]
            prod = self.new_tensor(f"{grad_name(x)}@{n.name}/{i}/full", n.outputs[0], role="gradient")
            self.emit("mul", [dy, other], [prod], {}, n.name, suffix=f"/{i}")
            self._unbroadcast(n, i, prod, f"/{i}")

    def _gemm(self, n, dy):
        ta, tb, alpha = n.attrs["transA"], n.attrs["transB"], n.attrs["alpha"]
        a, b = n.inputs[0], n.inputs[1]
        if self.needs_grad[a]:
            da = self.out_grad(n, 0)
            lhs, rhs, t = ((dy, b, (0, 1 - tb)) if not ta else (b, dy, (tb, 1)))
            self.emit("gemm", [lhs, rhs], [da], {"transA": t[0], "transB": t[1], "alpha": alpha, "beta": 0.0},
                      n.name, suffix="/dA")
            self.contribute(a, da)
        if self.needs_grad[b]:
            db = self.out_grad(n, 1)
            lhs, rhs, t = ((a, dy, (1 - ta, 0)) if not tb else (dy, a, (1, ta)))
            self.emit("gemm", [lhs, rhs], [db], {"transA": t[0], "transB": t[1], "alpha": alpha, "beta": 0.0},
                      n.name, suffix="/dB")
            self.contribute(b, db)
        if len(n.inputs) > 2 and self.needs_grad[n.inputs[2]]:
            c = n.inputs[2]
            if n.attrs["beta"] != 1.0:
                raise PlannerError(f"Gemm {n.name!r}: training with beta != 1 is not supported")
            c_shape, y_shape = self.tensors[c].shape, self.tensors[dy].shape
            if c_shape in ([y_shape[1]], [1, y_shape[1]]):
                dc = self.out_grad(n, 2)
                self.emit("bias_grad", [dy], [dc], {"axis": 1}, n.name)
                if len(c_shape) == 2:
                    self.tensors[dc].shape = [y_shape[1]]
                    self._reshape_grad(c, dc, n.name)
                else:
                    self.contribute(c, dc)
            else:
                self._unbroadcast(n, 2, dy, "/dC")

    def _reshape_grad(self, x: str, grad: str, where: str) -> None:
        dx = self.new_tensor(f"{grad_name(x)}@{where}/view", x, alias_of=grad)
        self.emit("reshape", [grad], [dx], {"shape": self.tensors[x].shape}, where, suffix="/view")
        self.contribute(x, dx)

    def _matmul(self, n, dy):
        a, b = n.inputs
        if len(self.tensors[a].shape) != 2 or len(self.tensors[b].shape) != 2:
            raise PlannerError(f"MatMul {n.name!r}: training supports 2-D operands only")
        if self.needs_grad[a]:
            da = self.out_grad(n, 0)
            self.emit("gemm", [dy, b], [da], {"transA": 0, "transB": 1, "alpha": 1.0, "beta": 0.0}, n.name,
                      suffix="/dA")
            self.contribute(a, da)
        if self.needs_grad[b]:
            db = self.out_grad(n, 1)
            self.emit("gemm", [a, dy], [db], {"transA": 1, "transB": 0, "alpha": 1.0, "beta": 0.0}, n.name,
                      suffix="/dB")
            self.contribute(b, db)
