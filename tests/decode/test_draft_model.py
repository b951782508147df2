"""A separate draft model (decode/draft_model.py): greedy output is the target's own with drafts
accepted, and every tree the drafter grows from its KV cache is the tree the draft model grows from
the committed text alone (a drafter whose cache leaves the committed sequence fails that check);
sampling follows the target's distribution; a draft with another tokenizer, or no causal LM, is
refused in one line; make_draft_model cuts a draft whose logits are the target's first layers'."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_first_two_tokens_follow, assert_other_numbers, assert_same_numbers, hf_greedy
from test_generate import accepts_any_draft_in_support, first_two_probs, first_two_samples

from specheads.config.infer import DraftModelConfig
from specheads.decode.baselines import Assistant, hf_generate
from specheads.decode.draft_model import (
    MADE_FROM_FILE,
    DraftModel,
    DraftModelDrafter,
    first_layers_logits,
    load_draft_model,
    make_draft_model,
)
from specheads.decode.drafters import DraftTable, grow_tree
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import DynamicTreeSpec
from specheads.decode.tree import chain_paths, static_tree
from specheads.errors import SpecHeadsError
from specheads.target import eos_token_ids
from specheads.tiny import SPECIAL_TOKENS, byte_tokenizer
from specheads.tiny import tiny_target as tiny_target_builder

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = {
    "chain": static_tree(chain_paths(4)),
    "tree": static_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]),
    "dynamic": DynamicTreeSpec(depth=4, top_k=3, total_tokens=10),
}
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]]


@pytest.fixture(scope="module")
def made(tiny_target, tmp_path_factory):
    """A 4-layer draft cut from the 6-layer tiny target by make_draft_model, loaded as draft.model."""
    out = make_draft_model(tiny_target, 4, tmp_path_factory.mktemp("draft") / "tiny-4l")
    return load_draft_model(DraftModelConfig(model=str(out)), tiny_target)


class KeepsDraftedSlots(DraftModelDrafter):
    """Wrong: never crops the drafted entries, so the cache keeps the rejected drafts."""

    def _crop(self, stable):
        pass


class FeedsOnlyTheBonus(DraftModelDrafter):
    """Wrong: queues the bonus token but not the accepted drafts, so the cache misses them."""

    def advance(self, states, tokens, bonus):
        self.pending += [int(bonus)]


VARIANTS = {
    "right": DraftModelDrafter,
    "keeps drafted slots": KeepsDraftedSlots,
    "feeds only the bonus": FeedsOnlyTheBonus,
}


def plain_tree(model, context, root, policy, max_depth):
    """The tree the draft model grows below `root` after the committed text `context` alone: every level's
    nodes run over their whole context (committed text + path) with no KV cache."""
    vocab = min(model.config.vocab_size, 320)

    def child_logp(ids, table):
        rows = [context + path(table, i) for i in ids]
        with torch.no_grad():
            logits = model(torch.tensor(rows)).logits[:, -1, :vocab]
        return torch.log_softmax(logits.float(), dim=-1)

    return grow_tree(root, child_logp, lambda x: x, policy, max_depth, DraftTable())


def path(table, i):
    out = [table.tokens[i]]
    while table.parents[i] >= 0:
        i = table.parents[i]
        out.append(table.tokens[i])
    return out[::-1]


class Checked:
    """Wraps a drafter: every step's tree must be the one the draft model grows after the committed
    text without a cache (plain_tree)."""

    def __init__(self, inner, policy):
        self.inner, self.policy, self.layer_ids, self.reads_final = inner, policy, [], False

    def start(self, prompt, states, root):
        self.text = prompt[0].tolist()
        self.inner.start(prompt, states, root)

    def draft(self, root, prefix_len, max_depth):
        assert prefix_len == len(self.text)
        tokens, layout = self.inner.draft(root, prefix_len, max_depth)
        expected = plain_tree(self.inner.model, self.text, root, self.policy, max_depth)
        assert (tokens, layout) == expected, f"step after {len(self.text)} tokens"
        return tokens, layout

    def advance(self, states, tokens, bonus):
        self.text += list(tokens)  # the root and the accepted drafts; the bonus is the next root
        self.inner.advance(states, tokens, bonus)


def check_greedy_identity(target, draft, variant, policy, n=12):
    """Greedy decoding with `variant` drafting from `draft`: the target's own greedy output with
    drafts accepted, and every step's tree the one the draft model grows from the committed text
    without a cache (verification is lossless whatever is drafted, so the output alone cannot see a
    broken draft cache: the trees can)."""
    accepted = 0
    for ids in PROMPTS:
        prompt = torch.tensor([ids])
        cfg = SamplingConfig(max_new_tokens=n, eos_token_ids=eos_token_ids(target))
        res = speculative_generate(target, Checked(VARIANTS[variant](draft, policy), policy), prompt, cfg)
        assert res.output_ids == hf_greedy(target, prompt, n)
        accepted += sum(res.accepted_drafts)
    assert accepted > 0


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_draft_model_decodes_greedy_exactly(variant, policy, tiny_target, made):
    """The right drafter passes; one that keeps the rejected drafts in its cache, or that feeds the
    bonus token without the accepted drafts, fails the same check."""
    if variant == "right":
        check_greedy_identity(tiny_target, made, variant, POLICIES[policy])
    else:
        with pytest.raises(AssertionError):
            check_greedy_identity(tiny_target, made, variant, POLICIES[policy])


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_target_as_its_own_draft_has_every_draft_accepted(variant, tiny_target):
    """The target drafting for itself: each step's chain of 4 is accepted whole (as deep as the
    answer's length leaves it), with output the target's own; the wrong variants' drafts fall off."""
    draft = DraftModel(tiny_target.model, tiny_target.tokenizer, "itself", 320)
    prompt, n = torch.tensor([PROMPTS[0]]), 24
    res = speculative_generate(
        tiny_target, VARIANTS[variant](draft, POLICIES["chain"]), prompt, SamplingConfig(max_new_tokens=n)
    )
    assert res.output_ids == hf_greedy(tiny_target, prompt, n)
    left = [n - 1 - sum(res.accept_lengths[:i]) for i in range(len(res.accept_lengths))]
    every = res.accepted_drafts == [min(4, k - 1) for k in left]
    assert every == (variant == "right"), (variant, res.accepted_drafts)


