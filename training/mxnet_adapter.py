"""Resumable MXNet Gluon training: parameters, trainer (optimizer) states, step counter, notices.

MXNet is imported lazily (inside functions), so importing this module costs nothing and never
pulls MXNet into a process that has TensorFlow (MXNet 1.9.1 segfaults when TensorFlow came first).

A plain Gluon loop becomes resumable with four added lines (docs/training-mxnet.md)::

    ckpt = GluonCheckpointer(net, trainer, every_steps=50, steps_per_epoch=spe)   # + 1
    for step in ckpt.steps(total_steps):                                          # loop over steps
        idx = batch_indices(step, batch_size=bs, n=len(x), seed=seed)             # + 1 (data from the step)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x[idx])), mx.nd.array(y[idx]))
        loss.backward()
        trainer.step(bs)

``steps()`` restores the newest valid checkpoint, yields the 0-based global step indices still to
run, saves on the cadence and on request (SIGUSR1 or the request file), and on SIGTERM finishes the
current step, saves and exits 0. After the last step it writes the final checkpoint and
``COMPLETED`` (docs/contracts.md).

What one checkpoint holds (inside the store's ``ckpt-<step>`` directory, see training/store.py):

``model.params``
    every parameter (BatchNorm running statistics included) in the format of
    ``Block.save_parameters`` (``mx.nd.save`` of the structural names, ``features.0.weight``), so
    ``net.load_parameters(path)`` reads it.
``trainer.states``
    the pickle ``gluon.Trainer.save_states`` writes (the updater's states and the optimizer with its
    update counts and learning-rate schedule; pickle protocol 5, see :class:`StatesPickler`), so
    ``trainer.load_states(path)`` reads it.
manifest metadata
    ``steps_per_epoch`` and the adapter's format version. The step counter is the manifest's ``step``:
    the number of completed optimizer steps, which is also the data position (training/datasets.py).

Background saving: at the step boundary every parameter and optimizer-state array is copied to
host memory with ``NDArray.copyto`` (an engine operation ordered after the step that wrote the
array and before the next one that overwrites it: a consistent copy that the training thread does
not wait for), into one of two sets of host arrays allocated at the first two saves and used in
turn, and the optimizer object is copied on the training thread. The copy is written
on the :class:`~training.store.BackgroundSaver` thread (``mx.nd.save`` and pickle, which wait for
the copies; MXNet's default threaded engine accepts calls from any thread and ctypes releases the
GIL while they run). The training thread never waits for the write except at the next save, if the
previous one is still running, and at the final save before exit.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from training.datasets import batch_indices, default_checkpoint_dir, steps_per_epoch
from training.notice import NoticeHandler, SaveSchedule
from training.store import (
    BackgroundSaver,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    ShapeMismatchError,
)

__all__ = ["GluonCheckpointer", "GluonState", "PARAMS_FILE", "TRAINER_FILE", "capture_state", "check_shapes",
           "load_state", "remap_trainer_states", "StatesPickler", "sync_distributed_parameters", "trainer_order",
           # re-exported so that a training script needs one import line (docs/training-mxnet.md)
           "batch_indices", "steps_per_epoch"]

PARAMS_FILE = "model.params"
TRAINER_FILE = "trainer.states"
ADAPTER_FORMAT = 2
FRAMEWORK = "mxnet"


def _mxnet_version() -> str:
    import mxnet as mx

    return str(mx.__version__)


class GluonState:
    """A host-memory copy of a Gluon model's parameters and trainer states at one step boundary.

    params: ``{structural name: NDArray on the CPU}``; states: the updater's state structure with
    every NDArray copied to the CPU; optimizer: a copy of the optimizer (update counts, learning-rate
    schedule) taken on the training thread. :meth:`write` writes ``model.params`` with ``mx.nd.save``
    (the format of ``Block.save_parameters``) and ``trainer.states`` as the pickle of ``(states,
    optimizer)``, the objects ``Trainer.save_states`` pickles when not updating on the kvstore, with
    :class:`StatesPickler` (protocol 5; ``Trainer.load_states`` reads it).
    """

    def __init__(self, params: dict, states: dict, optimizer) -> None:
        self.params = params
        self.states = states
        self.optimizer = optimizer

    @property
    def nbytes(self) -> int:
        """Size of the copied arrays in bytes (waits for the copies)."""
        total = 0
        for array in list(self.params.values()) + list(_arrays_in(self.states)):
            total += int(np.prod(array.shape)) * np.dtype(array.dtype).itemsize
        return total

    def write(self, directory: Path) -> None:
        """Write ``model.params`` and ``trainer.states`` into ``directory`` (fsync is the store's job).

        Safe on the background thread: it only reads this copy (MXNet's engine makes the reads wait
        for the pending copy operations) and never touches the live model.
        """
        import mxnet as mx

        _lower_background_priority()
        directory = Path(directory)
        mx.nd.save(str(directory / PARAMS_FILE), self.params)
        with open(directory / TRAINER_FILE, "wb") as handle:
            # Streams the large state buffers to the file instead of building the whole
            # 2x-parameters-sized byte string first, as Updater.get_states would.
            StatesPickler(handle).dump((self.states, self.optimizer))


class StatesPickler(pickle.Pickler):
    """Pickles dense NDArrays straight from MXNet's serialized bytes; everything else as ``pickle``.

    ``NDArray.__getstate__`` copies each array's ``MXNDArraySaveRawBytes`` output into a new
    ``bytearray``, and protocol 4 copies that again into ``bytes``: two copies into fresh memory per
    array, 0.09-0.10 s of writer CPU for the 43 MB of Adam states of the 5.4 M-parameter benchmark
    model on a 2-core VM, where ``mx.nd.save`` writes the 21.5 MB of parameters in 0.015 s. This
    pickler gives pickle a writable view of those serialized bytes (a protocol-5
    ``PickleBuffer``, written in-band, so ``pickle.loads`` returns it as the ``bytearray``
    ``NDArray.__setstate__`` expects): 0.022 s for the same states. The stream holds the same
    objects as ``pickle.dumps((states, optimizer))`` and ``Trainer.load_states`` reads it.
    Hand-rolled because MXNet's NDArray pickling offers no way around the copies.

    The view points into MXNet's per-thread return buffer, which the next ``SaveRawBytes`` call on
    this thread overwrites; pickle writes (or copies) each buffer before it moves to the next object.
    """

    def __init__(self, file) -> None:
        super().__init__(file, protocol=5)

    def reducer_override(self, obj):
        import ctypes

        from mxnet.base import _LIB, check_call
        from mxnet.ndarray import NDArray

        if type(obj) is not NDArray or obj.handle is None:  # sparse arrays and the rest: pickle's way
            return NotImplemented
        length = ctypes.c_size_t()
        pointer = ctypes.POINTER(ctypes.c_char)()
        check_call(_LIB.MXNDArraySaveRawBytes(obj.handle, ctypes.byref(length), ctypes.byref(pointer)))
        raw = (ctypes.c_char * length.value).from_address(ctypes.addressof(pointer.contents))
        # NDArray.__reduce__ returns (NDArray, (None,), {"handle": <serialized bytes>}); so does this.
        return NDArray, (None,), {"handle": pickle.PickleBuffer(memoryview(raw).cast("B"))}


#: nice value the background writer thread runs at (Linux), so that on a node without a spare core
#: the write takes the CPU time training leaves over instead of slowing every step down.
WRITER_NICE = 10


def _lower_background_priority() -> None:
    """Lower the calling thread's CPU priority to :data:`WRITER_NICE` unless it is the main thread.

    Linux gives every thread its own nice value (``setpriority`` on the thread id); raising it needs
    no privilege. No library does this for a writer thread, hence these lines. No-op elsewhere.
    """
    if threading.current_thread() is threading.main_thread() or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < WRITER_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
    except OSError:
        pass  # not permitted in this sandbox: the write just runs at normal priority


def _arrays_in(state) -> Iterator:
    if state is None:
        return
    if isinstance(state, dict):
        for value in state.values():
            yield from _arrays_in(value)
    elif isinstance(state, (tuple, list)):
        for value in state:
            yield from _arrays_in(value)
    elif hasattr(state, "copyto"):
        yield state


def _copy_to_cpu(state, cpu, out=None):
    """Same structure as ``state`` (None, NDArray, or nested tuples/lists) with every NDArray copied
    to ``cpu``: into the matching array of ``out`` (same place in the structure, a dense CPU array
    of the same shape and dtype) when there is one, else into new memory."""
    if isinstance(state, (tuple, list)):
        outs = out if isinstance(out, (tuple, list)) and len(out) == len(state) else [None] * len(state)
        copied = [_copy_to_cpu(value, cpu, o) for value, o in zip(state, outs)]
        return tuple(copied) if isinstance(state, tuple) else copied
    if hasattr(state, "copyto"):
        if (out is not None and getattr(state, "stype", None) == "default" and getattr(out, "stype", None) == "default"
                and out.shape == state.shape and out.dtype == state.dtype and out.context == cpu):
            state.copyto(out)
            return out
        return state.copyto(cpu)
    return state


def _named_parameters(net) -> dict:
    # Block._collect_params_with_prefix() is what Block.save_parameters/load_parameters use: names
    # from the block structure ("features.0.weight"), stable across processes, unlike the global
    # name-counter prefixes of collect_params() ("resnet0_conv0_weight"). MXNet has no public
    # accessor for them in 1.9.1.
    return net._collect_params_with_prefix()


def _updater(trainer):
    """The trainer's single-context updater; raises ValueError when states live in the kvstore."""
    if not trainer._kv_initialized:  # what Trainer.save_states does first (MXNet 1.9.1)
        trainer._init_kvstore()
    if trainer._update_on_kvstore:
        raise ValueError(
            "the Gluon Trainer updates on the kvstore (update_on_kvstore=True), where "
            "Trainer.save_states refuses in distributed mode and states cannot be copied to host "
            "memory; create it with gluon.Trainer(..., update_on_kvstore=False)"
        )
    return trainer._updaters[0]


def _is_distributed(trainer) -> bool:
    """True when ``trainer`` was given a ``dist_*`` kvstore (a type name or a KVStore object)."""
    kvstore = trainer._kvstore_params.get("kvstore")  # what Trainer._init_kvstore reads (MXNet 1.9.1)
    name = kvstore if isinstance(kvstore, str) else getattr(kvstore, "type", "")
    return "dist" in str(name)


def sync_distributed_parameters(trainer, *, logger: logging.Logger | None = None) -> bool:
    """Broadcast rank 0's parameters through ``trainer``'s distributed kvstore now and wait for them.

    Gluon initializes a kvstore lazily inside the first ``Trainer.step()``: for each parameter it
    broadcasts rank 0's value (kvstore init, then a pull into the parameter) and right after pushes
    the gradient on the same key. In MXNet 1.9.1 nothing orders that pull (it writes the parameter)
    before the gradient push (it reads the gradient): a busy worker's pull can reach the server after
    the first gradient round completed there, and that worker takes the summed gradients as its
    weights. (On the CPU the kvstore pushes the gradient array itself instead of copying it into the
    buffer the pull writes, so the engine sees no dependency between the two.) Seen here with
    ``dist_sync``, ``update_on_kvstore=False``: rank 0's loss went from 2.3 to 14.3 at step 2 of a
    2-worker run on a loaded machine, a CI run of the cluster drill ended at 0.1 held-out accuracy,
    and 19 of 48 two-worker trials (6 clusters at once on 2 cores) ended step 1 with different
    weights on the two workers; 0 of 24 after this call (tests/mxnet/test_dist_init.py).

    Does the broadcast ahead of time (``Trainer._init_kvstore``/``_init_params``, what
    ``Trainer.save_states`` and ``load_states`` call first; MXNet has no public way) and waits for
    the engine, so the first gradient push starts after the pulls completed. It is a collective
    operation (kvstore init ends in a barrier): every worker calls it at the same point, after the
    parameters are initialized and before the first step. :meth:`GluonCheckpointer.restore` calls it.

    Returns True when it synchronized, False for a non-distributed kvstore (nothing done) or when a
    parameter still has deferred initialization (logged: the first ``step()`` then initializes the
    kvstore as usual, with the race above).
    """
    import mxnet as mx

    if not _is_distributed(trainer):
        return False
    deferred = [param.name for param in trainer._params if param._deferred_init]
    if deferred:
        (logger or logging.getLogger("training.mxnet")).warning(
            "cannot broadcast the parameters before the first step: %s not initialized yet (give the layers "
            "their input sizes); the first Trainer.step() initializes the distributed kvstore instead", deferred)
        return False
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    if trainer._params_to_init:
        trainer._init_params()
    mx.nd.waitall()
    return True


def capture_state(net, trainer, out: GluonState | None = None) -> GluonState:
    """Copy ``net``'s parameters and ``trainer``'s states to host memory (call between steps).

    out: a state captured earlier whose arrays may be overwritten (nothing may still read them, e.g.
    a background write of it must have finished): each array is copied into its counterpart there
    when shape and dtype match, else into new memory. Default None: all new memory. On this VM a copy
    of the benchmark's 64.6 MB into new memory took 10-63 ms of the engine's time (memory freed
    seconds earlier faults again when touched, as the Keras adapter found), into reused arrays ~12 ms.

    Every array is copied with ``NDArray.copyto``: MXNet's engine runs the copy after the
    step that wrote the array and before the next step overwrites it (it orders operations by the
    arrays they read and write), so the copy is consistent, yet the training thread does not wait
    for it the way ``asnumpy()`` would (a 64 MB state took 0.3-0.4 s through ``asnumpy()`` and
    pickling on a busy 2-core machine). The optimizer object (update counts, schedule) is small and
    is copied right here with a pickle round trip, the serialisation ``Trainer.save_states`` uses.

    Raises:
        ValueError: the trainer has ``update_on_kvstore=True``, or a parameter is not initialized yet.
    """
    import mxnet as mx

    cpu = mx.cpu()
    params = {}
    for name, param in _named_parameters(net).items():
        if param._data is None:
            raise ValueError(
                f"parameter {name!r} is not initialized (deferred initialization): run one forward "
                "pass or give the layers their input sizes before saving a checkpoint"
            )
        copies = param.list_data()
        # One context: copy it. Several: _reduce() (what save_parameters stores) averages them on the CPU.
        reuse = out.params.get(name) if out is not None else None
        params[name] = _copy_to_cpu(copies[0], cpu, reuse) if len(copies) == 1 else param._reduce()
    updater = _updater(trainer)
    old_states = out.states if out is not None else {}
    states = {index: _copy_to_cpu(state, cpu, old_states.get(index)) for index, state in updater.states.items()}
    optimizer = pickle.loads(pickle.dumps(updater.optimizer))
    return GluonState(params, states, optimizer)


def check_shapes(net, params: dict, *, path: Path) -> None:
    """Raise ShapeMismatchError unless ``params`` has exactly ``net``'s parameters with matching shapes.

    A dimension of 0 in the model (unknown before deferred initialization) matches any size.
    The message names the checkpoint ``path``, each parameter and both shapes.
    """
    model = _named_parameters(net)
    missing = sorted(set(model) - set(params))
    unexpected = sorted(set(params) - set(model))
    problems = []
    for name in sorted(set(model) & set(params)):
        want = tuple(model[name].shape or ())
        got = tuple(params[name].shape)
        if len(want) != len(got) or any(w not in (0, -1, g) for w, g in zip(want, got)):
            problems.append(f"parameter {name!r}: checkpoint has shape {got}, model has shape {want}")
    if missing:
        problems.append(f"model parameter(s) missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"checkpoint parameter(s) the model does not have: {unexpected}")
    if problems:
        raise ShapeMismatchError(
            f"checkpoint {str(path)!r} does not match the model: " + "; ".join(problems)
            + ". Build the same model as the run that wrote it, or use another checkpoint directory."
        )


def trainer_order(net, trainer) -> list[str]:
    """Structural names of ``trainer``'s parameters in the trainer's index order.

    ``gluon.Trainer`` keys optimizer states and update counts by the parameter's index in its own
    list, which it builds by sorting the global names (``conv10_weight`` sorts before
    ``conv9_weight``) or takes as given; the same model built in another order or process can get
    another order. Checkpoints record this list so that :func:`remap_trainer_states` can move each
    state back to its parameter. Parameters that ``net`` does not hold keep their global name.
    """
    by_id: dict[int, str] = {}
    for name, param in _named_parameters(net).items():
        by_id.setdefault(id(param), name)
    return [by_id.get(id(param), param.name) for param in trainer._params]


def remap_trainer_states(trainer, saved_order: list[str], current_order: list[str], *, path: Path) -> None:
    """Re-key the loaded updater states and Adam-style per-index update counts from the saved
    parameter order to the current one (no-op when they are equal).

    Raises:
        ShapeMismatchError: the two orders do not hold the same parameter names.
    """
    if saved_order == current_order:
        return
    _check_same_parameters(saved_order, current_order, path=path)
    where = {name: i for i, name in enumerate(current_order)}
    perm = {old: where[name] for old, name in enumerate(saved_order)}
    for updater in trainer._updaters:
        updater.states = {perm.get(k, k): v for k, v in updater.states.items()}
        updater.states_synced = dict.fromkeys(updater.states, False)
    optimizer = trainer._optimizer
    # The optimizer's counts dicts are shared by reference (_index_update_count is one of them): edit in place.
    for counts in optimizer._all_index_update_counts.values():
        remapped = {perm.get(k, k): v for k, v in counts.items()}
        counts.clear()
        counts.update(remapped)


def _check_same_parameters(saved_order: list[str], current_order: list[str], *, path: Path) -> None:
    if sorted(saved_order) != sorted(current_order):
        raise ShapeMismatchError(
            f"checkpoint {str(path)!r}: the trainer optimizes other parameters than the one that wrote it "
            f"(only in checkpoint: {sorted(set(saved_order) - set(current_order))}, only in this trainer: "
            f"{sorted(set(current_order) - set(saved_order))})"
        )


def load_state(net, trainer, path: Path, *, saved_order: list[str] | None = None) -> None:
    """Load a checkpoint directory written by :class:`GluonState` into ``net`` and ``trainer``.

    All shapes are checked before anything is changed (ShapeMismatchError, nothing modified).
    Trainer states go through the public ``Trainer.load_states``.
    """
    import mxnet as mx

    path = Path(path)
    params = mx.nd.load(str(path / PARAMS_FILE))
    if not isinstance(params, dict):
        raise CheckpointError(f"{path / PARAMS_FILE} holds a list of arrays, not named parameters")
    check_shapes(net, params, path=path)
    _updater(trainer)  # fails clearly before any change when update_on_kvstore=True
    current_order = trainer_order(net, trainer)
    if saved_order is not None:
        _check_same_parameters(saved_order, current_order, path=path)
    for name, param in _named_parameters(net).items():
        param.set_data(params[name])
    trainer.load_states(str(path / TRAINER_FILE))
    if saved_order is not None:
        remap_trainer_states(trainer, saved_order, current_order, path=path)


class GluonCheckpointer:
    """Checkpoint, resume and interruption handling for a Gluon ``net`` trained with ``trainer``.

    Args:
        net: the ``gluon.Block``; its parameters must be initialized before the first save.
        trainer: a ``gluon.Trainer`` with ``update_on_kvstore=False`` (the default on one device).
        directory: checkpoint directory (default ``$SPOT_TRAINING_CHECKPOINT_DIR`` or
            ``/dltraining/checkpoints``). CheckpointPathError if it is a file.
        every_steps: save when the completed step count is a multiple of it (default 50; None: off).
        every_seconds: also save when this many seconds passed since the last save (default None).
        background: copy to host memory and write on a background thread (default True); False
            writes synchronously inside :meth:`after_step`.
        keep: checkpoints kept, >= 2 (default 3).
        steps_per_epoch: used to record the epoch of each checkpoint (default None: epoch 0).
        notices: a :class:`~training.notice.NoticeHandler` (default: a new one for SIGTERM,
            SIGUSR1 and ``$SPOT_TRAINING_CHECKPOINT_REQUEST_FILE``), installed by :meth:`steps`
            or :meth:`install`.
        metadata: optional callable returning a JSON-serialisable dict stored in each manifest.
        logger: default ``logging.getLogger("training.mxnet")``.

    Attributes:
        step: completed optimizer steps (the data position); set by :meth:`restore`.
        restored: the checkpoint restored from, or None.
    """

    def __init__(
        self,
        net,
        trainer,
        *,
        directory: str | os.PathLike | None = None,
        every_steps: int | None = 50,
        every_seconds: float | None = None,
        background: bool = True,
        keep: int = 3,
        steps_per_epoch: int | None = None,
        notices: NoticeHandler | None = None,
        metadata: Callable[[], dict] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        if steps_per_epoch is not None and (
            isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1
        ):
            raise ValueError(
                f"steps_per_epoch must be an integer >= 1 or None. Received: steps_per_epoch={steps_per_epoch!r}"
            )
        if not isinstance(background, bool):
            raise ValueError(f"background must be True or False. Received: background={background!r}")
        self.net = net
        self.trainer = trainer
        self.log = logger or logging.getLogger("training.mxnet")
        self.store = CheckpointStore(
            directory if directory is not None else default_checkpoint_dir(),
            framework=FRAMEWORK,
            framework_version=_mxnet_version(),
            keep=keep,
            logger=self.log,
        )
        self.schedule = SaveSchedule(every_steps=every_steps, every_seconds=every_seconds)
        self.background = background
        self.saver = BackgroundSaver(self.store) if background else None
        self.steps_per_epoch = steps_per_epoch
        self.notices = notices if notices is not None else NoticeHandler()
        self.metadata = metadata
        self._trainer_order = trainer_order(net, trainer)
        self.step = 0
        self.restored: Checkpoint | None = None
        self.last_saved_step: int | None = None
        self._host_buffers: list[GluonState | None] = [None, None]  # reused by save(); freed by close()
        self._next_buffer = 0
        self.save_seconds: list[float] = []  # time the training thread spent per save (copy or full write)

    # ------------------------------------------------------------------ state
    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self.store.directory

    def epoch_of(self, step: int) -> int:
        """Epoch (0-based) that the step after ``step`` completed steps belongs to."""
        return step // self.steps_per_epoch if self.steps_per_epoch else 0

    def restore(self) -> int:
        """Load the newest valid checkpoint into the net and trainer; return the completed steps (0 if none).

        Torn or corrupt newer checkpoints are skipped with a warning (the store's fallback). With a
        ``dist_*`` kvstore, then broadcasts rank 0's parameters and waits for them
        (:func:`sync_distributed_parameters`), so call it on every worker.

        Raises:
            FrameworkMismatchError: the newest checkpoint was written by TensorFlow.
            CheckpointError: it was written by another MXNet tool or adapter format.
            ShapeMismatchError: its parameters do not match the model (message names path,
                parameter and both shapes). Nothing is changed or deleted on either error.
        """
        def read(c: Checkpoint) -> None:
            fmt = c.metadata.get("adapter_format")
            if c.metadata.get("adapter") != "gluon" or fmt != ADAPTER_FORMAT:
                raise CheckpointError(
                    f"checkpoint {str(c.path)!r} was not written by this Gluon adapter (metadata adapter="
                    f"{c.metadata.get('adapter')!r}, adapter_format={fmt!r}; expected 'gluon', {ADAPTER_FORMAT}); "
                    "use another checkpoint directory"
                )
            load_state(self.net, self.trainer, c.path, saved_order=c.metadata.get("trainer_params"))

        ckpt = self.store.restore(read)
        # Every worker of a distributed job calls restore() at the same point before training: the
        # place to broadcast the parameters so that MXNet's first step cannot race its own pull.
        sync_distributed_parameters(self.trainer, logger=self.log)
        self.restored = ckpt
        self.step = ckpt.step if ckpt is not None else 0
        self.last_saved_step = ckpt.step if ckpt is not None else None
        if ckpt is not None:
            self.log.info("restored %s: step %d, epoch %d", ckpt.path, ckpt.step, ckpt.epoch)
        return self.step

    def manifest_metadata(self) -> dict:
        """The metadata stored in each manifest: adapter, format, steps_per_epoch, trainer_params, user."""
        meta: dict[str, Any] = {"adapter": "gluon", "adapter_format": ADAPTER_FORMAT,
                                "steps_per_epoch": self.steps_per_epoch,
                                "trainer_params": self._trainer_order}
        if self.metadata is not None:
            meta["user"] = self.metadata()
        return meta

    def save(self, *, wait: bool = False) -> Checkpoint | None:
        """Checkpoint the current state at :attr:`step` (call between steps).

        Background mode copies to host memory and queues the write (returns None unless ``wait``,
        then the committed checkpoint); synchronous mode writes and returns the checkpoint.
        A step already saved is not written again.
        """
        started = time.perf_counter()
        if self.last_saved_step == self.step:
            return self.saver.wait() if (wait and self.saver) else None
        # Two sets of host arrays used in turn: the set captured two saves ago is free, because the
        # BackgroundSaver runs one write at a time and submit() waits for the previous one.
        slot = self._next_buffer
        state = capture_state(self.net, self.trainer, out=self._host_buffers[slot])
        self._host_buffers[slot], self._next_buffer = state, 1 - slot
        step, epoch = self.step, self.epoch_of(self.step)
        if self.saver is not None:
            self.saver.submit(state.write, step=step, epoch=epoch, metadata=self.manifest_metadata())
            ckpt = self.saver.wait() if wait else None
        else:
            ckpt = self.store.save(state.write, step=step, epoch=epoch, metadata=self.manifest_metadata())
        self.last_saved_step = step
        self.schedule.saved()
        self.save_seconds.append(time.perf_counter() - started)
        return ckpt

    # ------------------------------------------------------------------ loop
    def install(self) -> "GluonCheckpointer":
        """Install the notice handlers (SIGTERM, SIGUSR1); must run on the main thread."""
        self.notices.install()
        return self

    def after_step(self, *, exit_on_stop: bool = True) -> bool:
        """Count one completed step, then save if due, requested, or a stop was requested.

        On a stop request (SIGTERM) the checkpoint is written and waited for, then
        ``SystemExit(0)`` is raised (exit_on_stop=True, the default) or True is returned.
        Returns False otherwise.
        """
        self.step += 1
        if self.notices.stop_requested:
            self.save(wait=True)
            self.log.info("stop requested (signal %s): checkpoint at step %d written, exiting 0",
                          self.notices.stop_signal, self.step)
            self.close()
            if exit_on_stop:
                raise SystemExit(0)
            return True
        requested = self.notices.consume_checkpoint_request()
        if requested or self.schedule.due(self.step):
            if requested:
                self.log.info("checkpoint requested at step %d", self.step)
            self.save()
        return False

    def finish(self) -> Checkpoint:
        """Write the final checkpoint (waited for), then ``COMPLETED``; returns the checkpoint."""
        ckpt = self.save(wait=True) if self.saver is not None else (self.save() or self.store.latest())
        if ckpt is None or ckpt.step != self.step:
            ckpt = self.store.latest()
        if ckpt is None or ckpt.step != self.step:
            raise CheckpointError(
                f"final checkpoint at step {self.step} is not in {str(self.directory)!r}; not writing COMPLETED"
            )
        self.store.mark_complete(step=self.step, epoch=self.epoch_of(self.step))
        self.log.info("training complete at step %d; wrote %s", self.step, self.directory / "COMPLETED")
        return ckpt

    def close(self) -> None:
        """Wait for a pending background write, stop the writer thread and uninstall the handlers."""
        try:
            if self.saver is not None:
                self.saver.close()
        finally:
            self._host_buffers = [None, None]
            self.notices.uninstall()

    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield the 0-based global step indices from the restored step up to ``total_steps - 1``.

        Installs the notice handlers, restores, and after each yielded step calls
        :meth:`after_step` (saves on cadence/request; on SIGTERM saves and raises SystemExit(0)).
        After the last step calls :meth:`finish` and :meth:`close`. If ``COMPLETED`` already
        exists with a checkpoint at ``total_steps`` nothing is yielded.

        Raises:
            ValueError: ``total_steps`` is not a positive integer.
        """
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be an integer >= 1. Received: total_steps={total_steps!r}")
        self.install()
        try:
            start = self.restore()
            if start > total_steps:
                raise ValueError(
                    f"checkpoint {str(self.restored.path)!r} is at step {start}, past total_steps={total_steps}; "
                    "raise total_steps or use another checkpoint directory"
                )
            if self.notices.stop_requested:
                # Stopped before any step ran: the restored checkpoint (or the untrained start)
                # is already the state, so there is nothing new to save.
                self.log.info("stop requested before the first step; exiting 0 at step %d", self.step)
                raise SystemExit(0)
            for step in range(start, total_steps):
                yield step
                self.after_step()
            self.finish()
        finally:
            self.close()


def state_bytes(net, trainer) -> int:
    """Size in bytes of one host-memory copy of ``net`` and ``trainer`` (what a checkpoint holds)."""
    return capture_state(net, trainer).nbytes

