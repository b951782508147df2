"""The training log's derived series: tokens read per logged step, and the curves PNG."""

import json
import random

import pytest

from specheads.train.metrics import plot_metrics, tokens_seen


def logged(windows):
    """Records as the trainer writes them: one per window of (steps, tokens, seconds)."""
    records, step = [], 0
    for steps, tokens, seconds in windows:
        step += steps
        records.append({"step": step, "train/tokens_per_s": tokens / seconds, "train/steps_per_s": steps / seconds})
        if step % 10 == 0:
            records.append({"step": step, "eval/sim_tau": 1.0 + step / 100})
    return records


def test_tokens_seen_is_the_running_sum_of_the_windows():
    rng = random.Random(0)
    # uneven windows (the last one of a run, a resume) and uneven speeds
    windows = [(rng.choice([1, 3, 5]), rng.randint(100, 5000), rng.uniform(0.5, 9.0)) for _ in range(40)]
    records = logged(windows)
    want, total, step = {}, 0, 0
    for steps, tokens, _ in windows:
        step += steps
        total += tokens
        want[step] = total
    got = tokens_seen(records)
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k], rel=1e-9) for k in want)
    # a sum that ignored the window length (tokens/s x 1 step) would be far off
    assert (
        sum(r["train/tokens_per_s"] / r["train/steps_per_s"] for r in records if "train/tokens_per_s" in r)
        < 0.5 * total
    )


def test_curves_plot_acceptance_against_tokens(tmp_path):
    records = logged([(5, 1000, 2.0)] * 12)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    png = plot_metrics(path, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics(tmp_path / "missing.jsonl", tmp_path / "none.png") is None
