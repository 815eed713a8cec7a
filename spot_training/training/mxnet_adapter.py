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

What one checkpoint holds (inside the store's ``ckpt-<step>`` directory, see spot_training/training/store.py):

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
    the number of completed optimizer steps, which is also the data position (spot_training/training/datasets.py).

Background saving: at the step boundary every parameter and optimizer-state array is copied to
host memory with ``NDArray.copyto`` (an engine operation ordered after the step that wrote the
array and before the next one that overwrites it: a consistent copy that the training thread does
not wait for), into one of two sets of host arrays allocated at the first two saves and used in
turn, and the optimizer object is copied on the training thread. The copy is written
on the :class:`~spot_training.training.store.BackgroundSaver` thread (``mx.nd.save`` and pickle, which wait for
the copies; MXNet's default threaded engine accepts calls from any thread and ctypes releases the
GIL while they run). The training thread never waits for the write except at the next save, if the
previous one is still running, and at the final save before exit.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from spot_training.training.core import (CHECKPOINT_STORAGE_EXIT_CODE, DEFAULT, DEFAULT_KEEP, CheckpointDriver, StateAdapter,
                           renamed_option)
from spot_training.training.datasets import batch_indices, steps_per_epoch
from spot_training.training.notice import NoticeHandler
from spot_training.training.store import Checkpoint, CheckpointError, ShapeMismatchError

__all__ = ["GluonAdapter", "GluonCheckpointer", "GluonState", "rng_seed_for", "PARAMS_FILE", "TRAINER_FILE", "capture_state", "check_shapes",
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

    :meth:`write` writes ``model.params`` with ``mx.nd.save`` (the format of ``Block.save_parameters``)
    and ``trainer.states`` as the pickle of ``(states, optimizer)``, the objects ``Trainer.save_states``
    pickles when not updating on the kvstore, with :class:`StatesPickler` (protocol 5;
    ``Trainer.load_states`` reads it).

    Args:
        params: ``{structural name: NDArray on the CPU}``.
        states: the updater's state structure with every NDArray copied to the CPU.
        optimizer: a copy of the optimizer (update counts, learning-rate schedule) taken on the training thread.
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
    array. This pickler gives pickle a writable view of those serialized bytes (a protocol-5
    ``PickleBuffer``, written in-band, so ``pickle.loads`` returns it as the ``bytearray``
    ``NDArray.__setstate__`` expects), which saves both copies (the writer CPU time this saves:
    docs/training-mxnet.md, "What a checkpoint holds"). The stream holds the same
    objects as ``pickle.dumps((states, optimizer))`` and ``Trainer.load_states`` reads it.
    Hand-rolled because MXNet's NDArray pickling offers no way around the copies.

    The view points into MXNet's per-thread return buffer, which the next ``SaveRawBytes`` call on
    this thread overwrites; pickle writes (or copies) each buffer before it moves to the next object.
    """

    def __init__(self, file) -> None:
        super().__init__(file, protocol=5)

    def reducer_override(self, obj):
        """Reduce a dense NDArray to a protocol-5 ``PickleBuffer`` of its serialized bytes.

        Args:
            obj: the object being pickled.

        Returns:
            ``NotImplemented`` for anything but a dense NDArray with a handle (pickle's own way), else the
            reduce tuple that rebuilds it through ``NDArray.__setstate__``.
        """
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
    ``dist_sync``, ``update_on_kvstore=False``; tests/mxnet/test_dist_init.py reproduces it, and
    docs/training-mxnet.md gives the figures.

    Does the broadcast ahead of time (``Trainer._init_kvstore``/``_init_params``, what
    ``Trainer.save_states`` and ``load_states`` call first; MXNet has no public way) and waits for
    the engine, so the first gradient push starts after the pulls completed. It is a collective
    operation (kvstore init ends in a barrier): every worker calls it at the same point, after the
    parameters are initialized and before the first step. :meth:`GluonCheckpointer.restore` calls it.

    Args:
        trainer: the ``gluon.Trainer``, its parameters initialized.
        logger: where the deferred-initialization warning goes (default ``training.mxnet``).

    Returns:
        True when it synchronized; False for a non-distributed kvstore (nothing done) or when a
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

    Every array is copied with ``NDArray.copyto``: MXNet's engine runs the copy after the step that
    wrote the array and before the next step overwrites it (it orders operations by the arrays they
    read and write), so the copy is consistent, yet the training thread does not wait for it the way
    ``asnumpy()`` would. The optimizer object (update counts, schedule) is small and is copied right
    here with a pickle round trip, the serialisation ``Trainer.save_states`` uses.

    Args:
        net: the ``gluon.Block``, its parameters initialized.
        trainer: its ``gluon.Trainer`` (``update_on_kvstore=False``).
        out: a state captured earlier whose arrays may be overwritten (nothing may still read them, e.g.
            a background write of it must have finished): each array is copied into its counterpart there
            when shape and dtype match, else into new memory (reused memory does not fault again when
            touched). Default None: all new memory.

    Returns:
        the captured state (``out``'s arrays reused where they fit).

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

    Args:
        net: the ``gluon.Block``.
        params: ``{structural name: NDArray}`` loaded from the checkpoint.
        path: the checkpoint directory, named in the message.

    Raises:
        ShapeMismatchError: a shape differs or a parameter is missing on either side; the message names
            ``path``, each parameter and both shapes.
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

    Args:
        net: the ``gluon.Block`` whose structural names are used.
        trainer: the ``gluon.Trainer``.

    Returns:
        one name per trainer index.
    """
    by_id: dict[int, str] = {}
    for name, param in _named_parameters(net).items():
        by_id.setdefault(id(param), name)
    return [by_id.get(id(param), param.name) for param in trainer._params]


def remap_trainer_states(trainer, saved_order: list[str], current_order: list[str], *, path: Path) -> None:
    """Re-key the loaded updater states and per-index update counts from the saved parameter order to the current one.

    A no-op when the orders are equal.

    Args:
        trainer: the ``gluon.Trainer`` whose states were just loaded.
        saved_order: :func:`trainer_order` of the run that wrote the checkpoint.
        current_order: :func:`trainer_order` of this run.
        path: the checkpoint directory, named in the message.

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


#: The only globals a ``trainer.states`` file may name (what ``Trainer.save_states`` and :class:`StatesPickler`
#: write): MXNet's NDArray, optimizer and learning-rate-scheduler classes, numpy's array and scalar
#: reconstructors, and a few plain containers. Anything else (``os.system``, ``builtins.eval``) is refused.
_STATES_GLOBALS = {
    ("mxnet.ndarray.ndarray", "NDArray"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy", "ndarray"), ("numpy", "dtype"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "slice"),
    ("collections", "OrderedDict"), ("copyreg", "_reconstructor"),
}


class _StatesUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`_STATES_GLOBALS` and subclasses of MXNet's ``Optimizer``
    and ``LRScheduler`` (an explicit allow-list, as ``torch.load(weights_only=True)`` is for PyTorch)."""

    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(__import__("io").BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        if (module, name) not in _STATES_GLOBALS and module.partition(".")[0] == "mxnet" and "." not in name:
            import mxnet as mx

            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and issubclass(found, (mx.optimizer.Optimizer, mx.lr_scheduler.LRScheduler)):
                return found
        elif (module, name) in _STATES_GLOBALS:
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path}: refers to {module}.{name}, which a trainer-states file never holds; "
                              "refusing to load it (a checkpoint is data and never runs code). Delete this "
                              "checkpoint if you did not write it")


def verified_trainer_states(path: Path) -> bytes:
    """The bytes of a ``trainer.states`` file, after unpickling them once with :class:`_StatesUnpickler`.

    Args:
        path: the file (``<checkpoint>/trainer.states``).

    Returns:
        The file's bytes, for ``Trainer.load_states`` to read from a private copy.

    Raises:
        CheckpointError: the file names a global outside the allow-list (a planted payload) or is not a
            pickle at all; the message names the file. Nothing of it has run.
    """
    data = Path(path).read_bytes()
    try:
        _StatesUnpickler(data, Path(path)).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated or not a pickle: unreadable, not a payload
        raise CheckpointError(f"{path}: not a readable trainer-states file ({type(exc).__name__}: {exc})") from exc
    return data


def load_state(net, trainer, path: Path, *, saved_order: list[str] | None = None) -> None:
    """Load a checkpoint directory written by :class:`GluonState` into ``net`` and ``trainer``.

    All shapes are checked before anything is changed (ShapeMismatchError, nothing modified).
    Trainer states go through the public ``Trainer.load_states``, after :func:`verified_trainer_states`
    refused any global outside its allow-list (a checkpoint never runs code on restore).

    Args:
        net: the ``gluon.Block`` (deferred initialization is finished with the checkpoint's shapes).
        trainer: its ``gluon.Trainer`` (``update_on_kvstore=False``).
        path: the checkpoint directory (``model.params``, ``trainer.states``).
        saved_order: the checkpoint's :func:`trainer_order` (None: a checkpoint from before it was recorded;
            the states are loaded by index as they are).

    Raises:
        ShapeMismatchError: a parameter's shape or the trainer's parameter set differs (nothing modified).
        CheckpointError: ``model.params`` holds unnamed arrays, or ``trainer.states`` is unreadable or names
            a global outside the allow-list.
        ValueError: the trainer has ``update_on_kvstore=True``.
    """
    import mxnet as mx

    path = Path(path)
    params = mx.nd.load(str(path / PARAMS_FILE))
    if not isinstance(params, dict):
        raise CheckpointError(f"{path / PARAMS_FILE} holds a list of arrays, not named parameters")
    check_shapes(net, params, path=path)
    if trainer._update_on_kvstore or trainer._kvstore_params.get("update_on_kvstore"):
        _updater(trainer)  # raises its clear ValueError before any change
    current_order = trainer_order(net, trainer)
    if saved_order is not None:
        _check_same_parameters(saved_order, current_order, path=path)
    named = _named_parameters(net)
    for name, param in named.items():
        if param._data is None and param._deferred_init:
            # Deferred initialization (nn.Dense(64) without in_units): the shapes are only known
            # after a forward pass, and Trainer._init_kvstore() refuses such parameters
            # (DeferredInitializationError). The checkpoint knows them: finish the initialization
            # with its shape (MXNet 1.9.1 has no public call for that; Parameter._finish_deferred_init
            # is what the first forward pass runs), then the value is overwritten below.
            param.shape = params[name].shape
            param._finish_deferred_init()
    _updater(trainer)
    states = verified_trainer_states(path / TRAINER_FILE)
    for name, param in named.items():
        param.set_data(params[name])
    # The public reader, on a private copy of the verified bytes: the checkpoint directory may be on
    # shared storage that another writer could change between the check and the read.
    with tempfile.TemporaryDirectory(prefix="spot-training-states-") as private:
        copy = Path(private) / TRAINER_FILE
        copy.write_bytes(states)
        trainer.load_states(str(copy))
    if saved_order is not None:
        remap_trainer_states(trainer, saved_order, current_order, path=path)


def _has_dropout(net) -> bool:
    """True when ``net`` (a Gluon Block) contains a ``gluon.nn.Dropout`` block at any depth."""
    from mxnet.gluon import nn

    found: list = []
    net.apply(lambda block: found.append(block) if isinstance(block, nn.Dropout) else None)
    return bool(found)


def rng_seed_for(seed: int, step: int) -> int:
    """The MXNet seed of the step that follows ``step`` completed steps, derived from ``(seed, step)``.

    numpy's ``SeedSequence`` mixes the pair well: neighbouring steps get unrelated seeds.

    Args:
        seed: the run's base seed, >= 0.
        step: completed steps, >= 0.

    Returns:
        a 31-bit non-negative integer for ``mx.random.seed``.
    """
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0] >> 1)


