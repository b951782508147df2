"""The paths a GPU changes, run on SPECHEADS_TEST_DEVICE (default cuda; skipped where there is none):
greedy decoding equal to the target's own on every head family and tree, sampling that follows the
target's distribution, and train.py through DeepSpeed. `SPECHEADS_TEST_DEVICE=cpu` rehearses them
on a machine without one. The target is fp32: bf16 logits tie too often for token-exact checks."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import POLICIES, assert_first_two_tokens_follow, greedy_sequences, hf_greedy, quick_head

from specheads.decode.drafters import make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.tree import static_tree
from specheads.sampling import sampling_probs
from specheads.target import FrozenTarget
from specheads.tiny import tiny_target as build_tiny

DEVICE = os.environ.get("SPECHEADS_TEST_DEVICE", "cuda")
ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["medusa", "eagle", "eagle3", "hydra", "peagle", "dflash"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture(scope="module")
def target():
    model, tok = build_tiny("llama")
    return FrozenTarget(model.to(DEVICE), tok, name="tiny-random")


@pytest.fixture(scope="module")
def sequences(target):
    """The target's greedy continuations of 8 seeded prompts, made on the device: what heads overfit on."""
    return greedy_sequences(target)


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_the_targets_own_on_the_device(family, head_dtype, target, sequences):
    head = quick_head(target, family, sequences, steps=60).to(head_dtype)
    prompts = [sequences[1:2, :8], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], device=DEVICE)]
    refs = [hf_greedy(target, p, 24) for p in prompts]
    accepted = 0
    for name, policy in POLICIES.items():
        for prompt, ref in zip(prompts, refs):
            res = speculative_generate(target, make_drafter(head, policy), prompt, SamplingConfig(max_new_tokens=24))
            assert res.output_ids == ref, (family, name)
            accepted += sum(res.accepted_drafts)
    assert accepted > 20, (family, accepted)  # the check ran through accepted paths, not only rejections


def test_sampling_follows_the_target_distribution_on_the_device(target, sequences):
    """The first two sampled tokens, the second decided by one tree verification, against the
    target's joint distribution; the drafts are both accepted and rejected."""
    head = quick_head(target, "eagle", sequences, steps=60)
    prompt = sequences[1:2, :8]
    cfg = SamplingConfig(max_new_tokens=3, temperature=0.8, top_p=0.9)
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    drafter = make_drafter(head, static_tree([[0], [1], [2], [0, 0]]))
    n, counts, first_accepted = 600, Counter(), Counter()
    for _ in range(n):
        res = speculative_generate(target, drafter, prompt, cfg, generator=gen)
        counts[tuple(res.output_ids[:2])] += 1
        first_accepted[res.accepted_drafts[0]] += 1
    assert first_accepted[0] > n * 0.05 and n - first_accepted[0] > n * 0.3, first_accepted
    with torch.no_grad():
        p1 = sampling_probs(target.model(prompt).logits[0, -1].float(), 0.8, 0.9)
        vocab = p1.numel()
        batch = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab, device=DEVICE)[:, None]], dim=1)
        p2 = sampling_probs(target.model(batch).logits[:, -1].float(), 0.8, 0.9)
    assert_first_two_tokens_follow(counts, p1, p2, n)


@pytest.mark.parametrize("family", ["eagle3", "medusa2", "hydra", "peagle", "dflash"])
def test_train_py_writes_a_head_on_the_device(family, tmp_path):
    """train.py on the device through deepspeed.initialize (Medusa-2: a LoRA inside the target)."""
    from conftest import write_conversations

    data = write_conversations(tmp_path / "chats.jsonl")
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "model=tiny-random", f"head={family}", f"device={DEVICE}"]
    cmd += [f"data.path={data}", "data.max_length=96", "data.eval_fraction=0.25", "train.max_steps=3"]
    cmd += [f"output_dir={out}", "wandb.mode=disabled"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out / "head")
    assert (out / "head" / "model.safetensors").is_file()


def test_target_layer_drafters_give_the_targets_greedy_output_on_the_device(target, sequences, tmp_path):
    """The drafters that run the target's own layers on its KV cache (early exit, layer skipping)
    and a separate draft model with its own cache: greedy output equal to the target's own, with
    drafts accepted, on every tree policy."""
    from specheads.config.infer import DraftModelConfig
    from specheads.config.train import HeadConfig
    from specheads.decode.draft_model import DraftModelDrafter, load_draft_model, make_draft_model
    from specheads.decode.layer_skip import LayerSkipDrafter
    from specheads.heads import build_head

    torch.manual_seed(0)
    early = build_head(HeadConfig(family="early_exit", exit_layer=5), target).to(DEVICE).eval()
    draft = load_draft_model(DraftModelConfig(model=str(make_draft_model(target, 4, tmp_path / "d"))), target)
    makers = {
        "early exit": lambda policy: make_drafter(early, policy),
        "layer skip": lambda policy: LayerSkipDrafter(target, (5,), policy),
        "draft model": lambda policy: DraftModelDrafter(draft, policy),
    }
    prompts = [sequences[1:2, :8], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], device=DEVICE)]
    refs = [hf_greedy(target, p, 24) for p in prompts]
    for kind, make in makers.items():
        accepted = 0
        for name, policy in POLICIES.items():
            for prompt, ref in zip(prompts, refs):
                res = speculative_generate(target, make(policy), prompt, SamplingConfig(max_new_tokens=24))
                assert res.output_ids == ref, (kind, name)
                accepted += sum(res.accepted_drafts)
        assert accepted > 10, (kind, accepted)


@pytest.mark.parametrize("family,extra", [("early_exit", ["head.exit_layer=3"]), ("eagle3", ["data.pack=true"])])
def test_train_py_trains_early_exit_and_packed_rows_on_the_device(family, extra, tmp_path):
    """train.py on the device for the early-exit head, and EAGLE-3 on packed rows."""
    from conftest import write_conversations

    data = write_conversations(tmp_path / "chats.jsonl")
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "model=tiny-random", f"head={family}", f"device={DEVICE}", *extra]
    cmd += [f"data.path={data}", "data.max_length=96", "data.eval_fraction=0.25", "train.max_steps=3"]
    cmd += [f"output_dir={out}", "wandb.mode=disabled"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "head" / "model.safetensors").is_file()
