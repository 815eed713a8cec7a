"""What the MXNet and TensorFlow cluster trainers share: arguments, the global batch of a step and
each worker's shard of it, the per-process step log and the result file. numpy only.

Data position = the step: the global batch of step ``s`` is ``batch_indices(s, batch_size=B)``
(spot_training/training/datasets.py), whatever the worker count, so a generation that resumes at step ``s`` with
another number of workers still sees the same examples in the same order. Worker ``r`` of ``n``
takes ``numpy.array_split(global_batch, n)[r]``; the gradients are summed across workers and divided
by ``B``, which is the mean over the global batch (the same update as one process, up to summation order).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from spot_training.contract import ENV_GENERATION, ENV_NODE_ID, TRAINING_LOG_FILE, write_json_atomic
from spot_training.training.core import DEFAULT_EVERY_STEPS, default_every_steps
from spot_training.training.datasets import batch_indices, default_data_dir, default_log_dir, load_digits
from spot_training.training.training_log import append_csv, write_progress

__all__ = ["parse_args", "global_batch", "global_batch_size", "worker_shard", "StepLog", "write_result", "node_id",
           "generation", "pace", "run_and_exit", "flat_digits"]

STEP_LOG_FIELDS = ("step", "generation", "rank", "num_workers", "loss", "learning_rate", "wall_time")
#: The progress file the node agent reads and publishes (docs/contracts.md, "Signals and files between
#: agent and trainer"): rank 0 appends one row per step, whichever node holds rank 0 in a generation.
TRAINING_LOG = TRAINING_LOG_FILE
TRAINING_LOG_FIELDS = ("step", "generation", "num_workers", "loss", "learning_rate", "wall_time")


def parse_args(argv=None, *, description: str) -> argparse.Namespace:
    """Arguments of both cluster trainers (``--help`` lists them).

    Args:
        argv: the arguments without the program name; default ``sys.argv[1:]``.
        description: the trainer's description for ``--help``.

    Returns:
        the parsed namespace, ``save_every_steps`` filled from the environment when not given.

    Raises:
        SystemExit: 2, naming a bad value (argparse's ``error``).
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps (default 300)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size when --per-worker-batch is not set")
    p.add_argument("--per-worker-batch", type=int, default=0,
                   help="each worker adds this many examples (global batch = this x workers; default 0: off)")
    p.add_argument("--learning-rate", type=float, default=0.1, help="SGD (momentum 0.9) learning rate, default 0.1")
    p.add_argument("--scale-lr", action="store_true",
                   help="linear learning-rate scaling by worker count with warm-up (spot_training.training.distributed.lr)")
    p.add_argument("--warmup-steps", type=int, default=20, help="warm-up steps of --scale-lr (default 20)")
    p.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP (default 64)")
    p.add_argument("--save-every-steps", type=int, default=None,
                   help="checkpoint cadence in steps (0: off; default: $SPOT_TRAINING_CHECKPOINT_EVERY_STEPS or "
                        f"{DEFAULT_EVERY_STEPS})")
    p.add_argument("--min-step-seconds", type=float, default=0.0,
                   help="pace steps to take at least this long (tests and benchmarks: room for events)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=None, help="default $SPOT_TRAINING_DATA_DIR")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="default $SPOT_TRAINING_CHECKPOINT_DIR")
    p.add_argument("--log-dir", type=Path, default=None, help="default $SPOT_TRAINING_LOG_DIR")
    args = p.parse_args(argv)
    if args.save_every_steps is None:  # the node config's cadence (the agent's environment), else the contract's
        try:
            args.save_every_steps = default_every_steps()
        except ValueError as exc:
            p.error(str(exc))
    for name in ("steps", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("per_worker_batch", "warmup_steps", "save_every_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not args.learning_rate > 0:
        p.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    return args


def flat_digits(data_dir: Path | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``x_train, y_train, x_test, y_test`` of the digits (:func:`spot_training.training.datasets.load_digits`) with each
    8x8 image flattened to one row of 64 (the trainers' MLP input). ``data_dir``: default
    :func:`spot_training.training.datasets.default_data_dir`."""
    data_dir = data_dir or default_data_dir()
    x_train, y_train = load_digits(data_dir, "train", layout="NHWC")
    x_test, y_test = load_digits(data_dir, "test", layout="NHWC")
    return x_train.reshape(len(x_train), -1), y_train, x_test.reshape(len(x_test), -1), y_test


def global_batch_size(args: argparse.Namespace, num_workers: int) -> int:
    """Examples per optimizer step across all workers.

    Args:
        args: the namespace of :func:`parse_args` (``per_worker_batch``, ``batch_size``).
        num_workers: workers in the current group.

    Returns:
        ``per_worker_batch * num_workers`` when ``--per-worker-batch`` is set, else ``batch_size``.
    """
    return args.per_worker_batch * num_workers if args.per_worker_batch else args.batch_size


def global_batch(step: int, *, batch_size: int, n: int, seed: int) -> np.ndarray:
    """Indices (int64, (batch_size,)) of the global batch of ``step``.

    Args:
        step: the 0-based global step.
        batch_size: examples per global step.
        n: examples in the dataset.
        seed: permutation seed.

    Returns:
        int64 array of shape ``(batch_size,)`` (:func:`~spot_training.training.datasets.batch_indices`).

    Raises:
        ValueError: from :func:`~spot_training.training.datasets.batch_indices` (``batch_size > n``, ...).
    """
    return batch_indices(step, batch_size=batch_size, n=n, seed=seed)


def worker_shard(indices: np.ndarray, *, rank: int, num_workers: int) -> np.ndarray:
    """Worker ``rank``'s part of a global batch (``numpy.array_split``; sizes differ by at most one).

    Args:
        indices: the global batch's example indices, shape ``(global_batch,)``.
        rank: this worker, ``0 <= rank < num_workers``.
        num_workers: workers sharing the batch, ``<= len(indices)``.

    Returns:
        this worker's indices, a view of shape ``(about len(indices) / num_workers,)``.

    Raises:
        ValueError: unless ``0 <= rank < num_workers <= len(indices)``.
    """
    if not 0 <= rank < num_workers:
        raise ValueError(f"rank must be in 0..num_workers-1, got rank={rank}, num_workers={num_workers}")
    if num_workers > len(indices):
        raise ValueError(f"global batch of {len(indices)} cannot be split across {num_workers} workers; "
                         "raise --batch-size")
    return np.array_split(indices, num_workers)[rank]


def node_id() -> str:
    """This process's id in the step logs: the node's ``SPOT_TRAINING_NODE_ID`` (the instance id, set by
    the agent), else ``pid-<pid>``; with more than one process on a node (torchrun's
    ``LOCAL_WORLD_SIZE`` > 1) ``-<LOCAL_RANK>`` is appended, so no two processes share a file."""
    base = os.environ.get(ENV_NODE_ID) or f"pid-{os.getpid()}"
    if int(os.environ.get("LOCAL_WORLD_SIZE") or 1) > 1:
        return f"{base}-{os.environ.get('LOCAL_RANK', '0')}"
    return base


def generation() -> int:
    """The generation from ``SPOT_TRAINING_GENERATION`` (0 outside a cluster)."""
    return int(os.environ.get(ENV_GENERATION, "0"))


class StepLog:
    """``<log_dir>/steps-<node_id>.csv``: one flushed row per step this process ran
    (``step`` = completed steps after it, ``generation``, ``rank``, ``num_workers``, ``loss``,
    ``learning_rate``, ``wall_time`` in seconds since the epoch). Appends across generations.

    Rank 0 also appends the row to ``<log_dir>/training_log.csv`` (:data:`TRAINING_LOG_FIELDS`) and, with
    ``steps_total``, writes ``<log_dir>/progress.json`` once
    (:mod:`spot_training.training.training_log`): the progress the node agent publishes
    (docs/contracts.md), so ``spot-train status`` shows a cluster's step, loss and ETA.

    Args:
        log_dir: the directory (created if missing); default ``$SPOT_TRAINING_LOG_DIR``
            (:func:`~spot_training.training.datasets.default_log_dir`).
        steps_total: the job's total steps, written to ``progress.json`` by rank 0 (None: not written).
    """

    def __init__(self, log_dir: Path | None, *, steps_total: int | None = None) -> None:
        directory = Path(log_dir) if log_dir else default_log_dir()
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.path = directory / f"steps-{node_id()}.csv"
        self.steps_total = steps_total
        self._file, self._writer = append_csv(self.path, STEP_LOG_FIELDS)
        self._progress: tuple | None = None

    def write(self, *, step: int, rank: int, num_workers: int, loss: float, learning_rate: float) -> None:
        """Append one row for a completed step (rank 0 also to the training log).

        Args:
            step: completed steps after this one.
            rank: this process's rank.
            num_workers: workers in the current group.
            loss: the step's training loss.
            learning_rate: the learning rate the step used.
        """
        now = f"{time.time():.3f}"
        self._writer.writerow([step, generation(), rank, num_workers, f"{loss:.6f}", f"{learning_rate:.6g}", now])
        if rank != 0:
            return
        if self._progress is None:
            self._progress = append_csv(self.directory / TRAINING_LOG, TRAINING_LOG_FIELDS)
            if self.steps_total is not None:
                write_progress(self.directory, int(self.steps_total))
        self._progress[1].writerow([step, generation(), num_workers, f"{loss:.6f}", f"{learning_rate:.6g}", now])

    def close(self) -> None:
        """Close the step log (and rank 0's training log)."""
        self._file.close()
        if self._progress is not None:
            self._progress[0].close()


def write_result(log_dir: Path | None, payload: dict) -> Path:
    """Write ``<log_dir>/result.json`` atomically (:func:`spot_training.contract.write_json_atomic`; final step, test accuracy, ...).

    Args:
        log_dir: the directory; default ``$SPOT_TRAINING_LOG_DIR``.
        payload: a JSON-serializable dict (written with sorted keys).

    Returns:
        the path written.
    """
    directory = Path(log_dir) if log_dir else default_log_dir()
    path = directory / "result.json"
    write_json_atomic(path, payload)
    return path


def pace(started: float, min_seconds: float) -> None:
    """Sleep so that a step that began at ``started`` lasts at least ``min_seconds``.

    Args:
        started: the step's start, ``time.perf_counter()`` seconds.
        min_seconds: the shortest step, seconds (0: no sleep).
    """
    left = min_seconds - (time.perf_counter() - started)
    if left > 0:
        time.sleep(left)


def run_and_exit(main: Callable[[], int], *, hard_exit: bool) -> None:
    """Run ``main()`` and end the process with its status: 0..255 from ``main`` or its ``SystemExit``
    (Python's rule: ``None`` is 0, a non-int is 1), 1 after any other exception (traceback on stderr).

    ``hard_exit``: flush the logs and stdio, then ``os._exit`` instead of ``sys.exit``: the trainers use
    it where interpreter shutdown blocks in the framework's teardown after everything durable is done
    (the reasons are in each trainer's ``run``). Never returns.

    Args:
        main: the trainer's entry point, returning its exit status.
        hard_exit: see above.

    Raises:
        SystemExit: always (or the process ends in ``os._exit``).
    """
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report, then exit non-zero so the agent / torchrun sees the failure
        import traceback

        traceback.print_exc()
        code = 1
    if hard_exit:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
