"""Tree verification's forward and cache: every node sees exactly its ancestors; compaction leaves
the cache as if the accepted path had been decoded one token at a time."""

import torch
from conftest import assert_same_numbers

from specheads.decode.kv import compact_cache, new_cache, verify_tree
from specheads.decode.tree import TreeLayout


@torch.no_grad()
def test_each_tree_node_sees_the_prefix_and_its_ancestors(tiny_target):
    prefix = [5, 6, 7, 8, 9]
    # root 10; children 11, 12 of the root; 13 below 11
    tokens, layout = [10, 11, 12, 13], TreeLayout((-1, 0, 0, 1))
    cache = new_cache(tiny_target.model)
    tiny_target.model(torch.tensor([prefix]), cache=cache, use_cache=True)
    out = verify_tree(tiny_target, tokens, layout, len(prefix), cache)
    for node in range(layout.size):
        seq = prefix + [tokens[i] for i in layout.path_to(node)]
        ref = tiny_target.model(torch.tensor([seq])).logits[0, -1]
        assert_same_numbers(out.logits[0, node], ref)
    # keep root and node 2: the cache continues like plain decoding of prefix + [10, 12]
    compact_cache(cache, len(prefix), [0, 2])
    nxt = tiny_target.model(torch.tensor([[14]]), cache=cache, use_cache=True).logits[0, -1]
    ref = tiny_target.model(torch.tensor([prefix + [10, 12, 14]])).logits[0, -1]
    assert_same_numbers(nxt, ref)
