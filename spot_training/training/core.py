"""The framework-neutral checkpoint driver: cadence, notices, background writes, restore, stop, finish.

Every training front-end (Keras ``ResumableFit``, the custom TensorFlow loop, MXNet Gluon, PyTorch)
runs the same loop logic, the way ``tf.train.CheckpointManager`` owns its schedule while the
framework owns the bytes. The split:

* :class:`StateAdapter` (one per framework, in its own module, importing its framework):
  captures the training state into host memory at a step boundary (:meth:`StateAdapter.snapshot`),
  hands back a function that writes those bytes into a directory on the writer thread, and reads a
  checkpoint back into the live objects (:meth:`StateAdapter.load`). It captures every random-number
  generator state its framework has. Nothing else.
* :class:`CheckpointDriver` (here, standard library only): when to save (every N steps and/or every
  T seconds, on SIGUSR1 or the request file, on SIGTERM), one background writer with at most one
  write in flight, the atomic verified keep-N store (spot_training/training/store.py), restore with fallback past
  a torn or corrupt newest checkpoint, the Python ``random`` and numpy global generator states (so
  that a script that draws augmentation from them resumes bitwise), stop and finish semantics, and
  the ``COMPLETED`` marker (docs/contracts.md).

The loop every front-end gets::

    driver = CheckpointDriver(adapter, steps_per_epoch=spe)
    for step in driver.steps(total_steps):     # restores, then yields 0-based global steps still to run
        train_one_step(step)                   # the data of step ``step`` is a function of ``step``
    # after the last step: final checkpoint (waited for), then COMPLETED

Stop semantics (SIGTERM, the spot interruption notice relayed by the node agent): the current step
finishes, a checkpoint at that step is written and waited for, then ``SystemExit(0)`` ends the
script, so code after the loop never runs on a half-trained model. A stop that arrives before the
first step exits 0 without writing (the restored state is already on disk). Outside a step (a
validation pass, callbacks, code inside :meth:`CheckpointDriver.outside_step`) a stop is not left
waiting for the next boundary: the notice watcher saves the last completed step's state and ends
the process at once (see :meth:`CheckpointDriver.begin_step`; docs/training.md, "A notice in any
phase").

What a SIGKILL can lose: the steps since the last committed checkpoint, that is at most
``every_steps`` plus the steps that ran while the newest write was still in flight (a write that a
kill interrupts leaves the previous checkpoint as the newest valid one).

Settings and their one default: ``every_steps`` defaults to ``$SPOT_TRAINING_CHECKPOINT_EVERY_STEPS``
or :data:`DEFAULT_EVERY_STEPS` (50); ``every_seconds`` to ``$SPOT_TRAINING_CHECKPOINT_EVERY_SECONDS``
or None (off); the directory to ``$SPOT_TRAINING_CHECKPOINT_DIR`` or ``/dltraining/checkpoints``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from spot_training import contract
from spot_training.training.datasets import default_checkpoint_dir
from spot_training.training.notice import NoticeHandler, SaveSchedule
from spot_training.training.store import (
    BackgroundSaver,
    Checkpoint,
    CheckpointError,
    CheckpointPathError,
    CheckpointStore,
    MIN_KEEP,
    check_int,
    write_file,
)

__all__ = [
    "CHECKPOINT_MISMATCH_EXIT_CODE",
    "CHECKPOINT_STORAGE_EXIT_CODE",
    "EXIT_PEER_STOPPED",
    "cadence_flag",
    "add_checkpoint_arguments",
    "check_checkpoint_arguments",
    "check_positive_arguments",
    "checkpoint_exit_code",
    "run_script",
    "CheckpointDriver",
    "CheckpointDiskFullError",
    "DriverFront",
    "DEFAULT_EVERY_STEPS",
    "DEFAULT_KEEP",
    "EVERY_SECONDS_ENV",
    "EVERY_STEPS_ENV",
    "HOST_RNG_FILE",
    "StateAdapter",
    "check_writable",
    "warn_not_exact",
    "default_every_seconds",
    "default_every_steps",
    "renamed_option",
    "stop_exit_code",
]

EVERY_STEPS_ENV = contract.ENV_CHECKPOINT_EVERY_STEPS
EVERY_SECONDS_ENV = contract.ENV_CHECKPOINT_EVERY_SECONDS
#: Steps between checkpoints when neither the caller nor the environment says otherwise (the
#: contract's one default of ``checkpoint_every_steps``).
DEFAULT_EVERY_STEPS = contract.default("checkpoint_every_steps")
#: Checkpoints kept in the directory (>= 2, so that a corrupt newest one has a predecessor).
DEFAULT_KEEP = 3
#: File holding the Python ``random`` and numpy global generator states inside a checkpoint.
HOST_RNG_FILE = "host_rng.json"
#: Seconds a stop notice that arrives during a run's first step waits for that step's boundary
#: before the trainer exits without saving (nothing completed yet; the first step may be a long
#: trace or compile).
FIRST_STEP_GRACE_S = 0.5
#: Marks "use the environment or the documented default" (None means "off" for the cadence).
DEFAULT: Any = object()
#: Exit status of a trainer whose checkpoint storage is full or unusable (docs/contracts.md, "Trainer
#: exit codes"): the node agent's supervisor does not restart it, since every restart would fail the
#: same way.
CHECKPOINT_STORAGE_EXIT_CODE = contract.EXIT_CHECKPOINT_STORAGE
#: Exit status of a trainer whose checkpoint cannot serve this job (another framework's, another
#: adapter's, another model's): permanent as well; nothing in the directory is changed.
CHECKPOINT_MISMATCH_EXIT_CODE = contract.EXIT_CHECKPOINT_MISMATCH
#: Exit status of a torchrun worker that stopped only because ANOTHER rank was asked to (an agreed
#: stop: a spot notice or a membership restart on another node) while its own torchrun may restart
#: it (``$TORCHELASTIC_MAX_RESTARTS`` > 0). Non-zero on purpose: torchrun then counts a worker-group
#: failure and re-rendezvouses (the group continues from the agreed checkpoint without the leaver),
#: where a 0 would end this node's torchrun and close the rendezvous for good
#: (torch/distributed/launcher/api.py). 75 = EX_TEMPFAIL ("try again"). docs/contracts.md.
EXIT_PEER_STOPPED = contract.EXIT_PEER_STOPPED


class CheckpointDiskFullError(CheckpointError, OSError):
    """A save ran out of space. The message names the directory, the bytes the save needed (when
    known) and the bytes free; the previous checkpoints are untouched."""


def _env_setting(env: str, name: str) -> int | float | None:
    """``$env`` checked by the contract's validator for setting ``name`` (the one the stack and the
    agent run), or None when unset or empty. ValueError names the variable, the value and the range."""
    raw = os.environ.get(env, "").strip()
    return contract.check(name, raw, label=f"${env}") if raw else None


def default_every_steps() -> int:
    """``$SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`` (an integer >= 1) or the contract's default (50).
    ValueError names a bad value."""
    value = _env_setting(EVERY_STEPS_ENV, "checkpoint_every_steps")
    return DEFAULT_EVERY_STEPS if value is None else int(value)


def default_every_seconds() -> float | None:
    """``$SPOT_TRAINING_CHECKPOINT_EVERY_SECONDS`` (seconds, the contract's range) or None (no
    time-based saves, the contract's default). ValueError names a bad value."""
    value = _env_setting(EVERY_SECONDS_ENV, "checkpoint_every_seconds")
    return None if value is None else float(value)


def renamed_option(options: dict, old: str, new: str, value: Any, *, owner: str, unset: Any = DEFAULT) -> Any:
    """Accept a deprecated keyword: pop ``old`` from ``options`` and return its value.

    Warns with a ``DeprecationWarning`` that names ``new``.

    Args:
        options: the caller's ``**kwargs`` (changed: ``old`` is removed).
        old: the deprecated keyword.
        new: the keyword that replaces it (same meaning).
        value: the value given for ``new``.
        owner: the function or class named in the warning and the error.
        unset: the sentinel meaning ``new`` was not given (default :data:`DEFAULT`).

    Returns:
        ``value`` when ``old`` was not given, else the value given for ``old``.

    Raises:
        TypeError: both names are given with different values.
    """
    if old not in options:
        return value
    old_value = options.pop(old)
    warnings.warn(f"{owner}: {old!r} is deprecated; use {new!r} (same meaning)", DeprecationWarning, stacklevel=3)
    if value is not unset and value != old_value:
        raise TypeError(f"{owner}: give {new!r} or the deprecated {old!r}, not both. "
                        f"Received: {new}={value!r}, {old}={old_value!r}")
    return old_value


def cadence_flag(value: float | None) -> Any:
    """Turn a command-line cadence flag (``--save-every-steps``/``--save-every-seconds``) into a
    :class:`CheckpointDriver` argument: None (flag not given) -> :data:`DEFAULT` (the environment,
    else the documented default), 0 -> None (off), any other value -> itself."""
    if value is None:
        return DEFAULT
    return value or None


def add_checkpoint_arguments(parser: Any) -> None:
    """Add the flags every example trainer shares to an ``argparse.ArgumentParser``: the cadence
    ``--save-every-steps`` (0: off) and ``--save-every-seconds`` with no default of their own (None:
    the agent's environment, else the contract's default; pass them through :func:`cadence_flag`),
    ``--keep`` (checkpoints kept, default :data:`DEFAULT_KEEP`), ``--sync`` (synchronous saves), and
    ``--data-dir`` / ``--checkpoint-dir`` / ``--log-dir`` (default: the ``SPOT_TRAINING_*`` environment).
    Check them after parsing with :func:`check_checkpoint_arguments`."""
    parser.add_argument("--save-every-steps", type=int, default=None,
                        help=f"checkpoint cadence in steps (0: off; default: ${EVERY_STEPS_ENV} or {DEFAULT_EVERY_STEPS})")
    parser.add_argument("--save-every-seconds", type=float, default=None,
                        help=f"checkpoint cadence in seconds (default: ${EVERY_SECONDS_ENV} or off)")
    parser.add_argument("--keep", type=int, default=DEFAULT_KEEP, help=f"checkpoints kept (>= {MIN_KEEP}, default {DEFAULT_KEEP})")
    parser.add_argument("--sync", action="store_true", help="synchronous saves (default: background)")
    parser.add_argument("--data-dir", type=Path, default=None, help="default $SPOT_TRAINING_DATA_DIR")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="default $SPOT_TRAINING_CHECKPOINT_DIR")
    parser.add_argument("--log-dir", type=Path, default=None, help="default $SPOT_TRAINING_LOG_DIR")


