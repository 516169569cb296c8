"""Per-op times of `planner run`: kernels that run side by side count once, host gaps between them not at all."""

from runner.cupti_trace import Activity
from runner.replay import busy_us


def kernel(start_us, end_us):
    return Activity(kind="kernel", name="k", start_ns=int(start_us * 1000), end_ns=int(end_us * 1000), graph_node_id=0)


def test_busy_time_is_the_union_of_kernel_intervals():
    # a transpose, a host gap, four convolution kernels overlapping (cuDNN fp32 eng1), a nested one, a transpose
    kernels = [kernel(0, 2), kernel(100, 142), kernel(116, 158), kernel(130, 175), kernel(144, 188), kernel(150, 160),
               kernel(190, 193)]
    assert busy_us(kernels) == 2 + 88 + 3
    assert busy_us(list(reversed(kernels))) == 93
    assert busy_us([]) == 0
