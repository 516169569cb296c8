"""`planner profile --show`: what a profile offers the solver, per op kind, as a table or JSON.

Per kind: how many ops and candidates, the spread between each op's fastest and slowest candidate, the
workspace range, and the ops where the fastest candidate is not the leanest (the time-memory trade-offs the
solver can make). Estimated profiles say so in the title and in the JSON. Then what `planner calibrate` fitted,
which solve adds to the times measured alone: per mode, and per batch or model where fitted so.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from planner.memsize import fmt_bytes
from planner.profile import DeviceInfo, OpProfile, Profile

SHOW_TRADEOFFS = 15


@dataclass
class KindRow:
    kind: str
    ops: int
    candidates_min: int
    candidates_max: int
    fastest_total_us: float
    spread_median: float  # slowest / fastest time, median over the kind's ops
    spread_max: float
    workspace_min_bytes: int
    workspace_max_bytes: int
    fastest_not_leanest: int


@dataclass
class Tradeoff:
    signature: str
    describe: str
    fastest: str
    fastest_us: float
    fastest_workspace_bytes: int
    leanest: str
    leanest_us: float
    leanest_workspace_bytes: int


def tradeoff(op: OpProfile) -> Tradeoff | None:
    """The op's fastest and leanest candidates when they differ (leanest: least workspace, then fastest)."""
    if not op.candidates:
        return None
    fastest = min(op.candidates, key=lambda c: (c.time_us, c.workspace_bytes))
    leanest = min(op.candidates, key=lambda c: (c.workspace_bytes, c.time_us))
    if fastest.workspace_bytes <= leanest.workspace_bytes:
        return None
    return Tradeoff(op.signature, op.describe, fastest.name, fastest.time_us, fastest.workspace_bytes,
                    leanest.name, leanest.time_us, leanest.workspace_bytes)


def summary_rows(profile: Profile) -> list[KindRow]:
    by_kind: dict[str, list[OpProfile]] = {}
    for op in profile.ops.values():
        if op.candidates:
            by_kind.setdefault(op.kind, []).append(op)
    rows = []
    for kind, ops in sorted(by_kind.items()):
        times = [[c.time_us for c in op.candidates] for op in ops]
        spreads = [max(t) / min(t) if min(t) > 0 else 1.0 for t in times]
        workspaces = [c.workspace_bytes for op in ops for c in op.candidates]
        rows.append(KindRow(
            kind=kind, ops=len(ops), candidates_min=min(len(op.candidates) for op in ops),
            candidates_max=max(len(op.candidates) for op in ops), fastest_total_us=sum(min(t) for t in times),
            spread_median=statistics.median(spreads), spread_max=max(spreads),
            workspace_min_bytes=min(workspaces), workspace_max_bytes=max(workspaces),
            fastest_not_leanest=sum(tradeoff(op) is not None for op in ops),
        ))
    return rows


def tradeoffs(profile: Profile) -> list[Tradeoff]:
    """Every op whose fastest candidate needs more workspace than its leanest, largest saving first."""
    found = [t for op in profile.ops.values() if (t := tradeoff(op)) is not None]
    return sorted(found, key=lambda t: t.fastest_workspace_bytes - t.leanest_workspace_bytes, reverse=True)


def counter_rows(profile: Profile) -> list[dict]:
    """Every candidate with Nsight Compute readings (--counters), slowest op first."""
    rows = [{"signature": op.signature, "describe": op.describe, "candidate": c.name, "time_us": c.time_us,
             **c.counters.model_dump()}
            for op in profile.ops.values() for c in op.candidates if c.counters is not None]
    return sorted(rows, key=lambda r: -r["time_us"])


def summary_json(profile: Profile) -> dict:
    return {
        "estimated": profile.estimated,
        "device": profile.device.name,
        "fingerprint": profile.device.fingerprint,
        "dtype": profile.dtype,
        "graph_sha256": profile.graph_sha256,
        "ops": len(profile.ops),
        "kinds": [asdict(r) for r in summary_rows(profile)],
        "fastest_not_leanest": [asdict(t) for t in tradeoffs(profile)],
        "counters": counter_rows(profile),
        "calibration": calibration_json(profile.device),
    }


def calibration_json(device: DeviceInfo) -> dict:
    """Per calibration key (mode, and batch or model: `inference.b1@googlenet`) the fitted values (None: not fitted, the
    mode's or 0 apply), and the copies' slowdown and interference."""
    keys = sorted(set(device.dispatch_us) | set(device.one_stream_dispatch_us) | set(device.co_running))
    return {"keys": [{"key": k, "dispatch_us": device.dispatch_us.get(k),
                      "one_stream_dispatch_us": device.one_stream_dispatch_us.get(k),
                      "co_running": device.co_running.get(k)} for k in keys],
            "copy_slowdown": dict(device.copy_slowdown), "copy_interference": device.copy_interference}


