"""Medusa-2: Medusa heads trained jointly with a peft LoRA on the target; the adapter saved in
peft's format, folded into the target on load, merged on request; decoding lossless with respect
to the adapted target.

A medusa2 head changes its target, so every test here builds fresh tiny targets of its own (the
session's shared tiny_target must stay the original)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import POLICIES, assert_other_numbers, assert_same_numbers, hf_greedy
from peft import PeftModel
from transformers import AutoModelForCausalLM

from specheads.config.model import ModelConfig
from specheads.config.train import HeadConfig
from specheads.decode.drafters import make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.errors import SpecHeadsError
from specheads.export import export_head
from specheads.heads import Medusa2Head, MedusaHead, build_head, load_head, save_head
from specheads.heads.medusa2 import ADAPTER_DIR, ADAPTER_WEIGHTS, MERGED_KEY
from specheads.target import FrozenTarget, load_target

pytestmark = pytest.mark.usefixtures("one_thread")


def fresh_target() -> FrozenTarget:
    return load_target(ModelConfig(name="tiny-random", path="tiny:llama"), device=torch.device("cpu"))


def make_medusa2(target, seed=0, **overrides) -> Medusa2Head:
    torch.manual_seed(seed)
    # lambda 1 and the LoRA at the heads' rate: the small adapter these checks were sized for (the defaults,
    # lambda 10 and a LoRA rate of its own, are tested in tests/config/test_train_schema.py)
    fields = {"num_heads": 4, "lora_r": 4, "lora_dropout": 0.0, "heads_only_steps": 0, "lm_loss_warmup_steps": 0}
    fields.update(lm_loss_weight=1.0, lora_lr=None)
    return build_head(HeadConfig(family="medusa2", **{**fields, **overrides}), target)


def full_batch(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


def fit(head, batch, steps, lr=3e-3) -> list[dict]:
    """`steps` optimizer steps over the head and its LoRA, as the trainer takes them."""
    adapter = head.target_adapter()
    opt = torch.optim.AdamW([*head.parameters(), *adapter.parameters()], lr=lr)
    head.train()
    adapter.train()
    history = []
    for step in range(steps):
        head.steps_done = step
        loss, metrics = head.loss(batch, {})
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append({"loss": loss.item(), **metrics, "lora": lora_state(head)})
    head.eval()
    adapter.eval()
    return history


def lora_state(head) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in head.target_adapter().state_dict().items()}


def base_state(target) -> dict[str, torch.Tensor]:
    """The target's own weights under their plain names (LoRA layers wrap them as base_layer)."""
    return {
        k.replace(".base_layer.", "."): v.detach().clone()
        for k, v in target.model.state_dict().items()
        if ".lora_" not in k
    }


