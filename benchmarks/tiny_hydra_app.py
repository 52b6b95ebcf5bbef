"""The start-up reference: a trivial ``@hydra.main`` app that imports torch, as every rank does.

``python -m benchmarks.tiny_hydra_app hydra.run.dir=DIR``
"""

from __future__ import annotations

import hydra
import torch
from omegaconf import DictConfig


@hydra.main(config_path=None, version_base="1.3")
def main(cfg: DictConfig) -> None:
    print(f"torch {torch.__version__}, config {dict(cfg)}")


if __name__ == "__main__":
    main()
