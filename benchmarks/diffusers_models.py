"""remat.auto on diffusers models (a Stable Diffusion UNet, a DiT, a VAE) trained as users train
them (`remat.models.diffusion`), measured on this CPU: the table of benchmarks/hf_models.py (auto's
choice at store-all's peak, halfway and the lowest feasible budget; kept ops matched; held and peak
bytes measured / predicted; the largest gradient difference against the model without remat).

    python benchmarks/diffusers_models.py [--batch 2] [--size 16] [--out FILE] [MODEL ...]
"""

from __future__ import annotations

import argparse

from hf_models import rows, sweep

from remat.models.diffusion import MODELS, build_for_training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=MODELS)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=16, help="latent (VAE: image) side")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()

    def rows_of(name: str) -> list[str]:
        return rows(name, *build_for_training(name, batch=args.batch, size=args.size))

    sweep(args.models, rows_of, args.out)


if __name__ == "__main__":
    main()
