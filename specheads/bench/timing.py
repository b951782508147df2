"""How every calibration times a step: with the statistic the decoding loop pays.

The loop pays each step's time, slow ones included, so a step costs the mean over repeats (after a
warm-up round the loop has long paid before it is timed). The minimum, used before, is the least
disturbed repeat, which the loop does not get: tree=auto expected 2.14x from it where the benchmark
measured 1.64x, and layer skip timed a level at 51 ms that cost 63 ms in the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from statistics import fmean
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def time_steps(
    steps: Mapping[K, Callable[[], object]],
    repeats: int = 5,
    before: Callable[[K], object] | None = None,
    after: Callable[[K], object] | None = None,
    sync: Callable[[], object] | None = None,
) -> dict[K, float]:
    """Seconds each step takes: the mean of `repeats` rounds after a warm-up round. Each round runs
    every step once, in turn, so that a slow spell of the machine falls on all of them alike.
    before(key) and after(key) run untimed around each step; sync() (a device's) closes the timed
    span on both sides, so that queued work is counted where it was queued."""
    times: dict[K, list[float]] = {key: [] for key in steps}
    for r in range(repeats + 1):
        for key, step in steps.items():
            if before is not None:
                before(key)
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            step()
            if sync is not None:
                sync()
            if r:  # round 0 warms up
                times[key].append(time.perf_counter() - t0)
            if after is not None:
                after(key)
    return {key: fmean(t) for key, t in times.items()}


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (isotonic regression by
    pool-adjacent-violators: a value below the one before is pooled with it into their mean, and
    the pool with the ones before it while they are higher).

    What a timing ladder is made monotone with (more query tokens never cost less): a running
    maximum copied one noisy small size's time onto every larger size (verifying 2 tokens timed at
    95.9 ms made sizes 2..13 all cost that, where the loop paid 73.5 ms); the fit spreads such an
    error over the sizes it is pooled with instead, and leaves a monotone ladder as it is."""
    pools: list[list[float]] = []  # [sum, count] of each pool, left to right
    for v in values:
        pools.append([float(v), 1.0])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    out: list[float] = []
    for total, count in pools:
        out += [total / count] * int(count)
    return out
