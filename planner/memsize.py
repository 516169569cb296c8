"""Memory sizes as users write them: 11GB, 11 GiB, 512MB, 1e9, 40% (of the device), lists with commas."""

from __future__ import annotations

import re

from planner.files import PlannerError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*|%)\s*$", re.IGNORECASE)


def parse_size(text: str, device_bytes: int | None = None) -> int:
    """Bytes from one size; a percentage is of `device_bytes`."""
    m = _SIZE.match(text)
    if not m or (m.group(2) != "%" and m.group(2).lower() not in UNITS):
        raise PlannerError(f"cannot read memory size {text!r} (use e.g. 11GB, 512MiB, 3e9 or 40%)")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if device_bytes is None:
            raise PlannerError(f"{text!r}: a percentage needs the device's memory size")
        if not 0 < value <= 100:
            raise PlannerError(f"{text!r}: a percentage must be in (0, 100]")
        return int(device_bytes * value / 100)
    size = int(value * UNITS[unit])
    if size <= 0:
        raise PlannerError(f"memory size {text!r} must be positive")
    return size


def parse_sizes(text: str, device_bytes: int | None = None) -> list[int]:
    """One or more comma-separated sizes."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise PlannerError("--mem needs a size")
    return [parse_size(p, device_bytes) for p in parts]


def fmt_bytes(n: float) -> str:
    """1.50 GiB, 12.00 MiB, 512 B: binary units, as people read memory."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
