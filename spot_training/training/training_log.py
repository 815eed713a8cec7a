"""The trainer's progress files (docs/contracts.md, "Progress"), written one way by every trainer here.

- ``<log dir>/training_log.csv``: one flushed row per step, appended across restarts, the header
  written only when the file is new or empty. The node agent publishes its last row (step, loss) and
  ``spot-train status`` shows it.
- ``<log dir>/progress.json``: ``{"steps_total": N}``, the total the agent publishes for an ETA,
  written atomically (:func:`spot_training.contract.write_json_atomic`), so the agent never reads half.

The example trainers use :class:`TrainingLog`; the cluster trainers'
:class:`~spot_training.training.distributed.common.StepLog` uses :func:`append_csv` and
:func:`write_progress` for their own columns.

Runs on Python 3.10 (the node's interpreter).
"""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from spot_training.contract import PROGRESS_FILE, TRAINING_LOG_FILE, write_json_atomic
from spot_training.training.datasets import default_log_dir

__all__ = ["EXAMPLE_LOG_FIELDS", "TrainingLog", "append_csv", "write_progress"]

#: The example trainers' columns: completed steps, the step's epoch (0-based), its training loss and
#: accuracy (0..1) and the wall time in seconds since the epoch.
EXAMPLE_LOG_FIELDS = ("step", "epoch", "loss", "accuracy", "wall_time")


def append_csv(path: str | os.PathLike[str], fields: Sequence[str]) -> tuple[TextIO, Any]:
    """Open a CSV log for appending, one flushed line per row (line-buffered), so a kill loses no row.

    Args:
        path: the CSV file; its directory must exist.
        fields: the header, written when the file is new or empty (a resumed run appends below the rows
            of the run before).

    Returns:
        ``(file, csv.writer)``; the caller closes the file.

    Raises:
        OSError: the file cannot be opened.
    """
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    handle = open(path, "a", newline="", buffering=1)
    writer = csv.writer(handle)
    if new:
        writer.writerow(fields)
    return handle, writer


def write_progress(log_dir: str | os.PathLike[str], steps_total: int) -> Path:
    """Write ``<log_dir>/progress.json`` = ``{"steps_total": steps_total}`` atomically.

    Args:
        log_dir: the log directory; it must exist.
        steps_total: the job's total optimizer steps, >= 1.

    Returns:
        the file's path.

    Raises:
        ValueError: ``steps_total`` is not a positive integer.
        OSError: the file cannot be written.
    """
    if isinstance(steps_total, bool) or not isinstance(steps_total, int) or steps_total < 1:
        raise ValueError(f"steps_total must be an integer >= 1 (the job's total steps), got {steps_total!r}")
    path = Path(log_dir) / PROGRESS_FILE
    write_json_atomic(path, {"steps_total": steps_total})
    return path


class TrainingLog:
    """An example trainer's ``training_log.csv`` (:data:`EXAMPLE_LOG_FIELDS`) and ``progress.json``.

    Only one process of a job writes it (rank 0 of a ``torchrun`` job). Usable as a context manager.

    Args:
        log_dir: the directory, created if missing; default ``$SPOT_TRAINING_LOG_DIR``
            (:func:`~spot_training.training.datasets.default_log_dir`).
        steps_total: the job's total optimizer steps, written to ``progress.json`` (None: not written).

    Attributes:
        path: the CSV file.

    Raises:
        ValueError: a bad ``steps_total``.
        OSError: the directory or a file cannot be written.
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, *, steps_total: int | None = None) -> None:
        directory = Path(log_dir) if log_dir else default_log_dir()
        directory.mkdir(parents=True, exist_ok=True)
        if steps_total is not None:
            write_progress(directory, steps_total)
        self.path = directory / TRAINING_LOG_FILE
        self._file, self._writer = append_csv(self.path, EXAMPLE_LOG_FIELDS)

    def write(self, step: int, epoch: int, loss: float, accuracy: float) -> None:
        """Append one flushed row, stamped with the wall time.

        Args:
            step: completed optimizer steps after this one.
            epoch: the step's epoch, 0-based.
            loss: the step's training loss.
            accuracy: the step's training accuracy, 0..1.
        """
        self._writer.writerow([step, epoch, f"{float(loss):.6f}", f"{float(accuracy):.6f}", f"{time.time():.3f}"])

    def close(self) -> None:
        """Close the CSV file (again: nothing)."""
        self._file.close()

    def __enter__(self) -> "TrainingLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
