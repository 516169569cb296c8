"""Arena offsets: never two live tensors on one byte, and close to the live-bytes lower bound."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.files import PlannerError
from runner.arena import (ALIGN_BYTES, PLACEMENT_ORDERS, Block, _first_fit, _overlaps, aligned, assign_offsets,
                          check_offsets, first_over, peak_live_bytes)


def test_chain_reuses_memory():
    # a -> b -> c -> d, each live from its producer to its consumer: two buffers suffice
    blocks = [Block(n, 1024, i, i + 2) for i, n in enumerate("abcd")]
    offsets, arena = assign_offsets(blocks)
    assert arena == 2 * 1024 == peak_live_bytes(blocks)
    assert offsets["a"] == offsets["c"] and offsets["b"] == offsets["d"] != offsets["a"]


def test_a_lifetime_order_packs_what_largest_first_fragments():
    """Largest first puts a and d at 0 and b above them; c, live with a and b, goes on top: 1792 B. Longest
    lived first (b, then a and c beside it, d in the gap) reaches the live-bytes bound, 1280 B, and is kept."""
    blocks = [Block("a", 768, 4, 6), Block("b", 512, 0, 4), Block("c", 512, 3, 5), Block("d", 768, 1, 2)]
    _, arena = assign_offsets(blocks)
    assert arena == peak_live_bytes(blocks) == 1280


def test_a_flatter_lifetime_weight_packs_what_the_other_orders_fragment():
    """In 256-B units: largest first puts a and b at 0, c on b and d on top of a and c, 15 units, as do the
    other three orders. Size x lifetime^(1/4) first (a, c, d, b) puts c beside a, d on them and b on c: 11, the
    live-bytes bound."""
    u = ALIGN_BYTES
    blocks = [Block("a", 6 * u, 1, 4), Block("b", 6 * u, 7, 8), Block("c", 5 * u, 6, 10), Block("d", 4 * u, 0, 7)]
    _, arena = assign_offsets(blocks)
    assert arena == peak_live_bytes(blocks) == 11 * u


def test_rounds_past_the_orders_pack_what_every_order_fragments():
    """In 256-B units. Every order places b (8) and c (6) at 0, a (5), live with b, on it at 8, and d (5), live
    with a and c, on a at 13: 18. The rounds raise d, the block above the live-bytes bound, until it goes before
    c: d at 0 beside b in time, c on d at 5, a on b at 8: 13, the bound."""
    u = ALIGN_BYTES
    blocks = [Block("a", 5 * u, 2, 7), Block("b", 8 * u, 0, 5), Block("c", 6 * u, 7, 12), Block("d", 5 * u, 6, 10)]
    assert all(_first_fit(blocks, order, _overlaps(blocks))[1] == 18 * u for order in PLACEMENT_ORDERS)
    offsets, arena = assign_offsets(blocks)
    assert arena == peak_live_bytes(blocks) == 13 * u
    assert offsets == {"a": 8 * u, "b": 0, "c": 5 * u, "d": 0}


def test_sizes_are_aligned():
    offsets, arena = assign_offsets([Block("a", 10, 0, 2), Block("b", 10, 1, 3)])
    assert sorted(offsets.values()) == [0, ALIGN_BYTES] and arena == 2 * ALIGN_BYTES


def test_first_block_over_a_limit_is_named():
    blocks = [Block("a", 1000, 0, 10), Block("b", 1000, 5, 20), Block("c", 1000, 2, 8)]
    offsets, arena = assign_offsets(blocks)
    assert first_over(blocks, offsets, arena) is None
    over = first_over(blocks, offsets, 2 * aligned(1000))
    assert over is not None and offsets[over.name] == 2 * aligned(1000) and over.start == 5


def test_check_catches_overlap():
    blocks = [Block("a", 512, 0, 2), Block("b", 512, 1, 3)]
    with pytest.raises(PlannerError, match="'a' and 'b'"):
        check_offsets(blocks, {"a": 0, "b": 256})


blocks_strategy = st.lists(
    st.tuples(st.integers(1, 64), st.integers(0, 40), st.integers(1, 15)), min_size=1, max_size=40
).map(lambda xs: [Block(f"t{i}", size * ALIGN_BYTES, start, start + length)
                  for i, (size, start, length) in enumerate(xs)])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(blocks_strategy)
def test_random_lifetimes_pack_without_overlap(blocks):
    offsets, arena = assign_offsets(blocks)  # checks overlap itself
    lower = peak_live_bytes(blocks)
    assert lower <= arena <= 2 * lower  # greedy by size stays near the bound on interval lifetimes
    assert all(offsets[b.name] + b.size_bytes <= arena for b in blocks)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(blocks_strategy)
def test_first_fit_puts_each_block_at_the_lowest_offset_clear_of_those_placed(blocks):
    """Against the rule itself: in each order, a block goes to the lowest of 0 and the tops of the placed blocks
    live with it where it meets none of them."""
    for order in PLACEMENT_ORDERS:
        offsets, arena = _first_fit(blocks, order, _overlaps(blocks))
        placed = []
        for b in sorted(blocks, key=order):
            live = [o for o in placed if o.start < b.end and b.start < o.end]
            clear = [at for at in [0] + [offsets[o.name] + aligned(o.size_bytes) for o in live]
                     if all(at + aligned(b.size_bytes) <= offsets[o.name] or offsets[o.name] + aligned(o.size_bytes) <= at
                            for o in live)]
            assert offsets[b.name] == min(clear)
            placed.append(b)
        assert arena == max(offsets[b.name] + aligned(b.size_bytes) for b in blocks)


def _plan_with_reuse(with_data_wait: bool):
    """a (stream 0) writes x, read by b (stream 1); later c (stream 0) writes y into x's bytes."""
    from planner.plan import Plan, Residency, ScheduledOp, Totals

    def op(name, stream, start, end, reads=(), writes=(), record=None, waits=()):
        return ScheduledOp(node=name, algorithm="k", stream=stream, start_us=start, end_us=end, reads=list(reads),
                           writes=list(writes), record_event=record, wait_events=list(waits))

    ops = [op("a", 0, 0, 1, writes=["x"], record="ea"), op("b", 1, 1, 5, reads=["x"], waits=["ea"]),
           op("c", 0, 6, 7, writes=["y"], waits=["eb"] if with_data_wait else [])]
    if with_data_wait:
        ops[1].record_event = "eb"
    tensors = [Residency(tensor="x", bytes=1024, intervals_us=[(0, 5)]), Residency(tensor="y", bytes=1024,
                                                                                   intervals_us=[(6, 7)])]
    totals = Totals(makespan_us=7, peak_bytes=0, mem_cap_bytes=1, lower_bound_us=0, baseline_makespan_us=7,
                    status="FEASIBLE", gap=0, solve_time_s=0)
    return Plan(graph_sha256="0" * 64, model_name="m", batch=1, dtype="fp32", training=False,
                device_fingerprint="d", estimated=False, compute_streams=2, ops=ops, tensors=tensors, totals=totals)


def test_reused_bytes_make_the_writer_wait_for_the_last_reader():
    from runner.arena import add_reuse_waits, plan_blocks

    plan = _plan_with_reuse(with_data_wait=False)
    blocks, uses, _ = plan_blocks(plan)
    offsets, arena = assign_offsets(blocks)
    assert offsets["x#0"] == offsets["y#0"] and arena == 1024  # y reuses x's bytes
    safe = add_reuse_waits(plan, blocks, uses, offsets)
    b, c = safe.ops[1], safe.ops[2]
    assert b.record_event is not None and c.wait_events == [b.record_event]
    assert plan.ops[2].wait_events == []  # the input plan is not modified


def test_reuse_wait_already_implied_is_not_added():
    from runner.arena import add_reuse_waits, plan_blocks

    plan = _plan_with_reuse(with_data_wait=True)
    blocks, uses, _ = plan_blocks(plan)
    offsets, _ = assign_offsets(blocks)
    assert add_reuse_waits(plan, blocks, uses, offsets).ops[2].wait_events == ["eb"]
