import pytest
import torch
from conftest import conversations, thinking_target, write_jsonl, write_questions

from specheads.config.train import DataConfig
from specheads.data.chat import tokenize_conversation
from specheads.data.datasets import build_datasets, collate
from specheads.data.formats import load_conversations
from specheads.errors import SpecHeadsError


def data_cfg(path, **kw):
    cfg = DataConfig(path=str(path), max_length=128, eval_fraction=0.25)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_build_datasets_split_shuffle_and_drop(tok, tmp_path):
    rows = conversations(20) + [{"messages": [{"role": "user", "content": "no answer here"}]}]
    file = write_jsonl(tmp_path / "d.jsonl", rows)
    train, evaluation = build_datasets(data_cfg(file), tok)
    assert (len(train), len(evaluation)) == (15, 5)  # the row without an assistant turn is dropped
    assert set(train.column_names) == {"input_ids", "loss_mask"}
    ids = lambda ds: list(ds["input_ids"])  # noqa: E731
    again_train, again_eval = build_datasets(data_cfg(file), tok)
    assert ids(again_train) == ids(train) and ids(again_eval) == ids(evaluation)
    other, _ = build_datasets(data_cfg(file, shuffle_seed=1), tok)
    assert ids(other) != ids(train)
    everything = sorted(map(tuple, ids(train) + ids(evaluation)))
    direct = sorted(tuple(tokenize_conversation(tok, c, 128)["input_ids"]) for c in load_conversations(str(file))[:20])
    assert everything == direct  # split is a partition: no duplicates, no gaps
    small, small_eval = build_datasets(data_cfg(file, max_examples=8, eval_fraction=0.0), tok)
    assert (len(small), len(small_eval)) == (8, 0)


def test_build_datasets_decontaminates_and_reports(tok, tmp_path, capsys):
    leaked = "please write a short poem about the quiet autumn rain falling on the old stone bridge"
    evalfile = write_questions(
        tmp_path / "question.jsonl", [leaked.upper() + "!"], first_id=1, later_turns=("Now shorter.",)
    )
    rows = conversations(6) + [
        {"messages": [{"role": "user", "content": f"Hey: {leaked}, thanks"}, {"role": "assistant", "content": "ok"}]}
    ]
    file = write_jsonl(tmp_path / "d.jsonl", rows)
    train, evaluation = build_datasets(data_cfg(file, decontaminate=[str(evalfile)]), tok)
    assert len(train) + len(evaluation) == 6
    assert "dropped 1 of 7" in capsys.readouterr().out


def test_build_datasets_drops_looping_answers(tok, tmp_path, capsys):
    loops = [
        {"messages": [{"role": "user", "content": f"loop {i}"}, {"role": "assistant", "content": "la la la " * 20}]}
        for i in range(5)
    ]
    file = write_jsonl(tmp_path / "d.jsonl", conversations(12) + loops)
    train, evaluation = build_datasets(data_cfg(file, max_repeat_rate=0.5), tok)
    kept = list(train["input_ids"]) + list(evaluation["input_ids"])
    assert len(kept) == 12 and "dropped 5 of 17" in capsys.readouterr().out
    assert not any(tok.decode([t for t in ids]).count("la la la") for ids in kept)
    # max_examples counts the rows kept: a filtered run reads as many conversations as another
    small, small_eval = build_datasets(data_cfg(file, max_repeat_rate=0.5, max_examples=10, eval_fraction=0.0), tok)
    assert len(small) == 10
    everything, _ = build_datasets(data_cfg(file, eval_fraction=0.0), tok)
    assert len(everything) == 17  # the filter is off by default
    with pytest.raises(SpecHeadsError, match="max_repeat_rate"):
        build_datasets(data_cfg(file, max_repeat_rate=1.5), tok)


