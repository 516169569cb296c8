"""Which pooling gradients also offer the 2x2 blocks (runner/ops/pool_grad.py), and how many threads each
candidate launches: checked without a GPU (tests/test_gpu_ops.py runs the kernels against the reference)."""

import pytest

from runner.ops.common import spec
from runner.ops.pool import Pool, offered

MAX_3x3_S2 = {"kernel": [3, 3], "strides": [2, 2], "pads": [0, 0, 0, 0], "ceil_mode": 1, "dilations": [1, 1]}


@pytest.mark.parametrize("kind,attrs,blocks", [
    ("maxpool_bwd", MAX_3x3_S2, True),
    ("maxpool_bwd", {**MAX_3x3_S2, "strides": [1, 1], "pads": [1, 1, 1, 1]}, True),
    ("maxpool_bwd", {**MAX_3x3_S2, "kernel": [2, 2]}, True),
    ("maxpool_bwd", {**MAX_3x3_S2, "dilations": [2, 2]}, False),  # dilated windows: the general gather only
    ("maxpool_bwd", {**MAX_3x3_S2, "strides": [3, 3]}, False),
    ("maxpool", MAX_3x3_S2, False),  # forward pools have one kernel
    ("avgpool_bwd", {"kernel": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}, True),
    ("avgpool_bwd", {"kernel": [5, 3], "strides": [2, 1], "pads": [2, 1, 2, 1], "count_include_pad": 0}, False),
])
def test_the_blocks_are_offered_for_the_windows_their_kernels_take(kind, attrs, blocks):
    x, y = spec((2, 16, 11, 9), "fp16"), spec((2, 16, 5, 4), "fp16")
    pool = Pool(kind, {"count_include_pad": 0, **attrs}, x, y)
    names = [name for name, _ in pool.candidates]
    assert names == (["cupy_pool", "cupy_pool_2x2"] if blocks else ["cupy_pool"])
    assert offered(kind, attrs) == (["pool_2x2"] if blocks else [])


def test_the_blocks_launch_a_thread_per_2x2_block_of_each_channel():
    """Odd sides round up: the last row and column of blocks hold one element each."""
    x, y = spec((2, 16, 11, 9), "fp16"), spec((2, 16, 5, 4), "fp16")
    pool = Pool("maxpool_bwd", MAX_3x3_S2, x, y)
    assert pool.kernels == [("cupy_pool", "maxpool_bwd", 2 * 16 * 11 * 9),
                            ("cupy_pool_2x2", "maxpool_bwd_block", 2 * 16 * 6 * 5)]
    workspace = [size for _, size in pool.candidates]
    assert workspace[0] == workspace[1] >= 2 * 16 * 5 * 4  # one argmax byte per output element, for both
