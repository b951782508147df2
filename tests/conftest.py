import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
