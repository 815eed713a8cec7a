"""Bridges for moto 5.2.5's gaps, applied inside our moto server process (work in progress)."""
from __future__ import annotations

from pathlib import Path


def apply(*, ebs_dir: Path) -> None:
    """Patch moto's backends in this process (the moto server's). Idempotent."""
    ebs_dir.mkdir(parents=True, exist_ok=True)
