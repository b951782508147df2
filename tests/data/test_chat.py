import pytest
from conftest import write_jsonl

from specheads.data.chat import tokenize_conversation
from specheads.data.formats import load_conversations
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


# -- model.thinking: one setting every chat rendering honours -------------------------------------


def thinking_tokenizer(thinking):
    """The byte tokenizer with a template that reads enable_thinking (Qwen3's switch), set to `thinking`."""
    from specheads.chat_template import set_thinking

    tok = byte_tokenizer("thinking")
    set_thinking(tok, thinking)
    return tok


CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello you"},
    {"role": "user", "content": "?"},
]


def renderings(tok):
    """What each rendering of specheads makes of CHAT with `tok`: the training data, infer.py's
    prompt, distill's identity probe and Magpie's user-turn prefix."""
    from specheads.bench.inputs import encode_turns
    from specheads.data.chat import render
    from specheads.distill.identity import probe_text
    from specheads.distill.prompts import user_turn_prefix

    return {
        "render": render(tok, CHAT, add_generation_prompt=True),
        "infer": tok.decode(encode_turns(tok, ["Hi", "?"], ["Hello you"])),
        "identity": probe_text(tok),
        "magpie": user_turn_prefix(tok, CHAT[:2]),
    }


def test_thinking_off_renders_otherwise_and_every_rendering_honours_it():
    off, on, default = (renderings(thinking_tokenizer(t)) for t in (False, True, None))
    raw = byte_tokenizer("thinking")
    assert off["render"] == raw.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off["render"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for name in off:  # each call site: thinking off renders otherwise, thinking on as the template's default
        assert off[name] != on[name], name
        assert on[name] == default[name], name


def test_the_loss_mask_covers_the_answer_alone_with_thinking_off():
    tok = thinking_tokenizer(False)
    row = tokenize_conversation(tok, CHAT[:2], max_length=1000)
    assert "<think>" in tok.decode(row["input_ids"])
    assert tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]) == "Hello you<|im_end|>"


def test_a_setting_the_template_does_not_read_is_said_in_one_line(capsys):
    from specheads.chat_template import set_thinking

    set_thinking(byte_tokenizer(), False)  # ChatML: no enable_thinking
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not read enable_thinking" in err
    thinking_tokenizer(False)
    set_thinking(byte_tokenizer(), None)
    assert capsys.readouterr().err == ""


def test_the_chat_record_tells_renderings_apart():
    from specheads.chat_template import chat_mismatch, chat_record

    off, on, default = (chat_record(thinking_tokenizer(t)) for t in (False, True, None))
    assert len(off["template_sha256"]) == 64 and off["thinking"] is False and on["thinking"] is True
    assert off["template_sha256"] == on["template_sha256"] and off["probe_sha256"] != on["probe_sha256"]
    line = chat_mismatch(off, thinking_tokenizer(True), "data D was made with", "this run renders it with")
    assert "\n" not in line and "thinking off" in line and "thinking on" in line
    assert line.endswith("set model.thinking=false to match")
    assert off["template_sha256"][:12] in line
    assert chat_mismatch(off, thinking_tokenizer(False), "a", "b") is None
    # the template's default is thinking on: unset and on render alike, so they agree
    assert chat_mismatch(default, thinking_tokenizer(True), "a", "b") is None
    assert chat_mismatch(None, thinking_tokenizer(True), "a", "b") is None  # made before the record
    other = chat_mismatch(chat_record(byte_tokenizer()), thinking_tokenizer(None), "a", "b")
    assert other is not None and "model.thinking" not in other  # another template: no setting fixes it
    # a template that does not read the variable renders alike whatever the record says
    assert chat_mismatch({**chat_record(byte_tokenizer()), "thinking": False}, byte_tokenizer(), "a", "b") is None
