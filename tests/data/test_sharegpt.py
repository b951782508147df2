import json

import pytest

from specheads.config.distill import DistillConfig
from specheads.data import sharegpt
from specheads.data.formats import load_conversations
from specheads.data.sharegpt import ReadReport, iter_json_array, read_sharegpt
from specheads.distill.prompts import PromptFilter, dataset_prompts
from specheads.distill.regenerate import _dataset_prompt_list
from specheads.errors import SpecHeadsError


def turn(who, text):
    return {"from": who, "value": text}


CONVERSATIONS = [
    {"id": "a_0", "conversations": [turn("human", "What is a star?"), turn("gpt", "A ball of gas.")]},
    # leading non-human turns are dropped; system and the assistant aliases map by the format
    {"id": "b_0", "conversations": [turn("gpt", "Hello!"), turn("human", "Hi"), turn("chatgpt", "Hey")]},
    {"id": "c_0", "conversations": [turn("system", "Be brief."), turn("human", "Sum 2+2"), turn("bing", "4")]},
    {"id": "d_0", "conversations": [turn("human", "Tell a joke"), turn("bard", "No."), turn("user", "Please")]},
    {"id": "e_0", "conversations": [turn("gpt", "only the assistant")]},  # no human turn
    {"id": "f_0", "conversations": [turn("human", "x"), turn("narrator", "?")]},  # unknown speaker
    {"id": "a_1", "conversations": [turn("human", "continue"), turn("gpt", "...and then")]},  # a later piece
    {"id": "g_0", "conversations": [turn("human", "What is a star?"), turn("gpt", "dup")]},  # duplicate prompt
    {"id": "h_0", "conversations": [turn("human", "   "), turn("gpt", "empty prompt")]},
    {"id": "i_0", "conversations": [turn("human", "long " * 300), turn("gpt", "too long")]},
    {"id": "j_0", "conversations": [turn("human", "Name a color."), turn("gpt", "Blue."), turn("human", "Another")]},
]


def write_cut(path, rows, keep_fraction_of_last=0.5):
    """A JSON array whose last element is cut off mid-way, as in the packaged file."""
    text = json.dumps(rows, ensure_ascii=False, indent=1)
    last = text.rindex(json.dumps(rows[-1], ensure_ascii=False, indent=1).splitlines()[0][:5])
    cut = last + int((len(text) - last) * keep_fraction_of_last)
    path.write_text(text[:cut], encoding="utf-8")
    return path


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_streaming_equals_json_load_on_a_whole_file_and_stops_at_a_cut(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sharegpt, "_CHUNK", chunk)  # 7 bytes: every element spans many refills
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(CONVERSATIONS, ensure_ascii=False), encoding="utf-8")
    report = ReadReport()
    assert list(iter_json_array(whole, report)) == json.loads(whole.read_text())
    assert report.complete and report.elements == len(CONVERSATIONS)

    cut = write_cut(tmp_path / "cut.json", CONVERSATIONS + [{"id": "z_0", "conversations": [turn("human", "zzz")]}])
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.read_text())  # the reason for streaming
    report = ReadReport()
    assert list(iter_json_array(cut, report)) == CONVERSATIONS
    assert not report.complete and report.elements == len(CONVERSATIONS)


def test_roles_counts_and_the_one_line_report(tmp_path, capsys):
    path = write_cut(tmp_path / "cut.json", CONVERSATIONS + CONVERSATIONS[:1])
    rows, report = read_sharegpt(path)
    line = capsys.readouterr().out.strip()
    assert line.count("\n") == 0
    assert f"{len(CONVERSATIONS)} conversations read" in line and "ends early" in line
    assert report.skipped == {"no_human_turn": 1, "unknown_role": 1, "malformed": 0}
    by_id = {r["id"]: r for r in rows}
    assert set(by_id) == {c["id"] for c in CONVERSATIONS} - {"e_0", "f_0"}
    assert by_id["b_0"]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]
    assert [m["role"] for m in by_id["c_0"]["messages"]] == ["user", "assistant"]  # system before the human: dropped
    assert [m["role"] for m in by_id["d_0"]["messages"]] == ["user", "assistant", "user"]
    assert by_id["a_1"]["part"] == 1 and by_id["a_0"]["part"] == 0
    assert report.roles["narrator"] == 1 and report.roles["bard"] == 1


