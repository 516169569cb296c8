"""Deep recomputations (planner/deep.py): a recomputation that re-runs the chains of the tensors it reads, offered
per tensor, taken only where the list schedule gets cheaper under the cap, and every such plan checks."""

from __future__ import annotations

import pytest
from test_solver import H100, MODELS, _plan_of

from planner.analytic import estimate_profile
from planner.check import check_plan
from planner.decisions import best_heuristic, fit_slack
from planner.deep import deep_recomputations, with_deep
from planner.heuristic import cost, list_schedule
from planner.onnx_import import import_onnx
from planner.plan import FUSED_RECOMPUTE
from planner.problem import build_problem
from planner.schedule import peak_memory, timed
from planner.training import build_training


@pytest.fixture(scope="module")
def googlenet_b1():
    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=1, dtype="fp16", training=True))
    return build_problem(g, estimate_profile(g, H100))


def _named(p, name):
    return next(t for t, u in enumerate(p.tensors) if u.name == name)


def test_a_deep_recomputation_reruns_the_convolution_its_chain_reads(googlenet_b1):
    """conv1's ReLU output is recomputed from conv1's output (BatchNormalization and ReLU as one fused kernel);
    its deep way re-runs conv1 from the batch first, conv1's output held in its workspace, and reads neither."""
    p = googlenet_b1
    relu, conv = _named(p, "/conv1/Relu_output_0"), _named(p, "/conv1/conv/Conv_output_0")
    tu = p.tensors[relu]
    assert conv in tu.recompute_reads and tu.recompute.name.startswith(FUSED_RECOMPUTE)
    chain, reads, (alternative, *_) = tu.deep
    assert chain == p.tensors[conv].recompute_chain + tu.recompute_chain
    assert conv not in reads and set(p.tensors[conv].recompute_reads) <= set(reads)
    first, fused = alternative.name.split("+")  # the convolution, then the fused tail
    assert fused.startswith(FUSED_RECOMPUTE) and not first.startswith(FUSED_RECOMPUTE)
    assert alternative.time_us > tu.recompute.time_us and alternative.workspace_bytes >= p.tensors[conv].bytes
    assert p.tensors[conv].deep is None  # conv1's own chain reads only the batch


def test_with_deep_changes_only_the_tensors_it_is_given(googlenet_b1):
    p = googlenet_b1
    relu = _named(p, "/conv1/Relu_output_0")
    q = with_deep(p, {relu})
    chain, reads, alternatives = p.tensors[relu].deep
    assert (q.tensors[relu].recompute_chain, q.tensors[relu].recompute_reads,
            q.tensors[relu].recompute_alternatives) == (chain, reads, alternatives)
    assert all(q.tensors[t] is p.tensors[t] for t in range(len(p.tensors)) if t != relu)
    assert p.tensors[relu].recompute_chain != chain  # the problem given is left alone


def test_a_schedule_with_a_deep_recomputation_checks(googlenet_b1):
    """Recomputing conv1's output and its ReLU output the deep way: the ReLU output's recomputation reads the
    batch (copied back), not conv1's output, and the plan passes the independent check."""
    p = googlenet_b1
    relu, conv, batch = (_named(p, n) for n in ("/conv1/Relu_output_0", "/conv1/conv/Conv_output_0", "input"))
    q = with_deep(p, {relu})
    s = list_schedule(q, 1 << 40, 4, {relu: "recompute", conv: "recompute", batch: "offload"}).schedule
    tm = timed(q, s)
    assert tm.h2d[batch][1] <= tm.recompute[relu][0]
    plan = _plan_of(q, s, 1 << 40)
    (op,) = [o for o in plan.ops if o.recompute_of == "/conv1/Relu_output_0"]
    assert len(op.recompute_nodes) == 3 and "/conv1/conv/Conv_output_0" not in op.reads
    assert check_plan(plan).ok


def test_deep_recomputations_speed_up_googlenet_at_35_percent_and_leave_50_percent_alone(googlenet_train_b32):
    """GoogLeNet training b32 fp16 (measured H100 profile, concats as views), the heuristic's plan under the
    solver caps of 35% and 50% of its serial peak: at 35% re-running conv1 to recompute its ReLU output (instead
    of offloading that output) makes the list schedule over 20% cheaper within the cap; at 50% nothing gains."""
    p = googlenet_train_b32
    slack = fit_slack(p, 4)
    for mib, gains in ((213.13, True), (318.72, False)):
        cap = int(mib * 2**20)
        hint = best_heuristic(p, cap, 4, slack, refined=True)
        deeper = deep_recomputations(p, cap, 4, hint, slack)
        assert (deeper is not None) == gains
        if gains:
            q, s = deeper
            assert cost(q, s) < 0.8 * cost(p, hint)
            assert peak_memory(q, s.decision, timed(q, s))[0] <= cap
            deep = [t for t in range(len(p.tensors)) if q.tensors[t] is not p.tensors[t]]
            assert "/conv1/Relu_output_0" in {p.tensors[t].name for t in deep}
            assert all(s.decision[t] == "recompute" for t in deep)
            assert check_plan(_plan_of(q, s, cap)).ok
