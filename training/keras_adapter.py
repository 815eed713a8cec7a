"""Resumable ``model.fit`` for Keras 3 on TensorFlow: exact mid-epoch resume, notices, background saves.

A plain Keras script becomes resumable with two changed lines (docs/training.md)::

    from training.keras_adapter import ResumableFit                                  # + 1
    ResumableFit(model, seed=0).fit(x, y, batch_size=32, epochs=10, callbacks=[...])  # was model.fit(...)

``fit`` restores the newest valid checkpoint from ``$SPOT_TRAINING_CHECKPOINT_DIR`` (weights, optimizer
slots and iteration counter, random-generator states, the step counter), feeds the batches that an
uninterrupted run would have fed from that step on, saves every ``save_every_steps`` steps (default
50) and on request (SIGUSR1 or the request file), and on SIGTERM finishes the current step, writes a
final checkpoint and returns ``FitResult(stopped=True)`` so the script exits 0. After the last step it
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
(``optimizer.build(model.trainable_variables)``) before restoring (design.md: Keras 3).

A checkpoint (inside the store's ``ckpt-<step>`` directory, training/store.py) holds
``keras.variables/<key>.npy`` (one standard numpy file per variable): ``model.variables`` (weights, BatchNorm statistics and the ``SeedGenerator``
states that Dropout and random augmentation layers draw from) and ``optimizer.variables`` (iteration
counter, learning rate, slots), in their Keras order, as numpy arrays of their dtype; and
``keras.variables.json``: each variable's Keras path, shape and dtype (shape checks name the variable).
Variables are matched by position, not by path: Keras numbers layer names per process (``dense_1``),
so paths may differ between two runs that build the same model. Our own step counter (the manifest's
``step``; Keras 3's ``optimizer.iterations`` is not trusted for this, design.md) is also the data
position (training/datasets.py: the batch of step ``s`` is a pure function of ``s`` and the seed).
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import keras
import numpy as np

from training.datasets import batch_indices, default_checkpoint_dir, steps_per_epoch
from training.notice import NoticeHandler, SaveSchedule
from training.store import (
    BackgroundSaver,
    Checkpoint,
    CheckpointStore,
    ShapeMismatchError,
    write_file,
)

__all__ = ["FitResult", "KerasCheckpointer", "ResumableFit", "make_deterministic", "StepCallback"]

VARIABLES_DIR = "keras.variables"   # one standard .npy file per variable: <key>.npy
INDEX_FILE = "keras.variables.json"
ADAPTER_FORMAT = 1
log = logging.getLogger("training.keras_adapter")


def make_deterministic(seed: int, *, intra_op_threads: int = 1, inter_op_threads: int = 1) -> None:
    """Seed Python, numpy and TensorFlow (``keras.utils.set_random_seed``), turn on TensorFlow's
    deterministic ops and set its thread pools (default 1 and 1), for bitwise-reproducible runs.

    Call it first, before any TensorFlow op runs (thread pools cannot change afterwards:
    RuntimeError from TensorFlow). design.md: intra_op=1 is also the fastest on small nodes.
    """
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()


def _tf_version() -> str:
    import tensorflow as tf

    return f"tensorflow {tf.__version__}, keras {keras.__version__}"


class KerasCheckpointer:
    """Saves and restores one compiled Keras 3 model (and its optimizer) through a CheckpointStore.

    model: a compiled Keras model (``model.optimizer`` set). store: a CheckpointStore with
    ``framework="tensorflow"``. background: write on a BackgroundSaver thread after a host copy
    (default True); False writes on the calling thread.
    Raises ValueError when the model is not compiled.

    Host memory: saves copy into host buffers that are allocated once and reused, two sets in
    background mode (one being written while the next save fills the other; the BackgroundSaver
    never runs two writes at once), one set when synchronous: 2x (1x) the size of the state, kept
    until :meth:`close`. Why: a copy into fresh memory pays a page fault per page, and on
    virtual machines whose freed memory goes back to the host (free page reporting) those faults
    cost far more than the copy itself; measured on the 2-CPU development VM for a 64.6 MB state,
    6 s apart as saves come (docs/training.md): 43-108 ms into new arrays, 21-23 ms into reused ones.
    """

    def __init__(self, model: keras.Model, store: CheckpointStore, *, background: bool = True) -> None:
        if getattr(model, "optimizer", None) is None:
            raise ValueError(f"model {model.name!r} has no optimizer: call model.compile(optimizer=...) first")
        self.model = model
        self.store = store
        self.background = background
        self.saver: BackgroundSaver | None = None  # started on the first background save
        self.save_seconds: list[float] = []  # training-thread time per save (host copy, or the whole write)
        self.last_saved_step: int | None = None
        self._reader = None  # (variable ids, tf.function reading them all), see _read_values
        self._host_buffers: list[list[np.ndarray] | None] = [None, None]
        self._buffer_busy = [False, False]  # a write reads that set: never copy into it
        self._next_buffer = 0

    # -- state
    def ensure_built(self, sample_x: np.ndarray | None = None) -> None:
        """Build the model (calling it on ``sample_x`` if needed) and the optimizer's slots, so every
        variable exists before a restore. Raises ValueError if the model is unbuilt and no sample is given."""
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

        out: host buffers to copy into, one per variable in :meth:`_variables` order (e.g. a previous
        snapshot's arrays, once written); default None allocates new arrays. A buffer whose shape or
        dtype does not match its variable, or a missing one, is replaced by a new array.
        Returns ``(arrays, index)``: arrays keyed ``model.0000``/``optimizer.0000`` (the ``out``
        buffers where they matched); index entries ``{"key", "path", "shape", "dtype"}``.
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
        :func:`training.store.write_file`: the header, then the array's own buffer in one
        ``write`` hashed as it goes, one fsync per file. Returns the files' manifest entries
        ``{relative path: {"size", "sha256"}}`` for :meth:`CheckpointStore.save`, so the store does
        not read the 64 MB back to hash it. Measured on 2 CPUs (docs/training.md): the writer
        thread's work halves, and every large step (write, sha256) runs without the GIL, so the
        training thread's Python (the ``fit`` loop, the batch generator) is not stalled.
        Not ``np.savez`` (``zipfile`` copies chunks holding the GIL) nor ``np.save`` (it writes the
        file, and the store would then read it all back to hash it).
        Raises ValueError for an object-dtype array (never a Keras variable).
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

        Raises ShapeMismatchError naming the checkpoint path, the variable, the expected and the
        actual shape (or the variable counts); nothing is assigned in that case.
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

    # -- saving
    def save(self, *, step: int, epoch: int, metadata: dict | None = None, block: bool = False) -> Checkpoint | None:
        """Save the current state as checkpoint ``step``. In background mode the host copy is taken
        now and written on the saver thread (returns None unless ``block``); ``block=True`` also
        waits until it is committed and returns it."""
        if step == self.last_saved_step:  # e.g. the final save right after a scheduled one
            return self.wait() if block else None
        started = time.perf_counter()
        slot = self._next_buffer if self.background else 0
        if self._buffer_busy[slot]:  # not expected: submit() waited for the write before the last
            self.wait()
        arrays, index = self.snapshot(out=self._host_buffers[slot])
        self._host_buffers[slot] = list(arrays.values())
        self._buffer_busy[slot] = True
        self._next_buffer = 1 - slot
        meta = {"adapter": "keras", "adapter_format": ADAPTER_FORMAT, **(metadata or {})}

        def write(directory: Path) -> dict[str, dict]:
            try:
                return self.write_snapshot(arrays, index, directory)
            finally:
                self._buffer_busy[slot] = False

        if not self.background:
            ckpt = self.store.save(write, step=step, epoch=epoch, metadata=meta)
        else:
            if self.saver is None:
                self.saver = BackgroundSaver(self.store)
            self.saver.submit(write, step=step, epoch=epoch, metadata=meta)
            ckpt = self.saver.wait() if block else None
        self.last_saved_step = step
        self.save_seconds.append(time.perf_counter() - started)
        return ckpt

    def wait(self) -> Checkpoint | None:
        """Wait for a background write (no-op in synchronous mode)."""
        return self.saver.wait() if self.saver is not None else None

    def close(self) -> None:
        """Finish pending writes, stop the writer thread and free the host buffers (a later save
        starts a new thread and allocates new buffers)."""
        if self.saver is not None:
            saver, self.saver = self.saver, None
            saver.close()
        self._host_buffers = [None, None]
        self._buffer_busy = [False, False]


@dataclass
class FitResult:
    """What :meth:`ResumableFit.fit` did. step: completed steps at return; epoch: the epoch the
    next step belongs to; total_steps: epochs * steps_per_epoch; completed: the last step ran (and
    ``COMPLETED`` was written); stopped: a stop notice ended it early (a final checkpoint was
    written: exit 0 and resume later); restored_from: the checkpoint it resumed from (None: fresh);
    histories: the ``History`` of each ``model.fit`` call made (two when resuming mid-epoch)."""

    step: int
    epoch: int
    total_steps: int
    completed: bool
    stopped: bool
    restored_from: Checkpoint | None
    histories: list = field(default_factory=list)


class StepCallback(keras.callbacks.Callback):
    """Counts global steps and saves on the schedule, on request and on a stop notice (internal to
    :class:`ResumableFit`; placed first so user callbacks see ``fitter.step`` already advanced)."""

    def __init__(self, fitter: "ResumableFit") -> None:
        super().__init__()
        self.fitter = fitter

    def on_train_batch_end(self, batch, logs=None):
        self.fitter._after_step()


class ResumableFit:
    """``model.fit`` that resumes at the exact step after any interruption.

    model: a compiled Keras 3 model. checkpoint_dir: default ``$SPOT_TRAINING_CHECKPOINT_DIR`` or
    ``/dltraining/checkpoints``. seed: seeds the per-epoch batch order (training/datasets.py), default 0.
    save_every_steps: default 50 (None: off). save_every_seconds: default None. background: host copy
    + background write (default True). keep: checkpoints kept (>= 2, default 3). notice: a
    NoticeHandler (default: one installed for the duration of ``fit``, reading SIGTERM, SIGUSR1 and
    ``$SPOT_TRAINING_CHECKPOINT_REQUEST_FILE``).

    ``fitter.step`` is the global step count (completed steps) while ``fit`` runs.
    """

    def __init__(
        self,
        model: keras.Model,
        checkpoint_dir: str | os.PathLike | None = None,
        *,
        seed: int = 0,
        save_every_steps: int | None = 50,
        save_every_seconds: float | None = None,
        background: bool = True,
        keep: int = 3,
        notice: NoticeHandler | None = None,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0. Received: seed={seed!r}")
        self.model = model
        self.seed = seed
        self.schedule = SaveSchedule(every_steps=save_every_steps, every_seconds=save_every_seconds)
        self.store = CheckpointStore(
            default_checkpoint_dir() if checkpoint_dir is None else checkpoint_dir,
            framework="tensorflow", framework_version=_tf_version(), keep=keep,
        )
        self.checkpointer = KerasCheckpointer(model, self.store, background=background)
        self.notice = notice
        self.step = 0
        self.steps_per_epoch = 0
        self.stopped = False

    def _epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def _after_step(self) -> None:
        self.step += 1
        if self.notice.stop_requested:
            # Final save completes before fit returns (and so before the process exits 0).
            self.checkpointer.save(step=self.step, epoch=self._epoch(), metadata=self._meta(), block=True)
            log.info("stop requested: saved step %d, stopping", self.step)
            self.stopped = True
            self.model.stop_training = True
        elif self.notice.consume_checkpoint_request() or self.schedule.due(self.step):
            self.checkpointer.save(step=self.step, epoch=self._epoch(), metadata=self._meta())
            self.schedule.saved()

    def _meta(self) -> dict:
        return {"steps_per_epoch": self.steps_per_epoch, "seed": self.seed}

    def _batches(self, x, y, start: int, count: int, batch_size: int):
        n = len(x)
        for s in range(start, start + count):
            idx = batch_indices(s, batch_size=batch_size, n=n, seed=self.seed)
            yield x[idx], y[idx]

    def fit(
        self,
        x: np.ndarray,
        y: np.ndarray,
        *,
        batch_size: int,
        epochs: int,
        callbacks: Sequence[keras.callbacks.Callback] = (),
        verbose="auto",
        **fit_kwargs,
    ) -> FitResult:
        """Train ``epochs`` epochs of ``len(x) // batch_size`` full batches (the remainder of each
        epoch's permutation is left out, so every step has one shape), resuming where a previous
        run stopped. A callback that sets ``model.stop_training`` (EarlyStopping) ends training:
        the final checkpoint and ``COMPLETED`` are written at that step (the callback's own state,
        e.g. EarlyStopping's patience counter, is not checkpointed). x, y: numpy arrays with equal first dimension. Other keyword arguments
        (``validation_data``...) go to ``model.fit``; ``shuffle``, ``steps_per_epoch``,
        ``initial_epoch`` are owned by this method (ValueError if given).

        Raises ValueError for bad sizes; FrameworkMismatchError / ShapeMismatchError (naming the
        checkpoint path) when the checkpoint does not fit this model; nothing is deleted then.
        """
        for owned in ("shuffle", "steps_per_epoch", "initial_epoch", "batch_size", "epochs", "x", "y"):
            if owned in fit_kwargs:
                raise ValueError(f"ResumableFit.fit owns {owned!r}; remove it. Received: {owned}={fit_kwargs[owned]!r}")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be an integer >= 1. Received: epochs={epochs!r}")
        if len(x) != len(y):
            raise ValueError(f"x and y must have the same length. Received: len(x)={len(x)}, len(y)={len(y)}")
        if getattr(self.model, "steps_per_execution", 1) != 1:
            raise ValueError("ResumableFit needs model.compile(steps_per_execution=1) to count every step. "
                             f"Received: steps_per_execution={self.model.steps_per_execution}")
        self.steps_per_epoch = spe = steps_per_epoch(len(x), batch_size)
        total = epochs * spe
        self.checkpointer.ensure_built(x[:1])
        restored = self.store.restore(self.checkpointer.read)
        self.step = restored.step if restored is not None else 0
        self.checkpointer.last_saved_step = restored.step if restored is not None else None
        if restored is not None:
            log.info("resumed from %s (step %d of %d)", restored.path, self.step, total)
            saved_spe = restored.metadata.get("steps_per_epoch")
            if saved_spe not in (None, spe):
                raise ValueError(
                    f"checkpoint {str(restored.path)!r} was written with steps_per_epoch={saved_spe}, this run has "
                    f"{spe} (len(x)={len(x)}, batch_size={batch_size}); the data position would not match")
            if self.step > total:
                raise ValueError(
                    f"checkpoint {str(restored.path)!r} is at step {self.step}, beyond this run's {total} steps "
                    f"(epochs={epochs} x {spe} steps); raise epochs or use another checkpoint directory")
            saved_seed = restored.metadata.get("seed")
            if saved_seed not in (None, self.seed):
                log.warning("checkpoint %s was written with seed=%s, this run has seed=%s: the batch order "
                            "from here on differs from the interrupted run's", restored.path, saved_seed, self.seed)
        self.stopped = False
        result = FitResult(step=self.step, epoch=self.step // spe, total_steps=total, completed=False,
                           stopped=False, restored_from=restored)
        own_notice = self.notice is None
        if own_notice:
            self.notice = NoticeHandler().install()
        callbacks = [StepCallback(self), *callbacks]
        try:
            if self.notice.stop_requested and self.step < total:
                # A stop notice before the first step (e.g. during the TensorFlow import): the state
                # is the restored checkpoint's, so there is nothing new to save.
                log.info("stop requested before the first step; nothing to save (step %d)", self.step)
                self.stopped = True
            if self.step < total and self.step % spe and not self.stopped:
                epoch, done = divmod(self.step, spe)
                result.histories.append(self.model.fit(
                    self._batches(x, y, self.step, spe - done, batch_size), steps_per_epoch=spe - done,
                    initial_epoch=epoch, epochs=epoch + 1, callbacks=callbacks, verbose=verbose, shuffle=False,
                    **fit_kwargs))
            ended_by_callback = bool(result.histories) and self.model.stop_training and not self.stopped
            if self.step < total and not self.stopped and not ended_by_callback:
                result.histories.append(self.model.fit(
                    self._batches(x, y, self.step, total - self.step, batch_size), steps_per_epoch=spe,
                    initial_epoch=self.step // spe, epochs=epochs, callbacks=callbacks, verbose=verbose,
                    shuffle=False, **fit_kwargs))
            if not self.stopped:
                if self.step != total:
                    # Another callback (EarlyStopping...) set model.stop_training: training is over.
                    log.info("a callback stopped training at step %d of %d; treating it as the end", self.step, total)
                final = self.checkpointer.save(step=self.step, epoch=self._epoch(), metadata=self._meta(), block=True)
                self.store.mark_complete(step=self.step, epoch=self._epoch())
                log.info("training complete at step %d (%s)", self.step, final.path if final else "")
                result.completed = True
        finally:
            self.checkpointer.close()
            if own_notice:
                self.notice.uninstall()
                self.notice = None
        result.step, result.epoch, result.stopped = self.step, self.step // spe, self.stopped
        return result
