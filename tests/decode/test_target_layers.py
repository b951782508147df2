"""Running some of the target's own layers on its KV cache (decode/target_layers.py) against the
target's own full forward: a tree drafted level by level after a cached prefix gets, at every node,
the layer-L state that a full forward over the node's sequence captures; cropping leaves the cache
exactly as it was. The check is shown failing for positions off by one."""

import pytest
import torch
from conftest import assert_same_numbers

from specheads.decode.kv import new_cache
from specheads.decode.target_layers import check_layer_family, crop_layers, layers_length, run_layers
from specheads.errors import SpecHeadsError
from specheads.target import FrozenTarget
from specheads.tiny import tiny_target as build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = [17, 3, 99, 41, 250, 8, 64]
# root 10; 11, 12 under the root; 13 under 11, 14 under 12 (two siblings per level share a position)
TOKENS = [10, 11, 12, 13, 14]
PARENTS = [-1, 0, 0, 1, 2]
LEVELS = [[0], [1, 2], [3, 4]]


def depth(node):
    return 0 if PARENTS[node] < 0 else depth(PARENTS[node]) + 1


def path(node):
    return ([] if PARENTS[node] < 0 else path(PARENTS[node])) + [TOKENS[node]]


@torch.no_grad()
def tree_states(target, layers, shift=0):
    """The tree's nodes run level by level through `layers` after the cached prefix; returns
    ({node: layer output [H]}, the cache, its keys and values before drafting). shift: added to
    every node's position (a wrong variant)."""
    cache = new_cache(target.model)
    target.model(torch.tensor([PREFIX]), cache=cache, use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    p = len(PREFIX)
    slot, out = {}, {}
    for level in LEVELS:
        past = layers_length(cache, layers)
        visible = torch.zeros(len(level), past + len(level), dtype=torch.bool)
        visible[:, :p] = True
        for r, node in enumerate(level):
            visible[r, past + r] = True
            a = PARENTS[node]
            while a >= 0:
                visible[r, slot[a]] = True
                a = PARENTS[a]
        ids = torch.tensor([[TOKENS[i] for i in level]])
        positions = torch.tensor([p + depth(i) + shift for i in level])
        h = run_layers(target, layers, target.embed_tokens(ids), positions, cache, None if past == p else visible)
        for r, node in enumerate(level):
            slot[node] = past + r
            out[node] = h[0, r]
    return out, cache, before


def check_against_full_forward(target, n_layers, shift=0):
    layers = list(range(n_layers))
    states, cache, before = tree_states(target, layers, shift)
    for node, h in states.items():
        with torch.no_grad(), target.capture([n_layers]) as store:
            target.model(torch.tensor([PREFIX + path(node)]))
        assert_same_numbers(h, store[n_layers][0, -1])
    # the layers run hold the prefix and the tree's five nodes; the others were not touched
    for i, layer in enumerate(cache.layers):
        assert layer.get_seq_length() == len(PREFIX) + (len(TOKENS) if i < n_layers else 0)
    crop_layers(cache, layers, len(PREFIX))
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


@pytest.mark.parametrize("n_layers", [1, 3, 6])
def test_the_first_layers_give_each_tree_node_the_full_forwards_state(tiny_target, n_layers):
    check_against_full_forward(tiny_target, n_layers)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "llama-sdpa"])
def test_other_llama_family_targets(arch):
    model, tok = build_tiny(arch.removesuffix("-sdpa"))
    if arch.endswith("-sdpa"):
        model.set_attn_implementation("sdpa")  # the tiny targets run eager attention by default
    check_against_full_forward(FrozenTarget(model, tok, name=f"tiny-{arch}"), 4)


def test_positions_off_by_one_fail_the_check(tiny_target):
    """The wrong variant: every drafted node one position on (the prefix as cached)."""
    with pytest.raises(AssertionError):
        check_against_full_forward(tiny_target, 3, shift=1)


def test_a_target_outside_the_llama_family_is_refused_in_one_line(tiny_target):
    check_layer_family(tiny_target)
    model, tok = build_tiny("gemma")
    with pytest.raises(SpecHeadsError, match="needs a Llama-family target") as err:
        check_layer_family(FrozenTarget(model, tok, name="tiny-gemma"))
    assert "\n" not in str(err.value)


def test_layers_out_of_step_are_refused(tiny_target):
    """run_layers needs its layers at one length: a cache cropped in some layers only is refused."""
    cache = new_cache(tiny_target.model)
    with torch.no_grad():
        tiny_target.model(torch.tensor([PREFIX]), cache=cache, use_cache=True)
    crop_layers(cache, [1], len(PREFIX) - 1)
    with pytest.raises(ValueError, match="different numbers of entries"):
        run_layers(tiny_target, [0, 1], tiny_target.embed_tokens(torch.tensor([[5]])), torch.tensor([7]), cache)
    with pytest.raises(ValueError, match="fewer than"):
        crop_layers(cache, [1], len(PREFIX))