def test_a_padded_draft_vocabulary_drafts_the_shared_ids_only(tiny_target, tmp_path):
    """A second random model with the target's tokenizer and 64 padded rows: it loads, drafts among
    the 320 ids both have, and greedy output is the target's."""
    model, tok = tiny_target_builder("llama", seed=1, vocab_size=384)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    draft = load_draft_model(DraftModelConfig(model=str(tmp_path)), tiny_target)
    assert draft.vocab_size == 320 and draft.model.config.vocab_size == 384
    prompt = torch.tensor([PROMPTS[1]])
    drafter = DraftModelDrafter(draft, POLICIES["tree"])
    res = speculative_generate(tiny_target, drafter, prompt, SamplingConfig(max_new_tokens=12))
    assert res.output_ids == hf_greedy(tiny_target, prompt, 12)
    assert max(drafter.table.tokens) < 320


def test_a_draft_model_samples_the_target_distribution(tiny_target, made, monkeypatch):
    """Sampling with the draft model's tree: the first two tokens follow the target's joint
    distribution (chi-square), with drafts both accepted and rejected; a rule that accepts every
    draft in the target's support fails the same check."""
    drafter = DraftModelDrafter(made, static_tree([[0], [1], [2], [0, 0]]))
    prompt = torch.tensor([PROMPTS[0]])
    temperature, top_p, n = 0.7, 0.9, 100
    p1, p2 = first_two_probs(tiny_target, prompt, temperature, top_p)
    counts, accepted = first_two_samples(tiny_target, drafter, prompt, n, temperature, top_p)
    assert n * 0.15 < accepted[0] < n * 0.85, accepted
    assert_first_two_tokens_follow(counts, p1, p2, n)
    import specheads.decode.generate as generate

    monkeypatch.setattr(generate, "speculative_accept", accepts_any_draft_in_support)
    counts, _ = first_two_samples(tiny_target, drafter, prompt, n, temperature, top_p)
    with pytest.raises(AssertionError):
        assert_first_two_tokens_follow(counts, p1, p2, n)


