"""The preallocated draft KV cache against a plain one that concatenates (the implementation it
replaced): the same entries after any sequence of appends, crops and compactions, and the same
drafts from a real drafter."""

import random

import pytest
import torch

from specheads.decode.drafters import make_drafter
from specheads.decode.policy import DynamicTreeSpec
from specheads.heads.layers import DraftCache

pytestmark = pytest.mark.usefixtures("one_thread")


class ConcatCache:
    def __init__(self, num_layers: int):
        self.keys = [None] * num_layers
        self.values = [None] * num_layers

    @property
    def length(self):
        return self.layer_length(0)

    def layer_length(self, layer):
        return 0 if self.keys[layer] is None else self.keys[layer].shape[2]

    def append(self, layer, k, v):
        if self.keys[layer] is not None:
            k, v = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, n_keep):
        self.keys = [k if k is None else k[:, :, :n_keep] for k in self.keys]
        self.values = [v if v is None else v[:, :, :n_keep] for v in self.values]

    def keep(self, indices):
        self.keys = [k if k is None else k.index_select(2, indices) for k in self.keys]
        self.values = [v if v is None else v.index_select(2, indices) for v in self.values]


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_the_concatenating_cache(seed):
    rng = random.Random(seed)
    fast, ref = DraftCache(2, capacity=4), ConcatCache(2)  # a tiny capacity: growth is exercised
    for _ in range(60):
        op = rng.choice(["append", "append", "crop", "keep"])
        if op == "append" or ref.length == 0:
            n = rng.randint(1, 7)
            for layer in range(2):
                k, v = torch.randn(1, 2, n, 3), torch.randn(1, 2, n, 3)
                got, want = fast.append(layer, k, v), ref.append(layer, k, v)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        elif op == "crop":
            n = rng.randint(0, ref.length)
            fast.crop(n), ref.crop(n)
        else:
            idx = torch.tensor(sorted(rng.sample(range(ref.length), rng.randint(1, ref.length))))
            fast.keep(idx), ref.keep(idx)
        assert fast.length == ref.length
        for layer in range(2):
            if ref.length:
                torch.testing.assert_close(fast.keys[layer][:, :, : ref.length], ref.keys[layer], rtol=0, atol=0)
                torch.testing.assert_close(fast.values[layer][:, :, : ref.length], ref.values[layer], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_drafts_equal_those_of_the_concatenating_cache(family, tiny_target, monkeypatch):
    from conftest import quick_head

    head = quick_head(tiny_target, family)
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    policy = DynamicTreeSpec(depth=4, top_k=3, total_tokens=10)

    def drafts(cache_cls):
        monkeypatch.setattr(type(head), "new_cache", lambda self: cache_cls(len(self.layers)))
        drafter = make_drafter(head, policy)
        with tiny_target.capture(drafter.layer_ids, final=drafter.reads_final) as store:
            out = tiny_target.model(prompt)
        root = int(out.logits[0, -1].argmax())
        drafter.start(prompt, dict(store), root)
        trees = []
        for step in range(4):
            tokens, layout = drafter.draft(root, prompt.shape[1] + step, max_depth=6)
            trees.append((tokens, layout.parents))
            with tiny_target.capture(drafter.layer_ids, final=drafter.reads_final) as store:
                tiny_target.model(torch.tensor([[root]]))
            drafter.advance({k: v[:, -1:] for k, v in store.items()}, [root], tokens[1])
            root = tokens[1]
        return trees

    assert drafts(DraftCache) == drafts(ConcatCache)
