"""The throughput model: its measured runs are described with the counts the plan makes, the fit
solves for the constants that generated the runs, and it reproduces every measured run."""

import dataclasses

import pytest
from test_plan import job

from specheads.heads.spec import HeadSpec
from specheads.train.arch import read_arch
from specheads.train.plan import head_parameters
from specheads.train.throughput import (
    FIT,
    GPUS,
    MEASURED,
    Fit,
    MeasuredRun,
    Work,
    fit,
    flops_per_token,
    tokens_per_second,
)

# each measured run's target and head, as train.py composes them
MEASURED_AS = [
    ("model=smollm2-135m", "head=eagle3", "head.ttt_steps=3"),
    ("model=llama-3.1-8b", "head=eagle3", "head.ttt_steps=4", "head.draft_vocab_size=32000"),
]


@pytest.mark.parametrize("run,overrides", list(zip(MEASURED, MEASURED_AS)))
def test_measured_runs_carry_the_plans_own_counts(run, overrides):
    cfg = job(*overrides)
    arch = read_arch(cfg.model)
    spec = HeadSpec.from_config(cfg.head, arch.info)
    w = run.work
    assert w.target_parameters == arch.num_parameters and w.head_parameters == head_parameters(spec, arch.info)
    assert (w.target_layers, w.hidden_size, w.vocab_size, w.draft_passes) == (
        arch.info.num_layers,
        arch.info.hidden_size,
        arch.info.vocab_size,
        spec.ttt_steps,
    )


def synthetic(model: Fit, work: Work, tokens: int, gpu: str, micro: int = 1) -> MeasuredRun:
    seconds = micro * (model.overhead + tokens * flops_per_token(work) / (GPUS[gpu] * model.efficiency))
    return MeasuredRun("synthetic", "test", gpu, work, tokens, micro, seconds)


def test_the_fit_recovers_the_constants_that_made_the_runs():
    truth = Fit(overhead=0.05, efficiency=0.35)
    runs = [synthetic(truth, r.work, r.tokens_per_micro_batch, r.gpu, r.micro_batches_per_step) for r in MEASURED]
    runs.append(synthetic(truth, MEASURED[1].work, 8192, "h200", 2))  # a third, consistent run changes nothing
    found = fit(runs)
    assert found.overhead == pytest.approx(truth.overhead, rel=1e-9)
    assert found.efficiency == pytest.approx(truth.efficiency, rel=1e-9)


def test_the_model_reproduces_each_measured_run():
    for run in MEASURED:
        measured = run.tokens_per_micro_batch * run.micro_batches_per_step / run.seconds_per_step
        assert tokens_per_second(run.work, run.tokens_per_micro_batch, run.gpu) == pytest.approx(measured, rel=1e-6)
    assert 0.05 < FIT.efficiency < 0.8 and 0 < FIT.overhead < 1  # a physical fit, not a degenerate one


def test_flops_count_the_target_only_online_and_every_draft_pass():
    w = MEASURED[1].work
    offline = dataclasses.replace(w, online=False)
    assert flops_per_token(w) - flops_per_token(offline) == pytest.approx(
        2 * w.target_parameters + 4 * w.target_layers * w.context * w.hidden_size - 2 * w.vocab_size * w.hidden_size
    )
    twice = dataclasses.replace(w, draft_passes=2 * w.draft_passes)
    head = w.draft_passes * (6 * w.head_parameters + 12 * w.head_layers * w.context * w.hidden_size)
    assert flops_per_token(twice) - flops_per_token(w) == pytest.approx(head)
