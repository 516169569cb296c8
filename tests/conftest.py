"""Tests marked `gpu` need an NVIDIA GPU with CuPy; without one they are skipped, never faked."""

from functools import lru_cache
from pathlib import Path

import pytest

MODELS = Path(__file__).parent / "models"


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
