import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import HYBRID_TYPES, thinking_target, write_jsonl, write_questions
from transformers import GenerationConfig

from specheads.config.distill import DistillConfig, MagpieConfig
from specheads.data.formats import load_conversations
from specheads.distill import backends, regenerate
from specheads.distill.generation import generate
from specheads.distill.prompts import (
    TASK_TYPES,
    PromptFilter,
    dataset_prompts,
    end_of_turn_ids,
    magpie_prompts,
    trim_to_sentence,
    user_turn_prefix,
)
from specheads.distill.regenerate import run_distillation
from specheads.errors import SpecHeadsError

ROOT = Path(__file__).resolve().parents[2]
# A random-weight target writes random bytes: keep only dedup, not the quality filter.
RELAXED = MagpieConfig(min_words=0, min_printable=0.0, cut="keep", max_new_tokens=12)
LONG = "please write a short poem about the quiet autumn rain falling on the old stone bridge tonight"


pytestmark = pytest.mark.usefixtures("one_thread")


def cfg(tmp_path, name="out", **kw):
    base = DistillConfig(
        output=str(tmp_path / name),
        max_new_tokens=6,
        batch_size=4,
        shard_size=2,
        num_prompts=5,
        decontaminate=[],
        magpie=RELAXED,
    )
    return replace(base, **kw)


