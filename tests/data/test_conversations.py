import json

import pytest
import torch

from specheads.config.train import DataConfig
from specheads.data.chat import tokenize_conversation
from specheads.data.datasets import build_datasets, collate
from specheads.data.formats import load_conversations
from specheads.errors import SpecHeadsError
from specheads.tiny import byte_tokenizer

START, END = 257, 258  # <|im_start|>, <|im_end|> of the byte tokenizer
BYTES = byte_tokenizer()


def piece(text, mask):
    # The byte tokenizer has exactly one token per UTF-8 byte, whatever the context.
    ids = BYTES(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    return ids, [mask] * len(ids)


def expected(turns):
    """Token ids and mask of a ChatML conversation under the byte tokenizer, built by hand."""
    ids, mask = [], []
    for role, content in turns:
        parts = [
            ([START], [0]),
            piece(f"{role}\n", 0),
            piece(content, int(role == "assistant")),
            ([END], [int(role == "assistant")]),
            piece("\n", 0),
        ]
        for i, m in parts:
            ids += i
            mask += m
    return ids, mask


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_sharegpt_mask_is_exact(tok, tmp_path):
    file = write_jsonl(
        tmp_path / "sg.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "Hi there"},
                    {"from": "gpt", "value": "Hello! How can I help?"},
                ]
            }
        ],
    )
    [conversation] = load_conversations(str(file))
    assert conversation == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
    ]
    row = tokenize_conversation(tok, conversation, max_length=1000)
    ids, mask = expected([("user", "Hi there"), ("assistant", "Hello! How can I help?")])
    assert row["input_ids"] == ids
    assert row["loss_mask"] == mask


def test_openai_multi_turn_with_system_mask_is_exact(tok, tmp_path):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And in words, é?"},
        {"role": "assistant", "content": "four, é"},
    ]
    file = write_jsonl(tmp_path / "oa.jsonl", [{"messages": messages}])
    [conversation] = load_conversations(str(file), format="openai")
    row = tokenize_conversation(tok, conversation, max_length=1000)
    ids, mask = expected([(m["role"], m["content"]) for m in messages])
    assert row["input_ids"] == ids
    assert row["loss_mask"] == mask
    assert sum(mask) == len("4") + 1 + len("four, é".encode()) + 1


def test_answer_equal_to_a_template_word_is_not_matched_in_the_header(tok):
    # "user" and "assistant" also occur in the role headers before the answer.
    messages = [{"role": "user", "content": "Say user"}, {"role": "assistant", "content": "assistant"}]
    row = tokenize_conversation(tok, messages, max_length=1000)
    ids, mask = expected([(m["role"], m["content"]) for m in messages])
    assert row["loss_mask"] == mask


def test_cut_off_answer_gets_no_loss_on_the_end_token(tok, tmp_path):
    """distill.py marks answers cut by its token budget finished=false: the template still closes
    the turn, but the target never predicted that end token, so it is not trained."""
    turns = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, 3"}]
    file = write_jsonl(
        tmp_path / "d.jsonl", [{"messages": turns, "finished": False}, {"messages": turns, "finished": True}]
    )
    cut, whole = load_conversations(str(file))
    ids, mask = expected([("user", "Count"), ("assistant", "1, 2, 3")])
    end = len(ids) - 2  # <|im_end|> closing the answer, then "\n"
    assert ids[end] == END and mask[end] == 1
    assert tokenize_conversation(tok, whole, 1000) == {"input_ids": ids, "loss_mask": mask}
    row = tokenize_conversation(tok, cut, 1000)
    assert row["input_ids"] == ids
    assert row["loss_mask"] == mask[:end] + [0] + mask[end + 1 :]


def test_empty_answer_trains_only_its_end_token(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    row = tokenize_conversation(tok, messages, max_length=1000)
    ids, mask = expected([("user", "Hi"), ("assistant", "")])
    assert row["input_ids"] == ids and row["loss_mask"] == mask and sum(mask) == 1


def test_mask_with_another_template_that_strips_content():
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello you \n"}]
    row = tokenize_conversation(tok, messages, max_length=1000)
    text = "[user] Hi\n[assistant] Hello you\n"
    assert tok.decode(row["input_ids"]) == text
    start = text.index("Hello you")
    # No end-of-turn token in this template: exactly the stripped answer is trained on.
    assert row["loss_mask"] == [int(start <= i < start + len("Hello you")) for i in range(len(text))]


@pytest.mark.slow
def test_smollm2_mask_covers_exactly_the_answers(smollm2_target):
    tok = smollm2_target.tokenizer
    messages = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": " A pear, maybe.\n"},
    ]
    row = tokenize_conversation(tok, messages, max_length=1000)
    ids = row["input_ids"]
    assert ids == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    spans, current = [], []
    for token, m in zip(ids, row["loss_mask"]):
        if m:
            current.append(token)
        elif current:
            spans.append(tok.decode(current))
            current = []
    assert spans == ["An apple.<|im_end|>", " A pear, maybe.\n<|im_end|>"]


