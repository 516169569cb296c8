"""Tests marked `gpu` need an NVIDIA GPU with CuPy; without one they are skipped, never faked."""

from functools import lru_cache
from pathlib import Path

import pytest

MODELS = Path(__file__).parent / "models"
PROFILES = Path(__file__).parent.parent / "profiles"


@lru_cache(maxsize=1)
def gpu_missing_reason() -> str | None:
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means no usable GPU stack
        return f"CuPy not importable ({type(e).__name__})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001
        return f"no CUDA device ({type(e).__name__})"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and (reason := gpu_missing_reason()):
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {reason}"))


@pytest.fixture
def models() -> Path:
    return MODELS


def googlenet_train_b32_problem(profile: str = "googlenet.train.b32.fp16.json"):
    """GoogLeNet training b32 fp16's problem on a shipped profile (under profiles/), its concats as views (as solve
    takes them)."""
    from planner.files import load_model
    from planner.fuse import concat_view_candidates, with_concat_views
    from planner.onnx_import import import_onnx
    from planner.problem import build_problem
    from planner.profile import Profile
    from planner.training import build_training

    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=32, dtype="fp16", training=True))
    measured = load_model(Profile, PROFILES / profile)
    g, measured = with_concat_views(g, concat_view_candidates(g)), measured.model_copy(update={"graph_sha256": None})
    return build_problem(g, measured, streams=4)


@pytest.fixture(scope="session")
def googlenet_train_b32():
    """The problem on the shipped H100 profile: what the capped plans are solved from (but for the fused
    BatchNormalizations). Built once; tests only read it."""
    return googlenet_train_b32_problem()
