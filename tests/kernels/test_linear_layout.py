import json
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_other_numbers, assert_same_numbers
from torch import nn

from specheads.kernels import linear_layout
from specheads.kernels.linear_layout import (
    PACKED,
    ROW_LADDER,
    STOCK,
    WEIGHT_LEFT,
    RowLayouts,
    install,
    pack_weight,
    packed_linear,
    stock_kernels,
    uninstall,
    weight_left_linear,
)
from specheads.tiny import tiny_target

needs_packing = pytest.mark.skipif(
    not linear_layout.packing_available(torch.zeros(1)), reason="oneDNN (mkldnn) linear is not available in this torch"
)


@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 7), (1, 1, 7)])
def test_weight_left_computes_the_same_product(shape):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(*shape, generator=g), torch.randn(11, 7, generator=g), torch.randn(11, generator=g)
    assert_same_numbers(weight_left_linear(x, w, b), F.linear(x, w, b))
    assert_same_numbers(weight_left_linear(x, w, None), F.linear(x, w))


@needs_packing
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 7), (1, 1, 7)])
def test_packed_computes_the_same_product(shape):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(*shape, generator=g), torch.randn(11, 7, generator=g), torch.randn(11, generator=g)
    packed = pack_weight(w)
    assert_same_numbers(packed_linear(x, packed, b), F.linear(x, w, b))
    assert_same_numbers(packed_linear(x, packed, None), F.linear(x, w))
    assert_same_numbers(packed_linear(x.transpose(0, -1).transpose(0, -1), packed, b), F.linear(x, w, b))
    # the check can fail: another weight gives another product
    assert_other_numbers(packed_linear(x, pack_weight(w + 1), b), F.linear(x, w, b))


def test_row_counts_take_the_next_rung_up_and_beyond_the_ladder_stay_stock():
    layouts = RowLayouts({4: WEIGHT_LEFT, 8: PACKED, 1: PACKED})
    # 4 -> rung 4; 5, 6 -> rung 6 (not chosen); 7, 8 -> rung 8
    assert [layouts.kernel(r) for r in range(1, 10)] == [
        PACKED,
        STOCK,
        STOCK,
        WEIGHT_LEFT,
        STOCK,
        STOCK,
        PACKED,
        PACKED,
        STOCK,
    ]
    everywhere = RowLayouts.everywhere(WEIGHT_LEFT)
    assert everywhere.kernel(1) == WEIGHT_LEFT and everywhere.kernel(ROW_LADDER[-1] + 1) == STOCK
    with pytest.raises(ValueError, match="unknown linear kernel"):
        RowLayouts({2: "fast"})


