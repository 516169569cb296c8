"""The time limit, counted from work rather than a clock: the heuristic's work (heuristic.Work) in seconds of the
2-core development machine, so that the same plan comes on every run (solve.py; `--deterministic` leaves the wall
clock only as a runaway guard)."""

from __future__ import annotations

from planner.heuristic import Work
from planner.problem import Problem

# Measured on GoogLeNet and ResNet-50 training b32 (refitted in the nineteenth session, jobs and setups again in the
# thirty-sixth: 22-30 us and 0.11-0.22 ms, the most taken; docs/BENCHMARKS.md):
LIST_S_PER_JOB = 30e-6  # a job list-scheduled (with the rest of the heuristic's Python around it)
LAYOUT_S_PER_OP = 2.3e-4  # an op of a plan built and laid out until a placement order fits the cap (fits_device)
PLACE_S_PER_OP = 8e-5  # an op of a plan placed again in a round past the orders (arena.placements; 0.05 s a round
# on GoogLeNet training b32's 636 ops)
SETUP_S_PER_OP = 2e-4  # an op of a problem built
BOUND_S_PER_OP = 4.5e-3  # an op of a problem bounded (lower_bounds_us under a cap, the LPs included: GoogLeNet training
# b32 at 50% on the H100, 387 ops, 1.9-2.4 s; ResNet-50 at 30%, 360 ops, 1.4-1.7 s; seventy-first session)
CPSAT_WALL_PER_DET = 7.5  # wall seconds per deterministic second of CP-SAT on a whole model (solve_graph._search; one
# worker searches there, cpsat.solve: inference b32 runs 18-20, GoogLeNet and Inception v3, and --deterministic
# solves of them pass their limit by up to 1.4x; at 20 the exit-3 search no longer proves small minimum caps)
RUNAWAY = 3.0  # --deterministic: only the wall clock at this many times the limit ends the search. CP-SAT on a
# whole training graph overran its deterministic limit tenfold when eight workers searched in chunks of a
# deterministic second (GoogLeNet training b32 under 270 MB: 0.77 deterministic s spent 7.29 in 64 s of wall)
MIN_SEARCH_SHARE = 0.1  # the search gets at least this share of the time limit, whatever the heuristic took
FINAL_LAYOUTS = 6  # arena layouts the search leaves time for before the wall-clock deadline (the plan's checks)


def charged_s(work: Work) -> float:
    """The seconds the heuristic's work takes on the development machine, by its counts: what the time limit
    charges for it, the same on every run (a wall clock would make plans depend on the machine's load)."""
    return (work.jobs * LIST_S_PER_JOB + work.layouts * LAYOUT_S_PER_OP + work.placed * PLACE_S_PER_OP
            + work.setups * SETUP_S_PER_OP
            + work.bounded * BOUND_S_PER_OP)


def final_checks_s(p: Problem) -> float:
    """The seconds the plan's checks after the search take (FINAL_LAYOUTS arena layouts): the search's budget and
    its wall-clock deadline both leave them."""
    return FINAL_LAYOUTS * len(p.ops) * LAYOUT_S_PER_OP
