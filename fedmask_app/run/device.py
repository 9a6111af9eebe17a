"""Where and how a process computes: the torch device and the number of threads."""

from __future__ import annotations

import os

import torch

from fedmask_app.run.config import RunConfig


def pick_device(cfg: RunConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device = 'cuda' but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


def set_threads(cfg: RunConfig) -> None:
    """torch threads = ``threads``, or the CPUs the process was given (Ray sets OMP_NUM_THREADS)."""
    threads = cfg.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or os.cpu_count() or 1
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
