"""Schedule -> shorter Schedule: CP-SAT on one window of the timeline at a time (large-neighbourhood search).

One model of a whole training graph is too large for CP-SAT to improve on the list schedule (ResNet-50 training
b32, 565 ops: nothing better in 160 s). A window of a few dozen items solves well in a fraction of a second, and
the list scheduler's greedy choices leave much to gain there: it packs ops side by side only as they become
ready, while a window can pick a narrower algorithm for one op so that its neighbour runs beside it. Per window:
its items (ops, recomputations, copies) get free starts and algorithms; items that started before it stay
where they are; items after it all move earlier by one `shift`. The model minimises the makespan that results;
a window is kept when the whole schedule gets cheaper at the time its plan will predict (streams.predicted_cost)
and still fits the memory cap (memory is checked on the whole schedule, not modelled in the window).
Keep/offload/recompute decisions stay as they are. Windows are solved on several threads at once, ahead of the one
whose result is taken next.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable, Iterator

from planner.problem import Problem
from planner.schedule import Schedule, peaks_within
from planner.stretches import polish
from planner.streams import predicted_cost
from planner.swaps import swap_pass
from planner.window import Item, Memory, Move, Stop, apply, items_of, precedences, signature, solve_window
from planner.window_memory import residencies

MIN_PASS_GAIN = 0.002  # a pass gaining less than this share of the cost moves on to larger windows
NARROW_STAGES = tuple(((10, 16, 24), det_s) for det_s in (0.02, 0.05, 0.1, 0.2))  # (items whose starts a window
# frees, smallest first; CP-SAT's deterministic time per window at most), by stage: a stage's sizes cycle until a
# whole cycle gains nothing, then the next stage solves every window again, longer (a window that gained nothing in
# a short solve may in a longer one). Many short windows gain more than fewer long ones where about one item runs at
# a time (ResNet-50 training b32 fp16, H100 profile, the same start and budget: uncapped 5970.9 us against 6000.2
# with WIDE_STAGES, at 50% 6610.2 against 6640.7)
WIDE_STAGES = tuple(((24, 48), det_s) for det_s in (0.1, 0.2, 0.5, 1.0))  # where several run side by side, windows
# of 24-48 items repack them better (GoogLeNet training b32 fp16: uncapped 2841.4 us against 2872.2 with
# NARROW_STAGES, at 50% 3065.8 against 3070.5, and 3026.0 after 345 s of wall time, where NARROW_STAGES gave
# 3060.3 in a 300-s solve; stages that start narrow and widen once converged gain nothing within 300 s)
WIDE_FROM = 1.35  # compute items running at once, on average over the start schedule, from which WIDE_STAGES
# serve (training b32 fp16: GoogLeNet's schedules run 1.43-1.45, ResNet-50's 1.05-1.06; GoogLeNet fp32's 1.30 gains
# nothing from them: 6667.7 us uncapped against 6642.3). Not where ops slow each other: a wide window's move, judged
# settled as a whole, mostly loses, where narrow ones gain piece by piece (GoogLeNet training b32 fp16, H100 at k
# 1.63, the budget of a 120-s solve: at 50% 3420.5 us narrow against 3455.2 wide, uncapped 3217.2 against 3259.6)
WALL_PER_DET = 18.0  # wall seconds per deterministic second of the windows taken, laid out on the lanes, and
WINDOW_OVERHEAD_S = 0.032  # the wall seconds a window costs besides: fitted to the rounds' wall times on the 2-core
# development machine (training b32, budget in full, 178 and 93 rounds of GoogLeNet at 50% and ResNet-50 at
# cap40torch: 14.2 and 0.024 together), with a quarter more for its swings, so that the budget, not the wall clock,
# ends 120-s searches and plans repeat. They include the windows solved ahead and discarded and the main thread's
# work. Refitted in the 69th session (GoogLeNet and ResNet-50 training at 50%, 60 s each: 12.5 and 0.008, each run
# within 10%), but kept: at 16 and 0.03 ResNet-50 at cap40torch took 121.7 s of its 120, and at 17 GoogLeNet
# uncapped took 127.0 s where it had taken 109.3 at 16 (the machine's speed swings by a sixth)
SETTLE_S_PER_ITEM = 3e-5  # what judging a window's move at its predicted timeline costs where ops slow each other
# (streams.predicted_cost: 6-14 ms on GoogLeNet training's 401 items as the machine swings), charged a window taken
SWAP_S_PER_TRY = 0.025  # an algorithm and start tried by `swaps.swap_pass` (placed, its timeline settled, its
# memory checked: 18-27 ms on GoogLeNet training b32, 290-460 tries a pass)
RUNNER_UPS = 3  # where ops slow each other, a window's earlier CP-SAT solutions judged beside its last: one longer
# at times alone may settle sooner (GoogLeNet training b32 at 50% on the H100, 120-s solves at seeds 0-2: 3387.9,
# 3375.3 and 3376.4 us against 3381.3, 3400.0 and 3396.1; refined from one older start at seeds 0 and 1, 3403.2 ->
# 3394.3 and 3407.5 -> 3394.3)
LANES = 2  # windows solved at once, on threads (CP-SAT releases the GIL): that machine's cores
LOOKAHEAD = 16  # windows solved ahead of the one whose result is taken next, at most
FIT_EVERY = 8  # kept schedules between checks of the runner's arena (each ~0.07 s on training graphs)


Span = tuple[int, int, int, tuple]  # a window: (position in the items, t0, t1, signature)


def sweep(p: Problem, s: Schedule, items: list[Item], width: int, k: int, fruitless: set[tuple]) -> Iterator[Span]:
    """The windows of `width` items from position k on, every width / 2 items, but those known fruitless."""
    for at in range(k, len(items), width // 2):
        t0 = items[at].start
        t1 = max(t0 + 1, items[at + width].start if at + width < len(items) else s.makespan(p))
        seen = signature(items, t0, t1)
        if seen not in fruitless:
            yield at, t0, t1, seen


def _judged(p: Problem, cap_bytes: int, s: Schedule, s_cost: float, items: list[Item], move: Move
            ) -> tuple[Schedule, float, bool] | None:
    """(the schedule with the move made, its cost, whether it fits the cap) if that is cheaper, else None."""
    trial = apply(s, items, move)
    if (trial_cost := predicted_cost(p, trial)) >= s_cost:
        return None
    return trial, trial_cost, peaks_within(p, trial, cap_bytes)


def _better(p: Problem, cap_bytes: int, s: Schedule, s_cost: float, items: list[Item], move: Move | None
            ) -> tuple[Schedule, float] | None:
    """The schedule with the move (or one of its runner-ups) made and its cost: the cheapest that is cheaper than
    s and fits the cap, if any."""
    best = None
    for way in [move, *move.runner_ups] if move is not None else []:
        judged = _judged(p, cap_bytes, s, best[1] if best else s_cost, items, way)
        if judged is not None and judged[2]:
            best = judged[:2]
    return best


def _memory(p: Problem, cap_bytes: int, s: Schedule, s_cost: float, items: list[Item]) -> Memory | None:
    """The windows' Memory for schedule s, None where the cap cannot bind."""
    room = cap_bytes - p.resident_bytes
    if room >= sum(t.bytes for t in p.tensors):
        return None

    def overflows(move: Move) -> bool:
        judged = _judged(p, cap_bytes, s, s_cost, items, move)
        return judged is not None and not judged[2]

    return Memory(residencies(p, s, items), room, overflows)