def nudge_lora(head, scale=0.05, seed=1):
    """A non-trivial adapter: LoRA B off its zero initialisation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.target_adapter().named_parameters():
            if ".B." in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


def logits(target, ids):
    with torch.no_grad():
        return target.model(ids).logits


@pytest.fixture
def toy_ids():
    return torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def test_shapes_and_the_fresh_lora(toy_ids):
    target, original = fresh_target(), fresh_target()
    head = make_medusa2(target)
    assert isinstance(head, MedusaHead) and head.family == "medusa2" and head.draft_kind == "parallel"
    assert head.adapts_target and head.training_states() == ([], False) and head.reads_final
    assert Medusa2Head.max_draft_depth(head.spec) == 4 and head.spec.eval_depth == 4
    v = target.info.vocab_size
    final = target.states(toy_ids, final=True).final
    assert [x.shape for x in head.teacher_forced_logits(toy_ids, {"final": final}, 6)] == [(2, 40, v)] * 4
    # one LoRA per projection of every layer; its size is what the memory plan counts
    adapter = head.target_adapter()
    assert len(adapter) == 7 * target.info.num_layers
    n_lora = sum(p.numel() for p in adapter.parameters())
    assert n_lora == Medusa2Head.target_adapter_parameters(head.spec, target.info)
    assert all(p.requires_grad for p in adapter.parameters())
    lora_ids = {id(p) for p in adapter.parameters()}
    assert not any(p.requires_grad for p in target.model.parameters() if id(p) not in lora_ids)
    assert not lora_ids & {id(p) for p in head.parameters()}  # the head's own weights hold no LoRA
    # B starts at zero: the adapted target starts equal to the original
    torch.testing.assert_close(logits(target, toy_ids), logits(original, toy_ids), rtol=0, atol=0)
    assert "rank-4 LoRA" in Medusa2Head.describe(head.spec, target.info, [])


def masked_batch(ids):
    """Row 1 padded from 30; assistant tokens from 10 on (to 30 in row 1)."""
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.zeros_like(ids)}
    batch["attention_mask"][1, 30:] = 0
    batch["loss_mask"][0, 10:] = 1
    batch["loss_mask"][1, 10:30] = 1
    return batch


def counted_positions(batch):
    """(row, t) whose next token t + 1 is a real assistant token: where the LM loss counts."""
    mask, assistant = batch["attention_mask"], batch["loss_mask"]
    rows, length = mask.shape
    return [
        (b, t) for b in range(rows) for t in range(length - 1) if mask[b, t] and mask[b, t + 1] and assistant[b, t + 1]
    ]


def test_lm_loss_ce_is_the_adapted_targets_next_token_cross_entropy(toy_ids):
    target = fresh_target()
    head = make_medusa2(target, lm_loss="ce")
    nudge_lora(head)
    batch = masked_batch(toy_ids)
    with torch.no_grad():
        _, metrics = head.loss(batch, {})
        full = target.model(toy_ids, attention_mask=batch["attention_mask"]).logits
    counted = counted_positions(batch)
    ce = sum(float(F.cross_entropy(full[b, t], toy_ids[b, t + 1])) for b, t in counted)
    assert metrics["lm_loss"] == pytest.approx(ce / len(counted), rel=1e-4)


def test_lm_loss_kl_is_the_divergence_from_the_original_target(toy_ids):
    """KL(original || adapted) per counted position, the original computed here by a target that
    never carried the LoRA; 0 exactly while the LoRA is fresh (where cross-entropy is not)."""
    target, original = fresh_target(), fresh_target()
    head = make_medusa2(target)
    assert head.spec.lm_loss == "kl"
    batch = masked_batch(toy_ids)
    with torch.no_grad():
        assert head.loss(batch, {})[1]["lm_loss"] == 0.0
        nudge_lora(head)
        _, metrics = head.loss(batch, {})
        adapted = target.model(toy_ids, attention_mask=batch["attention_mask"]).logits.log_softmax(-1)
        plain = original.model(toy_ids, attention_mask=batch["attention_mask"]).logits.log_softmax(-1)
    counted = counted_positions(batch)
    kl = sum(float((plain[b, t].exp() * (plain[b, t] - adapted[b, t])).sum()) for b, t in counted)
    assert kl > 1e-3  # the nudged adapter does move the target: the comparison below can fail
    assert metrics["lm_loss"] == pytest.approx(kl / len(counted), rel=1e-4)


def test_the_kl_term_keeps_the_adapted_target_near_the_original(toy_ids):
    """The same joint training with lambda = 0 and lambda = 4: the KL term's run ends closer."""
    batch = full_batch(toy_ids)
    drift = {}
    for weight in (0.0, 4.0):
        target, original = fresh_target(), fresh_target()
        head = make_medusa2(target, lm_loss_weight=weight)
        fit(head, batch, 15, lr=1e-2)
        adapted, plain = logits(target, toy_ids).log_softmax(-1), logits(original, toy_ids).log_softmax(-1)
        drift[weight] = float((plain.exp() * (plain - adapted)).sum(-1).mean())
    assert drift[4.0] < 0.5 * drift[0.0], drift


def test_stages_lambda_ramp_and_falling_loss(toy_ids):
    """Stage 1 trains the heads alone; stage 2 trains the LoRA too, lambda ramping from 0.
    The target's base weights never change."""
    target = fresh_target()
    head = make_medusa2(target, heads_only_steps=4, lm_loss_warmup_steps=4, lm_loss_weight=0.5, lm_loss="ce")
    batch = full_batch(toy_ids)
    lora0, base0 = lora_state(head), base_state(target)
    history = fit(head, batch, 30)
    assert [h["lm_weight"] for h in history[:10]] == [0, 0, 0, 0, 0, 0.125, 0.25, 0.375, 0.5, 0.5]
    for h in history[:4]:  # stage 1: the LoRA is untouched
        assert all(torch.equal(h["lora"][k], lora0[k]) for k in lora0)
    changed = [k for k in lora0 if not torch.equal(history[-1]["lora"][k], lora0[k])]
    assert len(changed) == len(lora0)  # every A and B moved in stage 2
    assert all(torch.equal(v, base0[k]) for k, v in base_state(target).items())
    assert all(torch.isfinite(torch.tensor([h["loss"] for h in history])))
    heads_loss = [sum(h[f"loss_{k}"] for k in range(4)) for h in history]
    assert heads_loss[-1] < 0.5 * heads_loss[0], heads_loss
    assert history[-1]["lm_loss"] < history[8]["lm_loss"]  # the LM term falls once lambda weighs it