def test_a_complete_file_says_so(tmp_path, capsys):
    path = tmp_path / "whole.json"
    path.write_text(json.dumps(CONVERSATIONS[:2]))
    _, report = read_sharegpt(path)
    assert report.complete and "complete" in capsys.readouterr().out


@pytest.fixture
def packaged(tmp_path, monkeypatch):
    path = write_cut(tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json", CONVERSATIONS + CONVERSATIONS[:1])
    monkeypatch.setattr(sharegpt, "packaged_file", lambda: path)
    return path


def test_prompts_filtered_with_counts(packaged, tiny_target, capsys):
    prompts = dataset_prompts("sharegpt")
    # later pieces of a split conversation open mid-dialogue: not prompts
    assert "continue" not in [p["prompt"] for p in prompts]
    assert next(p for p in prompts if p["prompt"] == "Name a color.")["follow_ups"] == ["Another"]
    cfg = DistillConfig(prompts="sharegpt", num_prompts=None, max_prompt_tokens=200)
    kept = _dataset_prompt_list(tiny_target, cfg, PromptFilter(cfg.magpie, tiny_target.tokenizer), seed=0)
    out = capsys.readouterr().out
    assert sorted(p["prompt"] for p in kept) == sorted(
        ["What is a star?", "Hi", "Sum 2+2", "Tell a joke", "Name a color."]
    )
    assert "1 empty, 1 duplicates, 0 dropped by decontamination, 1 over 200 tokens, 5 used" in out


def test_prompts_are_decontaminated(packaged, tiny_target, tmp_path):
    from specheads.data.decontaminate import build_index

    def kept_with(benchmark_prompt):
        bench = tmp_path / "bench.jsonl"
        bench.write_text(json.dumps({"turns": [benchmark_prompt]}) + "\n")
        cfg = DistillConfig(prompts="sharegpt", num_prompts=None, ngram=3)
        pf = PromptFilter(cfg.magpie, tiny_target.tokenizer, build_index([bench], 3))
        return {p["prompt"] for p in _dataset_prompt_list(tiny_target, cfg, pf, seed=0)}

    assert "Tell a joke" in kept_with("Please tell me a joke about the sea")  # no 3 words in common
    assert "Tell a joke" not in kept_with("Please tell a joke about the sea")


def test_data_path_sharegpt_reads_the_package(packaged):
    conversations = load_conversations("sharegpt")
    assert len(conversations) == len(CONVERSATIONS) - 2
    assert conversations[0] == [
        {"role": "user", "content": "What is a star?"},
        {"role": "assistant", "content": "A ball of gas."},
    ]


def test_missing_package_is_one_line(monkeypatch):
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SpecHeadsError, match=r"pip install 'specheads\[sharegpt\]'"):
        load_conversations("sharegpt")


@pytest.mark.parametrize("chunk", [7, 1 << 20])
@pytest.mark.parametrize(
    "bad",
    [
        '{"id": "x_0", "conversations": [{"from": "human", "value": oops}]}',  # balanced, not JSON
        '{"id": "x_0", "conversations": [{"from": "human", "value": "a\\qb"}]}',  # bad escape
        "NaNsense",  # not a value at all
    ],
)
def test_a_malformed_element_is_skipped_and_counted_and_reading_continues(tmp_path, monkeypatch, chunk, bad):
    monkeypatch.setattr(sharegpt, "_CHUNK", chunk)
    good = [c for c in CONVERSATIONS if c["id"] in ("a_0", "b_0", "c_0", "d_0", "g_0", "j_0")]
    parts = [json.dumps(c) for c in good]
    path = tmp_path / "bad.json"
    path.write_text("[" + ",\n".join(parts[:2] + [bad] + parts[2:]) + "]", encoding="utf-8")
    report = ReadReport()
    assert list(iter_json_array(path, report)) == good  # 7 elements, the third bad: the other 6
    assert report.complete and report.elements == 6 and report.skipped["malformed"] == 1
    assert "1 malformed" in report.line(path) and "complete" in report.line(path)
    path.write_text(path.read_text()[:-1], encoding="utf-8")  # no "]": the last element still counts
    report = ReadReport()
    assert list(iter_json_array(path, report)) == good and not report.complete
