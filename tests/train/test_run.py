"""train(): what the head directories of a run record of it."""

import json

import pytest
import torch
from conftest import thinking_target, write_conversations, write_questions

from specheads import provenance
from specheads.config.model import ModelConfig
from specheads.config.train import DataConfig, HeadConfig, TrainConfig, TrainJobConfig, WandbConfig
from specheads.errors import SpecHeadsError
from specheads.train import run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_head_of_a_run_records_the_commit_it_started_at(tmp_path, monkeypatch):
    """A commit made while the run trains does not rename the code that trained it: the checkpoint
    heads and the final head all name the commit read at the start (a fake git here, that moves on
    at every call: it fails if a head reads the commit when it is written)."""
    commits = iter(f"commit-{i}" for i in range(100))
    monkeypatch.setattr(provenance, "git_commit", lambda: next(commits))
    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    out = tmp_path / "run"
    cfg = TrainJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        head=HeadConfig(family="eagle3"),
        data=DataConfig(path=str(data), max_length=64, eval_fraction=0.25),
        train=TrainConfig(warmup_steps=1, batch_size=2, max_steps=2, save_every=1, save_heads=True, eval_every=0),
        wandb=WandbConfig(mode="disabled"),
        output_dir=str(out),
    )
    run.train(cfg)
    heads = [out / "head", out / "heads" / "step-1", out / "heads" / "step-2"]
    recorded = [json.loads((h / "config.json").read_text())["training"]["commit"] for h in heads]
    assert recorded == ["commit-0"] * 3


def tiny_job(data, out, **train):
    return TrainJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        head=HeadConfig(family="eagle3"),
        data=DataConfig(path=str(data), max_length=64, eval_fraction=0.25),
        train=TrainConfig(warmup_steps=1, batch_size=2, eval_every=0, **train),
        wandb=WandbConfig(mode="disabled"),
        output_dir=str(out),
    )


def test_a_head_records_the_chat_rendering_it_trained_on_and_data_made_otherwise_is_said(tmp_path, capsys):
    """A distillation with thinking off trained on with model.thinking=true: one line says so, and
    the head's config.json records the run's own rendering (training.chat); trained on with the
    setting it was made with, nothing is said."""
    from specheads.chat_template import chat_record
    from specheads.config.distill import DistillConfig
    from specheads.distill.regenerate import run_distillation

    questions = write_questions(tmp_path / "q.jsonl", [f"Question {i}?" for i in range(8)])
    made = DistillConfig(prompts=str(questions), output=str(tmp_path / "data"), max_new_tokens=8, decontaminate=[])
    data = run_distillation(thinking_target(False), made)
    for thinking in (True, False):
        job = tiny_job(data, tmp_path / f"run-{thinking}", max_steps=1)
        job.model = ModelConfig(name="tiny-random", path="tiny:llama", tiny={"template": "thinking"}, thinking=thinking)
        capsys.readouterr()
        head = run.train(job)
        warnings = [line for line in capsys.readouterr().err.splitlines() if f"data {data} was made with" in line]
        assert len(warnings) == int(thinking)
        recorded = json.loads((head / "config.json").read_text())["training"]["chat"]
        assert recorded == chat_record(thinking_target(thinking).tokenizer) and recorded["thinking"] is thinking


def test_init_from_starts_a_run_from_an_earlier_heads_weights_and_records_it(tmp_path):
    """A continued head starts where the earlier one ended (its step-0 head equals it, draft vocab
    included, where a fresh start does not) and keeps the earlier head's record in its own."""
    from safetensors.torch import load_file

    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    first = run.train(tiny_job(data, tmp_path / "first", max_steps=2))
    # lr 0: the continued run's weights stay the earlier head's, so equality is exact
    later = run.train(tiny_job(data, tmp_path / "later", max_steps=1, lr=0.0, init_from=str(first)))
    fresh = run.train(tiny_job(data, tmp_path / "fresh", max_steps=1, lr=0.0))
    a, b, c = (load_file(str(h / "model.safetensors")) for h in (first, later, fresh))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    record = json.loads((later / "config.json").read_text())["training"]["init_from"]
    assert record["training"]["steps"] == 2
    assert record["weights_sha256"] == provenance.file_digest(first / "model.safetensors")
    assert "init_from" not in json.loads((fresh / "config.json").read_text())["training"]


def test_a_parallel_head_starts_from_an_eagle3_head_with_its_own_tensors_fresh(tmp_path):
    """P-EAGLE's first position is an EAGLE-3 draft: a peagle run may start from an eagle3 head
    (every shared tensor copied, mask_hidden fresh); the other way round, or with another layer
    count, is refused in one line."""
    from safetensors.torch import load_file

    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    first = run.train(tiny_job(data, tmp_path / "first", max_steps=2))
    job = tiny_job(data, tmp_path / "parallel", max_steps=1, lr=0.0, init_from=str(first))
    job.head = HeadConfig(family="peagle")
    parallel = run.train(job)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(parallel / "model.safetensors"))
    assert set(b) - set(a) == {"mask_hidden"} and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((parallel / "config.json").read_text())["training"]["init_from"]["training"]["steps"] == 2
    back = tiny_job(data, tmp_path / "back", max_steps=1, init_from=str(parallel))
    with pytest.raises(SpecHeadsError, match="is a peagle head; this run trains eagle3"):
        run.train(back)
    deeper = tiny_job(data, tmp_path / "deeper", max_steps=1, init_from=str(first))
    deeper.head = HeadConfig(family="peagle", num_decoder_layers=2)
    with pytest.raises(SpecHeadsError, match=r"lacks \['extra_input_norms.0.weight'"):
        run.train(deeper)


