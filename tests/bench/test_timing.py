"""Calibration timing (bench/timing.py): the mean of the repeats after a warm-up round, what the
decoding loop pays, with the untimed work around each step left out."""

import random
import statistics
import types

import pytest
from conftest import fails_for_some_seed

import specheads.bench.timing as timing
from specheads.bench.timing import time_steps

# seconds of each step per round: the warm-up first (a cold start, the slowest), then the repeats,
# one slow spell among fast ones; the mean the loop pays is neither the least nor the middle repeat
DURATIONS = {"a": [100.0, 1.0, 1.0, 1.0, 10.0], "b": [50.0, 2.0, 4.0, 2.0, 4.0]}
MEANS = {"a": 3.25, "b": 3.0}


def check_time_steps(timer, seed):
    """timer (time_steps) on steps that advance a fake clock by DURATIONS, with before/after hooks
    and a sync that advance it too (untimed work must not count): the means, every round running
    each step once in turn, sync closing the timed span on both sides."""
    clock, calls = [0.0], []
    runs = {key: iter(durations) for key, durations in DURATIONS.items()}

    def step(key):
        def run():
            calls.append(key)
            clock[0] += next(runs[key])

        return run

    def untimed(name, seconds):
        def hook(*key):
            calls.append((name, *key))
            clock[0] += seconds

        return hook

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        times = timer(
            {key: step(key) for key in DURATIONS},
            4,
            before=untimed("before", 1000.0 + seed),
            after=untimed("after", 500.0),
            sync=lambda: calls.append("sync"),
        )
    assert times == pytest.approx(MEANS)
    one = [[("before", key), "sync", key, "sync", ("after", key)] for key in DURATIONS]
    assert calls == [call for _ in range(5) for key_calls in one for call in key_calls]


def test_time_steps_reports_the_mean_repeat_the_loop_pays():
    check_time_steps(time_steps, 0)


@pytest.mark.parametrize(
    "reduce",
    [min, statistics.median, lambda times: times[-1]],
    ids=["least-disturbed", "median", "last"],
)
def test_the_time_steps_check_fails_on_another_statistic(reduce, monkeypatch):
    monkeypatch.setattr(timing, "fmean", reduce)  # shadows the mean in that module only
    assert fails_for_some_seed(check_time_steps, time_steps, range(1))


def test_the_time_steps_check_fails_when_the_warm_up_counts_or_the_hooks_are_timed():
    def with_warm_up(steps, repeats, **hooks):
        return {
            key: (seconds * repeats + DURATIONS[key][0]) / (repeats + 1)
            for key, seconds in time_steps(steps, repeats, **hooks).items()
        }

    def hooks_timed(steps, repeats, before, after, sync):
        return time_steps(
            {k: lambda k=k, s=s: (before(k), s(), after(k)) for k, s in steps.items()}, repeats, sync=sync
        )

    for variant in (with_warm_up, hooks_timed):
        assert fails_for_some_seed(check_time_steps, variant, range(1))


def brute_force_isotonic(values):
    """The least-squares non-decreasing fit by brute force: every split of the values into runs of
    neighbours, each run at its mean (the fit is one of these), the monotone one of least squares."""
    n, best = len(values), None
    for cuts in range(1 << max(n - 1, 0)):
        fit, start = [], 0
        for end in range(1, n + 1):
            if end == n or cuts >> (end - 1) & 1:
                run = values[start:end]
                fit += [sum(run) / len(run)] * len(run)
                start = end
        if all(a <= b for a, b in zip(fit, fit[1:])):
            sse = sum((f - v) ** 2 for f, v in zip(fit, values))
            if best is None or sse < best[0] - 1e-12:
                best = (sse, fit)
    return best[1] if best else []


def check_isotonic(fit, seed):
    rng = random.Random(seed)
    values = [rng.choice([rng.uniform(0, 10), float(rng.randint(0, 4))]) for _ in range(rng.randint(0, 8))]
    got = fit(values)
    assert all(a <= b for a, b in zip(got, got[1:]))
    assert got == pytest.approx(brute_force_isotonic(values))
    ordered = sorted(values)
    assert fit(ordered) == ordered  # a monotone ladder is left as it is


@pytest.mark.parametrize("seed", range(100))
def test_isotonic_is_the_least_squares_monotone_fit(seed):
    check_isotonic(timing.isotonic, seed)


def test_the_isotonic_check_fails_for_a_running_maximum():
    """The check can fail: the running maximum time_target made the ladder monotone with before."""

    def running_max(values):
        return [max(values[: i + 1]) for i in range(len(values))]

    assert fails_for_some_seed(check_isotonic, running_max, range(100))
    # the shape: one noisy small size lifted every larger one to its time
    assert timing.isotonic([60.0, 95.9, 73.5, 74.0, 76.0]) == pytest.approx([60.0, 79.85, 79.85, 79.85, 79.85])
