"""Run reports -> the per-op dispatch time and co-running slowdown that make predicted iterations match measured
ones (`planner calibrate`).

A profile times each op alone, replayed back to back on one stream. Inside an iteration's CUDA graph every op
costs more: its kernels wait for the graph to resolve their dependencies (about 0.5 us after an op on the same
stream, 2 us after an event from another stream, measured in H100 replay traces), and ops that run side by side
slow each other down. The first scales with the number of ops, so the planner adds one constant, `dispatch_us`,
to every op's profiled time; the second with what runs beside each op, so plans on several streams settle their
timeline under a slowdown `co_running` (k; planner.co_running). Both are fitted here: each reported plan's
streams and waits are replayed (the check's simulation) with every op's duration raised by a trial dispatch
time and slowed at a trial k, bisection finds the dispatch time whose mean relative error over the runs is zero,
and a bounded search the k whose dispatch time leaves the least squared error (H200 inference b32: k 1.05 took
ten plans from errors up to +15.8% to within -3.3% to +2.2%). Plans on one compute stream run no op beside another
and get a dispatch time of their own, fitted on their runs alone (H100 training b32: 0 us, the serial plans ran
1-6% under their ops' times alone, where plans on four streams need about 2 us an op).

Host copies are slower inside an iteration than alone (H100: 45-53 GB/s against 55 GB/s profiled; they share
the memory system with the kernels), and a plan whose prefetch ends just in time stalls when it runs late. With
`planner run --trace` files, each direction's `copy_slowdown` is fitted first: the traced copies' summed
durations over what the profile priced them at alone. The dispatch fit then replays the plans with copies
re-priced at it.

Copies also slow the compute beside them (H100, ResNet-50 training b32 at 50% memory: the forward pass ran 9%
slower while offloads ran, and the backward fell behind the prefetch chain), by an amount that grows with the
plan's copy time. `copy_interference` is that cost per microsecond of copy: the least-squares slope of what the
replay leaves unexplained in the runs with copies against their copy time, once the dispatch time is fitted on
the runs without (or, when every run copies, by alternating the two fits).

With traces, `traced_slowdowns` sets each op's kernel time inside the iteration against its time alone, by the op's
own SM share (H100, GoogLeNet training: x1.5 below 20% of the SMs beside others).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize_scalar

from planner.check import item_key, simulate
from planner.co_running import settle
from planner.files import PlannerError, load_model, save_model
from planner.plan import Plan
from planner.profile import Profile
from planner.report import RunReport
from planner.store import ProfileStore, measured_stores

MAX_DISPATCH_US = 50.0
MAX_CO_RUNNING = 3.0  # the largest co-running slowdown k the fit tries
DIRECTIONS = ("d2h", "h2d")
ROUNDS = 5  # alternations of the dispatch and interference fits when no run is without copies
GRID_US = 0.1  # time step of the SM-share timeline `traced_slowdowns` builds from a trace
SHARE_BINS = (0.2, 0.4, 0.6, 0.8, 1.0)  # upper edges of the ops' own SM shares in `co_running_rows`
BESIDE = 0.3  # an op runs beside others when their SM share averages at least this over its kernels
ALONE = 0.05  # ... and alone when below this
MIN_EXPOSURE_SPREAD = 0.01  # runs whose co-running costs at k 1 differ by less cannot tell k from run noise
# (about 0.5%; `unidentified_co_running`)
MIN_RANK_GAP = 0.01  # runs of one graph further apart than this differ by their plans, not by run noise (`misranked`)


@dataclass
class Calibrated:
    """One run: the plan, what `planner run` measured, and the simulation at the fitted dispatch time."""

    name: str
    plan: Plan
    measured_us: float
    fitted_us: float = 0.0
    dispatch_us: float = 0.0  # the dispatch time fitted for its kind of plan (one compute stream or several)
    co_running: float = 0.0  # k of the co-running slowdown it is replayed with (planner.co_running)
    copy_slowdown: dict[str, float] = field(default_factory=dict)  # the plan's copies re-priced at these (a
    # direction left out keeps the slowdown the plan was solved with)

    @property
    def predicted_us(self) -> float:
        return self.plan.totals.predicted_us

    @property
    def copy_us(self) -> float:
        """The plan's copies' summed duration at the run's copy slowdown."""
        scale = _copy_scale(self.plan, self.copy_slowdown)
        return sum((c.end_us - c.start_us) * scale[c.direction] for c in self.plan.copies)

    def simulated_us(self, dispatch_us: float, copy_interference: float) -> float:
        return (simulated_makespan_us(self.plan, dispatch_us, self.copy_slowdown, self.co_running)
                + copy_interference * self.copy_us)