def add_length_arguments(parser: Any, *, steps: bool = True, epochs: int = 5, batch_size: int = 32) -> None:
    """Add how long and in what batches an example trainer trains to an ``argparse.ArgumentParser``.

    ``--epochs`` (default ``epochs``) and, with ``steps``, ``--steps`` (total optimizer steps; default:
    ``--epochs`` worth), mutually exclusive; ``--batch-size`` (default ``batch_size``, examples per step on
    each process). Check them after parsing with :func:`parse_trainer_arguments`.

    Args:
        parser: the parser.
        steps: also offer ``--steps``; default true.
        epochs: ``--epochs``' default; default 5.
        batch_size: ``--batch-size``' default; default 32.
    """
    length = parser.add_mutually_exclusive_group()
    if steps:
        length.add_argument("--steps", type=int, help="total optimizer steps (default: --epochs worth)")
    length.add_argument("--epochs", type=int, default=epochs,
                        help=f"total epochs{' when --steps is not given' if steps else ''} (default {epochs})")
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help=f"examples per step on each process (default {batch_size})")


def parse_trainer_arguments(parser: Any, argv: Any, *positive: str) -> Any:
    """Parse ``argv`` and check the flags of :func:`add_checkpoint_arguments` and :func:`add_length_arguments`.

    Args:
        parser: the ``argparse.ArgumentParser``.
        argv: the arguments (None: ``sys.argv[1:]``).
        positive: the destinations that must be >= 1 when given (:func:`check_positive_arguments`);
            ``steps``, ``epochs`` and ``batch_size`` are always checked.

    Returns:
        the parsed namespace.

    Raises:
        SystemExit: 2, naming a bad value (or for ``--help``: 0).
    """
    args = parser.parse_args(argv)
    check_positive_arguments(parser, args, *(name for name in ("steps", "epochs", "batch_size")
                                              if hasattr(args, name) and name not in positive), *positive)
    check_checkpoint_arguments(parser, args)
    return args