def _range(lo, hi, fmt=str) -> str:
    return fmt(lo) if lo == hi else f"{fmt(lo)} – {fmt(hi)}"


def print_summary(profile: Profile, console: Console, as_json: bool = False) -> None:
    """The CLI's view of a profile; JSON goes to stdout unstyled so scripts can parse it."""
    if as_json:
        console.file.write(json.dumps(summary_json(profile), indent=1) + "\n")
        return
    source = "[bold yellow]ESTIMATED[/] (analytic model, not measured)" if profile.estimated else "measured"
    console.print(f"[bold]{profile.device.name}[/] ({profile.device.fingerprint}), {profile.dtype}, "
                  f"{len(profile.ops)} distinct ops: {source}")
    table = Table("op kind", "ops", "candidates", "fastest total", "slowest/fastest (median, max)", "workspace",
                  "fastest ≠ leanest", title="candidates by op kind", title_justify="left")
    for r in summary_rows(profile):
        table.add_row(r.kind, str(r.ops), _range(r.candidates_min, r.candidates_max), f"{r.fastest_total_us:.1f} us",
                      f"×{r.spread_median:.2f}, ×{r.spread_max:.2f}",
                      _range(r.workspace_min_bytes, r.workspace_max_bytes, fmt_bytes), str(r.fastest_not_leanest))
    console.print(table)
    _print_counters(profile, console)
    _print_calibration(profile.device, console)
    found = tradeoffs(profile)
    if not found:
        console.print("every op's fastest candidate is also its leanest: no time-memory trade-offs")
        return
    more = f", largest {SHOW_TRADEOFFS} of {len(found)}" if len(found) > SHOW_TRADEOFFS else ""
    table = Table("op", "fastest", "workspace", "leanest", "workspace", "saves",
                  title=f"ops where the fastest candidate is not the leanest{more}", title_justify="left")
    for t in found[:SHOW_TRADEOFFS]:
        saved = fmt_bytes(t.fastest_workspace_bytes - t.leanest_workspace_bytes)
        table.add_row(t.describe or t.signature, f"{t.fastest} {t.fastest_us:.1f} us", fmt_bytes(t.fastest_workspace_bytes),
                      f"{t.leanest} {t.leanest_us:.1f} us", fmt_bytes(t.leanest_workspace_bytes),
                      f"{saved} for +{t.leanest_us - t.fastest_us:.1f} us")
    console.print(table)


def _print_calibration(device: DeviceInfo, console: Console) -> None:
    calibration = calibration_json(device)
    if not calibration["keys"]:
        console.print("not calibrated (`planner calibrate`): solve prices every op at its time alone")
        return
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    table = Table("mode[.batch][@model]", "dispatch per op, several streams", "on one stream", "co-running k",
                  title="calibrated by planner calibrate (used: the model's at the batch, the model's, the batch's, "
                  "the mode's, else 0)",
                  title_justify="left")
    for row in calibration["keys"]:
        table.add_row(row["key"], fmt(row["dispatch_us"], "{:.2f} us"),
                      fmt(row["one_stream_dispatch_us"], "{:.2f} us"), fmt(row["co_running"], "{:.2f}"))
    console.print(table)
    copies = ", ".join(f"{d} x{v:.3f}" for d, v in calibration["copy_slowdown"].items())
    console.print(f"copies: {copies or 'as profiled'}; copy interference {device.copy_interference:.3f} us per us of "
                  "copy")


def _print_counters(profile: Profile, console: Console) -> None:
    rows = counter_rows(profile)
    if not rows:
        return
    more = f", slowest {SHOW_TRADEOFFS} of {len(rows)}" if len(rows) > SHOW_TRADEOFFS else ""
    table = Table("op", "candidate", "time", "SM %", "DRAM %", "long scoreboard", "barrier", "math throttle",
                  title=f"Nsight Compute counters (stalls: warps per issued instruction){more}", title_justify="left")
    for r in rows[:SHOW_TRADEOFFS]:
        table.add_row(r["describe"] or r["signature"], r["candidate"][:40], f"{r['time_us']:.1f} us",
                      f"{r['sm_throughput']:.0f}", f"{r['dram_throughput']:.0f}", f"{r['stall_long_scoreboard']:.2f}",
                      f"{r['stall_barrier']:.2f}", f"{r['stall_math_pipe_throttle']:.2f}")
    console.print(table)
