"""Plan + Graph -> a standalone PyTorch module (planner/torch_template.py with the model and plan filled in).

The same builder, with no plan, gives the plain serial PyTorch network used as the benchmark peer, so both
are built from our IR and any imported model can be compared.
"""

from __future__ import annotations

import pprint
from pathlib import Path

from planner.files import PlannerError
from planner.fuse import as_planned
from planner.ir import Graph
from planner.ops import KINDS
from planner.plan import Plan

TEMPLATE = Path(__file__).with_name("torch_template.py")  # read as text: writing the module needs no torch


def forward_graph_dict(graph: Graph) -> dict:
    """The forward ops and persistent tensors in the plain-data form the template reads."""
    forward = [n for n in graph.nodes if n.phase == "forward"]
    if not forward:
        raise PlannerError("graph has no forward ops")
    logits = next((n.inputs[0] for n in graph.nodes if n.kind == "softmax_xent"), graph.outputs[0])
    bn_roles = {}
    for n in forward:
        if n.kind == "batchnorm":
            bn_roles.update({n.inputs[1]: "scale", n.inputs[2]: "bias", n.inputs[4]: "var"})
    persistent = {}
    for n in forward:
        for t in n.inputs:
            tensor = graph.tensors[t]
            if tensor.role in ("weight", "state", "constant"):
                entry = {"shape": tensor.shape, "dtype": tensor.dtype, "role": tensor.role}
                if tensor.value is not None:
                    entry["value"] = tensor.value
                if bn_roles.get(t) in ("scale", "bias"):
                    entry["bn_param"] = bn_roles[t]
                if bn_roles.get(t) == "var":
                    entry["is_var"] = True
                persistent[t] = entry
    return {
        "model_name": graph.model_name, "dtype": graph.dtype, "batch": graph.batch,
        "inputs": [graph.inputs[0]], "outputs": [logits],
        "nodes": {n.name: _torch_node(n) for n in forward},
        "persistent": persistent,
    }


def _torch_node(n) -> list:
    """[kind, inputs, outputs, attrs] as the template runs it: PyTorch cannot write a conv's output into a
    channel slice, so a concat_view is a copying concat there."""
    if n.kind == "concat_view":
        return ["concat", n.inputs, n.outputs, {"axis": 1}]
    return [n.kind, n.inputs, n.outputs, {k: v for k, v in n.attrs.items() if k != "concat_channels"}]


def plan_dict(graph: Graph, plan: Plan | None) -> dict:
    """The plan's forward streams, events and offloads; `graph` as the plan runs it (fuse.as_planned)."""
    forward = {n.name for n in graph.nodes if n.phase == "forward"}
    if plan is None:
        return {"order": [n.name for n in graph.nodes if n.phase == "forward"], "streams": {}, "records": {},
                "waits": {}, "offload": []}
    ops = sorted((op for op in plan.ops if op.node in forward and op.recompute_of is None),
                 key=lambda op: (op.start_us, op.end_us))
    recorded = {op.record_event for op in ops if op.record_event}
    sgd = next((n.attrs for n in graph.nodes if n.kind == "sgd"), None)
    out = {
        "order": [op.node for op in ops],
        "streams": {op.node: op.stream for op in ops},
        "records": {op.node: op.record_event for op in ops if op.record_event},
        "waits": {op.node: [e for e in op.wait_events if e in recorded] for op in ops if op.wait_events},
        "offload": sorted(r.tensor for r in plan.tensors if r.decision == "offload"),
    }
    if sgd:
        out["sgd"] = dict(sgd)
    _insert_views(graph, out)
    missing = forward - set(out["order"])
    if missing:
        raise PlannerError(f"plan does not schedule forward op {sorted(missing)[0]!r}")
    return out


def _insert_views(graph: Graph, out: dict) -> None:
    """Views (Flatten, Reshape, concat_view) are no ops in a plan: each runs right after the last op that makes
    one of its inputs, on that op's stream. A concat_view copies in PyTorch, so it also waits for its other
    inputs' producers and its readers on other streams wait for it."""
    order = out["order"]
    for n in graph.nodes:
        if n.phase != "forward" or not KINDS[n.kind].view:
            continue
        inputs = n.inputs if n.kind == "concat_view" else n.inputs[:1]
        producers = [p for x in inputs if (p := graph.tensors[x].producer) in order]
        at = max((order.index(p) for p in producers), default=-1) + 1
        order.insert(at, n.name)
        if not producers:
            continue
        stream = out["streams"].get(order[at - 1], 0)
        out["streams"][n.name] = stream
        if n.kind != "concat_view":
            continue
        for p in producers:
            if out["streams"].get(p, 0) != stream:
                out["waits"].setdefault(n.name, []).append(out["records"].setdefault(p, f"view:{p}"))
        out["records"][n.name] = f"view:{n.name}"
        for c in graph.tensors[n.outputs[0]].consumers:
            if c in out["streams"] and out["streams"][c] != stream:
                out["waits"].setdefault(c, []).append(f"view:{n.name}")


def torch_module_source(graph: Graph, plan: Plan | None = None) -> str:
    """Python source of the standalone module."""
    if plan is not None and plan.graph_sha256 != graph.graph_sha256:
        raise PlannerError("the plan was made for another model graph")
    if plan is not None:
        graph = as_planned(graph, plan.bn_relu_fused, plan.concat_views, plan.relu_sums_fused)
    source = TEMPLATE.read_text()
    title = (f"{graph.model_name}: batch {graph.batch}, {graph.dtype}, "
             f"{'training' if graph.training else 'inference'}"
             + (f", plan predicted {plan.totals.predicted_us / 1000:.3f} ms on {plan.device_fingerprint}"
                if plan else ", serial (no plan)"))
    source = source.replace("PLAN_TITLE", title, 1)
    source = source.replace("GRAPH: dict = {}  # filled in by the exporter: the forward op DAG",
                            "GRAPH: dict = " + pprint.pformat(forward_graph_dict(graph), width=120, compact=True), 1)
    source = source.replace("PLAN: dict = {}  # filled in by the exporter: streams, events and offloads of the forward ops",
                            "PLAN: dict = " + pprint.pformat(plan_dict(graph, plan), width=120, compact=True), 1)
    return source
