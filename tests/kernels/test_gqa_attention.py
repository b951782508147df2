import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specheads.decode.kv import tree_attention_bias
from specheads.kernels import gqa_attention
from specheads.tiny import tiny_target


class GroupedModule(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("queries", [1, 2, 5])
def test_masked_grouped_attention_equals_transformers_sdpa_to_the_bit(queries):
    g = torch.Generator().manual_seed(queries)
    q = torch.randn(1, 9, queries, 16, generator=g)
    k, v = torch.randn(1, 3, 20 + queries, 16, generator=g), torch.randn(1, 3, 20 + queries, 16, generator=g)
    tree = torch.tril(torch.ones(queries, queries, dtype=torch.bool))
    tree[-1, 0] = queries == 1  # a branch: the last node does not see the first
    mask = tree_attention_bias(tree, 20, torch.float32, torch.device("cpu"))
    module = GroupedModule()
    ours, _ = gqa_attention.gqa_sdpa_forward(module, q, k, v, mask, scaling=0.25)
    stock, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)  # repeats the KV heads
    assert torch.equal(ours, stock)
    other, _ = sdpa_attention_forward(module, q, k, v, torch.zeros_like(mask), scaling=0.25)
    assert queries == 1 or not torch.equal(ours, other)  # the check can fail: the mask matters


def test_install_switches_only_sdpa_targets_and_stock_attention_restores():
    eager, _ = tiny_target("llama")
    assert not gqa_attention.install(eager) and eager.config._attn_implementation == "eager"
    sdpa, _ = tiny_target("llama")
    sdpa.set_attn_implementation("sdpa")
    assert gqa_attention.install(sdpa) and sdpa.config._attn_implementation == gqa_attention.NAME
    with gqa_attention.stock_attention(sdpa):
        assert sdpa.config._attn_implementation == "sdpa"
    assert sdpa.config._attn_implementation == gqa_attention.NAME
    gqa_attention.uninstall(sdpa)
    assert sdpa.config._attn_implementation == "sdpa"


def test_a_target_on_it_computes_the_same_logits():
    model, _ = tiny_target("llama")
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    tree = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    tree[3, 1:3] = False  # node 3 hangs below the root
    mask = tree_attention_bias(tree, 8, torch.float32, torch.device("cpu"))
    positions = torch.tensor([[8, 9, 10, 9]])

    def verify():
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :8], cache=cache, use_cache=True)
            return model(
                input_ids=ids[:, 8:], attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
            ).logits

    stock = verify()
    gqa_attention.install(model)
    try:
        assert torch.equal(verify(), stock)
    finally:
        gqa_attention.uninstall(model)
