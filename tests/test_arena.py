"""Arena offsets: never two live tensors on one byte, and close to the live-bytes lower bound."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.files import PlannerError
from runner.arena import ALIGN_BYTES, Block, assign_offsets, check_offsets, peak_live_bytes


def test_chain_reuses_memory():
    # a -> b -> c -> d, each live from its producer to its consumer: two buffers suffice
    blocks = [Block(n, 1024, i, i + 2) for i, n in enumerate("abcd")]
    offsets, arena = assign_offsets(blocks)
    assert arena == 2 * 1024 == peak_live_bytes(blocks)
    assert offsets["a"] == offsets["c"] and offsets["b"] == offsets["d"] != offsets["a"]


def test_sizes_are_aligned():
    offsets, arena = assign_offsets([Block("a", 10, 0, 2), Block("b", 10, 1, 3)])
    assert sorted(offsets.values()) == [0, ALIGN_BYTES] and arena == 2 * ALIGN_BYTES


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
