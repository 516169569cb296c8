"""Entry points `planner profile` uses on a GPU."""

from planner.devices import BUILTIN
from runner.counters import read_counters
from runner.measure import measure_ops
from runner.ops import implementations
from runner.probe import probe_device as _probe

__all__ = ["implementations", "measure_ops", "probe_device", "read_counters"]


def probe_device():
    """The GPU's description, with datasheet peaks from the built-in spec of the same GPU model (the analytic
    fallback for ops without a GPU implementation uses them)."""
    device = _probe()
    for spec in BUILTIN.values():
        if spec.name.split()[1:2] == device.name.split()[1:2]:
            for field in ("peak_dram_bytes_per_s", "peak_flops_fp32", "peak_flops_tf32", "peak_flops_fp16"):
                setattr(device, field, getattr(spec, field))
    return device