def shard_rows(directory):
    return [
        json.loads(line)
        for f in sorted(Path(directory, "shards").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]


# -- generation -----------------------------------------------------------------------------------


def prompt_ids(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_batched_greedy_equals_unbatched_and_transformers_generate(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    prompts = prompt_ids(tok, ["hello there", "a", "the quick brown fox jumps over", "xyz", "0123456789"])
    single = [generate(model, [p], max_new_tokens=12, stop_ids=[258], pad_id=256)[0] for p in prompts]
    batched = generate(model, prompts, max_new_tokens=12, stop_ids=[258], pad_id=256, batch_size=3)
    assert [g.tokens for g in batched] == [g.tokens for g in single]
    for p, g in list(zip(prompts, single))[:3]:
        out = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            generation_config=GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=258, pad_token_id=256),
        )
        assert out[0, len(p) :].tolist()[:12] == g.tokens
    # Stopping evicts rows from the batch; the others must not change.
    stop = single[2].tokens[3]
    single_stop = [generate(model, [p], max_new_tokens=12, stop_ids=[stop], pad_id=256)[0] for p in prompts]
    batched_stop = generate(model, prompts, max_new_tokens=12, stop_ids=[stop], pad_id=256, batch_size=5)
    assert [(g.tokens, g.finished) for g in batched_stop] == [(g.tokens, g.finished) for g in single_stop]
    assert single_stop[2].finished and single_stop[2].tokens == single[2].tokens[:3]


@pytest.mark.parametrize("model_type", [*HYBRID_TYPES, "gpt_oss"])
def test_finished_rows_leave_the_cache_of_every_layer_kind(model_type, monkeypatch):
    """Eviction on linear-attention, Mamba and sliding-window caches: rows are dropped from every
    layer's states, and every row's output is the one it has when generated alone."""
    from specheads.distill import generation
    from specheads.tiny import tiny_target

    model, tok = tiny_target(model_type, num_hidden_layers=4)
    # the long prompt twice: its two rows stop at once (one stop is below EVICT_FRACTION of 6 rows)
    prompts = prompt_ids(tok, ["hello there", LONG, "a", LONG, "xyz", "0123456789"])
    stop = generate(model, [prompts[1]], max_new_tokens=12, stop_ids=[258], pad_id=256)[0].tokens[3]
    alone = [generate(model, [p], max_new_tokens=12, stop_ids=[stop], pad_id=256)[0] for p in prompts]
    evicted = []
    select_rows = generation.select_rows
    monkeypatch.setattr(
        generation, "select_rows", lambda cache, rows: evicted.append(len(rows)) or select_rows(cache, rows)
    )
    batched = generate(model, prompts, max_new_tokens=12, stop_ids=[stop], pad_id=256, batch_size=6)
    assert evicted and evicted[0] == 4
    assert [(g.tokens, g.finished) for g in batched] == [(g.tokens, g.finished) for g in alone]


def test_sampling_is_seeded(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    prompts = prompt_ids(tok, ["hello"] * 6)

    def run(seed):
        return [
            g.tokens
            for g in generate(
                model, prompts, max_new_tokens=8, stop_ids=[258], pad_id=256, temperature=1.0, top_p=0.9, seed=seed
            )
        ]

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert len({tuple(t) for t in run(1)}) > 1


# -- prompts --------------------------------------------------------------------------------------


def test_user_turn_prefix_and_end_of_turn(tiny_target):
    tok = tiny_target.tokenizer
    assert user_turn_prefix(tok, []) == "<|im_start|>user\n"
    assert (
        user_turn_prefix(tok, [{"role": "system", "content": "S"}])
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"
    )
    assert 258 in end_of_turn_ids(tok, tiny_target.model)


def test_prompt_filter(tiny_target):
    f = PromptFilter(MagpieConfig(min_words=2, max_words=6), tiny_target.tokenizer)
    assert f.accept("Hello, World! How are you?")
    assert not f.accept("hello world how are you")  # duplicate after normalisation
    assert not f.accept("one")
    assert not f.accept("one two three four five six seven")
    assert not f.accept("a <|im_start|>user b")
    assert not f.accept("\x00\x01\x02 \x03\x04")
    assert not f.accept("a cut off prompt", finished=False)
    assert not f.accept("   ")
    assert f.counts == {
        "empty_or_cut": 2,
        "special": 1,
        "length": 2,
        "unprintable": 1,
        "duplicate": 1,
        "contaminated": 0,
    }


def test_cut_prompts_are_trimmed_to_their_last_sentence():
    assert (
        trim_to_sentence('I need help. Can you say "hi!" to Bob? Then write a')
        == 'I need help. Can you say "hi!" to Bob?'
    )
    assert trim_to_sentence("Version 2.5 of the tool is") == ""
    assert trim_to_sentence("Done.") == "Done."


def test_magpie_prompts_are_produced_and_deduplicated(tiny_target):
    greedy = replace(RELAXED, temperature=0.0, conditioned=False, max_rounds=2)
    f = PromptFilter(greedy, tiny_target.tokenizer)
    kept = magpie_prompts(tiny_target, 4, greedy, f, seed=0, batch_size=8)
    # Greedy from the same user-turn prefix writes the same prompt every time: one survives.
    assert len(kept) == 1 and f.counts["duplicate"] > 0
    f = PromptFilter(RELAXED, tiny_target.tokenizer)
    kept = magpie_prompts(tiny_target, 6, RELAXED, f, seed=0, batch_size=8)
    assert len(kept) == 6 and len({p["prompt"] for p in kept}) == 6
    assert all(p["category"] in TASK_TYPES for p in kept)


def test_dataset_prompts_formats(tmp_path):
    fastchat = write_questions(tmp_path / "q.jsonl", ["first turn", "other"])
    sharegpt = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {
                "conversations": [
                    {"from": "system", "value": "sys"},
                    {"from": "human", "value": "hi"},
                    {"from": "gpt", "value": "yo"},
                ]
            }
        ],
    )
    plain = write_jsonl(tmp_path / "p.jsonl", [{"question": "What is 2+2?", "answer": "4"}])
    assert [p["prompt"] for p in dataset_prompts(str(fastchat))] == ["first turn", "other"]
    assert dataset_prompts(str(sharegpt)) == [{"prompt": "hi", "category": "dataset", "follow_ups": []}]
    assert dataset_prompts(str(plain))[0]["prompt"] == "What is 2+2?"
    bad = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "assistant", "content": "only"}]}])
    with pytest.raises(SpecHeadsError, match="no user prompt"):
        dataset_prompts(str(bad))


# -- regeneration ---------------------------------------------------------------------------------


