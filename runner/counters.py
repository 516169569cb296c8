"""Nsight Compute counters of chosen candidates (`planner profile --counters`).

ncu replays each kernel it profiles many times to read its counters, so it runs once, over a child process
(`python -m runner.counters JOB`) that launches each chosen candidate once between cudaProfilerStart and
cudaProfilerStop (after a warm-up launch outside them). The profiled kernels come back in launch order; each
candidate takes as many as CUPTI counted when it was timed, and their mangled names must match CUPTI's.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from planner.files import load_model, save_model
from planner.ir import Graph, Node
from planner.profile import Candidate, Counters

METRICS = {
    "stall_long_scoreboard": "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "stall_barrier": "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "stall_math_pipe_throttle": "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
    "sm_throughput": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_throughput": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
}
DURATION = "gpu__time_duration.sum"


def ncu_command(job: Path, log: Path) -> list[str]:
    ncu = shutil.which("ncu")
    if ncu is None:
        raise RuntimeError("--counters needs Nsight Compute's `ncu` on PATH")
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--print-kernel-base", "mangled",
            "--csv", "--page", "raw", "--metrics", ",".join([*METRICS.values(), DURATION]), "--log-file", str(log),
            sys.executable, "-m", "runner.counters", str(job)]


def parse_rows(text: str) -> list[dict[str, str]]:
    """ncu's raw CSV page: a header row, a units row, then one row per profiled kernel (other log lines are
    not quoted)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    return [r for r in csv.DictReader(io.StringIO("\n".join(lines))) if r.get("ID", "").strip().isdigit()]


def _number(text: str) -> float:
    text = (text or "").replace(",", "").strip()
    return float(text) if text and text != "n/a" else 0.0


def _kernel_identity(name: str) -> str:
    """A kernel's name without the operation word of cuDNN's generated kernels: the same engine and knobs
    run as `..._sm80_convFwd_knob_21_...` in one process and `..._sm80_matMul_knob_21_...` in another (a 1x1
    convolution writing a channel slice, seen on H100)."""
    return re.sub(r"(_sm\d+)_[A-Za-z]+(_knob_)", r"\1\2", name)


def assign(rows: list[dict[str, str]], kernel_names: list[list[str]]) -> list[Counters]:
    """Each candidate's counters from its run of rows, weighted by kernel duration; kernel_names: per
    candidate, the kernels CUPTI recorded when it was timed."""
    if len(rows) != sum(map(len, kernel_names)):
        raise RuntimeError(f"ncu profiled {len(rows)} kernels where the candidates launch "
                           f"{sum(map(len, kernel_names))}")
    readings, at = [], 0
    for names in kernel_names:
        mine, at = rows[at:at + len(names)], at + len(names)
        for row, name in zip(mine, names):
            if _kernel_identity(row["Kernel Name"]) != _kernel_identity(name):
                raise RuntimeError(f"ncu kernel {row['Kernel Name'][:80]!r} where {name[:80]!r} was launched")
        weights = [_number(r[DURATION]) or 1.0 for r in mine]
        readings.append(Counters(**{key: sum(w * _number(r[metric]) for w, r in zip(weights, mine)) / sum(weights)
                                    for key, metric in METRICS.items()}))
    return readings


def read_counters(graph: Graph, targets: list[tuple[Node, Candidate]]) -> list[Counters]:
    """Counters of each (node, candidate), read by one ncu run."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        save_model(graph, tmp_dir / "graph.json")
        job = {"graph": str(tmp_dir / "graph.json"),  # nodes whole: some are not the graph's own (store.optional_nodes)
               "items": [[n.model_dump(mode="json"), c.name] for n, c in targets]}
        (tmp_dir / "job.json").write_text(json.dumps(job))
        log = tmp_dir / "ncu.log"
        done = subprocess.run(ncu_command(tmp_dir / "job.json", log), capture_output=True, text=True)
        text = log.read_text() if log.exists() else ""
        if done.returncode != 0:
            last = (done.stderr.strip() or text.strip() or "no output").splitlines()[-1]
            raise RuntimeError(f"ncu exited with {done.returncode}: {last}")
        return assign(parse_rows(text), [[k.name for k in c.kernels] for _, c in targets])


def _launch_items(job_path: str) -> None:
    """The child under ncu: each item's candidate once, alone inside the profiler range."""
    import numpy as np

    from runner.gpu import gpu
    from runner.measure import NodeData
    from runner.ops import build_op

    job = json.loads(Path(job_path).read_text())
    graph = load_model(Graph, job["graph"])
    cp, cudnn = gpu().cp, gpu().cudnn
    handle = cudnn.create_handle()
    stream = cp.cuda.Stream(non_blocking=True)
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    rng = np.random.default_rng(0)
    with stream:
        for node_fields, name in job["items"]:
            node = Node.model_validate(node_fields)
            op = build_op(graph, node, handle, algorithm=name)
            index = [n for n, _ in op.candidates].index(name)
            data = NodeData(graph, node, rng)
            workspace = cp.empty(max(op.candidates[index][1], 1), cp.uint8)
            for profiled in (False, True):
                if profiled:
                    cp.cuda.runtime.profilerStart()
                op.launch(index, data.inputs[0], data.outputs[0], workspace)
                stream.synchronize()
            cp.cuda.runtime.profilerStop()


if __name__ == "__main__":
    _launch_items(sys.argv[1])