def test_slow_tokenizer_path_gives_the_same_mask(tok, monkeypatch):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": "Sure thing"},
    ]
    fast = tokenize_conversation(tok, messages, max_length=1000)
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    slow = tokenize_conversation(tok, messages, max_length=1000)
    assert slow == fast


def test_truncation(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    full = tokenize_conversation(tok, messages, max_length=1000)
    cut = tokenize_conversation(tok, messages, max_length=20)
    assert cut["input_ids"] == full["input_ids"][:20] and cut["loss_mask"] == full["loss_mask"][:20]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"messages": [{"role": "user", "content": "x"}', "invalid JSON"),
        ('{"text": "no conversation"}', "no 'messages'"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "unknown role"),
        ('{"conversations": [{"from": "alien", "value": "x"}]}', "unknown speaker"),
        ('{"messages": [{"role": "user", "content": 3}]}', "must be a string"),
        ('{"messages": []}', "non-empty list"),
        ("[1, 2]", "expected an object"),
    ],
)
def test_malformed_rows_raise_naming_the_row(tmp_path, content, message):
    file = tmp_path / "bad.jsonl"
    file.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n' + content + "\n")
    with pytest.raises(SpecHeadsError, match=message) as err:
        load_conversations(str(file))
    assert "bad.jsonl:2" in str(err.value)


def test_missing_file_and_bad_format_raise(tmp_path):
    with pytest.raises(SpecHeadsError, match="does not exist"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    with pytest.raises(SpecHeadsError, match="unknown data format"):
        load_conversations(str(tmp_path / "nope.jsonl"), format="alpaca")
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(SpecHeadsError, match="invalid JSON"):
        load_conversations(str(bad))


def conversations(n, offset=0):
    return [
        {
            "messages": [
                {"role": "user", "content": f"question number {i}"},
                {"role": "assistant", "content": f"answer number {i}"},
            ]
        }
        for i in range(offset, offset + n)
    ]


def test_json_parquet_and_saved_dataset_dir(tmp_path):
    import datasets

    rows = conversations(5)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    expect = load_conversations(str(write_jsonl(tmp_path / "a.jsonl", rows)))
    assert load_conversations(str(tmp_path / "a.json")) == expect
    assert load_conversations(str(tmp_path / "a.parquet")) == expect
    assert load_conversations(str(tmp_path / "saved")) == expect
    with pytest.raises(SpecHeadsError, match="no split"):
        load_conversations(str(tmp_path / "saved"), split="test")


def test_hub_loader_reads_a_local_dataset_directory(tmp_path):
    from specheads.data.formats import _hub_rows

    write_jsonl(tmp_path / "train.jsonl", conversations(3))
    rows = [r for _, r in _hub_rows(str(tmp_path), "train")]
    assert [r["messages"][0]["content"] for r in rows] == [f"question number {i}" for i in range(3)]
    with pytest.raises(SpecHeadsError, match="cannot load data set"):
        list(_hub_rows(str(tmp_path / "missing-dir"), "train"))


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
    evalfile = write_jsonl(
        tmp_path / "question.jsonl",
        [{"question_id": 1, "category": "writing", "turns": [leaked.upper() + "!", "Now shorter."]}],
    )
    rows = conversations(6) + [
        {"messages": [{"role": "user", "content": f"Hey: {leaked}, thanks"}, {"role": "assistant", "content": "ok"}]}
    ]
    file = write_jsonl(tmp_path / "d.jsonl", rows)
    train, evaluation = build_datasets(data_cfg(file, decontaminate=[str(evalfile)]), tok)
    assert len(train) + len(evaluation) == 6
    assert "dropped 1 of 7" in capsys.readouterr().out


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
