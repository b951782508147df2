import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specheads import linear_layout
from specheads.linear_layout import ROW_LADDER, RowLayouts, install, uninstall, weight_left_linear
from specheads.tiny import tiny_target


@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 7), (1, 1, 7)])
def test_weight_left_computes_the_same_product(shape):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(*shape, generator=g), torch.randn(11, 7, generator=g), torch.randn(11, generator=g)
    torch.testing.assert_close(weight_left_linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(weight_left_linear(x, w, None), F.linear(x, w))


def test_row_counts_take_the_next_rung_up_and_one_row_stays_stock():
    layouts = RowLayouts([4, 8])
    # 4 -> rung 4; 5, 6 -> rung 6 (not chosen); 7, 8 -> rung 8
    assert [r for r in range(1, 70) if layouts.weight_left(r)] == [4, 7, 8]
    assert not RowLayouts(ROW_LADDER).weight_left(1) and not RowLayouts(ROW_LADDER).weight_left(ROW_LADDER[-1] + 1)


def test_install_routes_by_rows_and_uninstall_restores(monkeypatch):
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 6, bias=False))
    calls = []
    real = linear_layout.weight_left_linear
    monkeypatch.setattr(linear_layout, "weight_left_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    assert install(model, RowLayouts([2, 3])) == 2
    x = torch.randn(1, 3, 6)
    with torch.no_grad():
        stock = F.linear(x, model[0].weight, model[0].bias)
        model[0](torch.randn(1, 1, 6))  # one row: F.linear
        model[0](torch.randn(1, 4, 6))  # 4 rows: rung 4, not chosen
        routed = model[0](x)
    assert calls == [(1, 3, 6)]
    torch.testing.assert_close(routed, stock)
    uninstall(model)
    assert all("forward" not in layer.__dict__ for layer in model)


def test_choose_keeps_what_the_timer_says_is_faster(monkeypatch):
    # a fake timer: weight-left is faster only from 8 rows on, and only just faster at 4
    def fake_time(model, rows, repeats=5):
        return (1.0, 0.5) if rows >= 8 else ((1.0, 0.97) if rows == 4 else (1.0, 1.2))

    monkeypatch.setattr(linear_layout, "time_forwards", fake_time)
    chosen = linear_layout.choose(nn.Linear(2, 2))
    assert sorted(chosen.rungs) == [r for r in ROW_LADDER if r >= 8]  # 4: within the noise margin
    assert chosen.timings[4] == (1.0, 0.97)


def test_real_forwards_are_timed_and_the_model_left_as_it_was():
    model, _ = tiny_target("llama")
    stock, left = linear_layout.time_forwards(model, rows=3, context=8, repeats=2)
    assert stock > 0 and left > 0
    assert all("forward" not in layer.__dict__ for layer in linear_layout.linear_layers(model))


def test_measured_layouts_are_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    timed = []
    monkeypatch.setattr(linear_layout, "time_forwards", lambda m, rows, repeats=5: timed.append(rows) or (1.0, 0.5))
    model, _ = tiny_target("llama")
    first = linear_layout.measure_layouts(model)
    assert first.rungs == frozenset(ROW_LADDER) and len(timed) == len(ROW_LADDER)
    again = linear_layout.measure_layouts(model)
    assert len(timed) == len(ROW_LADDER) and again.rungs == first.rungs and again.timings == first.timings
    assert "weight-left for 2,3," in linear_layout.describe(again)