def test_init_from_refuses_another_family_other_tensors_or_a_target_adapter_in_one_line(tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    first = run.train(tiny_job(data, tmp_path / "first", max_steps=1))
    refused = [  # (the run's head fields, the one line that refuses them)
        (HeadConfig(family="eagle3", draft_vocab_size=64), r"is \(.*\) there and \(.*\) here"),
        (HeadConfig(family="medusa"), "is a eagle3 head; this run trains medusa"),
        (HeadConfig(family="eagle3", fc_bias=True), r"lacks \['fc.bias'\] and has \[\] that this run's head does not"),
        (HeadConfig(family="medusa2"), "cannot continue a medusa2 head"),
    ]
    for i, (head, line) in enumerate(refused):
        job = tiny_job(data, tmp_path / f"run-{i}", max_steps=1, init_from=str(first))
        job.head = head
        with pytest.raises(SpecHeadsError, match=line):
            run.train(job)
    with pytest.raises(SpecHeadsError, match="not a head directory"):
        run.train(tiny_job(data, tmp_path / "d", max_steps=1, init_from=str(tmp_path)))


def test_a_resumed_continued_run_keeps_the_init_from_record_of_its_first_start(tmp_path):
    """A resume takes every weight from its checkpoint, so the head it continued is not read again:
    rewritten in between, the record still names what the run started from; deleted, nothing fails."""
    import shutil

    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    source = tmp_path / "source"
    shutil.copytree(run.train(tiny_job(data, tmp_path / "first", max_steps=2)), source)
    out = tmp_path / "later"
    first_start = run.train(tiny_job(data, out, max_steps=1, save_every=1, init_from=str(source)))
    record = json.loads((first_start / "config.json").read_text())["training"]["init_from"]
    assert record["weights_sha256"] == provenance.file_digest(source / "model.safetensors")

    other = run.train(tiny_job(data, tmp_path / "other", max_steps=1))
    shutil.rmtree(source)
    shutil.copytree(other, source)  # the same path now holds another head
    resumed = run.train(tiny_job(data, out, max_steps=2, save_every=1, init_from=str(source)))
    assert json.loads((resumed / "config.json").read_text())["training"]["init_from"] == record
    shutil.rmtree(source)
    resumed = run.train(tiny_job(data, out, max_steps=3, save_every=1, init_from=str(source)))
    assert json.loads((resumed / "config.json").read_text())["training"]["init_from"] == record
    # a checkpoint from before checkpoints kept the record: read again if there, else its path alone
    job = tiny_job(data, out, init_from=str(source))
    assert run.init_from_reread(job)["init_from"] == {**record, "weights_sha256": None, "training": None}


@pytest.mark.parametrize(
    "field,value,refusal",
    [
        ("max_minutes", -1.0, r"train.max_minutes must be > 0 \(or null\), got -1.0"),
        ("max_minutes", 0.0, "train.max_minutes must be > 0"),
        ("max_steps", 0, "train.max_steps must be >= 1, got 0"),
        ("epochs", 0.0, "train.epochs must be > 0"),
        ("batch_size", 0, "train.batch_size and train.grad_accum must be >= 1"),
        ("grad_accum", 0, "train.batch_size and train.grad_accum must be >= 1"),
        ("lr", -1e-3, "train.lr must be >= 0"),
        ("warmup_steps", -1, "train.warmup_steps must be >= 0"),
        ("min_lr_ratio", 1.5, r"train.min_lr_ratio must be in \[0, 1\]"),
    ],
)
def test_train_values_no_run_can_start_with_are_one_line_before_anything_is_loaded(tmp_path, field, value, refusal):
    """Refused before the target is loaded or output_dir is made (a dry run too): the model path
    here does not exist, so getting past the check would fail another way."""
    cfg = TrainJobConfig(
        model=ModelConfig(name="missing", path=str(tmp_path / "no-model")),
        train=TrainConfig(**{field: value}),
        output_dir=str(tmp_path / "out"),
    )
    with pytest.raises(SpecHeadsError, match=refusal):
        run.train(cfg)
    cfg.dry_run = True
    with pytest.raises(SpecHeadsError, match=refusal):
        run.train(cfg)
    assert not (tmp_path / "out").exists()


def test_a_negative_time_budget_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    from test_train import ROOT, clean_env

    proc = subprocess.run(
        [sys.executable, "train.py", "model=tiny-random", f"output_dir={tmp_path / 'out'}", "train.max_minutes=-1"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: train.max_minutes must be > 0 (or null), got -1.0"]
    assert "it/s" not in proc.stdout + proc.stderr  # no progress bar: nothing started
    # only Hydra's record of the command (written before any task runs, as for every refusal)
    assert {p.name for p in (tmp_path / "out").iterdir()} <= {".hydra", "train.log"}