class GluonAdapter(StateAdapter):
    """The Gluon :class:`~spot_training.training.core.StateAdapter`: parameters (BatchNorm statistics included),
    trainer states and optimizer (update counts, schedule) to host memory and back.

    MXNet's generator (Dropout masks, ``mx.nd.random.*``, initializers) has no state that can be
    read back: MXNet 1.9.1 offers ``mx.random.seed`` only. So instead of capturing it, the adapter
    re-seeds it before every step with :func:`rng_seed_for` ``(seed, step)``. The draws of step
    ``s`` are then a function of ``(seed, s)`` alone, in an uninterrupted run and in one resumed at
    any step, which is what makes a run with Dropout resume bitwise. Re-seeding at save boundaries
    only would not do: a stop can come at any step. A re-seed costs CPU time (MXNet seeds every
    parallel generator state of the device; docs/training-mxnet.md), so ``seed="auto"`` (the
    default) re-seeds from seed 0 only when ``net`` contains a ``gluon.nn.Dropout`` block; an
    integer always re-seeds (give one when the step draws from ``mx.nd.random`` itself); None never.

    Args:
        net: the ``gluon.Block``.
        trainer: its ``gluon.Trainer``.
        seed: ``"auto"`` (default), an integer >= 0, or None (see above).
        is_writer: this process writes checkpoints (default True; False on non-zero ranks).

    Raises:
        ValueError: ``seed`` is not an integer >= 0, ``"auto"`` or None.
    """

    framework = FRAMEWORK
    adapter = "gluon"
    adapter_format = ADAPTER_FORMAT

    def __init__(self, net, trainer, *, seed: int | str | None = "auto", is_writer: bool = True) -> None:
        if seed == "auto":
            seed = 0 if _has_dropout(net) else None
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be an integer >= 0, 'auto' or None (no re-seeding). Received: seed={seed!r}")
        self.net = net
        self.trainer = trainer
        self.seed = seed
        self.is_writer = is_writer
        # A dist_* kvstore job stops at a step boundary on every worker (the cluster's agreed stop);
        # a single process may save outside a step (core.CheckpointDriver.begin_step).
        self.saves_outside_step = not _is_distributed(trainer)
        self.log = logging.getLogger("training.mxnet")
        self.trainer_params = trainer_order(net, trainer)

    def framework_version(self) -> str:
        """MXNet's version string, ``mxnet.__version__`` (see :meth:`StateAdapter.framework_version`)."""
        return _mxnet_version()

    def metadata(self) -> dict:
        """``{"trainer_params": trainer order}`` (:func:`trainer_order`), so a restore can re-key the states."""
        return {"trainer_params": self.trainer_params}

    def snapshot(self, directory: Path):
        """Capture the state into one of two reused host buffers (:func:`capture_state`, :meth:`StateAdapter.snapshot`).

        Args:
            directory: the store's empty temporary directory the returned writer fills.

        Returns:
            a function that writes ``model.params`` and ``trainer.states`` into ``directory``.

        Raises:
            ValueError: from :func:`capture_state`.
        """
        state = self.host_copy(lambda out: capture_state(self.net, self.trainer, out=out))
        return lambda: state.write(directory)

    def load(self, ckpt: Checkpoint) -> None:
        """Load ``ckpt`` into the net and trainer (:func:`load_state`); see :meth:`StateAdapter.load`.

        Args:
            ckpt: the checkpoint to restore.

        Raises:
            ShapeMismatchError: from :func:`load_state`.
            CheckpointError: from :func:`load_state`.
        """
        load_state(self.net, self.trainer, ckpt.path, saved_order=ckpt.metadata.get("trainer_params"))

    def after_restore(self, ckpt: Checkpoint | None) -> None:
        """Broadcast rank 0's parameters on a distributed kvstore (:func:`sync_distributed_parameters`).

        Args:
            ckpt: the restored checkpoint, or None on a fresh start (unused: every worker syncs either way).
        """
        # Every worker of a distributed job restores at the same point before training: the place
        # to broadcast the parameters so that MXNet's first step cannot race its own pull.
        sync_distributed_parameters(self.trainer, logger=self.log)

    def at_step(self, step: int) -> None:
        """Re-seed MXNet's generator with :func:`rng_seed_for` ``(seed, step)`` (nothing when ``seed`` is None).

        Args:
            step: completed steps so far.
        """
        if self.seed is not None:
            import mxnet as mx

            mx.random.seed(rng_seed_for(self.seed, step))


