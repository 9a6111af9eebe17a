"""gemm-convs: a convolution computed as one matrix product over image patches is the convolution;
so is every model built with gemm-convs and/or skip-padding-taps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from fedmask_app.run.gemm_convs import GemmConv2d, LiveTapGemmConv2d, conv2d_as_gemm, use_gemm_convs
from fedmask_app.run.live_taps import LiveTapConv2d
from fedmask_app.run.model import build_model


@pytest.mark.parametrize(("in_ch", "out_ch", "kernel", "stride", "padding", "size", "bias"), [
    (8, 6, 3, 1, 1, (5, 5), False),  # ResNet's 3×3 convolutions
    (8, 6, 3, 2, 1, (5, 7), True),  # stride 2 on an odd, non-square map
    (3, 6, 7, 2, 3, (32, 32), False),  # torchvision's stem
    (8, 6, 1, 2, 0, (4, 4), False),  # a downsampling shortcut: 1×1, stride 2, no padding
    (8, 6, 3, 1, 1, (1, 1), True),  # a 1×1 map: eight of nine taps read padding
    (3, 4, 5, 1, 2, (6, 3), True),  # the FedAvg CNN's 5×5 "same" convolutions
])
def test_conv2d_as_gemm_is_the_convolution(in_ch, out_ch, kernel, stride, padding, size, bias):
    """Values, input gradient, weight and bias gradients equal F.conv2d's in float64."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, in_ch, *size, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(out_ch, in_ch, kernel, kernel, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(out_ch, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = [t for t in (x, w, b) if t is not None]
    expected = F.conv2d(x, w, b, stride, padding)
    got = conv2d_as_gemm(x, w, b, (stride, stride), (padding, padding))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    for g, e in zip(torch.autograd.grad(got, inputs, upstream), torch.autograd.grad(expected, inputs, upstream),
                    strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_under_bf16_autocast_it_is_the_convolution_in_bf16():
    """Under autocast (precision = "bf16"), the output is bf16 like F.conv2d's and as close to the
    float32 convolution, and it equals patches and weights cast to bf16 before their product."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 6, 6, generator=gen)
    w = torch.randn(6, 8, 3, 3, generator=gen) / 8
    exact = F.conv2d(x.double(), w.double(), None, 1, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv, gemm = F.conv2d(x, w, None, 1, 1), conv2d_as_gemm(x, w, None, (1, 1), (1, 1))
    assert gemm.dtype == conv.dtype == torch.bfloat16
    cast = conv2d_as_gemm(x.bfloat16(), w.bfloat16(), None, (1, 1), (1, 1))
    assert torch.equal(gemm, cast)
    scale = exact.abs().max()
    assert (gemm.double() - exact).abs().max() / scale < 2e-2
    assert (gemm.double() - exact).abs().max() <= 2 * (conv.double() - exact).abs().max() + 1e-3 * scale


def test_only_plain_convolutions_are_swapped():
    """Ungrouped, undilated, zero-padded convolutions become GemmConv2d; others keep their forward."""
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1, groups=2),
                          nn.Conv2d(4, 4, 3, padding=2, dilation=2), nn.Conv2d(4, 4, 3, padding="same"),
                          nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"))
    use_gemm_convs(model)
    assert [type(m) for m in model] == [GemmConv2d, nn.Conv2d, nn.Conv2d, nn.Conv2d, nn.Conv2d]


@pytest.mark.parametrize("name", ["resnet18-gn", "resnet18-gn-cifar", "cnn-fedavg"])
@pytest.mark.parametrize(("skip_padding_taps", "gemm_convs", "swapped"), [
    (True, False, LiveTapConv2d), (False, True, GemmConv2d), (True, True, LiveTapGemmConv2d),
], ids=["live-taps", "gemm-convs", "live-taps-gemm-convs"])
def test_every_way_of_computing_the_convolutions_is_the_same_model(name, skip_padding_taps, gemm_convs, swapped):
    """skip-padding-taps, gemm-convs and both: every convolution swapped, the same parameters
    (names, order, values) and, in float64, the same loss and gradients as the plain model."""
    torch.manual_seed(3)
    plain = build_model(name).double()
    torch.manual_seed(3)
    other = build_model(name, skip_padding_taps, gemm_convs).double()
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in other.named_parameters()]
    assert sum(type(m) is swapped for m in other.modules()) == sum(isinstance(m, nn.Conv2d) for m in plain.modules())
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.tensor([0, 3, 5, 9])
    losses = [F.cross_entropy(m(x), y) for m in (plain, other)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for p, q in zip(plain.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.filterwarnings("error::UserWarning")  # vmap warns when an op falls back to a loop over the batch
def test_under_vmap_over_clients_no_convolution_runs(monkeypatch):
    """The point of gemm-convs: a cohort's forward over stacked per-client weights (as
    clients/vectorized.py runs it) calls no convolution, whose vmap rule would be a grouped one,
    takes no op that vmap runs client by client, and gives each client its own model's logits."""
    torch.manual_seed(0)
    clients = [build_model("resnet18-gn", gemm_convs=True).double() for _ in range(3)]
    stacked, _ = stack_module_state(clients)
    x = torch.randn(3, 2, 3, 32, 32, dtype=torch.float64)
    alone = torch.stack([m(x[k]) for k, m in enumerate(clients)])

    def refuse(*args, **kwargs):
        raise AssertionError("a convolution ran")

    monkeypatch.setattr(nn.Conv2d, "_conv_forward", refuse)
    monkeypatch.setattr(F, "conv2d", refuse)
    together = vmap(lambda params, images: functional_call(clients[0], params, (images,)))(stacked, x)
    torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-12)