def check_checkpoint_arguments(parser: Any, args: Any) -> None:
    """Exit 2 through ``parser.error`` naming a bad flag of :func:`add_checkpoint_arguments`.

    Args:
        parser: the ``argparse.ArgumentParser`` the flags were added to.
        args: its parsed namespace.

    Raises:
        SystemExit: 2, for ``--keep`` below :data:`~spot_training.training.store.MIN_KEEP` (2) or a cadence outside
            the contract's range (``checkpoint_every_steps``, ``checkpoint_every_seconds``) other than 0 (off).
    """
    if args.keep < MIN_KEEP:
        parser.error(f"--keep must be >= {MIN_KEEP} (a corrupt newest checkpoint needs an older one to fall back to), "
                     f"got {args.keep}")
    # The cadence flags take the contract's range, the one the agent's environment variables are checked
    # against, or 0 (off): a negative, NaN or too large value exits here, not in the driver as a crash.
    for flag, setting in (("save_every_steps", "checkpoint_every_steps"), ("save_every_seconds", "checkpoint_every_seconds")):
        value = getattr(args, flag)
        if value is not None and value != 0:
            try:
                contract.check(setting, value, label=f"--{flag.replace('_', '-')}")
            except contract.SettingError as error:
                parser.error(f"{error}, or 0 (off)")


def check_positive_arguments(parser: Any, args: Any, *names: str) -> None:
    """Exit 2 through ``parser.error`` naming the first of ``names`` (argparse destinations such as
    ``"batch_size"``, checked in that order) whose value is below 1; ``None`` (an optional flag not
    given) passes. For a trainer's own counts (epochs, steps, batch size, threads).

    Args:
        parser: the ``argparse.ArgumentParser`` that parsed ``args``.
        args: its parsed namespace.
        names: the destinations to check, in order.

    Raises:
        SystemExit: 2, naming the first value below 1.
    """
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def checkpoint_exit_code(err: BaseException) -> int | None:
    """The trainer's exit status for a checkpoint error that no restart can fix (docs/contracts.md):
    74 (:data:`CHECKPOINT_STORAGE_EXIT_CODE`) when the storage is full or unusable
    (:class:`CheckpointDiskFullError`, :class:`~spot_training.training.store.CheckpointPathError`), 78
    (:data:`CHECKPOINT_MISMATCH_EXIT_CODE`) for any other :class:`~spot_training.training.store.CheckpointError`
    (another framework's, adapter's or model's checkpoint), None for anything else. Scripts use it as
    ``except CheckpointError as err: log; return checkpoint_exit_code(err)``."""
    if isinstance(err, (CheckpointDiskFullError, CheckpointPathError)):
        return CHECKPOINT_STORAGE_EXIT_CODE
    if isinstance(err, CheckpointError):
        return CHECKPOINT_MISMATCH_EXIT_CODE
    return None


def stop_exit_code(own_signal: bool, environ: dict[str, str] | None = None) -> int:
    """The exit status of a rank after an agreed stop (the checkpoint is written and every rank met).

    0 when this process got the stop signal itself (its launcher or agent is going away anyway), or
    when it does not run under a torchrun that can restart it. :data:`EXIT_PEER_STOPPED` (75) when it
    stopped only because a peer asked (``own_signal`` False) and it runs under torchrun with restarts
    allowed: ``$TORCHELASTIC_RUN_ID`` set and ``$TORCHELASTIC_MAX_RESTARTS`` > 0 (the variables
    torchrun's agent sets for each worker). With ``--max-restarts=0`` (torchrun's default, e.g.
    ``--standalone``) no restart can follow, so such a rank exits 0 as a single process does.
    ``environ`` defaults to ``os.environ``.

    Args:
        own_signal: this process got the stop signal itself (not only a peer's stop).
        environ: the environment to read (default ``os.environ``).

    Returns:
        0 or :data:`EXIT_PEER_STOPPED` (75).
    """
    env = os.environ if environ is None else environ
    if own_signal or not env.get("TORCHELASTIC_RUN_ID"):
        return 0
    try:
        max_restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        max_restarts = 0
    return EXIT_PEER_STOPPED if max_restarts > 0 else 0


def run_script(train: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a training script's ``train(argv) -> status`` and turn a checkpoint error that no restart
    can fix into its exit status (:func:`checkpoint_exit_code`: 74 or 78, docs/contracts.md), logged
    with the error's class and message (which name the path). Other exceptions propagate (a crash,
    which the node agent restarts with backoff).

    Args:
        train: the script's ``train(argv) -> exit status``.
        argv: the arguments passed to ``train`` (default None: ``sys.argv[1:]``).

    Returns:
        ``train``'s status, or 74/78 after a :class:`~spot_training.training.store.CheckpointError`.
    """
    try:
        return train(argv)
    except CheckpointError as err:
        code = checkpoint_exit_code(err)
        logging.getLogger("spot_training.training").error("%s (exit %d, restarting will not help): %s",
                                            type(err).__name__, code, err)
        return code


def check_writable(directory: str | os.PathLike) -> Path:
    """Create ``directory`` if needed and prove this process can create, write and remove a file in it.

    Returns:
        the directory as a Path.

    Raises:
        CheckpointPathError: naming the path, the user id and the reason (not a directory, a parent
            is a file, read-only, permission denied), before any training step ran, so that a bad
            directory is found at start and not one save interval later.
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointPathError(f"checkpoint directory {str(path)!r} exists and is not a directory; "
                                  "pass a directory path (it is created if missing) or move the file away")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=path)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            try:
                os.unlink(probe)
            except FileNotFoundError:
                pass  # removed by another node's cleanup of the shared directory: the write already proved it
    except (FileExistsError, NotADirectoryError) as err:
        raise CheckpointPathError(
            f"cannot create checkpoint directory {str(path)!r}: a parent path is a file ({err})") from err
    except OSError as err:
        raise CheckpointPathError(
            f"checkpoint directory {str(path)!r} is not writable by this process (uid {os.getuid()}): "
            f"{err.strerror or err}; give the training user write access or choose another directory "
            f"(${'SPOT_TRAINING_CHECKPOINT_DIR'} or the checkpoint_dir option)") from err
    return path