def test_install_routes_by_rows_and_uninstall_restores(monkeypatch):
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 6, bias=False))
    calls = []
    real = linear_layout.weight_left_linear
    monkeypatch.setattr(linear_layout, "weight_left_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    assert install(model, RowLayouts({2: WEIGHT_LEFT, 3: WEIGHT_LEFT})) == 2
    x = torch.randn(1, 3, 6)
    with torch.no_grad():
        stock = F.linear(x, model[0].weight, model[0].bias)
        model[0](torch.randn(1, 1, 6))  # one row: rung 1, not chosen
        model[0](torch.randn(1, 4, 6))  # 4 rows: rung 4, not chosen
        routed = model[0](x)
        with stock_kernels(model):
            model[0](x)  # suspended: F.linear
        model[0](x)
    assert calls == [(1, 3, 6), (1, 3, 6)]
    assert_same_numbers(routed, stock)
    uninstall(model)
    assert all("forward" not in layer.__dict__ for layer in model)


@needs_packing
def test_packed_layers_use_their_packed_copy(monkeypatch):
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 6, bias=False))
    install(model, RowLayouts({1: PACKED}))
    calls = []
    real = linear_layout.packed_linear
    monkeypatch.setattr(linear_layout, "packed_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(1, 1, 6)
    with torch.no_grad():
        assert_same_numbers(model(x), model[1](F.linear(x, model[0].weight, model[0].bias)))
    assert len(calls) == 3  # both layers of model(x), then model[1] again
    uninstall(model)
    assert all("_packed_weight" not in layer.__dict__ for layer in model)


def test_choose_keeps_what_the_timer_says_is_faster(monkeypatch):
    # a fake timer: weight-left is faster only from 8 rows on, only just faster at 4; packed at 1-2
    def fake_time(model, rows, kernels, repeats=5):
        left = 0.5 if rows >= 8 else (0.97 if rows == 4 else 1.2)
        return {STOCK: 1.0, WEIGHT_LEFT: left, PACKED: 0.8 if rows <= 2 else 1.1}

    monkeypatch.setattr(linear_layout, "time_forwards", fake_time)
    monkeypatch.setattr(linear_layout, "candidate_kernels", lambda m: linear_layout.KERNELS)
    chosen = linear_layout.choose(nn.Linear(2, 2))
    assert chosen.kernels == {1: PACKED, 2: PACKED, **{r: WEIGHT_LEFT for r in ROW_LADDER if r >= 8}}
    assert chosen.timings[4][WEIGHT_LEFT] == 0.97  # within the noise margin: stock


def test_real_forwards_are_timed_and_the_model_left_as_it_was():
    model, _ = tiny_target("llama")
    kernels = linear_layout.candidate_kernels(model)
    timings = linear_layout.time_forwards(model, rows=3, kernels=kernels, context=8, repeats=2)
    assert set(timings) == set(kernels) and all(t > 0 for t in timings.values())
    assert all("forward" not in layer.__dict__ for layer in linear_layout.linear_layers(model))


def timed_logits(model):
    """time_forwards on `model` (context 12, two rounds): each timed call's cache length on entry and
    its logits (the warm-up round's included)."""
    seen = []
    pre = model.register_forward_pre_hook(
        lambda m, args, kw: seen.append([kw["cache"].get_seq_length()]), with_kwargs=True
    )
    post = model.register_forward_hook(lambda m, args, out: seen[-1].append(out.logits), with_kwargs=False)
    try:
        linear_layout.time_forwards(
            model, rows=3, kernels=linear_layout.candidate_kernels(model), context=12, repeats=1
        )
    finally:
        pre.remove()
        post.remove()
    return seen[1:]  # after the prefill


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4_text", "qwen3_next", "falcon_h1", "granitemoehybrid"])
def test_every_timed_forward_follows_the_same_context(arch):
    """Sliding-window and chunked layers (window 8 < the context of 12), linear attention and Mamba
    states cannot be cropped back: each timed forward starts from the prefilled context all the
    same, so every kernel computes the same logits (llama4's router, an nn.Linear returning its
    scores too, is left stock)."""
    model, _ = tiny_target(arch, num_hidden_layers=4)
    calls = timed_logits(model)
    assert [length for length, _ in calls] == [12] * len(calls)
    for _, logits in calls[1:]:
        assert_same_numbers(logits, calls[0][1])
    assert all("forward" not in layer.__dict__ for layer in linear_layout.linear_layers(model))


def test_a_shared_cache_would_time_a_growing_context(monkeypatch):
    """The wrong variant, one cache for every timed forward: each sees the last one's tokens."""
    model, _ = tiny_target("llama")
    monkeypatch.setattr(linear_layout, "copy", types.SimpleNamespace(deepcopy=lambda cache: cache))
    calls = timed_logits(model)
    assert [length for length, _ in calls] == [12 + 3 * i for i in range(len(calls))]
    assert_other_numbers(calls[1][1], calls[0][1])


def test_measured_layouts_are_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    timed = []
    monkeypatch.setattr(
        linear_layout,
        "time_forwards",
        lambda m, rows, kernels, repeats=5: timed.append(rows) or {STOCK: 1.0, WEIGHT_LEFT: 0.5},
    )
    model, _ = tiny_target("llama")
    first = linear_layout.measure_layouts(model)
    assert first.kernels == {r: WEIGHT_LEFT for r in ROW_LADDER} and len(timed) == len(ROW_LADDER)
    again = linear_layout.measure_layouts(model)
    assert len(timed) == len(ROW_LADDER) and again.kernels == first.kernels and again.timings == first.timings
    assert "1:weight-left 2:weight-left" in linear_layout.describe(again)
    stored = json.loads(next((tmp_path / "linear_layouts").glob("*.json")).read_text())
    assert stored["kernels"]["64"] == WEIGHT_LEFT
