"""skip-padding-taps: convolutions restricted to their live taps compute the full convolution (the
whole model: tests/test_gemm_convs.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmask_app.run.live_taps import LiveTapConv2d, live_taps, use_live_taps


@pytest.mark.parametrize(("size", "kernel", "stride", "padding", "expected"), [
    (1, 3, 1, 1, (1, 2)),  # a 1×1 map: the centre tap alone
    (2, 3, 2, 1, (1, 3)),  # layer4's first convolution on a 2×2 map: one output, taps 1 and 2
    (2, 3, 1, 1, (0, 3)),  # every tap reads input at some output
    (8, 3, 1, 1, (0, 3)),
    (1, 7, 2, 3, (3, 4)),  # the 7×7 stem on one pixel
    (4, 7, 2, 3, (1, 7)),  # outputs at 0 and 2: tap 0 reads -3 and -1 only
    (5, 1, 1, 0, (0, 1)),
])
def test_live_taps_by_hand(size, kernel, stride, padding, expected):
    assert live_taps(size, kernel, stride, padding) == expected


def _pair(in_ch, out_ch, kernel, stride, padding, groups=1, bias=False):
    torch.manual_seed(0)
    full = nn.Conv2d(in_ch, out_ch, kernel, stride, padding, groups=groups, bias=bias).double()
    live = nn.Conv2d(in_ch, out_ch, kernel, stride, padding, groups=groups, bias=bias).double()
    live.load_state_dict(full.state_dict())
    use_live_taps(live)
    assert type(live) is LiveTapConv2d
    return full, live


@pytest.mark.parametrize(("in_ch", "out_ch", "kernel", "stride", "padding", "size", "groups", "bias"), [
    (8, 6, 3, 1, 1, 1, 1, False),  # 1×1 map: the matrix-product path
    (8, 6, 3, 2, 1, 2, 1, True),  # 2×2 map, stride 2: the matrix-product path over 4 taps
    (8, 6, 7, 2, 3, 4, 1, False),  # cropped convolution with shrunk padding
    (8, 6, 3, 1, 1, 1, 2, True),  # grouped: cropped convolution
    (8, 6, 3, 1, 1, 5, 1, False),  # nothing to skip: the full convolution
    (8, 6, 3, 2, 1, 3, 1, False),
])
def test_live_tap_convolution_equals_the_full_one(in_ch, out_ch, kernel, stride, padding, size, groups, bias):
    """Values, input gradient and weight gradient equal in float64; the skipped taps' gradient is
    exactly zero, as in the full convolution."""
    full, live = _pair(in_ch, out_ch, kernel, stride, padding, groups, bias)
    x = torch.randn(4, in_ch, size, size, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y_full, y_live = full(x), live(x2)
    assert y_live.shape == y_full.shape
    torch.testing.assert_close(y_live, y_full, rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(y_full)
    y_full.backward(upstream)
    y_live.backward(upstream)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(live.weight.grad, full.weight.grad, rtol=1e-12, atol=1e-12)
    r0, r1 = live_taps(size, kernel, stride, padding)
    dead = torch.ones(kernel, kernel, dtype=torch.bool)
    dead[r0:r1, r0:r1] = False
    assert torch.equal(live.weight.grad[:, :, dead], torch.zeros_like(live.weight.grad[:, :, dead]))


def test_a_one_pixel_map_takes_no_convolution(monkeypatch):
    """The 1×1 case is a matrix product: the full convolution is never called."""
    _, live = _pair(8, 6, 3, 1, 1)

    def refuse(*args, **kwargs):
        raise AssertionError("the full convolution ran")

    monkeypatch.setattr(nn.Conv2d, "_conv_forward", refuse)
    monkeypatch.setattr(F, "conv2d", refuse)
    live(torch.randn(2, 8, 1, 1, dtype=torch.float64))