class StateAdapter:
    """What one framework contributes to :class:`CheckpointDriver` (subclass it per framework).

    Class attributes: ``framework`` (the store's framework name: ``tensorflow``, ``mxnet`` or
    ``pytorch``; a checkpoint of another framework raises FrameworkMismatchError on restore),
    ``adapter`` (a name recorded in each manifest's metadata) and ``adapter_format`` (an integer
    bumped when the files change incompatibly). ``is_writer``: False on ranks of a distributed job
    that do not write (rank 0 writes; every rank restores).
    """

    framework: str = ""
    adapter: str = ""
    adapter_format: int = 1
    is_writer: bool = True
    #: The driver may take a stop checkpoint on its watcher thread while the main thread is outside
    #: a step (validation, callbacks, data loading): the adapter's :meth:`snapshot` must then work
    #: from any thread. Distributed adapters (whose :meth:`agree` is overridden) never do: every rank
    #: must save at the same step boundary.
    saves_outside_step: bool = True
    #: The host buffers of the last two snapshots (see :meth:`host_copy`); freed by :meth:`release`.
    host_buffers: list | tuple = (None, None)
    _next_buffer: int = 0

    def framework_version(self) -> str:
        """Recorded in each manifest (e.g. ``torch 2.5.1``)."""
        return ""

    def snapshot(self, directory: Path) -> Callable[[], dict | None] | None:
        """Capture the state at this step boundary, on the training thread, into host memory
        (reused buffers), and return a function that writes it into ``directory`` (an empty
        temporary directory of the store). The driver runs that function on its writer thread in
        background mode, inline otherwise; it may return ``{relative path: {"size", "sha256"}}`` for
        files written with :func:`spot_training.training.store.write_file`. After :meth:`snapshot` returns, the
        training thread may change the live state: the captured copy must not change with it."""
        raise NotImplementedError

    def load(self, ckpt: Checkpoint) -> None:
        """Read ``ckpt`` into the live objects. Check every shape first and raise
        ShapeMismatchError (naming the path and the variable) before changing anything."""
        raise NotImplementedError

    def metadata(self) -> dict:
        """Extra JSON-serialisable metadata for each manifest (beside adapter and format)."""
        return {}

    def check_metadata(self, ckpt: Checkpoint) -> None:
        """Raise CheckpointError when ``ckpt`` was not written by this adapter and format."""
        meta = ckpt.metadata
        if meta.get("adapter") != self.adapter or meta.get("adapter_format") != self.adapter_format:
            raise CheckpointError(
                f"checkpoint {str(ckpt.path)!r} was not written by the {self.adapter!r} adapter (metadata "
                f"adapter={meta.get('adapter')!r}, adapter_format={meta.get('adapter_format')!r}; expected "
                f"{self.adapter!r}, {self.adapter_format}); use another checkpoint directory")

    def after_restore(self, ckpt: Checkpoint | None) -> None:
        """Called on every rank after restore (``ckpt`` None: fresh start), e.g. a broadcast."""

    def before_save(self) -> None:
        """Called on every rank (writer or not) when a checkpoint is about to be taken, before
        :meth:`snapshot` runs on the writer: a distributed job gathers per-rank state (e.g. each
        rank's random-number generator states) to the writer here. Default: nothing."""

    def at_step(self, step: int) -> None:
        """Called before the step that follows ``step`` completed steps runs: after :meth:`restore`
        and after every :meth:`CheckpointDriver.after_step` that does not stop. For a generator
        whose state cannot be read back (MXNet's), re-seed it here from ``(seed, step)`` so the
        draws of every step are the same in an interrupted and an uninterrupted run."""

    def agree(self, stop: bool, checkpoint: bool) -> tuple[bool, bool]:
        """Distributed jobs: combine every rank's stop and checkpoint requests (logical OR) so all
        ranks save and stop at the same step. Called after every step; single process: identity.

        Args:
            stop: this rank wants to stop (a notice arrived).
            checkpoint: this rank wants a checkpoint at this step.

        Returns:
            ``(stop, checkpoint)`` as every rank agreed.
        """
        return stop, checkpoint

    def barrier(self) -> None:
        """Distributed jobs: wait for every rank (after the final or the stop checkpoint)."""

    def host_copy(self, capture: Callable[[Any], Any], buffers_of: Callable[[Any], Any] = lambda copy: copy) -> Any:
        """Copy the state into host memory for :meth:`snapshot`, reusing the buffers of the save
        before last: the last save's copy may still be being written by the background writer, so
        two sets of buffers are used in turn (allocated by the first two saves).

        Args:
            capture: ``capture(buffers)`` copies the live state into ``buffers`` (None at the first
                two saves: allocate) and returns the copy.
            buffers_of: the buffers of a copy, to reuse two saves later (default: the copy itself).

        Returns:
            What ``capture`` returned.
        """
        buffers, slot = list(self.host_buffers), self._next_buffer
        copy = capture(buffers[slot])
        buffers[slot] = buffers_of(copy)
        self.host_buffers, self._next_buffer = buffers, 1 - slot
        return copy

    def release(self) -> None:
        """Free host buffers (the driver closed)."""
        self.host_buffers = [None, None]


_NOT_EXACT_WARNED: set[str] = set()


