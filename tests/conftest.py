import os

import pytest
import torch

from specheads.decode.policy import DynamicTreeSpec
from specheads.decode.tree import chain_paths, full_paths, static_tree

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# trees of depth 4 for the lossless-decoding tests
POLICIES = {
    "chain": static_tree(chain_paths(4)),
    "wide": static_tree(full_paths(2, 3)),
    "medusa-like": static_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]),
    "dynamic": DynamicTreeSpec(depth=4, top_k=3, total_tokens=12),
}


@pytest.fixture(scope="session")
def tiny_target():
    from specheads.config.train import ModelConfig
    from specheads.target import load_target

    return load_target(ModelConfig(name="tiny-random", path="tiny:llama"), device=torch.device("cpu"))


@pytest.fixture(scope="session")
def smollm2_target():
    from specheads.config.train import ModelConfig
    from specheads.target import load_target

    return load_target(ModelConfig(), device=torch.device("cpu"))


@pytest.fixture
def toy_batch():
    """Two right-padded sequences with an assistant span, fixed seed."""
    g = torch.Generator().manual_seed(0)
    b, t = 2, 40
    ids = torch.randint(0, 256, (b, t), generator=g)
    attention = torch.ones(b, t, dtype=torch.long)
    attention[1, 30:] = 0
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    loss_mask[:, 10:] = 1
    loss_mask[1, 30:] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def batch_rows(batch):
    return [{"input_ids": i.tolist(), "loss_mask": m.tolist()} for i, m in zip(batch["input_ids"], batch["loss_mask"])]


def head_states(target, head, batch):
    layer_ids, final = head.training_states()
    s = target.states(batch["input_ids"], batch["attention_mask"], layer_ids=layer_ids, final=final)
    return {**s.hidden, "final": s.final}


def hf_greedy(target, prompt, n, eos=None):
    """The target's own greedy continuation (transformers generate): n new token ids."""
    kwargs = {} if eos is None else {"eos_token_id": eos}
    out = target.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False, **kwargs
    )
    return out[0, prompt.shape[1] :].tolist()


def quick_head(target, family, sequences=None, steps=0):
    """A head of `family` on `target`, optionally overfitted on `sequences` for `steps` steps."""
    from specheads.config.train import HeadConfig
    from specheads.heads import build_head

    torch.manual_seed(0)
    rows = [{"input_ids": list(range(320)), "loss_mask": [1] * 320}]
    # eagle3 with a reduced draft vocab: the d2t mapping is exercised
    head = build_head(
        HeadConfig(family=family, draft_vocab_size=200, ttt_steps=2, num_heads=4), target, train_rows=rows
    )
    if steps:
        batch = {
            "input_ids": sequences,
            "attention_mask": torch.ones_like(sequences),
            "loss_mask": torch.ones_like(sequences),
        }
        layer_ids, final = head.training_states()
        s = target.states(sequences, batch["attention_mask"], layer_ids=layer_ids, final=final)
        states = {**s.hidden, "final": s.final}
        opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
        head.train()
        for _ in range(steps):
            loss, _ = head.loss(batch, states)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval()
