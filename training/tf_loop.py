"""Resumable custom TensorFlow training loops: ``tf.train.Checkpoint`` written through the checkpoint store.

A plain custom loop becomes resumable like this (docs/training.md)::

    ckpt = TFCheckpointer(model=model, optimizer=optimizer, steps_per_epoch=spe)     # + 1
    for step in ckpt.steps(total_steps):                                              # was: for step in range(total_steps)
        idx = batch_indices(step, batch_size=bs, n=len(x), seed=seed)                 # + 1 (data from the step)
        train_step(x[idx], y[idx])

``steps()`` restores the newest valid checkpoint, yields the 0-based global step indices still to
run, saves on the cadence and on request (SIGUSR1 or the request file), and on SIGTERM finishes the
current step, saves (waiting for the write) and exits 0. After the last step it writes the final
checkpoint and ``COMPLETED`` (docs/contracts.md).

What TensorFlow gives and what this adds. ``tf.train.Checkpoint`` writes the objects (a Keras 3
model, its optimizer with slots and iteration counter, anything trackable) and reads them back with
shape checks; ``tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)`` copies the
variables to host memory on the calling thread and writes them on TensorFlow's own background
thread, which is exactly the background saving we want, so it is used as is. ``tf.train.CheckpointManager``
is not used: it writes in place in the checkpoint directory without fsync or checksums, keeps its
own ``checkpoint`` state file (not atomic with the data), and on restore only knows "the latest",
so a torn newest checkpoint is fatal instead of falling back. Instead each ``Checkpoint.write``
goes into a temporary directory from :meth:`CheckpointStore.begin` and the store commits it
(fsync, sha256 manifest, rename, ``LATEST``, keep-N), after TensorFlow's ``sync()`` on the
:class:`BackgroundSaver` thread in background mode.

Our own step counter (design.md: Keras 3's ``optimizer.iterations`` under-counts with asynchronous
parameter servers) is an int64 ``tf.Variable`` named ``step`` inside the checkpoint; it is also the
data position. ``tf.train.Checkpoint`` does not track the ``SeedGenerator`` states of Keras 3 layers
(Dropout, random augmentation), so they are added explicitly for every ``keras.Model`` given;
without them a resumed run would draw other dropout masks than an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import tensorflow as tf

from training.datasets import default_checkpoint_dir
from training.notice import NoticeHandler, SaveSchedule
from training.store import (
    BackgroundSaver,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    ShapeMismatchError,
)

__all__ = ["TFCheckpointer"]

PREFIX = "tf_ckpt"  # files: tf_ckpt.index, tf_ckpt.data-00000-of-00001
ADAPTER_FORMAT = 1


_KERAS_ASYNC_FIXED = False


def _fix_keras_async_copy() -> None:
    """Make Keras 3 variables work with TensorFlow's async checkpoint more than once.

    TensorFlow's async checkpoint copies every variable to a CPU twin inside a ``tf.function`` on
    each write, through ``_copy_trackable_to_cpu(object_map)``: ``ResourceVariable`` creates its
    twin once and assigns it on later writes. Keras 3.15's ``Variable._copy_trackable_to_cpu``
    (keras/src/backend/tensorflow/core.py, added by keras-team/keras#18749) wraps the twin in a new
    ``tf.Variable`` on every call, so the second async write fails with "tf.function only supports
    singleton tf.Variables created on the first call" (seen here with TF 2.17.1 / Keras 3.15.1).
    The fix maps the Keras variable to its underlying variable's twin, which TensorFlow refreshes on
    every write and serializes under the same ``VARIABLE_VALUE`` key. Applied once, only when
    background saving is used; tests/training/test_tf_loop_resume.py proves it (several background
    saves, resume from the newest, bitwise equal).
    """
    global _KERAS_ASYNC_FIXED
    if _KERAS_ASYNC_FIXED:
        return
    from keras.src.backend.tensorflow.core import Variable as KerasTFVariable

    def _copy_trackable_to_cpu(self, object_map):
        self.value._copy_trackable_to_cpu(object_map)
        object_map[self] = object_map[self.value]

    KerasTFVariable._copy_trackable_to_cpu = _copy_trackable_to_cpu
    _KERAS_ASYNC_FIXED = True


def _seed_generator_states(model) -> list:
    # Keras 3 keeps each SeedGenerator's state as a variable whose path ends in "seed_generator_state";
    # Layer.variables lists them, tf.train.Checkpoint's object graph does not reach them.
    # Plain tf.Variables (of a tf.Module) have no ``path`` and are tracked by TensorFlow anyway.
    return [v for v in getattr(model, "variables", []) if str(getattr(v, "path", "")).endswith("seed_generator_state")]


class TFCheckpointer:
    """Checkpoint, resume and notice handling for a custom TensorFlow loop.

    trackables: the objects to checkpoint, by name (``model=``, ``optimizer=``, a
    ``tf.data`` iterator, any ``tf.Variable``); names ``step`` and ``keras_rng`` are reserved.
    Build everything before :meth:`restore` (call the model once, ``optimizer.build(model.trainable_variables)``:
    Keras 3 creates slots lazily and a restore into missing slots is deferred, not checked).
    directory: default ``$SPOT_TRAINING_CHECKPOINT_DIR`` or ``/dltraining/checkpoints``
    (CheckpointPathError if it is a file). every_steps: default 50 (None: off). every_seconds:
    default None. background: TensorFlow's async checkpoint + a committing thread (default True).
    keep: >= 2 (default 3). steps_per_epoch: to record epochs (default None: epoch 0).
    notices: a NoticeHandler (default: SIGTERM, SIGUSR1, ``$SPOT_TRAINING_CHECKPOINT_REQUEST_FILE``).

    Attributes: ``step`` (completed steps, Python int), ``step_variable`` (the int64 tf.Variable in
    the checkpoint), ``checkpoint`` (the ``tf.train.Checkpoint``), ``restored``.
    """

    def __init__(
        self,
        *,
        directory: str | os.PathLike | None = None,
        every_steps: int | None = 50,
        every_seconds: float | None = None,
        background: bool = True,
        keep: int = 3,
        steps_per_epoch: int | None = None,
        notices: NoticeHandler | None = None,
        logger: logging.Logger | None = None,
        **trackables: Any,
    ) -> None:
        for reserved in ("step", "keras_rng"):
            if reserved in trackables:
                raise ValueError(f"{reserved!r} is reserved by TFCheckpointer; pass your object under another name")
        if not trackables:
            raise ValueError("TFCheckpointer needs something to checkpoint, e.g. TFCheckpointer(model=m, optimizer=o)")
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                            or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be an integer >= 1 or None. Received: steps_per_epoch={steps_per_epoch!r}")
        if not isinstance(background, bool):
            raise ValueError(f"background must be True or False. Received: background={background!r}")
        self.log = logger or logging.getLogger("training.tf_loop")
        self.store = CheckpointStore(
            directory if directory is not None else default_checkpoint_dir(),
            framework="tensorflow", framework_version=f"tensorflow {tf.__version__}", keep=keep, logger=self.log,
        )
        self.step_variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        rng = [v for obj in trackables.values() for v in _seed_generator_states(obj)]
        self.checkpoint = tf.train.Checkpoint(step=self.step_variable, keras_rng=rng, **trackables)
        self.schedule = SaveSchedule(every_steps=every_steps, every_seconds=every_seconds)
        self.background = background
        self.async_options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
        if background:
            _fix_keras_async_copy()
        self.saver = BackgroundSaver(self.store) if background else None
        self.steps_per_epoch = steps_per_epoch
        self.notices = notices if notices is not None else NoticeHandler()
        self.step = 0
        self.restored: Checkpoint | None = None
        self.last_saved_step: int | None = None
        self.save_seconds: list[float] = []  # training-thread time per save (host copy, or whole write)

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self.store.directory

    def epoch_of(self, step: int) -> int:
        """Epoch (0-based) that the step after ``step`` completed steps belongs to."""
        return step // self.steps_per_epoch if self.steps_per_epoch else 0

    # ------------------------------------------------------------------ restore / save
    def _read(self, ckpt: Checkpoint) -> None:
        prefix = str(ckpt.path / PREFIX)
        try:
            status = self.checkpoint.read(prefix)
            status.assert_existing_objects_matched()
        except (ValueError, tf.errors.InvalidArgumentError) as err:
            text = str(err)
            if "shape" in text:
                raise ShapeMismatchError(
                    f"checkpoint {str(ckpt.path)!r} does not fit this model: {text.strip()} "
                    "(restore into the same architecture that wrote it, or use another checkpoint directory)"
                ) from err
            raise CheckpointError(f"checkpoint {str(ckpt.path)!r} cannot be restored into these objects: {text}") from err
        except AssertionError as err:
            raise ShapeMismatchError(
                f"checkpoint {str(ckpt.path)!r} does not match the objects given: {err}") from err

    def restore(self) -> int:
        """Load the newest valid checkpoint; return the completed steps (0 when there is none).

        Raises FrameworkMismatchError (MXNet checkpoint), ShapeMismatchError (message names the
        path, the variable and both shapes); nothing is changed on disk in either case.
        """
        ckpt = self.store.restore(self._read)
        self.restored = ckpt
        self.step = int(self.step_variable.numpy()) if ckpt is not None else 0
        if ckpt is not None and self.step != ckpt.step:
            raise CheckpointError(f"checkpoint {str(ckpt.path)!r}: manifest says step {ckpt.step}, "
                                  f"the step variable holds {self.step}")
        self.last_saved_step = ckpt.step if ckpt is not None else None
        if ckpt is not None:
            self.log.info("restored %s: step %d, epoch %d", ckpt.path, ckpt.step, ckpt.epoch)
        return self.step

    def _metadata(self) -> dict:
        return {"adapter": "tf.train.Checkpoint", "adapter_format": ADAPTER_FORMAT,
                "steps_per_epoch": self.steps_per_epoch}

    def save(self, *, wait: bool = False) -> Checkpoint | None:
        """Checkpoint the current state at :attr:`step` (call between steps). Background mode:
        TensorFlow copies to host memory now and writes on its thread; the store commits on ours
        (returns None unless ``wait``). A step already saved is not written again."""
        started = time.perf_counter()
        if self.last_saved_step == self.step:
            return self.saver.wait() if (wait and self.saver) else None
        self.step_variable.assign(self.step)
        step, epoch = self.step, self.epoch_of(self.step)
        if self.saver is not None:
            self.saver.wait()  # never two writes at once: the previous commit is done
            tmp = self.store.begin(step)
            try:
                self.checkpoint.write(str(tmp / PREFIX), options=self.async_options)
            except BaseException:
                self.store.abort(tmp)
                raise
            self.saver.submit_prepared(tmp, self.checkpoint.sync, step=step, epoch=epoch, metadata=self._metadata())
            ckpt = self.saver.wait() if wait else None
        else:
            # Synchronous mode, or after close(): a plain (blocking) write.
            ckpt = self.store.save(lambda d: self.checkpoint.write(str(d / PREFIX)),
                                   step=step, epoch=epoch, metadata=self._metadata())
        self.last_saved_step = step
        self.schedule.saved()
        self.save_seconds.append(time.perf_counter() - started)
        return ckpt

    # ------------------------------------------------------------------ loop
    def install(self) -> "TFCheckpointer":
        """Install the notice handlers (SIGTERM, SIGUSR1); must run on the main thread."""
        self.notices.install()
        return self

    def after_step(self, *, exit_on_stop: bool = True) -> bool:
        """Count one completed step, then save if due, requested, or a stop was requested.

        On a stop request the checkpoint is written and waited for, then SystemExit(0) is raised
        (exit_on_stop=True, the default) or True returned. Returns False otherwise."""
        self.step += 1
        if self.notices.stop_requested:
            self.save(wait=True)
            self.log.info("stop requested: checkpoint at step %d written, exiting 0", self.step)
            self.close()
            if exit_on_stop:
                raise SystemExit(0)
            return True
        requested = self.notices.consume_checkpoint_request()
        if requested or self.schedule.due(self.step):
            self.save()
        return False

    def finish(self) -> Checkpoint:
        """Write the final checkpoint (waited for), then ``COMPLETED``; return the checkpoint."""
        ckpt = self.save(wait=True)
        if ckpt is None or ckpt.step != self.step:
            ckpt = self.store.latest()
        if ckpt is None or ckpt.step != self.step:
            raise CheckpointError(f"final checkpoint at step {self.step} is not in {str(self.directory)!r}; "
                                  "not writing COMPLETED")
        self.store.mark_complete(step=self.step, epoch=self.epoch_of(self.step))
        return ckpt

    def close(self) -> None:
        """Wait for a pending write, stop the writer thread, uninstall the notice handlers."""
        try:
            if self.saver is not None:
                self.saver.close()
                self.saver = None
        finally:
            self.notices.uninstall()

    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield the 0-based global step indices from the restored step up to ``total_steps - 1``,
        calling :meth:`after_step` after each; then :meth:`finish` and :meth:`close`. A directory
        that is already COMPLETED at ``total_steps`` yields nothing."""
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be an integer >= 1. Received: total_steps={total_steps!r}")
        self.install()
        try:
            self.restore()
            if self.step > total_steps:
                raise ValueError(f"checkpoint in {str(self.directory)!r} is at step {self.step}, beyond "
                                 f"total_steps={total_steps}")
            while self.step < total_steps:
                yield self.step
                self.after_step()
            self.finish()
        finally:
            self.close()
