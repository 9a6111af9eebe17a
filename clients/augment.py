"""Data augmentation of a client's shard: the usual CIFAR recipe, drawn from a seeded generator.

``crop_flip`` is torchvision's ``RandomCrop(32, padding=4)`` followed by
``RandomHorizontalFlip()``, applied to every image of a batch with its own draws, but from the
generator it is given (torchvision's transforms draw from torch's global generator), so that a
client's augmented images depend only on its shard and its seed.
"""

from __future__ import annotations

import torch

AUGMENTATIONS = ("none", "crop-flip")
CROP_PADDING = 4


def crop_flip(images: torch.Tensor, generator: torch.Generator, fill: torch.Tensor,
              padding: int = CROP_PADDING) -> torch.Tensor:
    """Each image of ``images`` (N, C, H, W): an H×W crop of the image padded by ``padding`` pixels of
    ``fill`` (C values, one per channel) on every side, at an offset (dy, dx) uniform in
    {0..2·padding}², then mirrored left–right with probability 1/2. Draws, all from ``generator`` (a
    CPU generator): N offsets (dy, dx), then N flips."""
    n, channels, height, width = images.shape
    offsets = torch.randint(0, 2 * padding + 1, (n, 2), generator=generator)
    flips = torch.randint(0, 2, (n,), generator=generator).bool()
    padded = fill.to(images.device, images.dtype).view(1, channels, 1, 1).repeat(
        n, 1, height + 2 * padding, width + 2 * padding)
    padded[:, :, padding : padding + height, padding : padding + width] = images
    rows = offsets[:, :1] + torch.arange(height)  # (N, H): the padded rows each crop reads
    cols = offsets[:, 1:] + torch.arange(width)
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    rows, cols = rows.to(images.device), cols.to(images.device)
    batch = torch.arange(n, device=images.device)
    # advanced indices on dims 0, 2, 3 around a slice: the result is (N, H, W, C)
    return padded[batch[:, None, None], :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()
