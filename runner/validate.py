"""Validation of a plan's iteration against the NumPy reference (planner/reference), on the same random weights
and inputs rounded to the device dtypes.

End to end: inference outputs, or the training loss, against a reference run whose every op output is
rounded to its storage dtype. Op by op: each op that writes a checked tensor (in inference every op's output, in
training the weight gradients and updated weights) runs eagerly and its output is compared with the reference
op applied to the device's own inputs.
Weight gradients cannot be judged end to end in fp16: two float64 references that differ only in rounding each stored
tensor to fp16 already disagree on GoogLeNet b32's weight gradients by 32% (median; 172 of 173 over 1e-2),
because ReLU masks flip where activations are near zero and BatchNormalization spreads that through each batch;
where the learning rate makes an update a few percent of a weight (ResNet-50's first layers), the updated
weights inherit it.
"""

from __future__ import annotations

import numpy as np

from planner import reference
from planner.ir import Graph
from planner.report import Check
from runner.executor import Execution
from runner.gpu import gpu
from runner.measure import TOLERANCE as ADMITTED
from runner.ops.common import NUMPY_DTYPE

TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2}  # relative L2 error of the outputs or the loss; fp32 allows TF32


def rounded(graph: Graph, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each value in its tensor's storage dtype (what the device holds)."""
    return {k: np.asarray(v).astype(NUMPY_DTYPE[graph.tensors[k].dtype]) for k, v in values.items()}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), np.asarray(want, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _check(tensor: str, what: str, got: np.ndarray, want: np.ndarray, tolerance: float) -> Check:
    err = relative_error(got, want)
    return Check(tensor=tensor, what=what, relative_error=err, tolerance=tolerance, passed=err <= tolerance)


def _float64(x: np.ndarray) -> np.ndarray:
    """Floats widened for the reference; integer tensors (labels) as they are."""
    return x.astype(np.float64) if x.dtype.kind == "f" else x


def end_to_end(exe: Execution, graph: Graph, host_values: dict[str, np.ndarray]) -> list[Check]:
    """After one iteration from `host_values`: the outputs, or the loss, against the reference. An output's bar
    is the one the profiler admitted each op's algorithm at (runner.measure), since one such op can put the
    output there; the ops themselves are held to it on their own inputs (`outputs_op_by_op`). ResNet-50
    inference b32 fp16 on the H200: logits 1.03e-2 and 7.71e-3 in two runs, every op within 3.7e-4."""
    env = reference.run(graph, {k: _float64(v) for k, v in host_values.items()}, round_to_storage=True)
    if not graph.training:
        wanted, tolerance = [(t, "output") for t in graph.outputs], ADMITTED[graph.dtype]
    else:
        wanted = [(n.outputs[0], "loss") for n in graph.nodes if n.kind == "softmax_xent"]
        tolerance = TOLERANCE[graph.dtype]
    return [_check(t, what, gpu().cp.asnumpy(exe.array(None, t)), env[t], tolerance) for t, what in wanted]


def weights_op_by_op(exe: Execution, graph: Graph) -> list[Check]:
    """Training: every op that writes a gradient some SGD update reads, and every SGD update, against the
    reference op on the inputs the device gave it, within the error the profiler admitted the op's algorithm
    with (runner.measure): a stricter bar fails plans on algorithms the profile offers (GoogLeNet training b32
    fp32: TF32 weight gradients at 1.0-1.3e-3, within TF32's rounding of both operands, 2 x 2^-11, times the
    sums' cancellation)."""
    sgd = [n for n in graph.nodes if n.kind == "sgd"]
    checked = {dw: "weight_gradient" for n in sgd for dw in n.inputs[1::3]}
    return _op_by_op(exe, graph, checked | {w: "updated_weight" for n in sgd for w in n.outputs[0::2]})


def outputs_op_by_op(exe: Execution, graph: Graph) -> list[Check]:
    """Inference: every op's outputs against the reference op on the inputs the device gave it, within the
    error the profiler admitted its algorithm with: a wrong op shows as itself, not as a distance at the
    outputs that the ops after it compound."""
    return _op_by_op(exe, graph, {t: "activation" for n in graph.nodes for t in n.outputs})


def _op_by_op(exe: Execution, graph: Graph, checked: dict[str, str]) -> list[Check]:
    """One eager iteration in the plan's launch order; each op that writes a `checked` tensor runs alone, its
    inputs copied before it runs (some ops write in place), and its outputs are compared with the reference
    op's on those inputs."""
    cp = gpu().cp
    sync = cp.cuda.Device().synchronize
    tolerance = ADMITTED[graph.dtype]
    checks = []
    exe.begin()
    for launch in exe.order:
        kind, i = exe.key[id(launch.item)]
        op = exe.plan.ops[i] if kind == "op" else None
        node = exe.graph.node_by_name[op.node] if op and not op.recompute_of else None  # as the plan runs it
        if node is None or not checked.keys() & set(node.outputs):
            exe.issue_item(launch)
            continue
        sync()
        inputs = [cp.asnumpy(exe.array(("op", i), t)) for t in node.inputs]
        exe.issue_item(launch)
        sync()
        want = reference.KERNELS[node.kind]([_float64(x) for x in inputs], node.attrs)
        for t, w in zip(node.outputs, want):
            if t in checked:
                checks.append(_check(t, checked[t], cp.asnumpy(exe.array(("op", i), t)),
                                     w.astype(NUMPY_DTYPE[exe.graph.tensors[t].dtype]), tolerance))
    exe.end()
    sync()
    return checks