class GluonCheckpointer(CheckpointDriver):
    """Checkpoint, resume and interruption handling for a Gluon ``net`` trained with ``trainer``.

    :class:`~spot_training.training.core.CheckpointDriver` with a :class:`GluonAdapter`. Attributes as
    the driver's (``step``, ``restored``, ``store``, ``notices``, ``schedule``...).

    Args:
        net: the ``gluon.Block``. Deferred initialization (``nn.Dense(64)`` without ``in_units``) is
            fine: a restore initializes those parameters with the checkpoint's shapes.
        trainer: a ``gluon.Trainer`` with ``update_on_kvstore=False`` (the default on one device).
        checkpoint_dir: as :class:`~spot_training.training.core.CheckpointDriver`.
        every_steps: as the driver (default ``$SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`` or 50).
        every_seconds: as the driver.
        background: as the driver.
        keep: as the driver.
        steps_per_epoch: as the driver.
        notices: as the driver.
        metadata: as the driver.
        seed: MXNet's generator is re-seeded before every step from ``(seed, step)``: ``"auto"``
            (default) from seed 0 when ``net`` has a Dropout block, else never; an integer: always;
            None: never (then Dropout and ``mx.nd.random`` do not resume bitwise). See :class:`GluonAdapter`.
        logger: default ``logging.getLogger("training.mxnet")``.
        **deprecated: ``directory`` (use ``checkpoint_dir``), ``notice`` (use ``notices``).

    Raises:
        CheckpointPathError: the directory is a file or not writable (naming the path).
        TypeError: an unknown keyword, or a deprecated and a current name with different values.
        ValueError: a bad ``seed`` or cadence.
    """

    storage_exit_code = CHECKPOINT_STORAGE_EXIT_CODE

    def __init__(self, net, trainer, *, checkpoint_dir: str | os.PathLike | None = None,
                 every_steps: int | None = DEFAULT, every_seconds: float | None = DEFAULT,
                 background: bool = True, keep: int = DEFAULT_KEEP, steps_per_epoch: int | None = None,
                 notices: NoticeHandler | None = None, metadata: Callable[[], dict] | None = None,
                 seed: int | str | None = "auto", logger: logging.Logger | None = None, **deprecated: Any) -> None:
        checkpoint_dir = renamed_option(deprecated, "directory", "checkpoint_dir", checkpoint_dir,
                                        owner="GluonCheckpointer", unset=None)
        notices = renamed_option(deprecated, "notice", "notices", notices, owner="GluonCheckpointer", unset=None)
        if deprecated:
            raise TypeError(f"GluonCheckpointer got unexpected keyword arguments {sorted(deprecated)}")
        self.net = net
        self.trainer = trainer
        super().__init__(GluonAdapter(net, trainer, seed=seed), checkpoint_dir=checkpoint_dir,
                         every_steps=every_steps, every_seconds=every_seconds, background=background, keep=keep,
                         steps_per_epoch=steps_per_epoch, notices=notices, metadata=metadata,
                         logger=logger or logging.getLogger("training.mxnet"))

    @property
    def _host_buffers(self) -> list:
        return self.adapter.host_buffers


def state_bytes(net, trainer) -> int:
    """Size in bytes of one host-memory copy of ``net`` and ``trainer`` (what a checkpoint holds).

    Args:
        net: the ``gluon.Block``, initialized.
        trainer: its ``gluon.Trainer``.

    Returns:
        bytes of the parameters and trainer states.
    """
    return capture_state(net, trainer).nbytes

