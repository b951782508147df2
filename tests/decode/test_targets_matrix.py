"""The targets of 2026 (mixture-of-experts, sliding-window, chunked and hybrid-attention models), each
a tiny random model of its transformers type: it loads through FrozenTarget's hooks, an EAGLE-3 and
a Medusa head train on it, and greedy speculative output is the target's own for a chain and a
branching tree; a hybrid (a recurrent state beside attention) verifies chains and refuses trees in
one line. Each lossless check is shown failing on a wrong variant: a tree mask without the layers'
windows, a recurrent state not rewound. docs/heads.md's supported-targets table is written from
what these tests saw pass (OBSERVED; test_the_docs_table_is_the_matrix)."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    HYBRID_TYPES,
    MATRIX_TYPES,
    MOE_TYPES,
    ROOT,
    WINDOWED_TYPES,
    assert_first_two_tokens_follow,
    assert_other_numbers,
    assert_same_numbers,
    greedy_sequences,
    head_states,
    hf_greedy,
    overfit,
)
from test_generate import first_two_probs, first_two_samples
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import specheads.decode.generate as generate
import specheads.decode.kv as kv
from specheads.config.train import HeadConfig, ModelConfig
from specheads.decode.drafters import make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.tree import chain_paths, static_tree
from specheads.errors import SpecHeadsError
from specheads.export.eagle3 import VLLM_TARGETS, VLLM_VERSION
from specheads.heads import build_head
from specheads.heads.spec import default_layer_ids
from specheads.target import RECURRENT_TYPES, load_target, recurrent_layer_types

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 4
CHAIN = static_tree(chain_paths(4))
TREE = static_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
EOS = 258  # the byte tokenizer's <|im_end|>, the tiny targets' EOS
NEW = 24
FAMILY_NAMES = {"eagle3": "EAGLE-3", "medusa": "Medusa"}
# per type, the docs table's cells as the tests above saw them hold (a test adds its cells after
# its last assertion); the table is written from these, not from the type lists
OBSERVED: dict[str, dict[str, str]] = {}


def tiny(model_type):
    cfg = ModelConfig(name=f"tiny-{model_type}", path=f"tiny:{model_type}", tiny={"num_hidden_layers": LAYERS})
    return load_target(cfg, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def matrix():
    """Per type: its target, the text its heads are fitted on, and an EAGLE-3 and a Medusa head
    trained a few steps (with their losses)."""
    return {}


def entry(matrix, model_type):
    if model_type not in matrix:
        target = tiny(model_type)
        sequences = greedy_sequences(target)[:4, :32]
        batch = {"input_ids": sequences, "attention_mask": torch.ones_like(sequences)}
        batch["loss_mask"] = batch["attention_mask"]
        heads, losses = {}, {}
        for family in ("eagle3", "medusa"):
            torch.manual_seed(0)
            head = build_head(HeadConfig(family=family, ttt_steps=2, num_heads=4), target)
            head.train()
            losses[family], _ = overfit(head, batch, head_states(target, head, batch), steps=25, lr=1e-2)
            heads[family] = head.eval()
        matrix[model_type] = target, sequences, heads, losses
    return matrix[model_type]


def spec_output(target, head, policy, prompt):
    drafter = make_drafter(head, policy)
    return speculative_generate(target, drafter, prompt, SamplingConfig(max_new_tokens=NEW, eos_token_ids=[EOS]))


@pytest.mark.parametrize("model_type", MATRIX_TYPES)
def test_the_target_loads_through_the_hooks(model_type):
    """Every layer id captures the stream entering that layer (the model's own hidden states), the
    final norm turns the last into the LM head's input, and the LM head gives the model's logits."""
    target = tiny(model_type)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    s = target.states(ids, layer_ids=range(LAYERS + 1), final=True, logits=True)
    with torch.no_grad():
        own = target.model(ids, output_hidden_states=True)
    for k in range(LAYERS):
        assert_same_numbers(s.hidden[k], own.hidden_states[k])
    assert_same_numbers(target.final_norm(s.hidden[LAYERS]), s.final)
    assert_same_numbers(target.lm_head(s.final), own.logits)
    assert target.info.model_type == model_type and target.info.num_layers == LAYERS


@pytest.mark.parametrize("model_type", MATRIX_TYPES)
def test_heads_train_and_draft_the_target_greedy_output(model_type, matrix):
    """EAGLE-3 (on the engines' layer ids) and Medusa train; their chains and trees give the
    target's own greedy output, drafts accepted; a hybrid refuses trees in one line."""
    target, sequences, heads, losses = entry(matrix, model_type)
    assert heads["eagle3"].spec.layer_ids == default_layer_ids("eagle3", LAYERS) == [2, 2, 1]  # vLLM's rule
    prompt = sequences[1:2, :10]
    ref = hf_greedy(target, prompt, NEW, eos=EOS)
    for family, head in heads.items():
        assert losses[family][-1] < 0.8 * losses[family][0], (family, losses[family])
        res = spec_output(target, head, CHAIN, prompt)
        assert res.output_ids == ref, (family, "chain")
        assert sum(res.accepted_drafts) > 0, (family, res.accepted_drafts)
        if model_type in HYBRID_TYPES:
            with pytest.raises(SpecHeadsError, match=r"tree=chain") as refused:
                spec_output(target, head, TREE, prompt)
            assert "\n" not in str(refused.value) and model_type in str(refused.value)
            kinds = recurrent_layer_types(target.model.config)
            assert kinds and all(k in str(refused.value) for k in kinds)
        else:
            res = spec_output(target, head, TREE, prompt)
            assert res.output_ids == ref, (family, "tree")
            assert max(res.tree_sizes) == TREE.size
    hybrid = model_type in HYBRID_TYPES
    OBSERVED.setdefault(model_type, {}).update(
        trains=", ".join(FAMILY_NAMES[f] for f in heads),
        lossless="chains" if hybrid else "chains and trees",
        trees="refused (recurrent state)" if hybrid else "yes",
    )


def without_windows(config):
    """The wrong variant: every layer's tree mask as if it attended to every earlier position."""
    return {kind: None for kind in real_spans(config)}


real_spans = kv.attention_spans


@pytest.mark.parametrize("model_type", WINDOWED_TYPES)
def test_the_tree_mask_applies_each_layers_window(model_type, matrix, monkeypatch):
    """The window (8) is shorter than prompt + answer: a tree mask that lets the sliding or
    chunked layers see past it changes the output."""
    target, sequences, heads, _ = entry(matrix, model_type)
    spans = kv.attention_spans(target.model.config)
    assert {"window", "chunk"} & {s[0] for s in spans.values() if s}, spans
    assert max(s[1] for s in spans.values() if s) < 10 + NEW
    prompt = sequences[1:2, :10]
    ref = hf_greedy(target, prompt, NEW, eos=EOS)
    assert spec_output(target, heads["eagle3"], TREE, prompt).output_ids == ref
    monkeypatch.setattr(kv, "attention_spans", without_windows)
    assert spec_output(target, heads["eagle3"], TREE, prompt).output_ids != ref


def shifted_spans(shift):
    """attention_spans with every window and chunk `shift` positions wider: the off-by-one variants
    of the tree mask unless shift is 0."""

    def spans(config):
        return {t: s and (s[0], s[1] + shift) for t, s in real_spans(config).items()}

    return spans


def verified_logits(target, prompt, tokens, layout):
    """The target's logits at each node of a tree verified (kv.verify_tree) after `prompt`."""
    cache = kv.new_cache(target.model)
    with torch.no_grad():
        target.model(input_ids=prompt, cache=cache, use_cache=True)
        return kv.verify_tree(target, tokens, layout, prompt.shape[1], cache).logits[0].float()


def one_token_logits(model, context):
    """The model's logits after `context`, read one token at a time through its own KV cache
    (transformers' sliding-window and chunked layers, which drop the keys they no longer see)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for token in context:
            logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits
    return logits[0, -1].float()


def node_path(layout, i):
    """The node ids from the root to node i."""
    return node_path(layout, layout.parents[i]) + [i] if i >= 0 else []


@pytest.mark.parametrize("model_type", WINDOWED_TYPES)
def test_verification_sees_what_one_token_decoding_sees(model_type, monkeypatch):
    """Each node's verification logits (a 12-token prompt, longer than the window or chunk of 8)
    are the model's own after the prompt and the node's path read one token at a time; a mask
    whose windows or chunks are one position wider or narrower gives other logits."""
    target = tiny(model_type)
    ids = torch.randint(0, 256, (1, 12 + TREE.size), generator=torch.Generator().manual_seed(0))
    prompt, tokens, layout = ids[:, :12], ids[0, 12:].tolist(), TREE.layout
    own = torch.stack(
        [
            one_token_logits(target.model, prompt[0].tolist() + [tokens[j] for j in node_path(layout, i)])
            for i in range(layout.size)
        ]
    )
    for shift in (0, -1, 1):
        monkeypatch.setattr(kv, "attention_spans", shifted_spans(shift))
        verified = verified_logits(target, prompt, tokens, layout)
        (assert_same_numbers if shift == 0 else assert_other_numbers)(verified, own)


def keeps_the_rejected_state(target, cache, prefix_len, tokens, path, saved):
    """The wrong variant of kv.commit: the attention layers cropped to the accepted path, the
    recurrent state left holding the rejected drafts too."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            n = prefix_len + len(path)
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
    return 0


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_a_chain_rewinds_the_recurrent_state(model_type, matrix, monkeypatch):
    """A chain accepted in part leaves the state of the accepted tokens alone (saved, restored and
    advanced by them); a commit that keeps the rejected drafts in the state changes the output.
    Paths that cannot restore the state (a draft model's cache, calibration) refuse the target."""
    target, sequences, heads, _ = entry(matrix, model_type)
    prompt = sequences[1:2, :10]
    ref = hf_greedy(target, prompt, NEW, eos=EOS)
    res = spec_output(target, heads["medusa"], CHAIN, prompt)
    assert res.output_ids == ref
    assert any(0 < a < CHAIN.size - 1 for a in res.accepted_drafts), res.accepted_drafts  # partly accepted
    monkeypatch.setattr(generate, "commit", keeps_the_rejected_state)
    assert spec_output(target, heads["medusa"], CHAIN, prompt).output_ids != ref
    with pytest.raises(SpecHeadsError, match="tree verification is refused"):
        kv.new_cache(target.model)


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_the_rewind_forward_counts_in_tau(model_type, matrix):
    """Every target forward of the decode phase is counted, the one that rewinds a recurrent state
    after a partly accepted chain too (it was not: tau came out above the real forwards' rate): a
    hook on the target model counts its calls, the prefill's apart."""
    target, sequences, heads, _ = entry(matrix, model_type)
    calls = []
    hook = target.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        res = spec_output(target, heads["medusa"], CHAIN, sequences[1:2, :10])
    finally:
        hook.remove()
    partial = sum(0 < a < CHAIN.size - 1 for a in res.accepted_drafts)
    assert partial > 0 and res.target_forwards == len(calls) - 1, (partial, res.target_forwards, len(calls))


SAMPLED = ["qwen3_moe", "gemma3_text", "qwen3_next"]  # one MoE, one sliding-window, one recurrent type


@pytest.mark.parametrize("model_type", SAMPLED)
def test_sampled_tokens_follow_the_target_distribution(model_type, matrix):
    """A mixture of experts, a sliding window, a hybrid: the first two sampled tokens (the second
    decided by a verification past the window; a chain's on the hybrid) follow the target's joint
    distribution."""
    target, sequences, heads, _ = entry(matrix, model_type)
    prompt = sequences[1:2, :12]  # longer than the window
    paths = [[0], [0, 0]] if model_type in HYBRID_TYPES else [[0], [1], [2], [0, 0]]
    drafter = make_drafter(heads["eagle3"], static_tree(paths))
    temperature, top_p, n = 0.7, 0.9, 200
    counts, accepted = first_two_samples(target, drafter, prompt, n, temperature, top_p)
    assert accepted[0] < n * 0.9 and accepted[1] + accepted[2] > n * 0.1, accepted
    assert_first_two_tokens_follow(counts, *first_two_probs(target, prompt, temperature, top_p), n)
    OBSERVED.setdefault(model_type, {})["sampling"] = "yes (chains)" if model_type in HYBRID_TYPES else "yes"


# -- the supported-targets table of docs/heads.md -------------------------------------------------

TABLE_START = "<!-- supported targets: written by tests/decode/test_targets_matrix.py (supported_targets_table) -->"
TABLE_END = "<!-- supported targets end -->"


def kinds_of(config) -> str:
    spans = kv.attention_spans(config)
    kinds = sorted({f"{s[0]} {s[1]}" if s else "full" for t, s in spans.items() if t not in RECURRENT_TYPES})
    recurrent = recurrent_layer_types(config)
    return ", ".join(kinds + [f"{t} (recurrent)" for t in recurrent])


def supported_targets_table(observed: dict[str, dict[str, str]]) -> str:
    """The table, one row per tested type: its training, lossless, tree and sampling cells are what
    the tests above saw pass (observed, as OBSERVED holds it); a cell no test saw says so."""
    from specheads.tiny import tiny_config

    columns = ["type", "layers (tiny test model)", "trains", "greedy lossless", "trees", "sampling"]
    columns.append(f"vLLM {VLLM_VERSION} EAGLE-3 export")
    rows = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for model_type in MATRIX_TYPES:
        config = tiny_config(model_type, num_hidden_layers=LAYERS)
        experts = " + experts" if model_type in MOE_TYPES or getattr(config, "num_experts_per_tok", None) else ""
        seen = observed.get(model_type, {})
        cells = [seen.get(k, "not checked") for k in ("trains", "lossless", "trees", "sampling")]
        architecture, served = VLLM_TARGETS[model_type]
        export = f"yes ({architecture})" if served else f"refused ({architecture} lacks SupportsEagle3)"
        rows.append("| " + " | ".join([f"`{model_type}`", kinds_of(config) + experts, *cells, export]) + " |")
    return "\n".join(rows)


def written_table() -> str:
    text = (ROOT / "docs" / "heads.md").read_text()
    assert TABLE_START in text and TABLE_END in text
    return text.split(TABLE_START)[1].split(TABLE_END)[0].strip()


def test_the_docs_table_is_the_matrix():
    """Runs after the matrix tests of this file (pytest keeps a file's order, and --dist loadfile
    keeps a file in one process): their outcomes write the table."""
    if set(OBSERVED) != set(MATRIX_TYPES) or not all("sampling" in OBSERVED[t] for t in SAMPLED):
        pytest.skip("the matrix tests did not all run in this process: the table is written from their outcomes")
    table = supported_targets_table(OBSERVED)
    assert written_table() == table, "docs/heads.md's table is stale; write:\n" + table


def test_a_check_that_did_not_pass_leaves_its_cell_unclaimed():
    """The table has teeth: with one type's tree check unseen, its row says so and the written table differs."""
    if "qwen3_moe" not in OBSERVED:
        pytest.skip("the matrix tests did not run in this process")
    partial = {t: dict(cells) for t, cells in OBSERVED.items()}
    del partial["qwen3_moe"]["trees"]
    table = supported_targets_table(partial)
    assert "| `qwen3_moe` | full + experts | EAGLE-3, Medusa | chains and trees | not checked |" in table
    assert table != written_table()
