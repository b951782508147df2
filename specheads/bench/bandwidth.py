"""The machine's memory bandwidth, sampled between the questions of a CPU benchmark.

A one-row decoding step streams the target's weights from memory, so its time follows the
bandwidth the machine has at that moment; a verification of several rows computes more per weight
it reads and follows it much less (BENCHMARKS.md, "Why the sittings disagree"). Where the memory is
shared with other work, ratios to a one-row loop therefore rise and fall with the contention. The
probe times one copy between two buffers far larger than the caches, between questions (outside
every timed section), so that a sitting's rows and summary tell a contended run from a quiet one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch


class BandwidthProbe:
    """Two float32 buffers of `mib` MiB each, touched once; `sample()` is GB/s read + written."""

    def __init__(self, mib: int):
        if mib <= 0:
            raise ValueError(f"the probe needs a positive size, got {mib} MiB")
        self.mib = mib
        self.src = torch.ones(mib * 2**20 // 4)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # the first copy pays the page faults, not a sample

    def sample(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        seconds = time.perf_counter() - t0
        return 2 * self.src.numel() * self.src.element_size() / seconds / 1e9


def summarize_bandwidth(samples: Sequence[float], mib: int) -> dict:
    """The samples' median and 10th / 90th percentiles (inclusive method), in GB/s."""
    ordered = sorted(samples)
    if len(ordered) == 1:
        p10 = p90 = ordered[0]
    else:
        deciles = statistics.quantiles(ordered, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    return {
        "mib": mib,
        "samples": len(ordered),
        "median_gb_s": statistics.median(ordered),
        "p10_gb_s": p10,
        "p90_gb_s": p90,
    }


def format_bandwidth(b: dict) -> str:
    return (
        f"memory bandwidth ({b['mib']} MiB copies between questions, {b['samples']} samples): median "
        f"{b['median_gb_s']:.0f} GB/s, 10th-90th percentile {b['p10_gb_s']:.0f}-{b['p90_gb_s']:.0f}"
    )
