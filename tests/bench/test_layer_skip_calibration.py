"""skip.layers=auto's calibration (bench/layer_skip.py): the chain drafts it reads along an answer,
walked step by step, are exactly the steps the generation loop takes with the layer-skip drafter
(accepted drafts and levels drafted, for several depths, ranks a level and stop probabilities); a teacher-forced
reduced forward (the reduced stack's own keys and values for the prefix) is shown to differ. The
choice is stored in the machine's cache and used again; too few positions change nothing."""

import io
import json

import pytest
import torch
from conftest import hf_greedy, write_conversations, write_questions

from specheads.bench import layer_skip
from specheads.bench.layer_skip import Along, chain_walk, draft_along, resolve_layer_skip, skip_cache_path
from specheads.bench.runner import run_benchmark
from specheads.bench.session import Session
from specheads.config.infer import BenchConfig, InferJobConfig, LayerSkipConfig, TreeConfig, validate
from specheads.config.model import ModelConfig
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.layer_skip import LayerSkipDrafter, kept_layers
from specheads.decode.tree import spine_paths, static_tree
from specheads.errors import SpecHeadsError

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
SKIP = (5,)


def teacher_forced(target, skipped, ids, start, depth):
    """Wrong: the reduced stack run over the whole sequence on its own (its own keys and values for
    the prefix, not the full model's, which the drafter reads)."""
    layers = kept_layers(len(target.layers), skipped)
    with torch.no_grad():
        h = target.embed_tokens(torch.tensor([ids]))
        pos = torch.arange(len(ids))[None]
        rotary = target.model.get_decoder().rotary_emb(h, pos)
        for i in layers:
            h = target.layers[i](h, attention_mask=None, position_ids=pos, position_embeddings=rotary)
        logp = torch.log_softmax(target.lm_head(target.final_norm(h))[0].float(), dim=-1)
    top = logp.max(dim=-1)
    matches, probs, ranks = [], [], []
    for s in range(start, len(ids) - 1):
        n = min(depth, len(ids) - 1 - s)
        matches.append([int(top.indices[s + j]) == ids[s + j + 1] for j in range(n)])
        probs.append([float(top.values[s + j].exp()) for j in range(n)])
        ranks.append([int((logp[s + j] > logp[s + j, ids[s + j + 1]]).sum()) for j in range(n)])
    return Along(matches, probs, ranks)


@pytest.mark.parametrize(
    "depth,width,gate,vocab",
    [(1, 1, 0.0, False), (3, 1, 0.0, False), (4, 1, 0.3, False), (1, 3, 0.0, False), (3, 2, 0.3, False)]
    + [(3, 2, 0.0, True)],
)
def test_the_walk_is_the_loops_steps(depth, width, gate, vocab, tiny_target):
    n = 32
    answer = hf_greedy(tiny_target, PROMPT, n)
    ids, start = PROMPT[0].tolist() + answer, PROMPT.shape[1]
    if vocab:  # without the answer's most frequent token: it is never drafted, by the loop or the walk
        common = max(set(answer), key=answer.count)
        vocab = [i for i in range(tiny_target.lm_head.weight.shape[0]) if i != common]
    vocab = vocab or None
    drafter = LayerSkipDrafter(tiny_target, SKIP, static_tree(spine_paths(depth, width), gate), vocab)
    res = speculative_generate(tiny_target, drafter, PROMPT, SamplingConfig(max_new_tokens=n))
    assert res.output_ids == answer
    loop = list(zip(res.accepted_drafts, res.tree_depths))
    along = draft_along(tiny_target, SKIP, ids, start, depth, vocab=vocab)
    assert chain_walk(along, depth, gate, width) == loop
    if vocab:  # the full vocabulary's walk is another
        assert chain_walk(draft_along(tiny_target, SKIP, ids, start, depth), depth, gate, width) != loop
    assert sum(a for a, _ in loop) >= 3  # drafts were accepted
    if width > 1:  # some step took an alternative beside the chain, which a chain's walk misses
        assert chain_walk(along, depth, gate, 1) != loop
    wrong = chain_walk(teacher_forced(tiny_target, SKIP, ids, start, depth), depth, gate, width)
    if depth > 1:
        assert wrong != loop


