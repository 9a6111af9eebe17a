"""Write the CIFAR-10 subset that travels with the repo tree to a GPU machine (the full file does not).

The first ``--train`` training and ``--test`` test images of the verified full set, as
``cifar10-subset.npz`` (fedmask_app.run.data.write_subset: it carries ``subset_of`` and its own
content sha256) in ``--out`` (default ``.gpu-data/``, git-ignored). The defaults, 12,000 and
2,000 images, make a file of about 40 MB; pass the folder with the device tool's carry option.

    python benchmarks/gpu_subset.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedmask_app.run.data import SUBSET_FILE_NAME, load_dataset, resolve_data_dir, write_subset

DEFAULT_OUT = Path(__file__).resolve().parents[1] / ".gpu-data"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data", help="folder with the full cifar10.npz")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="folder the subset file is written to")
    parser.add_argument("--train", type=int, default=12000, help="first N training images")
    parser.add_argument("--test", type=int, default=2000, help="first N test images")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Write the subset and print its path, size and hash; return the path."""
    args = parse_args(argv)
    full = load_dataset(resolve_data_dir(args.data_dir))
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / SUBSET_FILE_NAME
    digest = write_subset(full, path, args.train, args.test)
    print(f"{path}: {args.train} train + {args.test} test images, {path.stat().st_size / 2**20:.1f} MiB, "
          f"content sha256 {digest}")
    return path


if __name__ == "__main__":
    main()