def renumbered_tokenizer():
    """The byte tokenizer with its special tokens in another order: same tokens, other ids."""
    import specheads.tiny as tiny

    saved = list(tiny.SPECIAL_TOKENS)
    tiny.SPECIAL_TOKENS[:] = saved[::-1]
    try:
        return byte_tokenizer()
    finally:
        tiny.SPECIAL_TOKENS[:] = saved


def with_tokenizer(src, out, tok):
    """A copy of the draft directory `src` at `out` with tokenizer `tok`."""
    import shutil

    shutil.copytree(src, out)
    for f in out.glob("tokenizer*"):
        f.unlink()
    tok.save_pretrained(out)
    return out


def test_a_draft_with_another_tokenizer_is_refused(tiny_target, made, tmp_path):
    """Refused in one line: the same tokens under other ids, and one token more."""
    extra = byte_tokenizer()
    extra.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    for name, tok in (("renumbered", renumbered_tokenizer()), ("extra", extra)):
        out = with_tokenizer(Path(made.name), tmp_path / name, tok)
        with pytest.raises(SpecHeadsError, match="another tokenizer than the target") as err:
            load_draft_model(DraftModelConfig(model=str(out)), tiny_target)
        assert "\n" not in str(err.value)
    assert SPECIAL_TOKENS == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # restored


def test_infer_refuses_a_draft_with_another_tokenizer_in_one_line(made, tmp_path, monkeypatch, capsys):
    from specheads.commands import infer

    out = with_tokenizer(Path(made.name), tmp_path / "other", renumbered_tokenizer())
    monkeypatch.setattr(sys, "argv", ["infer.py", "model=tiny-random", f"draft.model={out}", "prompt=hi"])
    with pytest.raises(SystemExit) as exit_:
        infer(ROOT / "conf")
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "another tokenizer than the target" in lines[0], lines