def solve_round(pool: ThreadPoolExecutor, lanes: int, items: list[Item], edges: list[tuple[int, int]],
                memory: Memory | None, spans: Iterator[Span], streams: int, seed: int, det_s: float,
                gains: Callable[[Move | None], tuple[Schedule, float] | None], budget_s: float, deadline: float,
                judge_s: float = 0.0, runner_ups: int = 0
                ) -> tuple[list[Span], tuple[Span, tuple[Schedule, float]] | None, float]:
    """Solves the spans in order on `lanes` threads, each lane taking the next span as soon as it is free, and
    takes their results in order up to the first that gains, or until `budget_s` is spent or the wall clock
    passes `deadline`: (the windows taken without gain, the gaining window and its schedule and cost or None, the
    seconds spent, with `judge_s` for each move judged: a window's, and up to `runner_ups` of the solutions its
    CP-SAT found before it, where ops slow each other). Windows solved past the first gain are
    stopped and discarded, so the windows taken are those one lane would take. The seconds are those of the
    windows taken, laid out in order on the lanes as the threads take them: they depend on CP-SAT's
    deterministic time, not on which thread finished first."""
    stop, flight, failed, gain = Stop(), deque(), [], None
    lane_free = [0.0] * lanes

    def fill() -> None:
        running = sum(not future.done() for _, future in flight)
        while running < lanes and len(flight) < LOOKAHEAD and (span := next(spans, None)) is not None:
            flight.append((span, pool.submit(solve_window, items, edges, span[1], span[2], streams, seed, det_s,
                                             stop, memory, runner_ups)))
            running += 1

    fill()
    while flight and gain is None and max(lane_free) < budget_s and time.monotonic() < deadline:
        span, future = flight[0]
        while not future.done():
            wait([f for _, f in flight if not f.done()], return_when=FIRST_COMPLETED)
            fill()
        flight.popleft()
        move, used = future.result()
        lane = lane_free.index(min(lane_free))
        judged = 1 + len(move.runner_ups) if move is not None else 1
        lane_free[lane] += used * WALL_PER_DET + WINDOW_OVERHEAD_S + judge_s * judged
        trial = gains(move)
        if trial is not None:
            gain = span, trial
        else:
            failed.append(span)
            fill()
    stop()
    for _, future in flight:
        future.result()
    return failed, gain, max(lane_free)


