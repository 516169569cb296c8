"""A captured graph runs its small memsets as kernels (runner/graphs.py): the same bytes, the same order across
streams, large memsets left alone. Skipped without a GPU."""

import numpy as np
import pytest

from runner.graphs import MEMSET_AS_KERNEL_MAX_BYTES, NODE_MEMSET, capture, node_type, nodes

pytestmark = pytest.mark.gpu


def test_small_memsets_run_as_kernels_between_the_same_neighbours():
    import cupy as cp

    origin, side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    small, after = cp.zeros(257, cp.uint8), cp.zeros(257, cp.uint8)
    head, tail = cp.zeros(16, cp.uint8), cp.zeros(8, cp.uint8)  # a memset with no node before it, none after
    big = cp.zeros(MEMSET_AS_KERNEL_MAX_BYTES + 1, cp.uint8)
    fork, join = cp.cuda.Event(), cp.cuda.Event()

    def issue():
        cp.cuda.runtime.memsetAsync(head.data.ptr, 1, head.nbytes, origin.ptr)
        fork.record(origin)
        side.wait_event(fork)
        with side:
            small.fill(3)
            cp.cuda.runtime.memsetAsync(small.data.ptr + 1, 0x5A, 255, side.ptr)  # odd offset and length
            cp.add(small, 1, out=after)  # must see the memset's bytes
        join.record(side)
        origin.wait_event(join)
        cp.cuda.runtime.memsetAsync(big.data.ptr, 7, big.nbytes, origin.ptr)
        cp.cuda.runtime.memsetAsync(tail.data.ptr, 2, tail.nbytes, origin.ptr)

    replay = capture(origin, issue)
    assert len(replay.replaced) == 3
    assert [node_type(n) for n in nodes(replay.graph)].count(NODE_MEMSET) == 1  # the big one stays
    for _ in range(2):
        with origin:  # the replay's stream does not wait for the default one
            for array in (head, after, big, tail):
                array.fill(0)
        replay.launch(origin)
        origin.synchronize()
        want = np.full(257, 0x5B, np.uint8)
        want[[0, -1]] = 4
        np.testing.assert_array_equal(cp.asnumpy(after), want)
        assert bool((big == 7).all()) and bool((head == 1).all()) and bool((tail == 2).all())


def test_a_failed_capture_leaves_the_stream_usable():
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)

    def issue():
        raise ValueError("boom")

    with pytest.raises(ValueError):
        capture(stream, issue)
    assert not cp.cuda.runtime.streamIsCapturing(stream.ptr)