def test_batched_regeneration_equals_unbatched(tiny_target, tmp_path):
    src = write_questions(tmp_path / "q.jsonl", [f"question {i} " + "x" * i for i in range(5)])
    a = run_distillation(tiny_target, cfg(tmp_path, "a", prompts=str(src), batch_size=1))
    b = run_distillation(tiny_target, cfg(tmp_path, "b", prompts=str(src), batch_size=4))
    assert shard_rows(a) == shard_rows(b)
    assert len(shard_rows(a)) == 5


def test_interrupted_distillation_resumes_without_duplicates_or_gaps(tiny_target, tmp_path, monkeypatch, capsys):
    reference = shard_rows(run_distillation(tiny_target, cfg(tmp_path, "ref", turns=2)))
    assert len(reference) == 5 and all(len(r["messages"]) == 4 for r in reference)

    calls = {"n": 0}
    real_write = regenerate.write_shard

    def crash_after_first(*args, **kwargs):
        if calls["n"] == 1:
            raise KeyboardInterrupt  # killed while shard 1 was being written
        calls["n"] += 1
        return real_write(*args, **kwargs)

    monkeypatch.setattr(regenerate, "write_shard", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        run_distillation(tiny_target, cfg(tmp_path, "run", turns=2))
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert list(manifest["shards"]) == ["0"] and not manifest["complete"]
    with pytest.raises(SpecHeadsError, match="unfinished distillation"):
        load_conversations(str(tmp_path / "run"))
    partial = load_conversations(str(tmp_path / "run"), partial_distill=True)  # its completed shard only
    assert 0 < len(partial) < 5 and "unfinished distillation; using its 1 of" in capsys.readouterr().out
    monkeypatch.setattr(regenerate, "write_shard", real_write)
    out = run_distillation(tiny_target, cfg(tmp_path, "run", turns=2))
    rows = shard_rows(out)
    assert rows == reference
    assert [r["id"] for r in rows] == sorted({r["id"] for r in rows})
    assert len(load_conversations(str(out))) == 5
    # A finished run is left alone; a different one in the same directory is refused.
    assert run_distillation(tiny_target, cfg(tmp_path, "run", turns=2)) == out
    with pytest.raises(SpecHeadsError, match="changed: max_new_tokens"):
        run_distillation(tiny_target, cfg(tmp_path, "run", turns=2, max_new_tokens=7))


def test_output_loads_with_datasets_and_records_provenance(tiny_target, tmp_path):
    import datasets

    out = run_distillation(tiny_target, cfg(tmp_path, num_prompts=3), seed=3, target_path="tiny:llama")
    loaded = datasets.load_dataset("json", data_files=str(out / "shards" / "*.jsonl"), split="train")
    assert len(loaded) == 3 and loaded[0]["messages"][0]["role"] == "user"
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["target"]["name"] == "tiny-random" and meta["target"]["path"] == "tiny:llama"
    assert meta["seed"] == 3 and meta["answers"]["temperature"] == 0.0 and meta["complete"]
    assert meta["specheads_version"]


def test_the_answers_are_written_and_recorded_with_the_targets_thinking_setting(tmp_path):
    """model.thinking reaches the loaded target's answers (its generation prompt changes), lands in
    metadata.json with the chat template's digest, and a resumed run with another setting is refused."""
    import hashlib

    from specheads.tiny import THINKING_TEMPLATE

    src = write_questions(tmp_path / "q.jsonl", ["What is rain?", "Name a color.", "Why?"])
    off, on = thinking_target(False), thinking_target(True)
    out = run_distillation(off, cfg(tmp_path, "off", prompts=str(src), num_prompts=None))
    chat = json.loads((out / "metadata.json").read_text())["target"]["chat"]
    assert chat["thinking"] is False
    assert chat["template_sha256"] == hashlib.sha256(THINKING_TEMPLATE.encode()).hexdigest()
    answers = lambda d: [r["messages"][1]["content"] for r in shard_rows(d)]  # noqa: E731
    assert answers(out) != answers(run_distillation(on, cfg(tmp_path, "on", prompts=str(src), num_prompts=None)))
    with pytest.raises(SpecHeadsError, match="changed: tokenizer"):
        run_distillation(on, cfg(tmp_path, "off", prompts=str(src), num_prompts=None))


def test_contaminated_prompts_are_dropped_before_answering(tiny_target, tmp_path):
    evalfile = write_questions(tmp_path / "question.jsonl", [LONG])
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in ["one", LONG.upper(), "two", "one"]])
    out = run_distillation(tiny_target, cfg(tmp_path, prompts=str(src), decontaminate=[str(evalfile)]))
    assert sorted(r["messages"][0]["content"] for r in shard_rows(out)) == ["one", "two"]