def test_a_model_that_is_not_a_causal_lm_is_refused(tiny_target, tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("t5", vocab_size=320, d_model=32, num_layers=1).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(SpecHeadsError, match="is a 't5' model, not a causal LM"):
        load_draft_model(DraftModelConfig(model=str(tmp_path)), tiny_target)


@pytest.mark.parametrize("layers", [1, 4])
def test_a_made_draft_is_the_targets_first_layers(layers, tiny_target, made, tmp_path):
    """The saved directory loads as a standalone causal LM (config num_hidden_layers = N, safetensors,
    the tokenizer, where it came from) whose logits equal the target's first N layers + final norm +
    LM head; those of N - 1 or N + 1 layers differ (the comparison can fail)."""
    from transformers import AutoModelForCausalLM

    out = made.name if layers == 4 else str(make_draft_model(tiny_target, layers, tmp_path / "d"))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.num_hidden_layers == layers
    files = {p.name for p in Path(out).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MADE_FROM_FILE} <= files
    assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        logits = model(ids).logits
        assert_same_numbers(logits, first_layers_logits(tiny_target, ids, layers))
        for other in (layers - 1, layers + 1):
            if other >= 1:
                assert_other_numbers(logits, first_layers_logits(tiny_target, ids, other))


def test_the_make_draft_tool_writes_atomically_and_refuses_bad_layers(tmp_path, capsys):
    """tools/make_draft_model.py: the directory printed last; 0 or all layers refused in one line
    with exit 2 and nothing left behind."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_draft_model", ROOT / "tools" / "make_draft_model.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tool.main(["--model", "tiny-random", "--layers", "2", "--out", str(tmp_path / "d")])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    for bad in ("0", "6"):
        with pytest.raises(SystemExit) as exit_:
            tool.main(["--model", "tiny-random", "--layers", bad, "--out", str(tmp_path / "bad")])
        assert exit_.value.code == 2
        assert "keeps 1..5 layers" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_assisted_generation_gives_the_targets_greedy_output(tiny_target, made):
    """transformers' own assisted generation with the made draft: the target's greedy output with
    fewer target forwards than tokens."""
    prompt = torch.tensor([PROMPTS[0]])
    cfg = SamplingConfig(max_new_tokens=24, eos_token_ids=eos_token_ids(tiny_target))
    out = hf_generate(tiny_target, prompt, cfg, assistant=Assistant(made.model, 4))
    assert out["output_ids"] == hf_greedy(tiny_target, prompt, 24)
    assert out["target_forwards"] < len(out["output_ids"]) - 1
    assert made.model.generation_config.num_assistant_tokens != 4  # the call's settings are not left behind


class RewindsWithoutCropping(DraftModelDrafter):
    """Wrong: queues the last fed tokens again but leaves their entries in the cache."""

    def rewind(self, n):
        self.pending = self.last_fed[-n:] + self.pending


@pytest.mark.parametrize("drafter_class", [DraftModelDrafter, RewindsWithoutCropping])
def test_rewind_redoes_the_last_drafting_step(drafter_class, tiny_target, made):
    """rewind(n) (tree calibration times a drafting step with it) makes the next draft() feed the
    last n tokens again and grow the same tree; a rewind that keeps their entries grows another."""
    drafter = drafter_class(made, POLICIES["tree"])
    prompt, root = torch.tensor([PROMPTS[1]]), 7
    drafter.start(prompt, {}, root)
    first = drafter.draft(root, prompt.shape[1], 4)
    drafter.advance({}, first[0][:2], 9)  # the root and its first child accepted, 9 the bonus
    second = drafter.draft(9, prompt.shape[1] + 2, 4)
    drafter.rewind(2)
    assert (drafter.draft(9, prompt.shape[1] + 2, 4) == second) == (drafter_class is DraftModelDrafter)


WINDOW = 4  # shorter than the prompt: the drafted nodes' windows leave its start out


def windowed_draft(model_type):
    """A tiny random draft model (seed 0) with sliding-window layers: qwen2 a full layer first and
    windowed ones after it (a mask per layer type), mistral every layer windowed (one mask)."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    sizes = dict(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
    )
    if model_type == "qwen2":
        config = Qwen2Config(**sizes, use_sliding_window=True, max_window_layers=1)
        assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    else:
        config = MistralConfig(**sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    return DraftModel(model, byte_tokenizer(), model_type, 320)


def recorded_draft(drafter, root, prefix_len, monkeypatch):
    """One draft() step, returning every node's log-probs as the drafter computed them (node id ->
    row) and the table of its nodes."""
    import specheads.decode.draft_model as draft_model

    rows = {}

    def recording(root, child_logp, *rest):
        def logp(ids, table):
            out = child_logp(ids, table)
            rows.update(zip(ids, out))
            return out

        return grow_tree(root, logp, *rest)

    monkeypatch.setattr(draft_model, "grow_tree", recording)
    tokens, _ = drafter.draft(root, prefix_len, 4)
    return rows, drafter.table, tokens


def one_token_logp(model, context, vocab):
    """The model's log-probs after `context`, read one token at a time through its own KV cache
    (transformers' sliding-window layers, which drop the keys past the window)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for token in context:
            logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits
    return torch.log_softmax(logits[0, -1, :vocab].float(), dim=-1)


@pytest.mark.parametrize("policy", ["tree", "dynamic"])
@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_a_sliding_window_draft_sees_what_its_one_token_decoding_sees(model_type, policy, monkeypatch):
    """Each drafted node's log-probs are the draft model's own after the committed text and the
    node's path read one token at a time, at two steps past the window: each layer's tree mask
    keeps to its layer's window, counted in the positions of the key slots (a mask without the
    window lets the tree see keys the model's own decoding has dropped)."""
    draft = windowed_draft(model_type)
    drafter = DraftModelDrafter(draft, POLICIES[policy])
    text, root = list(PROMPTS[1]), 7
    drafter.start(torch.tensor([text]), {}, root)
    for _step in range(2):
        rows, table, tokens = recorded_draft(drafter, root, len(text), monkeypatch)
        assert len({table.depths[i] for i in rows}) < len(rows) and len(text) > WINDOW  # branching, past the window
        for i, row in rows.items():
            assert_same_numbers(row, one_token_logp(draft.model, text + path(table, i), draft.vocab_size))
        text += tokens[:2]  # the root and its first child accepted, 9 the bonus
        drafter.advance({}, tokens[:2], 9)
        root = 9