def test_draft_along_leaves_the_cache_as_it_found_it(tiny_target):
    ids = PROMPT[0].tolist() + hf_greedy(tiny_target, PROMPT, 8)
    cache = layer_skip.full_cache(tiny_target, ids)
    first = draft_along(tiny_target, SKIP, ids, 8, 3, cache)
    assert {int(layer.get_seq_length()) for layer in cache.layers} == {len(ids)}
    assert draft_along(tiny_target, SKIP, ids, 8, 3, cache) == first


def settings(tmp_path, **skip):
    return InferJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        skip=LayerSkipConfig(**skip),
        tree=TreeConfig(calibration_prompts=2, calibration_tokens=12),
        prompt="hi",
        linear_layout="stock",
    )


def test_auto_calibrates_once_then_uses_the_stored_choice(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    s = validate(settings(tmp_path, layers="auto", max_share=0.4, depth=3))
    out = io.StringIO()
    first = resolve_layer_skip(s, tiny_target, False, out)
    path = skip_cache_path(tiny_target, False)
    stored = json.loads(path.read_text())
    assert list(first.layers) == stored["layers"] and 1 <= len(first.layers) <= 2
    assert first.policy.layout.max_depth == stored["depth"] <= 3
    assert len(stored["calibration"]["candidates"]) >= 1 and stored["calibration"]["positions"] == 2 * 11
    rows = stored["calibration"]["candidates"]
    assert sum(bool(r.get("retimed")) for r in rows) == min(layer_skip.FINALISTS, len(rows))
    assert "calibrated now" in out.getvalue() and "skipped  agree" in out.getvalue()
    again = resolve_layer_skip(s, tiny_target, False, io.StringIO())
    assert again.layers == first.layers and "this machine's calibration" in again.source
    # a re-calibration on fewer positions changes nothing
    s.tree.calibration_prompts, s.skip.recalibrate = 1, True
    out = io.StringIO()
    assert resolve_layer_skip(s, tiny_target, False, out).layers == first.layers
    assert "too few to decide" in out.getvalue() and json.loads(path.read_text()) == stored


def test_verification_and_levels_are_timed_after_the_context_tree_auto_times_at(tiny_target, tmp_path, monkeypatch):
    """One verification context for every calibration: layer skip times the target and its levels
    after calibrate.step_context's context (the mean the loop's steps verify after), as tree=auto
    does, not after the longest prompt."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    made, timed = [], []
    real_context, real_target, real_level = layer_skip.step_context, layer_skip.time_target, layer_skip.time_level

    def context(prompts, contexts):
        made.append((max(map(len, contexts)), real_context(prompts, contexts)))
        return made[-1][1]

    def target(t, ctx, *args, **kwargs):
        timed.append(list(ctx))
        return real_target(t, ctx, *args, **kwargs)

    def level(t, skipped, ctx, *args, **kwargs):
        timed.append(list(ctx))
        return real_level(t, skipped, ctx, *args, **kwargs)

    monkeypatch.setattr(layer_skip, "step_context", context)
    monkeypatch.setattr(layer_skip, "time_target", target)
    monkeypatch.setattr(layer_skip, "time_level", level)
    resolve_layer_skip(
        validate(settings(tmp_path, layers="auto", max_share=0.4, depth=2)), tiny_target, False, io.StringIO()
    )
    ((longest, chosen),) = made
    assert len(timed) >= 2 and all(ctx == chosen for ctx in timed)
    assert len(chosen) < longest  # the mean context, shorter than the longest calibration context


def test_a_draft_vocabulary_is_counted_from_the_data_and_stored_with_the_choice(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    data = write_conversations(tmp_path / "chats.jsonl")
    s = validate(settings(tmp_path, layers="auto", max_share=0.2, depth=2, draft_vocab=40, vocab_data=str(data)))
    choice = resolve_layer_skip(s, tiny_target, False, io.StringIO())
    stored = json.loads(skip_cache_path(tiny_target, False).read_text())
    assert choice.vocab is not None and len(choice.vocab) == 40 and list(choice.vocab) == stored["vocab"]
    assert 0 < stored["calibration"]["draft_vocab"]["coverage"] <= 1
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    answer = tiny_target.tokenizer(rows[0]["messages"][1]["content"], add_special_tokens=False)["input_ids"]
    assert set(answer) <= set(choice.vocab)  # 40 ids cover the byte-level answers' few letters
    again = resolve_layer_skip(s, tiny_target, False, io.StringIO())
    assert again.vocab == choice.vocab and again.drafter(tiny_target).reader.ids.tolist() == list(choice.vocab)


def test_a_given_list_drafts_as_the_tree_settings_say(tiny_target, tmp_path):
    s = validate(settings(tmp_path, layers=[4, 5]))
    s.tree.kind, s.tree.depth = "chain", 2
    choice = resolve_layer_skip(s, tiny_target, False, io.StringIO())
    assert choice.layers == (4, 5) and choice.policy.layout.max_depth == 2
    s.skip.layers = [6]
    with pytest.raises(SpecHeadsError, match="not decoder layers"):
        resolve_layer_skip(s, tiny_target, False, io.StringIO())


@pytest.mark.parametrize(
    "skip,methods,message",
    [
        ({"layers": "some"}, None, "auto or a list"),
        ({"layers": [1.5]}, None, "decoder layer indices"),
        ({"layers": "auto", "max_share": 1.0}, None, "max_share"),
        ({}, ["plain", "skip"], "give skip.layers"),
        ({"layers": "auto", "draft_vocab": 64}, None, "skip.vocab_data"),
        ({"layers": "auto", "width": 0}, None, "skip.width"),
    ],
)
def test_bad_settings_are_refused_in_one_line(skip, methods, message, tmp_path):
    s = settings(tmp_path, **skip)
    if methods:
        s.prompt, s.bench = None, BenchConfig(questions=str(write_questions(tmp_path / "q.jsonl", ["a"], ("x",))))
        s.bench.methods = methods
    with pytest.raises(SpecHeadsError, match=message):
        validate(s)


def test_the_benchmark_runs_the_skip_method_by_default(tiny_target, tmp_path):
    questions = write_questions(tmp_path / "q.jsonl", ["Tell me about cats.", "Count to five."], ("writing", "math"))
    s = settings(tmp_path, layers=list(SKIP))
    s.prompt = None
    s.bench = BenchConfig(questions=str(questions), output=str(tmp_path / "out.jsonl"), max_new_tokens=12, warmup=0)
    s.bench.bandwidth_mib, s.bench.plots = 0, False
    s = validate(s)
    assert s.bench.methods == ["baseline", "plain", "prompt_lookup", "lookup", "skip"]
    s.bench.methods = ["baseline", "plain", "skip"]
    session = Session(tiny_target, None, None, {})
    session.skip = resolve_layer_skip(s, tiny_target, False, io.StringIO())
    report = run_benchmark(s, session, io.StringIO())
    assert report["identical_to_baseline"]["skip"]["equal"] == 2
    assert report["skip"]["skipped_layers"] == [5] and report["skip"]["costs"]


def test_the_demo_drafts_with_the_skipped_layers_without_a_head(tiny_target, tmp_path):
    from specheads.bench.demo import run_demo

    s = settings(tmp_path, layers=list(SKIP))
    s.prompt, s.max_new_tokens, s.mark = "Tell me about cats.", 12, "brackets"
    s.tree.kind, s.tree.depth = "chain", 3
    s = validate(s)
    session = Session(tiny_target, None, None, {})
    session.skip = resolve_layer_skip(s, tiny_target, False, io.StringIO())
    out = io.StringIO()
    stats = run_demo(s, session, out=out)
    assert stats["new_tokens"] == 12 and stats["identical_to_baseline"]
    assert "[target skipping layers [5], static tree (3 nodes, depth 3)]" in out.getvalue().splitlines()[-1]
