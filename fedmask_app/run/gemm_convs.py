"""Convolutions as one matrix product over image patches (``gemm-convs``).

With ``vectorize = true`` a cohort's forward runs under ``torch.func.vmap`` over the clients'
stacked weights, and vmap turns a convolution whose weights differ from client to client into a
grouped convolution, one group a client. On an H200 cuDNN ran those group by group: the
data-gradient kernel of a 10-client bs-32 step took 12× one client's, the forward 10× (the
float32 step profile of 2026-12-04, docs/gpu). The same convolution written as patches · Wᵀ —
each output position's input patch gathered into a row (``Tensor.unfold`` views and one copy) —
is a matrix product, which vmap batches into one batched GEMM for all clients; its backward is
two more and one scatter-add of the patches' gradient (``unfold``'s backward). The same function
and parameters; the sums run in another order, so float rounding differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedmask_app.run.live_taps import LiveTapConv2d, output_size


def conv2d_as_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int],
                   padding: tuple[int, int]) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding)`` (zero padding, dilation 1, one group) as one
    matrix product: rows = the (N · H_out · W_out) input patches, each C · kh · kw long, in the
    order of ``weight.flatten(1)``'s columns."""
    n, channels, height, width = x.shape
    out_channels, _, kh, kw = weight.shape
    (sh, sw), (ph, pw) = stride, padding
    oh, ow = output_size(height, kh, sh, ph), output_size(width, kw, sw, pw)
    if torch.is_autocast_enabled(x.device.type):
        # F.linear would cast the patches to autocast's dtype; casting the input first gives the
        # same values and gathers a copy half the size (the patches are up to kh·kw times the input)
        x = x.to(torch.get_autocast_dtype(x.device.type))
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    patches = x.unfold(2, kh, sh).unfold(3, kw, sw)  # (N, C, H_out, W_out, kh, kw), a view
    rows = patches.permute(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, channels * kh * kw)
    out = F.linear(rows, weight.flatten(1), bias)  # (N · H_out · W_out, C_out)
    # NCHW in NCHW's strides, so that downstream ops take their usual kernels: a channels-last view
    # (a 1×1 map's permuted view included, which counts as contiguous) sent adaptive_avg_pool2d
    # down a path whose vmap rule is a loop over the clients
    if oh * ow == 1:
        return out.view(n, out_channels, 1, 1)
    return out.view(n, oh, ow, out_channels).permute(0, 3, 1, 2).contiguous()


class GemmConv2d(nn.Conv2d):
    """``nn.Conv2d`` (zero padding, dilation 1, one group) computed by ``conv2d_as_gemm``."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return conv2d_as_gemm(input, weight, bias, self.stride, self.padding)


class LiveTapGemmConv2d(LiveTapConv2d):
    """``LiveTapConv2d`` whose convolution over the live taps is ``conv2d_as_gemm``."""

    def _convolve(self, x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
        return conv2d_as_gemm(x, weight, self.bias, self.stride, padding)


def use_gemm_convs(model: nn.Module) -> nn.Module:
    """Make every zero-padded, undilated, ungrouped convolution of ``model`` compute by
    ``conv2d_as_gemm``, in place: ``nn.Conv2d`` becomes ``GemmConv2d`` and ``LiveTapConv2d``
    (skip-padding-taps) ``LiveTapGemmConv2d``; the same modules and parameters (names, order,
    values). Other convolutions keep their forward."""
    swaps = {nn.Conv2d: GemmConv2d, LiveTapConv2d: LiveTapGemmConv2d}
    for module in model.modules():
        if (type(module) in swaps and module.padding_mode == "zeros" and module.dilation == (1, 1)
                and module.groups == 1 and not isinstance(module.padding, str)):
            module.__class__ = swaps[type(module)]
    return model
