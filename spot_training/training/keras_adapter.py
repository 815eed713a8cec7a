"""Resumable ``model.fit`` for Keras 3 on TensorFlow: exact mid-epoch resume, notices, background saves.

A plain Keras script becomes resumable with three added lines and one changed (docs/training.md)::

    import spot_training.training.early_notice                                          # + 1, first line
    from spot_training.training.keras_adapter import ResumableFit, make_deterministic  # + 1
    make_deterministic(0)                                                 # + 1, before building the model
    ResumableFit(model).fit(x, y, batch_size=32, epochs=10, callbacks=[...])  # was model.fit(...)

``fit`` runs on :class:`spot_training.training.core.CheckpointDriver` with a :class:`KerasAdapter`: it restores
the newest valid checkpoint from ``$SPOT_TRAINING_CHECKPOINT_DIR`` (weights, optimizer slots and
iteration counter, random-generator states, stateful callbacks, the step counter), feeds the
batches that an uninterrupted run would have fed from that step on (numpy arrays or a
``tf.data.Dataset``), saves every ``every_steps`` steps (default 50) and on request (SIGUSR1 or the
request file), and on SIGTERM finishes the current step, writes a final checkpoint and exits 0
(``SystemExit``; ``exit_on_stop=False`` returns ``FitResult(stopped=True)``). After the last step it
writes the final checkpoint and ``COMPLETED`` (docs/contracts.md).

Why not ``keras.callbacks.BackupAndRestore`` (Keras 3.15, read in keras/src/callbacks/backup_and_restore.py):
  * it resumes at an epoch boundary only: it records ``{"epoch", "batch"}`` but on restore sets
    ``model._initial_epoch`` and ignores ``batch``, so a mid-epoch interruption repeats up to an epoch;
  * the data position is whatever ``fit`` shuffles; a resumed ``fit(x, y, shuffle=True)`` draws a
    fresh order, so even an epoch-boundary resume is not bitwise equal to an uninterrupted run;
  * it overwrites one ``latest.weights.h5`` in place (no temp file, no fsync, no checksum), so a kill
    mid-write destroys the only checkpoint; ``double_checkpoint`` copies the file, again in place,
    and falls back only on ``OSError``, not on a silently torn file;
  * it saves synchronously on the training thread (``save_weights`` reads the live variables, so it
    cannot write a snapshot in the background while training goes on), has no SIGTERM handling, and
    deletes the checkpoint when ``fit`` ends (``delete_checkpoint=True``).
What it does right is kept: the model must be built and the optimizer's slots built
(``optimizer.build(model.trainable_variables)``) before restoring (docs/architecture.md, "Framework facts that shaped the code").

A checkpoint (inside the store's ``ckpt-<step>`` directory, spot_training/training/store.py) holds
``keras.variables/<key>.npy`` (one standard numpy file per variable): ``model.variables`` (weights, BatchNorm statistics and the ``SeedGenerator``
states that Dropout and random augmentation layers draw from) and ``optimizer.variables`` (iteration
counter, learning rate, slots), in their Keras order, as numpy arrays of their dtype; and
``keras.variables.json``: each variable's Keras path, shape and dtype (shape checks name the variable).
Variables are matched by position, not by path: Keras numbers layer names per process (``dense_1``),
so paths may differ between two runs that build the same model. Our own step counter (the manifest's
``step``; Keras 3's ``optimizer.iterations`` is not trusted for this, docs/architecture.md, "Checkpoints") is also the data
position (spot_training/training/datasets.py: the batch of step ``s`` is a pure function of ``s`` and the seed).
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import keras
import numpy as np

from spot_training.training.core import (CHECKPOINT_STORAGE_EXIT_CODE, DEFAULT, DEFAULT_KEEP, CheckpointDriver,
                                        DriverFront, StateAdapter, renamed_option)
from spot_training.training.datasets import batch_indices
from spot_training.training.datasets import steps_per_epoch as steps_per_epoch_of
# callback_state and set_callback_state are re-exported: scripts import them from here.
from spot_training.training.keras_callbacks import (apply_callback_states, callback_state, capture_callback_states,
                                                    read_callback_states, set_callback_state, write_callback_states)
from spot_training.training.keras_data import ResumedPyDataset, class_weight_to_sample_weight, warn_if_reshuffling
from spot_training.training.notice import NoticeHandler
from spot_training.training.store import (
    Checkpoint,
    CheckpointStore,
    ShapeMismatchError,
    check_int,
    write_file,
)

__all__ = ["FitResult", "KerasAdapter", "KerasCheckpointer", "ResumableFit", "StepCallback", "callback_state",
           "make_deterministic", "set_callback_state"]

VARIABLES_DIR = "keras.variables"   # one standard .npy file per variable: <key>.npy
INDEX_FILE = "keras.variables.json"
ADAPTER_FORMAT = 1
log = logging.getLogger("spot_training.training.keras_adapter")
_SEEDED: int | None = None  # the seed make_deterministic() was given in this process


def make_deterministic(seed: int, *, intra_op_threads: int = 1, inter_op_threads: int = 1) -> None:
    """Seed Python, numpy and TensorFlow and turn on deterministic ops, for bitwise-reproducible runs.

    Seeds with ``keras.utils.set_random_seed`` and TensorFlow's global ``tf.random.Generator``, turns on
    ``tf.config.experimental.enable_op_determinism`` and sets TensorFlow's thread pools. Call it first,
    before any TensorFlow op runs (thread pools cannot change afterwards). docs/architecture.md:
    ``intra_op=1`` was also the fastest on small nodes.

    Args:
        seed: the seed of every generator.
        intra_op_threads: TensorFlow's intra-op thread pool size (default 1).
        inter_op_threads: TensorFlow's inter-op thread pool size (default 1).

    Raises:
        RuntimeError: from TensorFlow, when a TensorFlow op ran before (the thread pools are fixed then).
    """
    import tensorflow as tf

    global _SEEDED
    tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    keras.utils.set_random_seed(seed)
    # tf.random.get_global_generator() is otherwise seeded from the clock; TFCheckpointer checkpoints it.
    tf.random.set_global_generator(tf.random.Generator.from_seed(seed))
    tf.config.experimental.enable_op_determinism()
    _SEEDED = seed


def _tf_version() -> str:
    import tensorflow as tf

    return f"tensorflow {tf.__version__}, keras {keras.__version__}"


class KerasCheckpointer:
    """Reads and host-copies the state of one compiled Keras 3 model (and its optimizer).

    The framework half of :class:`KerasAdapter`, through which :class:`ResumableFit` saves (one save
    path: :class:`~spot_training.training.core.CheckpointDriver`).

    Args:
        model: a compiled Keras model (``model.optimizer`` set).
        store: an optional CheckpointStore (``framework="tensorflow"``) for reading outside a driver, as
            ``store.restore(ck.read)``.

    Raises:
        ValueError: the model is not compiled.
    """

    def __init__(self, model: keras.Model, store: CheckpointStore | None = None) -> None:
        if getattr(model, "optimizer", None) is None:
            raise ValueError(f"model {model.name!r} has no optimizer: call model.compile(optimizer=...) first")
        self.model = model
        self.store = store
        self._reader = None  # (variable ids, tf.function reading them all), see _read_values

    # -- state
    def ensure_built(self, sample_x: np.ndarray | None = None) -> None:
        """Build the model (calling it on ``sample_x`` if needed) and the optimizer's slots, so every
        variable exists before a restore.

        Raises:
            ValueError: the model is unbuilt and no sample is given.
        """
        if not self.model.built:
            if sample_x is None:
                raise ValueError(
                    f"model {self.model.name!r} is not built: give it an keras.Input or call it on a batch first")
            self.model(sample_x[:1])
        if not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)

    def _variables(self) -> list[tuple[str, object]]:
        seen, out = set(), []
        for group, variables in (("model", self.model.variables), ("optimizer", self.model.optimizer.variables)):
            for v in variables:
                if id(v) in seen:
                    continue
                seen.add(id(v))
                out.append((group, v))
        return out

    def _read_values(self) -> list:
        """Every variable's current value as a TensorFlow tensor, read in one ``tf.function`` call
        (one dispatch instead of one eager op per variable: a ResNet has hundreds). On CPU a read
        shares the variable's buffer (no copy); it stays unchanged while we hold it, because
        TensorFlow copies a variable's buffer before updating it in place when a tensor still
        references it (copy-on-write: ``PrepareToUpdateVariable`` in TensorFlow's
        training_op_helpers.h). On a GPU, turning a read into numpy copies it to the host first,
        so there the device-to-host copy and the copy into our buffers are two. The function is
        traced again when the variable list changes."""
        import tensorflow as tf

        variables = [v for _group, v in self._variables()]
        key = tuple(id(v) for v in variables)
        if self._reader is None or self._reader[0] != key:
            tf_vars = [v.value for v in variables]  # the backing tf.Variable (outside any autocast scope)
            self._reader = (key, tf.function(lambda: [tv.read_value() for tv in tf_vars], autograph=False))
        return self._reader[1]()

    def snapshot(self, out: list[np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], list[dict]]:
        """Copy every variable to host memory: numpy arrays that later training steps cannot change.

        Args:
            out: host buffers to copy into, one per variable in :meth:`_variables` order (e.g. a previous
                snapshot's arrays, once written); default None allocates new arrays. A buffer whose shape or
                dtype does not match its variable, or a missing one, is replaced by a new array.

        Returns:
            ``(arrays, index)``: arrays keyed ``model.0000``/``optimizer.0000`` (the ``out`` buffers where they
            matched); index entries ``{"key", "path", "shape", "dtype"}``.
        """
        values = self._read_values()
        variables = self._variables()
        arrays, index = {}, []
        counters = {"model": 0, "optimizer": 0}
        for i, ((group, v), value) in enumerate(zip(variables, values)):
            key = f"{group}.{counters[group]:04d}"
            counters[group] += 1
            # np.asarray of a CPU tensor is a view of its buffer (EagerTensor.numpy() would copy it
            # once more), so the one copy made here is the copy into host memory of our own.
            src = np.asarray(value)
            dst = out[i] if out is not None and i < len(out) else None
            if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
                dst = src.copy()
            else:
                np.copyto(dst, src)
            arrays[key] = dst
            index.append({"key": key, "path": v.path, "shape": list(dst.shape), "dtype": str(dst.dtype)})
        return arrays, index

    @staticmethod
    def write_snapshot(arrays: dict[str, np.ndarray], index: list[dict], directory: Path) -> dict[str, dict]:
        """Write a :meth:`snapshot` into ``directory`` (no TensorFlow call: safe on any thread).

        One standard ``.npy`` file per variable (``np.load`` reads it), written by
        :func:`spot_training.training.store.write_file`: the header, then the array's own buffer in one
        ``write`` hashed as it goes, one fsync per file. The returned entries let the store skip reading
        the files back to hash them, and every large step (write, sha256) runs without the GIL, so the
        training thread's Python (the ``fit`` loop, the batch generator) is not stalled (docs/training.md).
        Not ``np.savez`` (``zipfile`` copies chunks holding the GIL) nor ``np.save`` (it writes the file,
        and the store would then read it all back to hash it).

        Args:
            arrays: the snapshot's ``{key: array}``.
            index: the snapshot's index entries (written as ``keras.variables.json``).
            directory: the store's empty temporary directory.

        Returns:
            the files' manifest entries ``{relative path: {"size", "sha256"}}`` for :meth:`CheckpointStore.save`.

        Raises:
            ValueError: an object-dtype array (never a Keras variable).
            OSError: as the file system raises it.
        """
        (directory / VARIABLES_DIR).mkdir()
        written = {}
        for key, value in arrays.items():
            if value.dtype.hasobject:
                raise ValueError(f"variable {key!r} has dtype {value.dtype}; only numeric arrays are checkpointed")
            if not value.flags.c_contiguous:  # numpy() results are; ascontiguousarray would make 0-d 1-d
                value = np.ascontiguousarray(value).reshape(value.shape)
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(value))
            rel = f"{VARIABLES_DIR}/{key}.npy"
            written[rel] = write_file(directory / rel, (header.getbuffer(), value.reshape(-1).view(np.uint8)))
        written[INDEX_FILE] = write_file(
            directory / INDEX_FILE, [json.dumps({"format": ADAPTER_FORMAT, "variables": index}, indent=0).encode()])
        return written

    def read(self, ckpt: Checkpoint) -> None:
        """Assign a checkpoint's values to the model and optimizer, after checking every shape.

        Raises:
            ShapeMismatchError: naming the checkpoint path, the variable, the expected and the actual
                shape (or the variable counts); nothing is assigned in that case.
        """
        index = json.loads((ckpt.path / INDEX_FILE).read_text())["variables"]
        current = self._variables()
        for group in ("model", "optimizer"):
            saved_n = sum(1 for e in index if e["key"].startswith(group + "."))
            have_n = sum(1 for g, _ in current if g == group)
            if saved_n != have_n:
                raise ShapeMismatchError(
                    f"checkpoint {str(ckpt.path)!r} holds {saved_n} {group} variables but the model has "
                    f"{have_n}; restore into the same architecture and optimizer that wrote it")
        for entry, (_group, v) in zip(index, current):
            if tuple(entry["shape"]) != tuple(v.shape):
                raise ShapeMismatchError(
                    f"checkpoint {str(ckpt.path)!r}: variable {entry['path']!r} has shape {tuple(entry['shape'])} "
                    f"but the model's {v.path!r} expects {tuple(v.shape)}; restore into the same architecture "
                    "that wrote it, or use another checkpoint directory")
        for entry, (_group, v) in zip(index, current):
            v.assign(np.load(ckpt.path / VARIABLES_DIR / f"{entry['key']}.npy", allow_pickle=False))

# ---------------------------------------------------------------------------------------------
# Callback state (EarlyStopping, ReduceLROnPlateau, any callback with get/set_checkpoint_state)

class KerasAdapter(StateAdapter):
    """The Keras :class:`~spot_training.training.core.StateAdapter`: every model and optimizer variable (weights,
    BatchNorm statistics, the SeedGenerator states of Dropout and random-augmentation layers,
    iteration counter, learning rate, slots) through :class:`KerasCheckpointer`'s host snapshot
    into two sets of host buffers used in turn, plus the state of the stateful callbacks given to
    :meth:`ResumableFit.fit` (``keras.callbacks.json`` and ``keras.callbacks.npz``).

    Args:
        model: a compiled Keras 3 model.

    Raises:
        ValueError: the model is not compiled.
    """

    framework = "tensorflow"
    adapter = "keras"
    adapter_format = ADAPTER_FORMAT

    def __init__(self, model: keras.Model) -> None:
        self.checkpointer = KerasCheckpointer(model)
        self.callbacks: list = []
        #: callback states read from the checkpoint or held between two fit() calls of one resume
        self.callback_states: dict[str, dict] | None = None
        self.seed: int | None = None

    def framework_version(self) -> str:
        """``tensorflow <version>, keras <version>`` (see :meth:`StateAdapter.framework_version`)."""
        return _tf_version()

    def metadata(self) -> dict:
        """``{"seed": seed}``: the batch-order seed of numpy inputs, checked on resume."""
        return {"seed": self.seed}

    def capture_callbacks(self) -> dict[str, dict]:
        """The stateful callbacks' states, keyed ``<position>-<class name>``.

        Returns:
            ``{key: state}`` for every callback :func:`callback_state` knows (others are left out).
        """
        return capture_callback_states(self.callbacks)

    def apply_callbacks(self) -> None:
        """Put the restored callback states (:attr:`callback_states`) back into the callbacks; nothing if none."""
        apply_callback_states(self.callbacks, self.callback_states)

    def snapshot(self, directory: Path):
        """Copy the variables into one of two reused host buffers, and the callbacks' states.

        See :meth:`StateAdapter.snapshot`.

        Args:
            directory: the store's empty temporary directory the returned writer fills.

        Returns:
            a function that writes the variables and ``keras.callbacks.json``/``.npz`` and returns their
            manifest entries.
        """
        arrays, index = self.host_copy(lambda out: self.checkpointer.snapshot(out=out),
                                       lambda copy: list(copy[0].values()))
        callbacks = self.capture_callbacks()

        def write() -> dict:
            written = KerasCheckpointer.write_snapshot(arrays, index, directory)
            written.update(write_callback_states(callbacks, directory))
            return written

        return write

    def load(self, ckpt: Checkpoint) -> None:
        """Read ``ckpt``'s variables (shapes checked first) and its callback states; see :meth:`StateAdapter.load`.

        Args:
            ckpt: the checkpoint to restore.

        Raises:
            ShapeMismatchError: a variable's shape or count differs (from :meth:`KerasCheckpointer.read`).
            OSError: a variable or callback file is missing or unreadable.
        """
        self.checkpointer.read(ckpt)
        self.callback_states = read_callback_states(ckpt.path)


@dataclass
class FitResult:
    """What :meth:`ResumableFit.fit` did. step: completed steps at return; epoch: the epoch the
    next step belongs to; total_steps: epochs * steps_per_epoch; completed: the last step ran (and
    ``COMPLETED`` was written); stopped: a stop notice ended it early (a final checkpoint was
    written; only returned with ``exit_on_stop=False``, else the process exits 0);
    restored_from: the checkpoint it resumed from (None: fresh); histories: the ``History`` of each
    ``model.fit`` call made (two when resuming mid-epoch)."""

    step: int
    epoch: int
    total_steps: int
    completed: bool
    stopped: bool
    restored_from: Checkpoint | None
    histories: list = field(default_factory=list)


class _StopFit(Exception):
    """Raised from the last callback after the stop checkpoint: leaves ``model.fit`` at once, so
    Keras runs neither validation nor ``on_epoch_end`` for the partial epoch."""


class StepCallback(keras.callbacks.Callback):
    """Counts global steps (first in the list, so user callbacks see ``fitter.step`` advanced);
    internal to :class:`ResumableFit`."""

    def __init__(self, fitter: "ResumableFit") -> None:
        super().__init__()
        self.fitter = fitter

    def on_train_batch_begin(self, batch, logs=None):
        """Mark the start of a step for the driver (blocks while its watcher saves and exits).

        Args:
            batch: Keras's batch index within the epoch (unused).
            logs: Keras's logs (unused).
        """
        self.fitter.driver.begin_step()

    def on_train_batch_end(self, batch, logs=None):
        """Count one completed global step.

        Args:
            batch: Keras's batch index within the epoch (unused).
            logs: Keras's logs (unused).
        """
        self.fitter.driver.step += 1


class _SaveCallback(keras.callbacks.Callback):
    """Last in the list: puts the callbacks' restored state back after their ``on_train_begin``
    reset it, keeps it across the two ``fit`` calls of a mid-epoch resume, and after every step
    saves on the cadence, on request, and on a stop notice (then leaves ``fit``)."""

    def __init__(self, fitter: "ResumableFit") -> None:
        super().__init__()
        self.fitter = fitter

    def on_train_begin(self, logs=None):
        self.fitter.adapter.apply_callbacks()

    def on_train_end(self, logs=None):
        self.fitter.adapter.callback_states = self.fitter.adapter.capture_callbacks()

    def on_train_batch_end(self, batch, logs=None):
        try:
            stopped = self.fitter.driver.after_step(exit_on_stop=False, count=False)
        finally:
            self.fitter.driver.end_step()  # validation and epoch-end callbacks run outside a step
        if stopped:
            self.fitter.stopped = True
            raise _StopFit()


class _FitDriver(CheckpointDriver):
    storage_exit_code = CHECKPOINT_STORAGE_EXIT_CODE  # 74/78 exits, as the TF loop and Gluon


class ResumableFit(DriverFront):
    """``model.fit`` that resumes at the exact step after any interruption.

    :class:`~spot_training.training.core.CheckpointDriver` with a :class:`KerasAdapter`.
    ``fitter.step`` is the global step count (completed steps) while ``fit`` runs.

    Args:
        model: a compiled Keras 3 model.
        checkpoint_dir: default ``$SPOT_TRAINING_CHECKPOINT_DIR`` or ``/dltraining/checkpoints`` (checked
            here).
        seed: seeds the per-epoch batch order of numpy inputs (spot_training/training/datasets.py), >= 0,
            default 0.
        every_steps: default ``$SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`` or 50 (None: off).
        every_seconds: default ``$SPOT_TRAINING_CHECKPOINT_EVERY_SECONDS`` or None (off).
        background: host copy + background write (default True).
        keep: checkpoints kept (>= 2, default 3).
        notices: a NoticeHandler (default: SIGTERM, SIGUSR1 and ``$SPOT_TRAINING_CHECKPOINT_REQUEST_FILE``,
            installed for the duration of ``fit``).
        exit_on_stop: after a stop notice's checkpoint, end the process with ``SystemExit(0)`` (default
            True: code after ``fit`` never runs on a half-trained model); False returns
            ``FitResult(stopped=True)``.
        deterministic: turn on TensorFlow's deterministic ops (default True); bitwise-reproducible runs
            also need :func:`make_deterministic` called before the model is built (its weights are drawn
            then), which is logged as a warning when missing.
        **deprecated: ``save_every_steps`` (use ``every_steps``), ``save_every_seconds``
            (``every_seconds``), ``notice`` (``notices``).

    Raises:
        CheckpointPathError: the checkpoint directory is a file, read-only, or not permitted.
        ValueError: a bad ``seed``, ``exit_on_stop`` or ``deterministic``, or an uncompiled model.
        TypeError: an unknown keyword, or a deprecated and a current name with different values.
    """

    def __init__(
        self,
        model: keras.Model,
        checkpoint_dir: str | os.PathLike | None = None,
        *,
        seed: int = 0,
        every_steps: int | None = DEFAULT,
        every_seconds: float | None = DEFAULT,
        background: bool = True,
        keep: int = DEFAULT_KEEP,
        notices: NoticeHandler | None = None,
        exit_on_stop: bool = True,
        deterministic: bool = True,
        **deprecated,
    ) -> None:
        every_steps = renamed_option(deprecated, "save_every_steps", "every_steps", every_steps,
                                     owner="ResumableFit")
        every_seconds = renamed_option(deprecated, "save_every_seconds", "every_seconds", every_seconds,
                                       owner="ResumableFit")
        notices = renamed_option(deprecated, "notice", "notices", notices, owner="ResumableFit", unset=None)
        if deprecated:
            raise TypeError(f"ResumableFit got unexpected keyword arguments {sorted(deprecated)}")
        check_int("seed", seed, 0)
        for name, value in (("exit_on_stop", exit_on_stop), ("deterministic", deterministic)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False. Received: {name}={value!r}")
        if getattr(model, "optimizer", None) is None:
            raise ValueError(f"model {model.name!r} has no optimizer: call model.compile(optimizer=...) first")
        self.model = model
        self.seed = seed
        self.exit_on_stop = exit_on_stop
        self.deterministic = deterministic
        self._options = dict(checkpoint_dir=checkpoint_dir, every_steps=every_steps, every_seconds=every_seconds,
                             background=background, keep=keep)
        self._notices = notices
        self.adapter = KerasAdapter(model)
        self.adapter.seed = seed
        self.checkpointer = self.adapter.checkpointer
        self.driver = self._new_driver()
        self.stopped = False

    def _new_driver(self) -> CheckpointDriver:
        return _FitDriver(self.adapter, notices=self._notices, logger=log, **self._options)

    # The driver's state (DriverFront: step, store, schedule, ...), and under the names this class always had.
    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch of the current ``fit`` (0 before it is known)."""
        return self.driver.steps_per_epoch or 0

    @property
    def notice(self) -> NoticeHandler:
        """The driver's :class:`~spot_training.training.notice.NoticeHandler`."""
        return self.driver.notices

    # -- data
    def _array_batches(self, x, y, sw, start: int, count: int, batch_size: int):
        n = len(x)
        for s in range(start, start + count):
            idx = batch_indices(s, batch_size=batch_size, n=n, seed=self.seed)
            yield (x[idx], y[idx]) if sw is None else (x[idx], y[idx], sw[idx])

    def _dataset_batches(self, source, class_weight, start: int, count: int, spe: int):
        import tensorflow as tf

        step, end = start, start + count
        while step < end:
            epoch, done = divmod(step, spe)
            dataset = source(epoch) if callable(source) else source
            iterator = iter(dataset.skip(done) if done else dataset)
            for _ in range(min(spe - done, end - step)):
                try:
                    element = next(iterator)
                except StopIteration:
                    raise ValueError(
                        f"the dataset of epoch {epoch} ended after {done + _} batches, fewer than steps_per_epoch="
                        f"{spe}; give a dataset with the same number of batches every epoch") from None
                element = tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, element)
                if not isinstance(element, tuple) or len(element) not in (2, 3):
                    raise ValueError("ResumableFit needs dataset elements (x, y) or (x, y, sample_weight). "
                                     f"Received an element of type {type(element).__name__}")
                if class_weight is not None:
                    weights = class_weight_to_sample_weight(element[1], class_weight)
                    element = (element[0], element[1], weights if len(element) == 2 else element[2] * weights)
                yield element
                step += 1

    def fit(
        self,
        x=None,
        y: np.ndarray | None = None,
        *,
        batch_size: int | None = None,
        epochs: int,
        callbacks: Sequence[keras.callbacks.Callback] = (),
        verbose="auto",
        validation_split: float = 0.0,
        validation_data=None,
        class_weight: dict | None = None,
        sample_weight: np.ndarray | None = None,
        steps_per_epoch: int | None = None,
        **fit_kwargs,
    ) -> FitResult:
        """Train ``epochs`` epochs, resuming where a previous run stopped.

        Inputs, each with a data position that is a function of the step:

        * numpy ``x``, ``y`` (and ``sample_weight``): ``len(x) // batch_size`` full batches per epoch
          from a per-epoch permutation seeded by ``seed`` (the remainder of each permutation is left
          out, so every step has one shape). ``validation_split`` holds out the last fraction of the
          arrays as Keras does (before any shuffling).
        * a finite ``tf.data.Dataset`` of batches ``(x, y)`` or ``(x, y, sample_weight)`` that yields
          the same batches in the same order every time it is iterated (no shuffle, or
          ``shuffle(..., seed=S, reshuffle_each_iteration=False)``), or a function ``epoch ->
          Dataset`` (e.g. ``lambda e: ds.shuffle(1000, seed=e).batch(32)``) for another order each
          epoch. Steps per epoch: ``steps_per_epoch`` or the dataset's cardinality. A resume
          skips the batches of the epoch already done (``Dataset.skip``).

        ``class_weight`` is turned into sample weights (Keras's rule). A callback that sets
        ``model.stop_training`` (EarlyStopping) ends training: the final checkpoint and
        ``COMPLETED`` are written at that step. The state of EarlyStopping, ReduceLROnPlateau and
        any callback with ``get_checkpoint_state``/``set_checkpoint_state`` is checkpointed
        (:func:`callback_state`); a resumed ``CSVLogger`` appends. On a stop notice the current
        step's checkpoint is written and ``fit`` is left at once (no validation, no
        ``on_epoch_end`` for the partial epoch); then ``SystemExit(0)`` unless ``exit_on_stop=False``.
        Other keyword arguments go to ``model.fit``; ``shuffle`` and ``initial_epoch`` are owned
        here (ValueError if given).

        Args:
            x: numpy inputs, a ``tf.data.Dataset``, a function ``epoch -> Dataset``, or a
                ``keras.utils.PyDataset``.
            y: numpy targets (numpy ``x`` only).
            batch_size: examples per step (numpy ``x`` only).
            epochs: total epochs of the whole training (not the epochs still to run), >= 1.
            callbacks: Keras callbacks (their checkpointable state is saved and restored).
            verbose: as ``model.fit``.
            validation_split: fraction in [0, 1) of the numpy arrays held out (numpy ``x`` only).
            validation_data: as ``model.fit``.
            class_weight: ``{class index: weight}``, turned into sample weights.
            sample_weight: numpy per-example weights, shape ``(len(x),)`` (numpy ``x`` only).
            steps_per_epoch: steps per epoch of a dataset (default: its cardinality or length).
            **fit_kwargs: passed to ``model.fit`` (not ``shuffle``, ``initial_epoch``).

        Returns:
            a :class:`FitResult`.

        Raises:
            ValueError: bad sizes or inputs, or a keyword this class owns.
            FrameworkMismatchError: the checkpoint was written by another framework (naming its path;
                nothing is deleted).
            ShapeMismatchError: the checkpoint does not fit this model (naming its path and the variable).
            CheckpointDiskFullError: a save ran out of space (the previous checkpoints stay).
            SystemExit: 0 after a stop notice's checkpoint with ``exit_on_stop=True``.
        """
        import tensorflow as tf

        for owned in ("shuffle", "initial_epoch", "epochs", "x", "y"):
            if owned in fit_kwargs:
                raise ValueError(f"ResumableFit.fit owns {owned!r}; remove it. Received: {owned}={fit_kwargs[owned]!r}")
        check_int("epochs", epochs, 1)
        if getattr(self.model, "steps_per_execution", 1) != 1:
            raise ValueError("ResumableFit needs model.compile(steps_per_execution=1) to count every step. "
                             f"Received: steps_per_execution={self.model.steps_per_execution}")
        if not (0.0 <= validation_split < 1.0):
            raise ValueError(f"validation_split must be in [0, 1). Received: validation_split={validation_split!r}")
        if class_weight is not None and not isinstance(class_weight, dict):
            raise ValueError(f"class_weight must be a dict {{class index: weight}}. Received: {class_weight!r}")
        is_dataset = isinstance(x, tf.data.Dataset) or (callable(x) and not hasattr(x, "shape"))
        if isinstance(x, keras.utils.PyDataset):
            for name, value in (("y", y), ("batch_size", batch_size), ("sample_weight", sample_weight)):
                if value is not None:
                    raise ValueError(f"with a keras.utils.PyDataset, {name} comes from the dataset; remove {name}=")
            if validation_split:
                raise ValueError("validation_split needs numpy arrays (Keras's rule too); pass validation_data=")
            spe = steps_per_epoch if steps_per_epoch is not None else x.num_batches
            if isinstance(spe, bool) or not isinstance(spe, int) or spe < 1:
                raise ValueError("steps_per_epoch must be an integer >= 1 (the PyDataset's length is unknown or "
                                 f"infinite: pass steps_per_epoch=). Received: {spe!r}")
            sample = x[0]
            self.checkpointer.ensure_built(np.asarray(sample[0]) if not isinstance(sample[0], dict) else None)
            if class_weight is not None:
                fit_kwargs["class_weight"] = class_weight
            batches = lambda start, count: x if start % spe == 0 else ResumedPyDataset(x, start % spe, spe)  # noqa: E731
        elif is_dataset:
            for name, value in (("y", y), ("batch_size", batch_size), ("sample_weight", sample_weight)):
                if value is not None:
                    raise ValueError(f"with a tf.data.Dataset, {name} comes from the dataset; remove {name}=")
            if validation_split:
                raise ValueError("validation_split needs numpy arrays (Keras's rule too); with a tf.data.Dataset "
                                 "pass validation_data=")
            first = x(0) if callable(x) else x
            if not isinstance(first, tf.data.Dataset):
                raise ValueError(f"x must be numpy arrays, a tf.data.Dataset or a function epoch -> Dataset. "
                                 f"Received: x(0) of type {type(first).__name__}")
            if steps_per_epoch is None:
                cardinality = int(first.cardinality())
                if cardinality < 1:
                    raise ValueError("the dataset's length is unknown or infinite (cardinality "
                                     f"{cardinality}); pass steps_per_epoch= (batches per epoch)")
                steps_per_epoch = cardinality
            check_int("steps_per_epoch", steps_per_epoch, 1)
            spe = steps_per_epoch
            sample = next(iter(first.take(1)))
            warn_if_reshuffling(first, sample)
            self.checkpointer.ensure_built(np.asarray(sample[0]) if not isinstance(sample[0], dict) else None)
            batches = lambda start, count: self._dataset_batches(x, class_weight, start, count, spe)  # noqa: E731
        else:
            if steps_per_epoch is not None:
                raise ValueError("steps_per_epoch is len(x) // batch_size for numpy inputs; remove steps_per_epoch=")
            if x is None or y is None or batch_size is None:
                raise ValueError("give x, y and batch_size (numpy arrays), or x as a tf.data.Dataset")
            x, y = np.asarray(x), np.asarray(y)
            if len(x) != len(y):
                raise ValueError(f"x and y must have the same length. Received: len(x)={len(x)}, len(y)={len(y)}")
            if sample_weight is not None:
                sample_weight = np.asarray(sample_weight)
                if len(sample_weight) != len(x):
                    raise ValueError(f"sample_weight must have len(x)={len(x)} entries. "
                                     f"Received: {len(sample_weight)}")
            if validation_split:
                split_at = int(np.floor(len(x) * (1.0 - validation_split)))
                if validation_data is None:
                    validation_data = ((x[split_at:], y[split_at:]) if sample_weight is None
                                       else (x[split_at:], y[split_at:], sample_weight[split_at:]))
                x, y = x[:split_at], y[:split_at]
                sample_weight = None if sample_weight is None else sample_weight[:split_at]
            if class_weight is not None:
                weights = class_weight_to_sample_weight(y, class_weight)
                sample_weight = weights if sample_weight is None else sample_weight * weights
            spe = steps_per_epoch_of(len(x), batch_size)
            self.checkpointer.ensure_built(x[:1])
            batches = lambda start, count: self._array_batches(x, y, sample_weight, start, count, batch_size)  # noqa: E731
        if validation_data is not None:
            fit_kwargs["validation_data"] = validation_data
        total = epochs * spe

        if self.deterministic:
            tf.config.experimental.enable_op_determinism()
            if _SEEDED is None:
                log.warning("make_deterministic(seed) was not called before the model was built: its initial "
                            "weights differ from run to run, so two uninterrupted runs differ (a resume itself is "
                            "still exact)")
        if self.driver.closed:
            self.driver = self._new_driver()
        driver = self.driver
        driver.steps_per_epoch = spe
        callbacks = list(callbacks)
        self.adapter.callbacks = callbacks
        self.stopped = False
        result = FitResult(step=0, epoch=0, total_steps=total, completed=False, stopped=False, restored_from=None)
        try:
            with driver.storage_exit():
                driver.begin(total)  # ValueError for a checkpoint of another steps_per_epoch or past the total
                restored = result.restored_from = driver.restored
                if restored is not None:
                    log.info("resumed from %s (step %d of %d)", restored.path, driver.step, total)
                    saved_seed = restored.metadata.get("seed")
                    if saved_seed not in (None, self.seed):
                        log.warning("checkpoint %s was written with seed=%s, this run has seed=%s: the batch order "
                                    "from here on differs from the interrupted run's", restored.path, saved_seed,
                                    self.seed)
                    for cb in callbacks:
                        if isinstance(cb, keras.callbacks.CSVLogger):
                            cb.append = True  # a resumed run continues the file, as the interrupted one would have
                self.stopped = driver.stopped_before_start(total)
                all_callbacks = [StepCallback(self), *callbacks, _SaveCallback(self)]
                try:
                    if driver.step < total and driver.step % spe and not self.stopped:
                        epoch, done = divmod(driver.step, spe)
                        result.histories.append(self.model.fit(
                            batches(driver.step, spe - done), steps_per_epoch=spe - done, initial_epoch=epoch,
                            epochs=epoch + 1, callbacks=all_callbacks, verbose=verbose, shuffle=False, **fit_kwargs))
                    ended_by_callback = bool(result.histories) and self.model.stop_training
                    if driver.step < total and not self.stopped and not ended_by_callback:
                        result.histories.append(self.model.fit(
                            batches(driver.step, total - driver.step), steps_per_epoch=spe,
                            initial_epoch=driver.step // spe, epochs=epochs, callbacks=all_callbacks, verbose=verbose,
                            shuffle=False, **fit_kwargs))
                except _StopFit:
                    for cb in callbacks:  # flush what Keras would have closed in on_train_end
                        handle = getattr(cb, "csv_file", None) if isinstance(cb, keras.callbacks.CSVLogger) else None
                        if handle is not None and not handle.closed:
                            handle.close()
                if not self.stopped:
                    if driver.step != total:
                        log.info("a callback stopped training at step %d of %d; treating it as the end", driver.step, total)
                    driver.complete()
                    result.completed = True
        finally:
            driver.close()
        result.step, result.epoch, result.stopped = driver.step, driver.step // spe, self.stopped
        if self.stopped and self.exit_on_stop:
            log.info("stopped by a notice at step %d of %d; checkpoint written, exiting 0", driver.step, total)
            raise SystemExit(0)
        return result
