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

Our own step counter (docs/architecture.md, "Checkpoints": Keras 3's ``optimizer.iterations`` under-counts with asynchronous
parameter servers) is an int64 ``tf.Variable`` named ``step`` inside the checkpoint; it is also the
data position. ``tf.train.Checkpoint`` does not track the ``SeedGenerator`` states of Keras 3 layers
(Dropout, random augmentation), so they are added explicitly for every ``keras.Model`` given;
without them a resumed run would draw other dropout masks than an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import tensorflow as tf

from spot_training.training.core import (CHECKPOINT_STORAGE_EXIT_CODE, DEFAULT, DEFAULT_KEEP, CheckpointDriver, StateAdapter,
                           renamed_option, warn_not_exact)
from spot_training.training.notice import NoticeHandler
from spot_training.training.store import Checkpoint, CheckpointError, ShapeMismatchError

__all__ = ["TFAdapter", "TFCheckpointer"]

PREFIX = "tf_ckpt"  # files: tf_ckpt.index, tf_ckpt.data-00000-of-00001
#: 2: adds ``tf_rng`` (the global tf.random.Generator); 1 (without it) is still read.
ADAPTER_FORMAT = 2


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


#: TensorFlow's stateful random kernels: their state lives in the op kernel (seeded from
#: ``tf.random.set_seed`` and an op counter); no API reads or restores it.
STATEFUL_RANDOM_OPS = frozenset({
    "RandomStandardNormal", "RandomUniform", "RandomUniformInt", "TruncatedNormal", "RandomShuffle",
    "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "ParameterizedTruncatedNormal"})


def stateful_random_ops() -> dict[str, list[str]]:
    """``{traced function name: [stateful random op types]}`` over every ``tf.function`` traced in
    this process so far (TensorFlow's eager context keeps their FunctionDefs)."""
    from tensorflow.python.eager import context

    ctx = context.context()
    found = {}
    for name in ctx.list_function_names():
        if not name.startswith("__inference_"):
            continue
        ops = sorted({node.op for node in ctx.get_function_def(name).node_def} & STATEFUL_RANDOM_OPS)
        if ops:
            found[name] = ops
    return found


class TFAdapter(StateAdapter):
    """The ``tf.train.Checkpoint`` :class:`~spot_training.training.core.StateAdapter`.

    :meth:`snapshot` writes with TensorFlow's async checkpoint (``background``: the variables are
    copied to host memory now, on the training thread, and written on TensorFlow's thread) and
    returns ``checkpoint.sync`` as the write function the driver's writer thread waits on; without
    ``background`` it writes synchronously. Format 2 adds ``tf_rng`` (TensorFlow's global
    ``tf.random.Generator``); format 1 checkpoints (without it) are still read.

    Args:
        trackables: the objects to checkpoint, by name (see :class:`TFCheckpointer`).
        background: write with TensorFlow's async checkpoint.
        step: returns the completed steps, stored in the step variable at each snapshot.
    """

    framework = "tensorflow"
    adapter = "tf.train.Checkpoint"
    adapter_format = ADAPTER_FORMAT
    accepted_formats = (1, ADAPTER_FORMAT)

    def __init__(self, trackables: dict, *, background: bool, step: Callable[[], int]) -> None:
        self.step_variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        rng = [v for obj in trackables.values() for v in _seed_generator_states(obj)]
        # The global generator is created on first use (from a non-deterministic state unless the
        # script set one: make_deterministic does); tracked here so that tf.random.get_global_generator()
        # draws inside a step resume where they were.
        try:
            self.global_generator = tf.random.get_global_generator()
        except RuntimeError:  # op determinism is on and no generator was set: nothing to draw from anyway
            self.global_generator = None
        extra = {} if self.global_generator is None else {"tf_rng": self.global_generator}
        self.checkpoint = tf.train.Checkpoint(step=self.step_variable, keras_rng=rng, **extra, **trackables)
        self._legacy = lambda: tf.train.Checkpoint(step=self.step_variable, keras_rng=rng, **trackables)
        self.background = background
        self.async_options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
        if background:
            _fix_keras_async_copy()
        self._step = step
        self._at_step_calls = 0

    def framework_version(self) -> str:
        """``tensorflow <version>`` (see :meth:`StateAdapter.framework_version`)."""
        return f"tensorflow {tf.__version__}"

    def at_step(self, step: int) -> None:
        """After the first traced step, warn once when a traced function uses stateful random ops (not resumable).

        See :meth:`StateAdapter.at_step` and :func:`~spot_training.training.core.warn_not_exact`.

        Args:
            step: completed steps so far (unused; the call count tells the first step).
        """
        # After the first step of the run (the second call: the first follows the restore) the
        # training step has been traced: look once for random ops whose state no checkpoint holds.
        self._at_step_calls += 1
        if self._at_step_calls == 2:
            found = stateful_random_ops()
            if found:
                name, ops = next(iter(found.items()))
                warn_not_exact("tf-stateful-random", (
                    f"the traced function {name} uses the stateful random op(s) {', '.join(ops)} "
                    "(tf.random.normal/uniform, tf.nn.dropout, ...), whose state lives in the op kernel and is not "
                    "checkpointed, so a resumed run draws other numbers; fix: draw from "
                    "tf.random.get_global_generator() or a tf.random.Generator passed to TFCheckpointer, or use "
                    "tf.random.stateless_* with a seed from the step (docs/training.md, \"Your custom TensorFlow loop\")"),
                    logger=logging.getLogger("spot_training.training.tf_loop"))

    def check_metadata(self, ckpt: Checkpoint) -> None:
        """Accept this adapter's checkpoints of format 1 (no ``tf_rng``) and the current format.

        Args:
            ckpt: the checkpoint to check.

        Raises:
            CheckpointError: another adapter or format wrote it.
        """
        meta = ckpt.metadata
        if meta.get("adapter") != self.adapter or meta.get("adapter_format") not in self.accepted_formats:
            raise CheckpointError(
                f"checkpoint {str(ckpt.path)!r} was not written by the {self.adapter!r} adapter (metadata "
                f"adapter={meta.get('adapter')!r}, adapter_format={meta.get('adapter_format')!r}; expected "
                f"{self.adapter!r}, one of {self.accepted_formats}); use another checkpoint directory")

    def snapshot(self, directory: Path):
        """Write the ``tf.train.Checkpoint`` into ``directory`` (asynchronously in background mode).

        Args:
            directory: the store's empty temporary directory.

        Returns:
            ``checkpoint.sync`` in background mode (the driver's writer thread waits on it), else None (written).

        Raises:
            CheckpointError: ``tf.random.set_global_generator()`` replaced the tracked global generator.
        """
        if self.global_generator is not None and tf.random.get_global_generator() is not self.global_generator:
            raise CheckpointError("tf.random.set_global_generator() was called after TFCheckpointer was created: "
                                  "the new global generator is not checkpointed; set it before creating TFCheckpointer")
        self.step_variable.assign(self._step())
        prefix = str(directory / PREFIX)
        if self.background:
            self.checkpoint.write(prefix, options=self.async_options)
            return self.checkpoint.sync
        self.checkpoint.write(prefix)
        return None

    def load(self, ckpt: Checkpoint) -> None:
        """Read ``ckpt`` into the trackables and check that every existing object matched.

        Args:
            ckpt: the checkpoint to restore.

        Raises:
            ShapeMismatchError: a variable's shape differs or an object was not matched.
            CheckpointError: the checkpoint does not fit these objects, or its step variable disagrees
                with its manifest.
        """
        checkpoint = self._legacy() if ckpt.metadata.get("adapter_format") == 1 else self.checkpoint
        prefix = str(ckpt.path / PREFIX)
        try:
            status = checkpoint.read(prefix)
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
        held = int(self.step_variable.numpy())
        if held != ckpt.step:
            raise CheckpointError(f"checkpoint {str(ckpt.path)!r}: manifest says step {ckpt.step}, "
                                  f"the step variable holds {held}")


class TFCheckpointer(CheckpointDriver):
    """Checkpoint, resume and notice handling for a custom TensorFlow loop.

    :class:`~spot_training.training.core.CheckpointDriver` with a :class:`TFAdapter`. Build everything
    before :meth:`restore` (call the model once, ``optimizer.build(model.trainable_variables)``: Keras 3
    creates slots lazily and a restore into missing slots is deferred, not checked).

    Random numbers inside the step: ``tf.random.get_global_generator()`` and any
    ``tf.random.Generator`` passed as a trackable resume exactly; so do Keras layers' SeedGenerators.
    Stateful ops (``tf.random.normal``, ``tf.nn.dropout`` with op seeds from ``tf.random.set_seed``)
    keep their counter inside the op kernel, which no API reads or restores: they do not resume
    (docs/training.md).

    Attributes: ``step`` (completed steps, Python int), ``step_variable`` (the int64 tf.Variable in
    the checkpoint), ``checkpoint`` (the ``tf.train.Checkpoint``), ``restored``.

    Args:
        checkpoint_dir: as :class:`~spot_training.training.core.CheckpointDriver` (deprecated name ``directory``).
        every_steps: as the driver (default ``$SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`` or 50).
        every_seconds: as the driver.
        background: TensorFlow's async checkpoint plus the driver's committing thread (default True).
        keep: as the driver.
        steps_per_epoch: as the driver.
        notices: as the driver (deprecated name ``notice``).
        metadata: as the driver.
        logger: default ``logging.getLogger("spot_training.training.tf_loop")``.
        **trackables: the objects to checkpoint, by name (``model=``, ``optimizer=``, a
            ``tf.random.Generator``, a ``tf.data`` iterator, any ``tf.Variable``); ``step``,
            ``keras_rng`` and ``tf_rng`` are reserved.

    Raises:
        CheckpointPathError: the directory is a file or not writable (naming the path).
        ValueError: no trackable, a reserved name, or ``background`` not a bool.
        TypeError: a deprecated and a current name given with different values.
    """

    storage_exit_code = CHECKPOINT_STORAGE_EXIT_CODE

    def __init__(
        self,
        *,
        checkpoint_dir: str | os.PathLike | None = None,
        every_steps: int | None = DEFAULT,
        every_seconds: float | None = DEFAULT,
        background: bool = True,
        keep: int = DEFAULT_KEEP,
        steps_per_epoch: int | None = None,
        notices: NoticeHandler | None = None,
        metadata: Callable[[], dict] | None = None,
        logger: logging.Logger | None = None,
        **trackables: Any,
    ) -> None:
        checkpoint_dir = renamed_option(trackables, "directory", "checkpoint_dir", checkpoint_dir,
                                        owner="TFCheckpointer", unset=None)
        notices = renamed_option(trackables, "notice", "notices", notices, owner="TFCheckpointer", unset=None)
        for reserved in ("step", "keras_rng", "tf_rng"):
            if reserved in trackables:
                raise ValueError(f"{reserved!r} is reserved by TFCheckpointer; pass your object under another name")
        if not trackables:
            raise ValueError("TFCheckpointer needs something to checkpoint, e.g. TFCheckpointer(model=m, optimizer=o)")
        if not isinstance(background, bool):
            raise ValueError(f"background must be True or False. Received: background={background!r}")
        adapter = TFAdapter(trackables, background=background, step=lambda: self.step)
        super().__init__(adapter, checkpoint_dir=checkpoint_dir, every_steps=every_steps,
                         every_seconds=every_seconds, background=background, keep=keep,
                         steps_per_epoch=steps_per_epoch, notices=notices, metadata=metadata,
                         logger=logger or logging.getLogger("spot_training.training.tf_loop"))
        self.step_variable = adapter.step_variable
        self.checkpoint = adapter.checkpoint
