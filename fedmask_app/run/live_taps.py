"""Convolutions that skip the kernel taps which only ever read zero padding (``skip-padding-taps``).

With torchvision's stem a 32×32 image reaches ResNet-18's last stage as a 2×2 map and then a 1×1
one, and a 3×3 convolution with padding 1 over a 1×1 map reads real input with its centre tap
alone: the other eight multiply zeros, forward and backward, yet cost as much as the centre
(layer4 is a third of a bs-32 step on a CPU). The same function is computed by the convolution
restricted to the taps that read real input ("live" taps), with the padding shrunk to match; and
when a single output position sees the whole input, by one matrix product. The weights keep their
shape; the skipped taps' gradient is exactly zero, as in the full convolution, so an SGD step
leaves them as it would. Only float rounding differs (the sums run in another order).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """Positions along one axis of a convolution's output (dilation 1)."""
    return (size + 2 * padding - kernel) // stride + 1


@functools.cache  # called at every forward with the same few shapes
def live_taps(size: int, kernel: int, stride: int, padding: int) -> tuple[int, int]:
    """The taps [first, stop) along one axis that read real input for some output position: tap
    t at output o reads input o·stride − padding + t, which must lie in [0, size). All taps
    (0, kernel) when none is live or when the kernel cut to them, with its padding shrunk by
    ``first``, would give another number of output positions."""
    positions = range(output_size(size, kernel, stride, padding))
    live = [t for t in range(kernel) if any(0 <= o * stride - padding + t < size for o in positions)]
    if not live:
        return 0, kernel
    first, stop = live[0], live[-1] + 1
    if output_size(size, stop - first, stride, padding - first) != len(positions):
        return 0, kernel
    return first, stop


class LiveTapConv2d(nn.Conv2d):
    """``nn.Conv2d`` (zero padding, dilation 1) whose forward uses only the live taps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        height, width = x.shape[-2:]
        r0, r1 = live_taps(height, kh, self.stride[0], ph)
        c0, c1 = live_taps(width, kw, self.stride[1], pw)
        if (r0, r1, c0, c1) == (0, kh, 0, kw):
            return self._convolve(x, self.weight, self.padding)
        padding = (ph - r0, pw - c0)
        if padding == (0, 0) and (r1 - r0, c1 - c0) == (height, width) and self.groups == 1:
            # one output position, and its taps cover the input: a matrix product (one tap: its
            # weights selected in one step, so that the backward fills one zero gradient, not two)
            weight = (self.weight.flatten(2).select(2, r0 * kw + c0) if (height, width) == (1, 1)
                      else self.weight[:, :, r0:r1, c0:c1].flatten(1))
            return F.linear(x.flatten(-3), weight, self.bias)[..., None, None]
        return self._convolve(x, self.weight[:, :, r0:r1, c0:c1], padding)

    def _convolve(self, x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
        return F.conv2d(x, weight, self.bias, self.stride, padding, 1, self.groups)


def use_live_taps(model: nn.Module) -> nn.Module:
    """Make every zero-padded, undilated ``nn.Conv2d`` of ``model`` a ``LiveTapConv2d`` in place: the
    same module and parameters (names, order, values), a forward that skips dead taps."""
    for module in model.modules():
        if (type(module) is nn.Conv2d and module.padding_mode == "zeros" and module.dilation == (1, 1)
                and not isinstance(module.padding, str)):
            module.__class__ = LiveTapConv2d
    return model