def refine(p: Problem, cap_bytes: int, streams: int, s: Schedule, budget_s: float, seed: int = 0,
           on_progress: Callable[[int, float], None] | None = None,
           fits: Callable[[Schedule], bool] | None = None, lanes: int = LANES, fit_s: float = 0.0,
           deadline: float = float("inf")) -> tuple[Schedule, float, bool]:
    """(the schedule improved window by window, the budget spent, whether the wall clock ended it). Passes sweep
    windows of a stage's sizes (`stages_for`) from the start of the schedule to its end, overlapping by half; a
    window is kept when the schedule gets cheaper and fits the cap. A pass that gains over MIN_PASS_GAIN repeats
    its size, one that does not moves on to the next size; after the largest, the sizes cycle again while the
    cycle before gained over MIN_PASS_GAIN, then the next stage solves each window longer. Windows whose model was
    solved before without gain at this length are skipped, so a later cycle solves only the windows that kept
    schedules changed. `lanes` threads solve the next windows of the sweep from the same schedule, taken in order
    up to the first that gains (`solve_round`): this keeps the windows one lane would, sooner (ResNet-50 training
    at 50%, 60 s: 8573.6 us against 8648.8 with one lane). The budget is in seconds of the
    development machine, counted from CP-SAT's deterministic time (WALL_PER_DET, WINDOW_OVERHEAD_S) so that plans
    repeat for a given seed and lane count; no round starts after the wall clock passes `deadline`, less the arena
    checks that follow the last (a slower machine's plan then depends on its speed). Kept schedules must also pass
    `fits` (the runner's arena, which may need more than the peak), checked every FIT_EVERY of them (`_verified`),
    each check charged `fit_s`. Where ops slow each other, the stretches of the timeline are searched alone
    (planner.stretches) on the start schedule and at each stage's end, and each stage ends with passes of algorithm
    swaps (planner.swaps) while they gain and the arena fits."""
    t_start, spent = time.monotonic(), 0.0
    best, best_cost = s, predicted_cost(p, s)
    fruitless: set[tuple] = set()
    level, size, cycle_cost = 0, 0, best_cost
    verified, unverified = s, []  # the last schedule known to fit; those kept since, with their windows
    stages = stages_for(p, s)
    judge_s = SETTLE_S_PER_ITEM * len(items_of(p, s)) if p.co_running > 0 else 0.0

    fit_wall = 0.0  # the longest arena check seen, in wall seconds

    def fitting(trial: Schedule) -> bool:
        nonlocal spent, fit_wall
        spent += fit_s
        started = time.monotonic()
        ok = fits(trial)
        fit_wall = max(fit_wall, time.monotonic() - started)
        return ok

    def swapped() -> None:
        """Passes of the swaps that the windows, pricing ops alone, do not propose (planner.swaps), while they
        gain and the arena fits."""
        nonlocal best, best_cost, verified, spent
        while spent < budget_s and time.monotonic() < last_round_by():
            trial, trial_cost, used = swap_pass(p, cap_bytes, streams, best, best_cost, budget_s - spent,
                                                SWAP_S_PER_TRY)
            spent += used
            if trial is best or not (fits is None or fitting(trial)):
                return
            best, best_cost, verified = trial, trial_cost, trial

    def last_round_by() -> float:
        """The deadline less the checks that follow the last round (`_verified`: a bisection over up to
        FIT_EVERY schedules), at the longest check seen (GoogLeNet training at 50% on the H200 profile: up to 0.9
        s each, and the solve ended 2.9 s past its deadline)."""
        return deadline - fit_wall * FIT_EVERY.bit_length()

    searched: dict[tuple, tuple] = {}

    def polished() -> None:
        """The stretches searched alone (planner.stretches), those refine has changed since."""
        nonlocal best, best_cost, verified, spent
        trial, trial_cost, used = polish(p, cap_bytes, streams, best, best_cost, budget_s - spent, seed, searched,
                                         last_round_by())
        spent += used
        if trial is not best and (fits is None or fitting(trial)):
            best, best_cost, verified = trial, trial_cost, trial

    if p.co_running > 0:
        polished()
        cycle_cost = best_cost
    with ThreadPoolExecutor(lanes) as pool:
        while level < len(stages) and spent < budget_s and time.monotonic() < last_round_by():
            sizes, det_s = stages[level]
            width, k, pass_cost = sizes[size], 0, best_cost
            while True:
                items = items_of(p, best)
                edges = precedences(p, best, items)  # all three change only when a window is kept
                memory = _memory(p, cap_bytes, best, best_cost, items)
                failed, gain, used = solve_round(
                    pool, lanes, items, edges, memory, sweep(p, best, items, width, k, fruitless), streams, seed,
                    det_s, lambda move: _better(p, cap_bytes, best, best_cost, items, move),
                    budget_s - spent, last_round_by(), judge_s, RUNNER_UPS if p.co_running > 0 else 0)
                spent += used
                fruitless.update(seen for _, _, _, seen in failed)
                if gain is None:  # the pass or the budget is over
                    break
                (k, _, _, seen), (best, best_cost) = gain
                unverified.append((best, seen))
                if fits is not None and len(unverified) >= FIT_EVERY:
                    kept, best = best, _verified(verified, unverified, fitting, fruitless)
                    verified = best
                    if best is not kept:  # rolled back: the gain's cost is not this schedule's
                        best_cost = predicted_cost(p, best)
                k += width // 2
                if on_progress:
                    on_progress(best.makespan(p), time.monotonic() - t_start)
            size += best_cost > pass_cost * (1 - MIN_PASS_GAIN)
            if size == len(sizes):
                if best_cost >= cycle_cost * (1 - MIN_PASS_GAIN):  # converged: the next stage, every window again
                    if fits is not None and unverified:
                        best = verified = _verified(verified, unverified, fitting, fruitless)
                        best_cost = predicted_cost(p, best)
                    if p.co_running > 0:
                        polished()
                        swapped()
                    level += 1
                    fruitless.clear()
                size, cycle_cost = 0, best_cost
    wall_ended = level < len(stages) and spent < budget_s  # neither converged nor out of budget
    if fits is not None and unverified:
        best = _verified(verified, unverified, fitting, fruitless)
    return best, spent, wall_ended