def test_build_datasets_errors(tok, tmp_path):
    with pytest.raises(SpecHeadsError, match="needs the target"):
        build_datasets(DataConfig(path="builtin"), tok)
    only_users = write_jsonl(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(SpecHeadsError, match="no usable conversation"):
        build_datasets(data_cfg(only_users), tok)
    with pytest.raises(SpecHeadsError, match="eval_fraction"):
        build_datasets(data_cfg(write_jsonl(tmp_path / "d.jsonl", conversations(3)), eval_fraction=1.5), tok)


def test_collate_right_pads():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_mix_adds_the_other_sources_and_names_them(tok, tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", conversations(6))
    b = write_jsonl(tmp_path / "b.jsonl", conversations(6, offset=100))
    alone = build_datasets(data_cfg(a, eval_fraction=0.0), tok)[0]
    mixed = build_datasets(data_cfg(a, mix=[str(b)], eval_fraction=0.0), tok)[0]
    assert (len(alone), len(mixed)) == (6, 12)
    texts = {tok.decode(r) for r in mixed["input_ids"]}
    assert any("number 103" in t for t in texts) and any("number 3" in t for t in texts)
    assert f"6 conversations from {b}" in capsys.readouterr().out
    with pytest.raises(SpecHeadsError, match="builtin"):
        build_datasets(data_cfg(a, mix=["builtin"]), tok)


def test_max_per_source_keeps_a_seeded_subset_of_each_source(tok, tmp_path, capsys):
    big = write_jsonl(tmp_path / "big.jsonl", conversations(12))
    small = write_jsonl(tmp_path / "small.jsonl", conversations(3, offset=500))
    train = build_datasets(data_cfg(big, mix=[str(small)], max_per_source=4, eval_fraction=0.0), tok)[0]
    texts = [tok.decode(r) for r in train["input_ids"]]
    assert len(texts) == 4 + 3 and sum("number 50" in t for t in texts) == 3  # the small source whole
    assert f"4 of 12 conversations from {big}" in capsys.readouterr().out
    again = build_datasets(data_cfg(big, mix=[str(small)], max_per_source=4, eval_fraction=0.0), tok)[0]
    assert again["input_ids"] == train["input_ids"]  # seeded
    with pytest.raises(SpecHeadsError, match="max_per_source"):
        build_datasets(data_cfg(big, max_per_source=0), tok)


def test_row_lengths_of_a_shuffled_dataset():
    import datasets

    from specheads.data.datasets import row_lengths

    ds = datasets.Dataset.from_list([{"input_ids": [1] * n, "loss_mask": [0] * n} for n in range(1, 20)])
    view = ds.shuffle(seed=3).select(range(5))
    assert row_lengths(view) == [len(r["input_ids"]) for r in view]
    assert row_lengths([{"input_ids": [4, 5]}]) == [2]


def test_data_distilled_with_another_thinking_setting_is_said_in_one_line(tmp_path, capsys):
    """train.py's data check: a distillation records the chat template and model.thinking its answers
    were written with; building the data with another rendering says so once, the same one and data
    made before the record say nothing."""
    import json

    from specheads.config.distill import DistillConfig
    from specheads.distill.regenerate import run_distillation

    off = thinking_target(False)
    src = write_questions(tmp_path / "q.jsonl", ["What is rain?", "Name a color.", "Why?", "How?"])
    out = run_distillation(
        off, DistillConfig(prompts=str(src), output=str(tmp_path / "d"), max_new_tokens=4, decontaminate=[])
    )
    capsys.readouterr()
    build_datasets(data_cfg(out), off.tokenizer)
    assert "warning" not in capsys.readouterr().err
    build_datasets(data_cfg(out), thinking_target(True).tokenizer)
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and err.count("\n") == 1
    assert f"data {out} was made with" in err and "thinking off" in err and "thinking on" in err
    metadata = json.loads((out / "metadata.json").read_text())
    del metadata["target"]["chat"]
    (out / "metadata.json").write_text(json.dumps(metadata))
    build_datasets(data_cfg(out), thinking_target(True).tokenizer)
    assert "warning" not in capsys.readouterr().err