def _copy_scale(plan: Plan, copy_slowdown: dict[str, float] | None) -> dict[str, float]:
    priced = plan.totals.copy_slowdown
    return {d: {**priced, **(copy_slowdown or {})}.get(d, 1.0) / priced.get(d, 1.0) for d in DIRECTIONS}


def simulated_makespan_us(plan: Plan, dispatch_us: float, copy_slowdown: dict[str, float] | None = None,
                          co_running: float | None = None) -> float:
    """The plan's iteration replayed with every op's duration re-priced at `dispatch_us` and slowed at
    `co_running` (planner.co_running; None: the k it was solved with), and every copy's at `copy_slowdown` (in
    place of those it was solved with)."""
    k = plan.totals.co_running if co_running is None else co_running
    scale = _copy_scale(plan, copy_slowdown)
    items = [*plan.ops, *plan.copies]
    alone = np.array([*((o.end_us - o.start_us) / o.slowdown - plan.totals.dispatch_us + dispatch_us for o in plan.ops),
                      *((c.end_us - c.start_us) * scale[c.direction] for c in plan.copies)])
    share = np.array([o.sm_fraction for o in plan.ops] + [0.0] * len(plan.copies))

    def replay(duration: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        retimed = plan.model_copy(update={
            "ops": [o.model_copy(update={"end_us": o.start_us + d}) for o, d in zip(plan.ops, duration)],
            "copies": [c.model_copy(update={"end_us": c.start_us + d})
                       for c, d in zip(plan.copies, duration[len(plan.ops):])]})
        times, stuck = simulate(retimed)
        if stuck:
            raise PlannerError(f"the plan of {plan.model_name} deadlocks in simulation: {stuck[0]}")
        span = np.array([times[item_key(it)] for it in items])
        return span[:, 0], span[:, 1]

    return float(settle(alone, share, k if plan.compute_streams > 1 else 0.0, replay)[1].max(initial=0.0))


def k_runs(runs: list[Calibrated]) -> list[Calibrated]:
    """The runs the co-running slowdown k is fitted on: those on several streams, without copies where any is
    (as for the dispatch time: copies are priced apart)."""
    several = [r for r in runs if r.plan.compute_streams > 1]
    return [r for r in several if not r.plan.copies] or several


def co_running_cost(run: Calibrated, k: float) -> float:
    """What co-running at k adds to the run's replay (at its dispatch time), over its replay at k 0, relative."""
    slowed, alone = (simulated_makespan_us(run.plan, run.dispatch_us, run.copy_slowdown, at) for at in (k, 0.0))
    return slowed / alone - 1


def unidentified_co_running(runs: list[Calibrated]) -> tuple[float, float] | None:
    """(least, most) co-running cost at k 1 over the runs k is fitted on, where they differ by less than
    MIN_EXPOSURE_SPREAD, else None. Runs that lose alike to co-running cannot tell k from the dispatch time:
    two Inception v3 inference plans on two streams (2.4% and 2.8% at k 1, H200) fitted k 0.39, under which
    solve chose a packed plan predicted 5% under serial where every packed Inception v3 plan ran 3-6% over it."""
    costs = [co_running_cost(r, 1.0) for r in k_runs(runs)]
    return (min(costs), max(costs)) if len(costs) > 1 and max(costs) - min(costs) < MIN_EXPOSURE_SPREAD else None


def misranked(runs: list[Calibrated]) -> list[tuple[Calibrated, Calibrated]]:
    """(faster, slower) pairs of runs of one graph that ran more than MIN_RANK_GAP apart and that the fit ranks
    the other way round: between such plans it cannot choose (H200, GoogLeNet training: the shipped plan ran
    1.4% faster than a re-solved one, fitted 0.9% slower)."""
    pairs = []
    for a in runs:
        for b in runs:
            if (a.plan.graph_sha256 == b.plan.graph_sha256 and a.measured_us * (1 + MIN_RANK_GAP) < b.measured_us
                    and a.fitted_us > b.fitted_us):
                pairs.append((a, b))
    return pairs


def mean_error(runs: list[Calibrated], dispatch_us: float, copy_interference: float = 0.0) -> float:
    return sum(r.simulated_us(dispatch_us, copy_interference) / r.measured_us - 1 for r in runs) / len(runs)


@dataclass
class Fit:
    """What `fit` finds: per kind of plan the dispatch time (None: no run of that kind), the co-running slowdown of
    plans on several streams (None: fewer than two such runs without copies, which cannot tell it from the
    dispatch time), and the copy interference."""

    dispatch_us: float | None
    one_stream_dispatch_us: float | None
    co_running: float | None
    copy_interference: float


def fit(runs: list[Calibrated]) -> Fit:
    """The dispatch times, co-running slowdown and copy interference for the runs: one stream runs no op beside
    another, so what its ops add is fitted apart (DeviceInfo.one_stream_dispatch_us). On several streams, the
    slowdown k is the one whose dispatch time (fitted at k) leaves the least squared relative error.
    Sets each run's `dispatch_us`, `co_running` and `fitted_us`."""
    if not runs:
        raise PlannerError("no run reports to calibrate from")
    several, one = [r for r in runs if r.plan.compute_streams > 1], [r for r in runs if r.plan.compute_streams == 1]
    plain = k_runs(runs)
    k = _fit_co_running(plain) if len(plain) > 1 else None
    for r in several:
        r.co_running = k or 0.0
    dispatch: list[float | None] = [None, None]
    interference = 0.0
    for _ in range(1 if all(any(not r.plan.copies for r in kind) for kind in (several, one) if kind) else ROUNDS):
        dispatch = [fit_dispatch_us([r for r in kind if not r.plan.copies] or kind, interference) if kind else None
                    for kind in (several, one)]
        for kind, d in zip((several, one), dispatch):
            for r in kind:
                r.dispatch_us = d
        interference = fit_copy_interference(runs)
    for r in runs:
        r.fitted_us = r.simulated_us(r.dispatch_us, interference)
    return Fit(dispatch[0], dispatch[1], k, interference)


def _fit_co_running(runs: list[Calibrated]) -> float:
    """The k in [0, MAX_CO_RUNNING] whose fitted dispatch time leaves the runs' least squared relative error
    (bounded scalar search, to 0.01)."""
    def squared_error(k: float) -> float:
        for r in runs:
            r.co_running = k
        dispatch = fit_dispatch_us(runs)
        return sum((r.simulated_us(dispatch, 0.0) / r.measured_us - 1) ** 2 for r in runs)

    best = round(minimize_scalar(squared_error, bounds=(0.0, MAX_CO_RUNNING), method="bounded",
                                 options={"xatol": 0.005}).x, 2)
    return best if squared_error(best) < squared_error(0.0) else 0.0


def fit_copy_interference(runs: list[Calibrated]) -> float:
    """Least squares through the origin of (measured - replayed at each run's dispatch time) against copy time
    over the runs with copies: sum(c * e) / sum(c^2), at least 0 (copies do not speed compute up)."""
    pairs = [(r.copy_us, r.measured_us - r.simulated_us(r.dispatch_us, 0.0)) for r in runs if r.plan.copies]
    squares = sum(c * c for c, _ in pairs)
    return round(max(0.0, sum(c * e for c, e in pairs) / squares), 4) if squares else 0.0


def fit_dispatch_us(runs: list[Calibrated], copy_interference: float = 0.0, tolerance_us: float = 0.01) -> float:
    """The dispatch time at which the runs' mean relative error is zero (the makespan grows with it)."""
    if not runs:
        raise PlannerError("no run reports to calibrate from")
    error = lambda dispatch: mean_error(runs, dispatch, copy_interference)  # noqa: E731
    lo, hi = 0.0, MAX_DISPATCH_US
    if error(lo) >= 0:
        return 0.0  # already over-predicted without any dispatch time
    if error(hi) < 0:
        raise PlannerError(f"even {MAX_DISPATCH_US:g} us per op under-predicts these runs: the gap is not "
                           "per-op overhead (copies? another GPU's profile?)")
    while hi - lo > tolerance_us:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if error(mid) < 0 else (lo, mid)
    dispatch = round((lo + hi) / 2, 2)
    for r in runs:
        r.fitted_us = r.simulated_us(dispatch, copy_interference)
    return dispatch


def traced_copies(trace: dict, plan: Plan, name: str) -> list[tuple[str, float, float]]:
    """(direction, measured us, us alone) of each planned copy in a `planner run --trace` file: the trace names
    a copy "<direction> <tensor>"; its time alone is the plan's duration without the slowdown it was priced at."""
    planned = {c.trace_label: c for c in plan.copies}
    out = []
    for event in trace.get("traceEvents", []):
        c = planned.get(str(event.get("name", "")))
        if event.get("cat") == "memcpy" and c is not None:
            out.append((c.direction, float(event["dur"]),
                        (c.end_us - c.start_us) / plan.totals.copy_slowdown.get(c.direction, 1.0)))
    if plan.copies and not out:
        raise PlannerError(f"{name}: no copy of the plan in the trace (a trace of another run?)")
    return out


def fit_copy_slowdown(copies: list[tuple[str, float, float]]) -> dict[str, float]:
    """Each direction's summed measured copy time over its summed time alone (directions without copies are
    left out)."""
    return {d: round(sum(m for k, m, _ in copies if k == d) / sum(a for k, _, a in copies if k == d), 3)
            for d in DIRECTIONS if any(k == d for k, _, _ in copies)}


def pair(report: RunReport, plan: Plan, name: str) -> Calibrated:
    """A report with the plan it measured: refuse a plan that is not the one run (another prediction)."""
    if plan.model_name != report.model_name or abs(plan.totals.predicted_us - report.predicted_us) > 1e-6 * max(
            1.0, report.predicted_us):
        raise PlannerError(f"{name}: the report predicted {report.predicted_us:.1f} us, the plan file "
                           f"{report.plan_file} {plan.totals.predicted_us:.1f} us: not the plan that was run")
    if report.mode != "graph":
        raise PlannerError(f"{name}: an --eager run; calibrate from CUDA-graph replays")
    return Calibrated(name, plan, report.measured_median_us)


def write_calibration(targets: list[Path], fingerprint: str, mode: str, dispatch_us: float | None,
                      copy_slowdown: dict[str, float], copy_interference: float | None,
                      one_stream_dispatch_us: float | None = None, co_running: float | None = None) -> list[Path]:
    """Set the mode's dispatch times, co-running slowdown and the copy slowdown in profile files and in store
    directories (their file for the device); every target is checked before any is written. None leaves a value
    as it is."""
    writes = []
    for target in targets:
        if target.is_dir():
            stores = [(path, device) for path, device in measured_stores(target) if device.fingerprint == fingerprint]
            if not stores:
                raise PlannerError(f"{target}: no measured profile store for device {fingerprint!r}")
            writes += [(path, ProfileStore(target, device)) for path, device in stores]
            continue
        profile = load_model(Profile, target)
        if profile.device.fingerprint != fingerprint:
            raise PlannerError(f"{target}: a profile of device {profile.device.fingerprint!r}, not {fingerprint!r}")
        writes.append((target, profile))
    for path, what in writes:
        if isinstance(what, ProfileStore):
            what.set_calibration(mode, dispatch_us, copy_slowdown, copy_interference, one_stream_dispatch_us,
                                 co_running)
        else:
            what.device.calibrate(mode, dispatch_us, copy_slowdown, copy_interference, one_stream_dispatch_us,
                                  co_running)
            save_model(what, path)
    return [path for path, _ in writes]


@dataclass
class CoRun:
    """One op of a traced iteration: its SM share in the plan, its time alone (the run's per-op pass), its
    kernels' time inside the iteration, and the SM share of the other ops' kernels beside them (time-weighted)."""

    sm_fraction: float
    alone_us: float
    inside_us: float
    beside: float


def traced_slowdowns(trace: dict, plan: Plan, report: RunReport) -> list[CoRun]:
    """Each op of the plan that the trace shows and the report timed alone, as a CoRun: its kernel time inside the
    iteration against its time alone, by the SM share beside it (on H100 narrow algorithms beside others take up
    to 1.5x their time alone; docs/BENCHMARKS.md), what the co-running slowdown k prices (planner.co_running)."""
    share = {o.trace_label: o.sm_fraction for o in plan.ops}
    kernels = [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace.get("traceEvents", [])
               if e.get("cat") == "kernel" and e.get("ph") == "X" and e.get("name") in share]
    if not kernels:
        return []
    cells = [slice(int(ts / GRID_US), max(int(ts / GRID_US) + 1, int((ts + dur) / GRID_US)))
             for _, ts, dur in kernels]
    width = np.zeros(max(c.stop for c in cells))
    for (name, _, _), c in zip(kernels, cells):
        width[c] += share[name]
    inside: dict[str, float] = {}
    others: dict[str, float] = {}  # the others' SM share integrated over the op's kernels, in us
    for (name, _, dur), c in zip(kernels, cells):
        inside[name] = inside.get(name, 0.0) + dur
        others[name] = others.get(name, 0.0) + (width[c].mean() - share[name]) * dur
    timed = zip((o.trace_label for o in plan.ops), report.ops)  # the report times the plan's ops in its order
    return [CoRun(share[label], o.measured_us, inside[label], others[label] / inside[label])
            for label, o in timed if label in inside and o.measured_us > 0 and inside[label] > 0]


def co_running_rows(ops: list[CoRun]) -> list[tuple[str, int, float, float]]:
    """(which ops, how many, their time alone, their time inside the iteration): those run alone, then those run
    beside others by their own SM share (SHARE_BINS)."""
    def share_bin(o: CoRun) -> int:
        return next(k for k, high in enumerate(SHARE_BINS) if o.sm_fraction < high or k == len(SHARE_BINS) - 1)

    groups = [("alone", [o for o in ops if o.beside < ALONE])]
    for k, (low, high) in enumerate(zip((0.0, *SHARE_BINS), SHARE_BINS)):
        groups.append((f"beside others, on {low:.0%}-{high:.0%} of the SMs",
                       [o for o in ops if o.beside >= BESIDE and share_bin(o) == k]))
    return [(what, len(g), sum(o.alone_us for o in g), sum(o.inside_us for o in g)) for what, g in groups if g]