def stages_for(p: Problem, s: Schedule) -> tuple[tuple[tuple[int, ...], float], ...]:
    """WIDE_STAGES where the schedule runs WIDE_FROM compute items at once or more on average and nothing slows
    what runs beside it, else NARROW_STAGES."""
    busy = sum(item.end - item.start for item in items_of(p, s) if item.compute)
    return WIDE_STAGES if p.co_running <= 0 and busy >= WIDE_FROM * s.makespan(p) else NARROW_STAGES


def _verified(verified: Schedule, unverified: list[tuple[Schedule, tuple]], fits: Callable[[Schedule], bool],
              fruitless: set[tuple]) -> Schedule:
    """The latest of the schedules kept since `verified` (which fits) that fits, emptying `unverified`. Once a
    kept schedule overflows, those built on it mostly do too (ResNet-50 training b32 at 50%, solved under the
    cap itself: the 39th of 88 and every later one; checked at the end only, the search fell back to the 38th,
    8753.7 us against 8499.4): a bisection finds the first that overflows, and its window is not tried again."""
    schedules = [sch for sch, _ in unverified]
    if fits(schedules[-1]):
        unverified.clear()
        return schedules[-1]
    lo, hi = -1, len(schedules) - 1  # schedules[lo] fits (-1: the one before them), schedules[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(schedules[mid]) else (lo, mid)
    fruitless.add(unverified[hi][1])
    unverified.clear()
    return schedules[lo] if lo >= 0 else verified
