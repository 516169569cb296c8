"""`planner profile --counters` without a GPU: which candidates get read, and how ncu's CSV maps back to them."""

import pytest

from planner.profile import Candidate, Counters, DeviceInfo, Kernel, OpProfile, Profile
from planner.profile_gpu import counter_targets
from runner.counters import DURATION, METRICS, assign, parse_rows

HEADER = ["ID", "Process ID", "Kernel Name", "Block Size", *METRICS.values(), DURATION]


def _csv(rows):
    quote = lambda cells: ",".join(f'"{c}"' for c in cells)  # noqa: E731
    units = ["", "", "", "", "", "", "", "%", "%", "nsecond"]
    return "\n".join(["==PROF== Connected to process 7", quote(HEADER), quote(units), *map(quote, rows),
                      "==PROF== Disconnected from process 7"])


def _row(i, name, stalls, duration_ns):
    return [str(i), "7", name, "(256, 1, 1)", *map(str, stalls), "1,000" if duration_ns == 1000 else str(duration_ns)]


def test_rows_map_to_candidates_in_launch_order_weighted_by_duration():
    text = _csv([_row(0, "conv_a", [1, 2, 3, 40, 50], 3000), _row(1, "bias", [5, 6, 7, 8, 90], 1000),
                 _row(2, "relu_fwd", [0.5, 0, 0, 10, 80], 2000)])
    rows = parse_rows(text)
    assert [r["Kernel Name"] for r in rows] == ["conv_a", "bias", "relu_fwd"]  # units and log lines dropped
    first, second = assign(rows, [["conv_a", "bias"], ["relu_fwd"]])
    assert first.stall_long_scoreboard == pytest.approx((1 * 3 + 5 * 1) / 4)
    assert first.dram_throughput == pytest.approx((50 * 3 + 90 * 1) / 4)
    assert second == Counters(stall_long_scoreboard=0.5, sm_throughput=10, dram_throughput=80)


def test_a_kernel_count_or_name_mismatch_is_an_error():
    rows = parse_rows(_csv([_row(0, "conv_a", [1, 2, 3, 4, 5], 10)]))
    with pytest.raises(RuntimeError, match="profiled 1 kernels"):
        assign(rows, [["conv_a", "bias"]])
    with pytest.raises(RuntimeError, match="where 'conv_b' was launched"):
        assign(rows, [["conv_b"]])


def _cand(name, time_us, workspace=0, sm=1.0, counters=None):
    return Candidate(name=name, time_us=time_us, workspace_bytes=workspace, sm_fraction=sm, counters=counters,
                     kernels=[Kernel(name="k", duration_us=time_us, grid=[1, 1, 1], block=[1, 1, 1],
                                     registers_per_thread=32)])


def test_targets_are_the_ends_of_each_trade_off_not_yet_read():
    fast, lean, narrow = _cand("fast", 1.0, 1 << 20), _cand("lean", 2.0), _cand("narrow", 3.0, 1 << 20, sm=0.3)
    middle = _cand("middle", 1.5, 1 << 10)
    done = _cand("done", 1.0, counters=Counters())
    ops = {"a": OpProfile(signature="a", kind="conv", candidates=[fast, middle, lean, narrow]),
           "b": OpProfile(signature="b", kind="relu", candidates=[done]),
           "c": OpProfile(signature="c", kind="conv", candidates=[_cand("guess", 1.0)], estimated=True)}
    profile = Profile(device=DeviceInfo(name="gpu", sm_count=1, memory_bytes=1), dtype="fp16", ops=ops)
    assert [(sig, c.name) for sig, c in counter_targets(profile)] == [("a", "fast"), ("a", "lean"), ("a", "narrow")]


def test_show_prints_the_counters_table():
    import io

    from rich.console import Console

    from planner.profile_report import print_summary, summary_json

    read = _cand("fast", 1.0, counters=Counters(stall_long_scoreboard=2.5, sm_throughput=71, dram_throughput=12))
    ops = {"a": OpProfile(signature="a", kind="conv", describe="conv 3x3", candidates=[read, _cand("slow", 2.0)])}
    profile = Profile(device=DeviceInfo(name="gpu", sm_count=1, memory_bytes=1), dtype="fp16", ops=ops)
    assert [(r["candidate"], r["sm_throughput"]) for r in summary_json(profile)["counters"]] == [("fast", 71)]
    out = io.StringIO()
    print_summary(profile, Console(file=out, width=200))
    assert "Nsight Compute counters" in out.getvalue() and "2.50" in out.getvalue()


def test_cudnn_kernels_match_across_their_operation_word():
    """One cuDNN engine launched a convFwd kernel under CUPTI and the same kernel named matMul under ncu."""
    ncu = "cudnn_generated_fort_native_sm80_matMul_knob_21_128x128x32_4_0"
    rows = parse_rows(_csv([_row(0, ncu, [1, 2, 3, 4, 5], 10)]))
    assert assign(rows, [[ncu.replace("matMul", "convFwd")]])[0].dram_throughput == 5
    with pytest.raises(RuntimeError, match="was launched"):
        assign(rows, [[ncu.replace("knob_21", "knob_22")]])
