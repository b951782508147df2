"""The heads shipped in the repository (heads/smollm2-135m-eagle3, the default, and
heads/smollm2-135m-early-exit): each loads on the embedded target, is small bf16 safetensors with
its calibrated tree and provenance, and decodes losslessly."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specheads.bench.inputs import encode_prompt
from specheads.bench.questions import read_questions
from specheads.config.infer import TreeConfig
from specheads.data.decontaminate import build_index, resolve_eval_files
from specheads.data.formats import load_conversations
from specheads.data.questions import DEV_QUESTIONS
from specheads.decode.baselines import PlainDrafter
from specheads.decode.drafters import make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import tree_policy_for
from specheads.export import open_head

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "heads" / "smollm2-135m-eagle3"
EARLY_EXIT = ROOT / "heads" / "smollm2-135m-early-exit"
# each shipped head, its family and the target layers it reads
SHIPPED_HEADS = {SHIPPED: ("eagle3", [2, 15, 27]), EARLY_EXIT: ("early_exit", [3])}


def run_records(head: Path = SHIPPED) -> list[dict]:
    """A shipped head's training record, then, for a head continued from another
    (train.init_from), that head's record, and so on: every run behind the shipped weights."""
    records, training = [], json.loads((head / "config.json").read_text())["training"]
    while training:
        records.append(training)
        training = training.get("init_from", {}).get("training")
    return records


def data_paths(training: dict) -> list[Path]:
    """The data sets one run's record names (training.data and data_mix), as repository paths."""
    return [ROOT / p for p in [training["data"], *training.get("data_mix", [])]]


def shipped_data() -> list[Path]:
    """The data sets of every run behind the shipped heads: paths inside the repository."""
    return list(dict.fromkeys(p for head in SHIPPED_HEADS for t in run_records(head) for p in data_paths(t)))


@pytest.mark.parametrize("head", SHIPPED_HEADS, ids=lambda p: p.name)
def test_shipped_head_is_small_bf16_with_tree_and_provenance(head):
    weights = head / "model.safetensors"
    assert weights.stat().st_size <= 30 * 2**20
    with safe_open(str(weights), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16", "I64", "BOOL"}  # weights; d2t, t2d maps
    config = json.loads((head / "config.json").read_text())
    assert config["family"] == SHIPPED_HEADS[head][0] and config["target"]["name"] == "smollm2-135m"
    assert config["default_tree"], "the calibrated tree is stored with the head"
    for training in run_records(head):  # a continued head names every run behind it
        check_run_record(training)


def check_run_record(training: dict) -> None:
    assert training["steps"] > 0 and training["commit"] and "train.py" in training["command"]
    assert "sharegpt_smollm2_135m" in training["data"] and training["data_mix"]
    # a head trained by several processes (resumed) names each, steps 0 to the end without a gap
    segments = training.get("segments", [{"steps": [0, training["steps"]], "command": training["command"]}])
    assert segments[0]["steps"][0] == 0 and segments[-1]["steps"][1] == training["steps"]
    assert all(a["steps"][1] == b["steps"][0] for a, b in zip(segments, segments[1:]))
    assert segments[-1]["command"] == training["command"] and all("train.py" in s["command"] for s in segments)
    for path in data_paths(training):  # named by a repository path that exists, not a machine's
        assert path.exists() and path.resolve().is_relative_to(ROOT / "data"), path
    if "init_from" in training:
        assert training["init_from"]["head"] and len(training["init_from"]["weights_sha256"]) == 64


@pytest.fixture(scope="module")
def shipped_training_data() -> list:
    """Every conversation of the data sets the shipped head was trained on (data/README.md); a
    distill.py output still unfinished is read in its finished shards, as the run read it."""
    conversations = []
    for path in shipped_data():
        conversations += load_conversations(str(path), partial_distill=path.is_dir())
    return conversations


def leaked(conversations: list, index) -> list:
    """The conversations a user turn of which shares a decontamination n-gram with an eval prompt."""
    return [c for c in conversations if any(m["role"] == "user" and index.matches(m["content"]) for m in c)]


def test_shipped_head_training_data_shares_no_ngram_with_the_dev_questions(shipped_training_data):
    """The project's own decontamination index over the shipped dev questions (what make demo and
    tree calibration measure on) finds nothing in the head's training data."""
    index = build_index(resolve_eval_files([]))
    assert index and len(shipped_training_data) > 8_000
    assert leaked(shipped_training_data, index) == []


def test_the_overlap_check_fails_on_contaminated_data(shipped_training_data):
    """The check can fail: one conversation that quotes a dev question, as a chat user would
    paste it, is found among the 8,000."""
    index = build_index(resolve_eval_files([]))
    question = read_questions(DEV_QUESTIONS)[5]["prompt"]
    quoting = [{"role": "user", "content": f"Help me with this: {question}"}, {"role": "assistant", "content": "Sure."}]
    broken = shipped_training_data[:1000] + [quoting] + shipped_training_data[1000:]
    assert leaked(broken, index) == [quoting]


@pytest.mark.parametrize("path", SHIPPED_HEADS, ids=lambda p: p.name)
def test_shipped_head_decodes_losslessly_on_the_embedded_target(smollm2_target, path):
    head = open_head(path, smollm2_target)
    assert head.target_layer_ids() == SHIPPED_HEADS[path][1]
    tok = smollm2_target.tokenizer
    prompt = torch.tensor([encode_prompt(tok, "Give me three tips for staying focused while studying.", None, True)])
    cfg = SamplingConfig(max_new_tokens=24, temperature=0.0, eos_token_ids=(tok.eos_token_id,))
    plain = speculative_generate(smollm2_target, PlainDrafter(), prompt, cfg)
    drafter = make_drafter(head, tree_policy_for(head, TreeConfig(kind="default")))
    spec = speculative_generate(smollm2_target, drafter, prompt, cfg)
    assert spec.output_ids == plain.output_ids
    assert sum(spec.accepted_drafts) > 0  # the head's drafts were accepted, not just the target's tokens
