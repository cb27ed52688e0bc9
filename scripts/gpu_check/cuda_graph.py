"""Timing calls on the GPU alone: captured once in a CUDA graph, then replayed, so no
host launch is in the time (the attention_bandwidth and decode_graph steps)."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def replay_ms(calls: list[Callable], replays: int) -> tuple[float, list]:
    """(median milliseconds of one replay of ``calls`` captured in one CUDA graph, timed by
    CUDA events over ``replays`` replays; what each call returned in the capture, which a
    replay writes again)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm-up outside the capture, as torch.cuda.graph asks
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [call() for call in calls]
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), outputs