def test_saved_adapter_reloads_with_peft_and_merges(toy_ids, tmp_path):
    target = fresh_target()
    head = make_medusa2(target)
    fit(head, full_batch(toy_ids), 5)
    nudge_lora(head)
    adapted = logits(target, toy_ids)
    assert_other_numbers(adapted, logits(fresh_target(), toy_ids))  # a non-trivial adapter
    save_head(head, tmp_path / "head")
    assert {p.name for p in (tmp_path / "head").iterdir()} == {"config.json", "model.safetensors", ADAPTER_DIR}
    assert {"adapter_config.json", ADAPTER_WEIGHTS} <= {p.name for p in (tmp_path / "head" / ADAPTER_DIR).iterdir()}

    # peft reads it back on its own
    plain = fresh_target().model
    peft_model = PeftModel.from_pretrained(plain, str(tmp_path / "head" / ADAPTER_DIR))
    with torch.no_grad():
        assert_same_numbers(peft_model(toy_ids).logits, adapted)

    # load_head folds it into the target: the adapted target, once only
    other = fresh_target()
    loaded = load_head(tmp_path / "head", other)
    assert getattr(other.model.config, MERGED_KEY)
    assert_same_numbers(logits(other, toy_ids), adapted)
    again = logits(other, toy_ids)
    load_head(tmp_path / "head", other)
    torch.testing.assert_close(logits(other, toy_ids), again, rtol=0, atol=0)
    final = target.states(toy_ids, final=True).final
    with torch.no_grad():
        torch.testing.assert_close(loaded.medusa_logits(final), head.medusa_logits(final), rtol=0, atol=0)

    # the merged target: a plain transformers directory equal to the adapted one
    merged_dir = head.save_merged_target(tmp_path / "merged", tmp_path / "head")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        assert_same_numbers(merged(toy_ids).logits, adapted)
    merged_target = load_target(ModelConfig(name="tiny-random", path=str(merged_dir)), device=torch.device("cpu"))
    before = logits(merged_target, toy_ids)
    load_head(tmp_path / "head", merged_target)  # already folded in: left as it is
    torch.testing.assert_close(logits(merged_target, toy_ids), before, rtol=0, atol=0)

    # a loaded head saves the same adapter bytes again (tree=auto rewrites the head directory)
    save_head(loaded, tmp_path / "copy")
    names = (ADAPTER_DIR, ADAPTER_WEIGHTS)
    assert (tmp_path / "copy").joinpath(*names).read_bytes() == (tmp_path / "head").joinpath(*names).read_bytes()


def test_adapter_refusals_are_one_line(toy_ids, tmp_path):
    target = fresh_target()
    head = make_medusa2(target)
    nudge_lora(head)
    save_head(head, tmp_path / "head")
    with pytest.raises(SpecHeadsError, match="already carries a LoRA adapter"):
        make_medusa2(target)  # a second LoRA on an adapted target
    other = make_medusa2(fresh_target(), seed=3)
    nudge_lora(other, seed=3)
    save_head(other, tmp_path / "other")
    folded = fresh_target()
    load_head(tmp_path / "head", folded)
    with pytest.raises(SpecHeadsError, match="already carries another LoRA adapter"):
        load_head(tmp_path / "other", folded)
    (tmp_path / "head" / ADAPTER_DIR / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(SpecHeadsError, match="without its adapter"):
        load_head(tmp_path / "head", fresh_target())
    with pytest.raises(SpecHeadsError, match="no serving-engine format serves Medusa-2 heads"):
        export_head(tmp_path / "other", "medusa", tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lora_target_modules": ["lm_head"]}, "decoder-layer projections"),
        ({"lora_target_modules": ["nothing_proj"]}, "lora_target_modules"),
        ({"lora_r": 0}, "lora_r >= 1"),
        ({"lm_loss_warmup_steps": -1}, "lm_loss_warmup_steps must be >= 0"),
        ({"lm_loss": "mse"}, "lm_loss must be kl or ce"),
    ],
)
def test_bad_lora_settings_are_one_line(overrides, message):
    with pytest.raises(SpecHeadsError, match=message) as err:
        make_medusa2(fresh_target(), **overrides)
    assert "\n" not in str(err.value)


def test_merge_lora_is_for_medusa2_only(tiny_target):
    with pytest.raises(SpecHeadsError, match="merge_lora.*medusa2"):
        build_head(HeadConfig(family="medusa", merge_lora=True), tiny_target)


def test_greedy_decoding_is_lossless_for_the_adapted_target(tmp_path):
    """Speculative decoding with a loaded medusa2 head gives the ADAPTED target's greedy output token
    for token, which differs from the original target's (so the comparison can fail)."""
    target, original = fresh_target(), fresh_target()
    head = make_medusa2(target, heads_only_steps=10**6)  # the heads alone: the adapter stays as nudged
    nudge_lora(head, scale=0.1)
    prompts = torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sequences = target.model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=40, do_sample=False
        )
    fit(head, full_batch(sequences), 60)  # the heads learn the adapted target's continuations
    save_head(head, tmp_path / "head")
    served = fresh_target()
    loaded = load_head(tmp_path / "head", served)
    tests = [sequences[1:2, :8], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])]
    differs = False
    for prompt in tests:
        ref = hf_greedy(served, prompt, 24)
        assert ref == hf_greedy(target, prompt, 24)  # folded in or not, the same adapted target
        differs |= ref != hf_greedy(original, prompt, 24)
        for name, policy in POLICIES.items():
            res = speculative_generate(served, make_drafter(loaded, policy), prompt, SamplingConfig(max_new_tokens=24))
            assert res.output_ids == ref, name
    assert differs  # the adapter changes the target's greedy output
    res = speculative_generate(
        served, make_drafter(loaded, POLICIES["chain"]), sequences[1:2, :8], SamplingConfig(max_new_tokens=32)
    )
    assert res.tau > 1.5, res.accept_lengths
