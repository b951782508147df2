import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specheads.errors import SpecHeadsError
from specheads.kernels import weight_int8


def reference_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """What an installed layer computes, written plainly (dequantize, then nn.Linear's product)."""
    w = weight_int8.dequantize(layer._int8_weight, layer._int8_scales).to(x.dtype)
    return F.linear(x, w, layer.bias)


def test_quantization_keeps_each_row_within_half_a_step_of_its_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(13, 40, generator=g) * torch.logspace(-3, 1, 13)[:, None]  # rows of very different size
    w[4] = 0.0  # an all-zero row must not divide by zero
    q, scales = weight_int8.quantize_per_channel(w)
    assert q.dtype == torch.int8 and scales.shape == (13,)
    assert int(q.abs().max()) == 127 and scales[4] == 1.0 and not q[4].any()
    err = (weight_int8.dequantize(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-12).all()
    # the check can fail: a scale one step off breaks the bound on that row
    assert not ((weight_int8.dequantize(q, scales * 1.02) - w).abs() <= scales[:, None] / 2 + 1e-12).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (1, 5, 64)])
def test_an_installed_layer_computes_the_dequantized_product(dtype, shape):
    g = torch.Generator().manual_seed(1)
    layer = nn.Linear(64, 24, bias=True).to(dtype)
    x = torch.randn(*shape, generator=g).to(dtype)
    stock = layer(x)
    assert weight_int8.install(layer) == 1 and weight_int8.installed(layer)
    out = layer(x)
    assert out.dtype == dtype and out.shape == stock.shape
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, reference_linear(x, layer), **tol)
    # int8 is close to the layer's own product, and not the same: the kernel really runs
    torch.testing.assert_close(out.float(), stock.float(), rtol=0.1, atol=0.05)
    if dtype == torch.float32:
        assert not torch.equal(out, stock)
    weight_int8.uninstall(layer)
    assert not weight_int8.installed(layer)
    torch.testing.assert_close(layer(x), stock, rtol=0, atol=0)


@pytest.mark.parametrize("width", [8, 24, 64])
def test_widths_the_cpu_kernel_cannot_take_multiply_by_the_dequantized_weight(width):
    layer = nn.Linear(width, 4).to(torch.bfloat16)
    weight_int8.install(layer)
    assert weight_int8.fused_kernel_fits(layer._int8_weight) == (width % 32 == 0)
    x = torch.randn(2, width)
    out = layer(x)  # a float input to a bf16 layer is cast
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference_linear(x.bfloat16(), layer), rtol=2e-2, atol=2e-2)


def test_an_integer_layer_is_refused():
    with pytest.raises(SpecHeadsError, match="int8 drafting needs"):
        weight_int8.install(nn.Linear(8, 4).to(torch.float64))


def test_reference_is_f_linear_over_the_dequantized_weight():
    layer = nn.Linear(16, 8, bias=False)
    weight_int8.install(layer)
    x = torch.randn(3, 16)
    w = layer._int8_weight.float() * layer._int8_scales[:, None]
    torch.testing.assert_close(reference_linear(x, layer), F.linear(x, w))