def warn_not_exact(cause: str, message: str, *, logger: logging.Logger | None = None) -> bool:
    """Log one WARNING ``resume is not exact: <message>`` per ``cause`` and process, when an adapter
    sees that a resumed run cannot be bitwise equal to an uninterrupted one (the message names the
    cause and the documented fix). Returns True when it logged.

    Args:
        cause: a short key for the cause; each is logged once per process.
        message: the warning's text after ``resume is not exact:``.
        logger: default ``logging.getLogger("spot_training.training.core")``.

    Returns:
        True when it logged, False when ``cause`` was logged before.
    """
    if cause in _NOT_EXACT_WARNED:
        return False
    _NOT_EXACT_WARNED.add(cause)
    (logger or logging.getLogger("spot_training.training.core")).warning("resume is not exact: %s", message)
    return True


def _capture_host_rng() -> dict:
    import numpy as np

    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": {"version": version, "state": list(state), "gauss_next": gauss},
            "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}


def _restore_host_rng(payload: dict) -> None:
    import numpy as np

    py = payload["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = payload["numpy"]
    np.random.set_state((npy["kind"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))


def _directory_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


class CheckpointDriver:
    """Checkpoint schedule, notices, background writer, restore, stop and finish for one adapter.

    Args:
        adapter: the framework's :class:`StateAdapter`.
        checkpoint_dir: default ``$SPOT_TRAINING_CHECKPOINT_DIR`` or ``/dltraining/checkpoints``.
            Checked at construction (created if missing, a file is written and removed): a file,
            a read-only directory or a missing permission raise CheckpointPathError naming the path.
        every_steps: save when the completed step count is a multiple of it (>= 1; None: off).
            Default ``$SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`` or 50.
        every_seconds: also save when this many seconds passed since the last save (> 0; None: off).
            Default ``$SPOT_TRAINING_CHECKPOINT_EVERY_SECONDS`` or None.
        background: write on a background thread (default True); the training thread only takes the
            host snapshot. False writes inside :meth:`save`.
        keep: checkpoints kept, >= 2 (default 3).
        steps_per_epoch: records each checkpoint's epoch (default None: epoch 0); a checkpoint
            written with another value raises ValueError on restore (the data position would differ).
        notices: a :class:`NoticeHandler` (default: SIGTERM stops, SIGUSR1 and
            ``$SPOT_TRAINING_CHECKPOINT_REQUEST_FILE`` request a checkpoint), installed by
            :meth:`steps` or :meth:`install`.
        host_rng: also checkpoint the Python ``random`` and numpy global generator states (default True).
        metadata: optional callable returning a JSON-serialisable dict stored as the manifest's
            ``metadata["user"]``.
        logger: default ``logging.getLogger("spot_training.training.core")``.

    Class attribute ``storage_exit_code``: when set (the Keras, TF-loop and Gluon front-ends set
    :data:`CHECKPOINT_STORAGE_EXIT_CODE`, 74), :meth:`steps` turns a CheckpointDiskFullError into
    ``SystemExit`` with that status (:meth:`storage_exit`); None (the default) lets it propagate.

    Attributes: ``step`` (completed steps: the data position), ``restored`` (the checkpoint restored
    from, or None), ``last_saved_step``, ``save_seconds`` (training-thread seconds per save).
    """

    storage_exit_code: int | None = None

    def __init__(
        self,
        adapter: StateAdapter,
        *,
        checkpoint_dir: str | os.PathLike | None = None,
        every_steps: int | None = DEFAULT,
        every_seconds: float | None = DEFAULT,
        background: bool = True,
        keep: int = DEFAULT_KEEP,
        steps_per_epoch: int | None = None,
        notices: NoticeHandler | None = None,
        host_rng: bool = True,
        metadata: Callable[[], dict] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                            or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be an integer >= 1 or None. Received: steps_per_epoch={steps_per_epoch!r}")
        for name, value in (("background", background), ("host_rng", host_rng)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False. Received: {name}={value!r}")
        self.adapter = adapter
        self.log = logger or logging.getLogger("spot_training.training.core")
        with self.storage_exit():  # a front-end with storage_exit_code exits 74 naming the path
            directory = check_writable(checkpoint_dir if checkpoint_dir is not None else default_checkpoint_dir())
        self.store = CheckpointStore(directory, framework=adapter.framework,
                                     framework_version=adapter.framework_version(), keep=keep, logger=self.log)
        self.schedule = SaveSchedule(
            every_steps=default_every_steps() if every_steps is DEFAULT else every_steps,
            every_seconds=default_every_seconds() if every_seconds is DEFAULT else every_seconds)
        self.background = background
        self.saver: BackgroundSaver | None = BackgroundSaver(self.store) if background else None
        self.steps_per_epoch = steps_per_epoch
        self.notices = notices if notices is not None else NoticeHandler()
        self.host_rng = host_rng
        self.user_metadata = metadata
        self.step = 0
        self.restored: Checkpoint | None = None
        self.last_saved_step: int | None = None
        self.save_seconds: list[float] = []
        self._closed = False
        # Phases (see :meth:`begin_step`): the main thread holds _step_lock while the live state may
        # differ from the state after the last completed step; the notice watcher takes it to save.
        self._step_lock = threading.Lock()
        self._holding = False      # the main thread holds _step_lock
        self._ready = False        # restored and checked: self.step is the live state's step
        self._start_step = 0       # the step this run started from
        self._body_done = False    # inside outside_step(): the current step's update is complete
        self._stopping = False     # someone is taking the stop checkpoint
        self._session = False      # begin() ran: the watcher acts (not for the low-level API alone)
        self.watch_phases = adapter.saves_outside_step and type(adapter).agree is StateAdapter.agree
        #: Set True inside a step of :meth:`steps` to end training after it (early stopping): that
        #: step's checkpoint and ``COMPLETED`` are written as after the last step.
        self.stop_training = False

    # ------------------------------------------------------------------ state
    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self.store.directory

    def epoch_of(self, step: int) -> int:
        """Epoch (0-based) that the step after ``step`` completed steps belongs to."""
        return step // self.steps_per_epoch if self.steps_per_epoch else 0

    def manifest_metadata(self) -> dict:
        """adapter, adapter_format, steps_per_epoch, the adapter's own metadata and ``user``."""
        meta: dict[str, Any] = {"adapter": self.adapter.adapter, "adapter_format": self.adapter.adapter_format,
                                "steps_per_epoch": self.steps_per_epoch, **self.adapter.metadata()}
        if self.user_metadata is not None:
            meta["user"] = self.user_metadata()
        return meta

    # ------------------------------------------------------------------ restore
    def restore(self) -> int:
        """Load the newest valid checkpoint; return the completed steps (0 when there is none).

        Torn or corrupt newer checkpoints are skipped with a warning (the store's fallback). Runs on
        every rank of a distributed job, then :meth:`StateAdapter.after_restore`.

        Raises:
            FrameworkMismatchError: the newest checkpoint was written by another framework.
            CheckpointError: it was written by another adapter or format.
            ShapeMismatchError: it does not fit the model (message names path and variable).
            ValueError: it was written with another ``steps_per_epoch``.
            Nothing is changed or deleted on disk in any of these cases.
        """
        def read(ckpt: Checkpoint) -> None:
            self.adapter.check_metadata(ckpt)
            saved_spe = ckpt.metadata.get("steps_per_epoch")
            if None not in (saved_spe, self.steps_per_epoch) and saved_spe != self.steps_per_epoch:
                raise ValueError(
                    f"checkpoint {str(ckpt.path)!r} was written with steps_per_epoch={saved_spe}, this run has "
                    f"{self.steps_per_epoch}; the data position would not match (same data and batch size, "
                    "or another checkpoint directory)")
            self.adapter.load(ckpt)
            rng_file = ckpt.path / HOST_RNG_FILE
            if self.host_rng and rng_file.is_file():
                _restore_host_rng(json.loads(rng_file.read_text(encoding="utf-8")))

        # Boot phases (bench/bench_boot.py): this line ends the framework import and model build,
        # the "restored"/"no checkpoint" line below ends the restore.
        self.log.info("looking for a checkpoint under %s", self.directory)
        ckpt = self.store.restore(read)
        self.adapter.after_restore(ckpt)
        self.restored = ckpt
        self.step = ckpt.step if ckpt is not None else 0
        self.last_saved_step = ckpt.step if ckpt is not None else None
        if ckpt is not None:
            self.log.info("restored %s: step %d, epoch %d", ckpt.path, ckpt.step, ckpt.epoch)
        else:
            self.log.info("no checkpoint under %s: starting at step 0", self.directory)
        self.adapter.at_step(self.step)
        return self.step

    # ------------------------------------------------------------------ save
    def _disk_full(self, err: OSError, tmp: Path | None, step: int | None = None) -> CheckpointDiskFullError:
        needed = _directory_bytes(tmp) if tmp is not None and tmp.exists() else None
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            free = None
        return CheckpointDiskFullError(
            errno.ENOSPC,
            f"no space left writing a checkpoint at step {self.step if step is None else step} into {str(self.directory)!r}: "
            f"{'%d bytes written before the device filled' % needed if needed is not None else 'size unknown'}, "
            f"{'%d bytes free' % free if free is not None else 'free space unknown'}; the previous checkpoints are "
            "intact; free space or give the checkpoint directory a larger volume")

    def save(self, *, wait: bool = False) -> Checkpoint | None:
        """Checkpoint the state at :attr:`step` (call between steps).

        Background mode: the adapter's host snapshot now, the write on the writer thread (returns
        None unless ``wait``, then the committed checkpoint). Synchronous mode: writes and returns
        the checkpoint. A step already saved is not written again. Ranks that do not write return
        None.

        Raises:
            CheckpointDiskFullError: ENOSPC: names the directory, bytes written and free; committed
                checkpoints stay as they were.
            Exception: what the adapter or the file system raise; committed checkpoints stay as they
                were.
        """
        started = time.perf_counter()
        if self.last_saved_step == self.step:
            return self.saver.wait() if (wait and self.saver is not None) else None
        step, epoch = self.step, self.epoch_of(self.step)
        ckpt = None
        self.adapter.before_save()
        if self.adapter.is_writer:
            try:
                ckpt = self._write(step, epoch, wait)
            except OSError as err:
                if err.errno == errno.ENOSPC and not isinstance(err, CheckpointDiskFullError):
                    raise self._disk_full(err, None) from err
                raise
        self.last_saved_step = step
        self.schedule.saved()
        self.save_seconds.append(time.perf_counter() - started)
        return ckpt

    def _write(self, step: int, epoch: int, wait: bool) -> Checkpoint | None:
        meta = self.manifest_metadata()
        if self.saver is not None:
            self.saver.wait()  # one write at a time: the adapter's buffers of the last save are free
        tmp = self.store.begin(step)
        try:
            rng = _capture_host_rng() if self.host_rng else None
            write = self.adapter.snapshot(tmp)
        except BaseException:
            self.store.abort(tmp)
            raise

        def finish() -> dict:
            try:
                written = dict((write() if write is not None else None) or {})
                if rng is not None:
                    written[HOST_RNG_FILE] = write_file(tmp / HOST_RNG_FILE, [json.dumps(rng).encode()])
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise self._disk_full(err, tmp, step) from err
                raise
            return written

        if self.saver is not None:
            self.saver.submit_prepared(tmp, finish, step=step, epoch=epoch, metadata=meta)
            return self.saver.wait() if wait else None
        try:
            written = finish()
        except BaseException:
            self.store.abort(tmp)
            raise
        return self.store.commit(tmp, step=step, epoch=epoch, metadata=meta, written=written)

    def wait(self) -> Checkpoint | None:
        """Wait for a background write; return the last checkpoint written (None if none)."""
        return self.saver.wait() if self.saver is not None else None

    # ------------------------------------------------------------------ loop
    def install(self) -> "CheckpointDriver":
        """Install the notice handlers (SIGTERM, SIGUSR1) and, for a single-process job, the stop
        watcher (:meth:`_on_stop_notice`); must run on the main thread."""
        self.notices.install()
        if self.watch_phases:
            self.notices.add_stop_watcher(self._on_stop_notice)
        return self

    def begin(self, total_steps: int) -> int:
        """Start a run: install the handlers, restore, check the checkpoint against ``total_steps``.

        From here on a stop notice outside a step is saved and acted on at once (:meth:`begin_step`). The
        caller checks :meth:`stopped_before_start` before its first step (a stop before it needs no save).

        Args:
            total_steps: the whole training's steps, >= 1.

        Returns:
            the completed steps restored (0: fresh).

        Raises:
            ValueError: ``total_steps`` is not an integer >= 1, or the checkpoint is past it.
            CheckpointError: as :meth:`restore`.
        """
        check_int("total_steps", total_steps, 1)
        self._session = True
        self.install()
        start = self.restore()
        if start > total_steps:
            raise ValueError(
                f"checkpoint {str(self.restored.path)!r} is at step {start}, past total_steps={total_steps}; "
                "raise total_steps (epochs) or use another checkpoint directory")
        self._start_step = start
        self._ready = True
        return start

    def stopped_before_start(self, total_steps: int) -> bool:
        """After :meth:`begin`: whether a stop notice came before the first step (e.g. during the
        framework's import), logged. The restored checkpoint (or the untrained start) is then
        already the state on disk, so there is nothing new to save.

        Args:
            total_steps: the run's total, as given to :meth:`begin` (a finished run never stops).

        Returns:
            True when the run should stop now, without a save.
        """
        if self.step < total_steps and self.notices.stop_requested:
            self.log.info("stop requested before the first step; nothing to save (step %d)", self.step)
            return True
        return False

    # ------------------------------------------------------------------ phases
    # A stop notice is heard at once by the notice watcher thread (NoticeHandler.add_stop_watcher).
    # Inside a step (between begin_step and end_step) the live state is half-updated, so the step
    # boundary acts on it (after_step). Outside one (validation, callbacks, an evaluation loop, the
    # gap before the next fetch) the live state IS the state after the last completed step: the
    # watcher takes the step lock (so no new step starts), saves it, and ends the process.
    def begin_step(self) -> None:
        """Mark the start of a step on the main thread (blocks while the watcher saves and exits)."""
        if self.watch_phases and not self._holding:
            self._step_lock.acquire()
            self._holding = True
        self._body_done = False

    def end_step(self) -> None:
        """Mark the end of a step (after :meth:`after_step`): the state is the completed step's."""
        if self._holding:
            self._holding = False
            self._step_lock.release()

    @contextlib.contextmanager
    def outside_step(self) -> Iterator[None]:
        """Inside a step of :meth:`steps`, after its optimizer update: declare that the code within
        (an evaluation pass, logging, a slow callback) changes no checkpointed state, so a stop
        notice that arrives meanwhile is saved at once, as the state after this step, instead of
        waiting for the step to end. The evaluation is abandoned and the process exits 0."""
        if not self._holding:
            yield
            return
        self._body_done = True
        self.end_step()
        try:
            yield
        finally:
            self.begin_step()
            self._body_done = True

    def _exit_now(self, code: int, message: str, *args: Any) -> None:
        self.log.info(message, *args)
        for handler in logging.getLogger().handlers + self.log.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        # os._exit: the main thread may be inside a C call for a long time (a validation pass, a first
        # trace); the checkpoint is committed and fsynced, so nothing is lost by not unwinding it.
        os._exit(code)

    def _on_stop_notice(self) -> None:
        """The watcher thread's reaction to a stop notice (see the comment above :meth:`begin_step`)."""
        if not self._session:
            return  # install()/restore()/after_step() used by hand: the step boundary acts, as documented
        grace = time.monotonic() + FIRST_STEP_GRACE_S
        while not (self._closed or self._stopping):
            if not self._step_lock.acquire(timeout=0.05):
                if (self._ready and self.step == self._start_step and not self._body_done
                        and time.monotonic() > grace):
                    # Still inside the run's first step (often its first trace or compile): nothing
                    # was completed since the start, whose state is on disk (or untrained): exit now.
                    # The grace lets a first step that had already finished its update reach its
                    # boundary and save it.
                    self._exit_now(0, "stop requested (signal %s) during the first step; nothing to save "
                                   "(step %d), exiting 0", self.notices.stop_signal, self.step)
                continue
            try:
                if self._closed or self._stopping:
                    return
                if not self._ready or (self.step == self._start_step and not self._body_done):
                    self._exit_now(0, "stop requested (signal %s) before the first step (startup, restore); "
                                   "nothing to save (step %d), exiting 0", self.notices.stop_signal, self.step)
                self._save_and_exit()
                return
            finally:
                self._step_lock.release()

    def _save_and_exit(self) -> None:
        previous = self.step
        self._stopping = True
        self.step = previous + (1 if self._body_done else 0)
        try:
            self.save(wait=True)
        except CheckpointDiskFullError as err:
            code = self.storage_exit_code if self.storage_exit_code is not None else CHECKPOINT_STORAGE_EXIT_CODE
            self.log.error("%s; exiting %d (checkpoint storage full)", err, code)
            self._exit_now(code, "stop checkpoint failed")
        except Exception:
            self.log.exception("the stop checkpoint outside a step failed; the next step boundary tries again")
            self.step, self._stopping = previous, False
            return
        self._exit_now(0, "stop requested (signal %s) outside a step: checkpoint at step %d written, exiting 0",
                       self.notices.stop_signal, self.step)

    def after_step(self, *, exit_on_stop: bool = True, count: bool = True) -> bool:
        """Count one completed step, then save if due, requested, or a stop was requested.

        On a stop request the checkpoint is written and waited for, every rank meets at
        :meth:`StateAdapter.barrier`, then ``SystemExit(stop_exit_code(...))`` is raised (0, or
        :data:`EXIT_PEER_STOPPED` on a torchrun rank that a peer's stop stopped) (``exit_on_stop=True``, the
        default) or True returned. Returns False otherwise. ``count=False``: the caller already
        advanced :attr:`step` (Keras counts in its first callback and saves in its last).

        Args:
            exit_on_stop: raise ``SystemExit`` on a stop (default True); False returns True instead.
            count: advance :attr:`step` by one first (default True).

        Returns:
            True when a stop was handled and ``exit_on_stop`` is False; False otherwise.

        Raises:
            SystemExit: after a stop's checkpoint, with :func:`stop_exit_code`'s status.
        """
        if count:
            self.step += 1
        self._body_done = False
        own = self.notices.stop_requested
        stop, requested = self.adapter.agree(own, self.notices.consume_checkpoint_request())
        if stop:
            self._stopping = True
            self.save(wait=True)
            self.adapter.barrier()
            code = stop_exit_code(own)
            self.log.info("stop requested (%s): checkpoint at step %d written, exiting %d",
                          f"signal {self.notices.stop_signal}" if own else "by another rank", self.step, code)
            self.close()
            if exit_on_stop:
                raise SystemExit(code)
            return True
        if requested or self.schedule.due(self.step):
            if requested:
                self.log.info("checkpoint requested at step %d", self.step)
            self.save()
        self.adapter.at_step(self.step)
        return False

    def finish(self) -> Checkpoint | None:
        """Write the final checkpoint (waited for), then ``COMPLETED``; return the checkpoint
        (None on ranks that do not write).

        Raises:
            CheckpointError: the final checkpoint is not in the directory.
        """
        ckpt = self.save(wait=True)
        if self.adapter.is_writer:
            if ckpt is None or ckpt.step != self.step:
                ckpt = self.store.latest()
            if ckpt is None or ckpt.step != self.step:
                raise CheckpointError(f"final checkpoint at step {self.step} is not in {str(self.directory)!r}; "
                                      "not writing COMPLETED")
            self.store.mark_complete(step=self.step, epoch=self.epoch_of(self.step))
            self.log.info("training complete at step %d; wrote %s", self.step, self.directory / contract.COMPLETED_FILE)
        self.adapter.barrier()
        return ckpt

    def complete(self) -> Checkpoint | None:
        """:meth:`finish` on the main thread after the last step (a stop notice meanwhile waits for it:
        the final checkpoint holds every step); returns the final checkpoint."""
        self.begin_step()
        self._ready = False
        return self.finish()

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (a new run needs a new driver)."""
        return self._closed

    def close(self) -> None:
        """Wait for a pending write, stop the writer thread, uninstall the handlers, free buffers.
        Idempotent; a later :meth:`save` writes synchronously."""
        if self._closed:
            return
        self._closed = True
        self._ready = False
        self.end_step()
        try:
            if self.saver is not None:
                saver, self.saver = self.saver, None
                saver.close()
        finally:
            self.adapter.release()
            self.notices.remove_stop_watcher(self._on_stop_notice)
            self.notices.uninstall()

    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield the 0-based global step indices from the restored step up to ``total_steps - 1``.

        Installs the notice handlers, restores, and calls :meth:`after_step` after each yielded step
        (saves on cadence/request; on SIGTERM saves and raises SystemExit(0)). After the last step:
        :meth:`finish`, then :meth:`close`. A directory whose newest checkpoint is at
        ``total_steps`` yields nothing (and writes COMPLETED if it is missing).

        Raises:
            ValueError: ``total_steps`` is not an integer >= 1, or the checkpoint is past it.
        """
        check_int("total_steps", total_steps, 1)
        try:
            start = self.begin(total_steps)
            if self.stopped_before_start(total_steps):
                raise SystemExit(0)
            with self.storage_exit():
                for step in range(start, total_steps):
                    self.begin_step()
                    try:
                        yield step
                    except GeneratorExit:
                        self.log.error(
                            "the loop over steps() was left during step %d of %d (break, return or an exception): "
                            "no final checkpoint and no COMPLETED were written, so a restart re-runs the steps since "
                            "the last checkpoint; to end training early set stop_training = True on the "
                            "checkpointer inside the step instead of break", step, total_steps)
                        raise
                    self.after_step()
                    self.end_step()
                    if self.stop_training:
                        self.log.info("stop_training set at step %d of %d; treating it as the end", self.step,
                                      total_steps)
                        break
                self.complete()
        finally:
            self.close()

    @contextlib.contextmanager
    def storage_exit(self) -> Iterator[None]:
        """Turn a checkpoint error that no restart can fix into ``SystemExit`` with the contract's
        status (:func:`checkpoint_exit_code`: 74 for full or unusable storage, 78 for a checkpoint
        of another framework, adapter or model), after logging its class and message (which name
        the path, and for a full disk the bytes needed and free), so the node agent does not
        restart a trainer that would fail the same way. For the front-ends that set
        ``storage_exit_code`` (Keras, the TF loop, Gluon); a no-op when it is None."""
        try:
            yield
        except CheckpointError as err:
            code = checkpoint_exit_code(err)
            if self.storage_exit_code is None or code is None:
                raise
            if code == CHECKPOINT_STORAGE_EXIT_CODE:
                code = self.storage_exit_code
            self.log.error("%s (exit %d, restarting will not help): %s", type(err).__name__, code, err)
            raise SystemExit(code) from err


class DriverFront:
    """The state of a front-end that holds its :class:`CheckpointDriver` in ``driver`` rather than
    being one (Keras's ``ResumableFit``, PyTorch's ``TorchCheckpointer``), under the driver's names."""

    driver: CheckpointDriver

    @property
    def step(self) -> int:
        """Completed optimizer steps (the data position)."""
        return self.driver.step

    @property
    def restored(self) -> Checkpoint | None:
        """The checkpoint restored from, or None (fresh start or not restored yet)."""
        return self.driver.restored

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self.driver.directory

    @property
    def store(self) -> CheckpointStore:
        """The driver's :class:`~spot_training.training.store.CheckpointStore`."""
        return self.driver.store

    @property
    def schedule(self) -> SaveSchedule:
        """The driver's save cadence (replaceable, e.g. by a benchmark's own schedule)."""
        return self.driver.schedule

    @schedule.setter
    def schedule(self, value: SaveSchedule) -> None:
        self.driver.schedule = value
