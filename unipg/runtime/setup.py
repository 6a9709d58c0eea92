"""What every run does first, in either mode: seed the generators, set the threads, make its folder."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import torch

from unipg.config import Config


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)  # a reduction split across threads may sum in a different order


def run_dir_for(config: Config) -> Path:
    """A fresh folder for the run; an existing run is never appended to or overwritten."""
    root = Path(config.log.output_dir)
    if config.log.run_name:
        run_dir = root / config.log.run_name
        if any((run_dir / name).exists() for name in ("metrics.jsonl", "config.yaml", "checkpoints")):
            raise ValueError(f"run directory '{run_dir}' already holds a run; choose another log.run_name "
                             "or move that run away")
        return run_dir
    subject = config.task.name if config.is_lm else config.env.id
    stem = f"{config.algorithm}-{subject}-seed{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir, suffix = root / stem, 1
    while run_dir.exists():
        suffix += 1
        run_dir = root / f"{stem}-{suffix}"
    return run_dir


def set_threads(config: Config) -> None:
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    elif config.model.name.startswith("embedded"):
        torch.set_num_threads(1)
