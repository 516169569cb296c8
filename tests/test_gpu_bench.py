"""`planner bench` on the GPU: a small network with every op kind, profiled into a fresh store, benchmarked for
inference and for training under a cap; and, where the shipped store has GoogLeNet's profile for this GPU, the
check against torchvision. Skipped without a GPU; the PyTorch rows only where PyTorch sees the GPU."""

from pathlib import Path

import pytest
from rich.console import Console

from planner.bench import BenchReport, Settings, bench_on_gpu
from planner.onnx_import import import_onnx
from planner.training import build_training
from test_gpu_ops import _small_training_model

pytestmark = pytest.mark.gpu


def _loader(path, train):
    def load(batch, dtype):
        graph = import_onnx(path, batch=batch, dtype=dtype, training=train)
        return build_training(graph) if train else graph
    return load


def _torch_runs() -> bool:
    from runner.torch_peer import torch_missing

    return torch_missing() is None


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training-capped"])
def test_bench_small_network(tmp_path, train):
    settings = Settings(batches=[4], dtypes=["fp16"], mem="70%" if train else None, rounds=10,
                        iterations=5, store=tmp_path / "store", time_limit_s=5, workers=4)
    report = bench_on_gpu(_loader(_small_training_model(tmp_path), train), settings, Console(record=True))
    assert BenchReport.model_validate_json(report.model_dump_json()) == report
    names = [r.variant for r in report.rows]
    assert names[:2] == ["ours planned", "ours serial"], report.notes
    expected = {"torch eager", "torch graph"} | ({"torch save_on_cpu", "torch checkpoint"} if train else set())
    if _torch_runs():
        assert expected <= set(names), report.notes
        assert all(r.ratio_vs_best_torch and r.best_torch for r in report.rows)
        assert report.environment.versions["torch"]
    else:
        assert any("our variants only" in n for n in report.notes)
    for r in report.rows:  # the driver counts memory in 2 MiB pages: a tiny plan's buffers may read 0
        assert r.iterations == 50 and 0 < r.p10_us <= r.median_us <= r.p90_us
        assert r.peak_bytes > 0 or r.framework == "ours"
    planned = next(r for r in report.rows if r.variant == "ours planned")
    if train:
        assert planned.cap_bytes and planned.peak_bytes <= planned.cap_bytes
    assert report.environment.gpu and report.environment.versions["cudnn"]


def test_googlenet_peer_is_as_fast_as_torchvision(models):
    """Our IR's PyTorch GoogLeNet runs at most 5% slower than torchvision's (the peer is not handicapped)."""
    pytest.importorskip("torchvision")
    if not _torch_runs():
        pytest.skip("PyTorch sees no GPU")
    from planner.store import ProfileStore
    from runner.probe import probe_device

    load = _loader(models / "googlenet.onnx", False)
    store = Path(__file__).parents[1] / "profiles" / "store"
    if ProfileStore(store, probe_device()).missing(load(32, "fp16")):
        pytest.skip("profiles/store has no GoogLeNet b32 fp16 profile for this GPU")
    settings = Settings(batches=[32], dtypes=["fp16"], rounds=20, iterations=5, store=store, time_limit_s=5,
                        workers=8)  # 100 eager iterations each: their lower decile is steady, 50 failed 1 run in 6
    report = bench_on_gpu(load, settings, Console(record=True))
    checks = {c.mode: c for c in report.checks}
    assert set(checks) == {"eager", "graph"} and all(c.passed for c in checks.values()), checks
