"""Where and how a process computes: the torch device, its precision and the number of threads."""

from __future__ import annotations

import os

import torch

from fedmask_app.run.config import ConfigError, RunConfig


def pick_device(cfg: RunConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device = 'cuda' but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


def refuse_graphs_without_cuda(cfg: RunConfig, device: torch.device | None = None) -> None:
    """cuda-graphs = true where the clients would not train on CUDA, refused before anything starts
    (every client would fail). ``device``: where this process trains (the local engine); None: a
    launcher whose clients train on this machine (a Flower simulation, a sweep)."""
    on_cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
    if cfg.cuda_graphs and not on_cuda:
        where = device if device is not None else "this machine's CPU (it has no CUDA device)"
        raise ConfigError(f"cuda-graphs = true needs a CUDA device; this run would train on {where} "
                          "(set cuda-graphs = false)")


def streams_graphs_float32_warning(cfg: RunConfig, device: torch.device) -> str | None:
    """A warning for client-streams > 1 with cuda-graphs = true in float32 on CUDA: on an H200 a
    round of 10 clients x 500 images at bs 32 so configured never finished (tf32 and bf16 did), while
    tests/test_cuda.py's 3 streams, 4 clients and shards of 80 pass; the cause is unknown
    (docs/gpu/README.md, 2026-12-04). None for every other configuration."""
    if not (device.type == "cuda" and cfg.client_streams > 1 and cfg.cuda_graphs and cfg.precision == "float32"):
        return None
    return (f"[fedmask] warning: client-streams = {cfg.client_streams} with cuda-graphs = true in float32 hung on "
            "an H200 (10 clients x 500 images, bs 32; docs/gpu/README.md, 2026-12-04). Measured to run there: "
            "vectorize = true with cuda-graphs = true (the faster path), or precision = 'tf32' / 'bf16'.")


def given_cpus() -> int:
    """The CPUs this process was given: OMP_NUM_THREADS (Ray sets it for its tasks), else all."""
    return int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or os.cpu_count() or 1


def set_threads(cfg: RunConfig) -> None:
    """torch threads = ``threads``, or the CPUs the process was given."""
    threads = cfg.threads or given_cpus()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def model_dtype(cfg: RunConfig) -> torch.dtype:
    """float64 for the CPU reference precision, else float32 (bf16 is autocast inside training)."""
    return torch.float64 if cfg.precision == "float64" else torch.float32


def configure_precision(cfg: RunConfig, device: torch.device) -> None:
    """Set this process's matmul/convolution precision for ``precision``.

    float32 (default): TF32 off for matmuls and cuDNN convolutions (PyTorch lets cuDNN use TF32 by
    default, which moves every Δ_k at the 1e-3 level), cuDNN autotuning off, and deterministic
    algorithms: an operation without one raises, naming itself. tf32 and bf16 allow TF32 (bf16 also
    autocasts local training to bfloat16) and keep algorithms free. float64: CPU only.
    """
    strict = cfg.precision in ("float32", "float64")
    torch.backends.cuda.matmul.allow_tf32 = not strict
    torch.backends.cudnn.allow_tf32 = not strict
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = strict
    if device.type == "cuda":
        # cuBLAS needs a fixed workspace to be deterministic; read when CUDA's handle is created.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(strict)


def compute_setup(cfg: RunConfig) -> tuple[torch.device, torch.dtype]:
    """Threads, device and precision for a process that trains, evaluates or measures; returns
    the device and the dtype of models and inputs."""
    set_threads(cfg)
    device = pick_device(cfg)
    configure_precision(cfg, device)
    return device, model_dtype(cfg)