def test_bad_prompt_source_leaves_nothing_behind(tiny_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(SpecHeadsError, match="bad.jsonl:1"):
        run_distillation(tiny_target, cfg(tmp_path, prompts=str(bad)))
    strict = replace(RELAXED, min_words=50, max_rounds=1)
    with pytest.raises(SpecHeadsError, match="no usable prompt"):
        run_distillation(tiny_target, cfg(tmp_path, magpie=strict))
    assert not (tmp_path / "out").exists()


def test_builtin_data_is_built_once_and_reused(tiny_target, tmp_path, monkeypatch):
    from specheads.config.train import DataConfig
    from specheads.data.datasets import build_datasets
    from specheads.distill.builtin import builtin_dir, ensure_builtin_data

    def builtin_datasets(data):
        return build_datasets(replace(data, path=str(ensure_builtin_data(tiny_target, data))), tiny_target.tokenizer)

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    data = DataConfig(
        builtin_examples=4, builtin_answer_tokens=5, builtin_batch_size=8, max_length=512, eval_fraction=0.25
    )
    train, evaluation = builtin_datasets(data)
    assert len(train) + len(evaluation) == 4
    [built] = list((tmp_path / "cache" / "data").iterdir())
    monkeypatch.setattr(backends, "generate", lambda *a, **k: pytest.fail("rebuilt the cached set"))
    again, _ = builtin_datasets(data)
    assert list(again["input_ids"]) == list(train["input_ids"])
    data.builtin_examples = 3
    assert builtin_dir(tiny_target, data) != built


# -- distill.py -----------------------------------------------------------------------------------


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "distill.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def test_distill_cli_end_to_end(tmp_path):
    src = write_questions(tmp_path / "q.jsonl", ["Tell me a joke.", "What is rain?", "Name a color."])
    out = tmp_path / "d"
    proc = run_cli(
        "model=tiny-random",
        f"distill.prompts={src}",
        "distill.num_prompts=3",
        "distill.max_new_tokens=8",
        f"distill.output={out}",
        "distill.turns=2",
        "distill.magpie.min_words=0",
        "distill.magpie.min_printable=0",
        "distill.magpie.cut=keep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    rows = load_conversations(str(out))
    assert sorted(r[0]["content"] for r in rows) == ["Name a color.", "Tell me a joke.", "What is rain?"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "q.jsonl"]  # nothing else written


def test_distill_cli_bad_input_is_one_line(tmp_path):
    commands = [  # side by side
        ("model=tiny-random", "distill.no_such_key=1"),
        ("model=tiny-random", f"distill.prompts={tmp_path / 'missing.jsonl'}", f"distill.output={tmp_path / 'o'}"),
    ]
    with ThreadPoolExecutor(2) as pool:
        unknown, proc = pool.map(lambda args: run_cli(*args, cwd=tmp_path), commands)
    assert unknown.returncode != 0
    assert len(unknown.stderr.strip().splitlines()) == 1 and "no_such_key" in unknown.stderr
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error:") and "does not exist" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_smollm2_writes_sensible_prompts(smollm2_target):
    cfg = MagpieConfig(max_new_tokens=48)
    f = PromptFilter(cfg, smollm2_target.tokenizer)
    kept = magpie_prompts(smollm2_target, 8, cfg, f, seed=0, batch_size=12)
    assert len(kept) >= 6
    assert len({p["category"] for p in kept}) >= 3
    for p in kept:
        text = p["prompt"]
        assert 3 <= len(text.split()) <= 200 and "<|im" not in text
        assert sum(ch.isascii() for ch in text) > 0.9 * len(text)
