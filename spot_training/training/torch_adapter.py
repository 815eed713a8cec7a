"""PyTorch on the framework-neutral checkpoint driver (spot_training/training/core.py).

Import it only in the PyTorch environment (``.venv-torch``): TensorFlow, MXNet and PyTorch never
share a process. ``spot_training/training/__init__.py`` does not import this module.

A script's change (docs/training-pytorch.md)::

    from spot_training.training.torch_adapter import TorchCheckpointer
    ckpt = TorchCheckpointer(model, optimizer, scheduler)          # restores on the first step
    loader = DataLoader(ds, batch_sampler=ckpt.batch_sampler(len(ds), batch_size=32, seed=0))
    for step, (x, y) in ckpt.steps(total_steps, loader):           # SIGTERM: save, exit 0
        ...                                                        # the usual step

What a checkpoint holds (one ``tensors.bin`` of raw tensor bytes and one ``index.json`` naming
each tensor's key, dtype, shape and byte offset, beside the driver's ``host_rng.json``; no pickle
of tensors): the ``nn.Module`` state dict (parameters and buffers such as BatchNorm running
statistics; a ``torch.compile``d or ``DistributedDataParallel``-wrapped module is unwrapped, so
the keys carry no ``_orig_mod.`` or ``module.`` prefix and compiled, wrapped and plain models
interchange), the optimizer, the LR scheduler, the AMP ``GradScaler``, any extra object with
``state_dict``/``load_state_dict``, and the torch CPU and every CUDA device's random-number
generator state (per rank in a distributed job). The driver adds the Python ``random`` and numpy
global generator states. The data position is the step: :class:`StepSampler` derives each
step's batch from ``(step, seed)`` as :func:`spot_training.training.datasets.batch_indices` does.

How a snapshot is taken (``snapshot_mode``):

* ``"sync"``: every tensor is copied into reused host buffers before :meth:`TorchAdapter.snapshot`
  returns (the training thread waits for the device-to-host copy).
* ``"pinned"``: CUDA tensors are copied into reused page-locked (pinned) host buffers on a side
  CUDA stream. The side stream first waits for an event recorded on the training stream (so it
  copies the state of this step), and an optimizer step-pre-hook makes the training stream wait
  for the copy-done event before the next ``optimizer.step()`` changes a parameter or an
  optimizer state in place; the next forward and backward overlap the copy.
* ``"device"``: CUDA tensors are first copied device-to-device into reused spare GPU buffers on
  the side stream (the next ``optimizer.step()`` waits only for this fast copy), then drained
  device-to-host into pinned buffers on the same side stream during the next steps.
* ``"auto"`` (default): ``"device"`` when ``torch.cuda.mem_get_info`` shows free memory for the
  state plus a headroom (:data:`DEVICE_HEADROOM_FRACTION` of the device, at least
  :data:`DEVICE_HEADROOM_MIN_BYTES`), else ``"pinned"``; decided at the first save.

Module buffers (BatchNorm statistics change in the forward pass, not in ``optimizer.step``) and
tensors of the scheduler, scaler and extra objects are copied on the training stream itself, so
the next forward cannot change them before they are copied. The writer thread waits for the
drain event, then writes. CPU tensors are copied into reused host buffers synchronously.
Anything that changes a parameter in place outside ``optimizer.step()`` (weight clipping by
hand, an EMA written into the model) must call :meth:`TorchCheckpointer.wait_for_snapshot` first.

Distributed (``torch.distributed`` initialised, e.g. ``torchrun`` with ``DistributedDataParallel``):
rank 0 writes, every rank restores; after every step one ``all_reduce(MAX)`` of the stop and
checkpoint flags makes a notice on any rank lead to one save at the same step on all ranks;
before a save each rank's generator states are gathered to rank 0; after the final or the stop
save every rank meets at a barrier.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from spot_training.contract import COMPLETED_FILE
from spot_training.training.core import (DEFAULT, DEFAULT_KEEP, CheckpointDriver, DriverFront, StateAdapter,
                                         checkpoint_exit_code, default_every_seconds)
from spot_training.training.datasets import batch_indices
from spot_training.training.notice import NoticeHandler
from spot_training.training.store import Checkpoint, CheckpointError, ShapeMismatchError, write_file

__all__ = [
    "DEVICE_HEADROOM_FRACTION",
    "DEVICE_HEADROOM_MIN_BYTES",
    "INDEX_FILE",
    "IgnoreNoticeSignals",
    "SNAPSHOT_MODES",
    "StepSampler",
    "TENSORS_FILE",
    "TorchAdapter",
    "TorchCheckpointer",
    "WORKER_IGNORED_SIGNALS",
    "protect_loader_workers",
    "worker_draws_random_numbers",
    "unwrap_module",
]

SNAPSHOT_MODES = ("auto", "device", "pinned", "sync")
#: Raw bytes of every tensor, back to back, in the order of ``index.json``'s ``tensors`` list.
TENSORS_FILE = "tensors.bin"
#: Tensor keys, dtypes, shapes, offsets and the non-tensor state (JSON).
INDEX_FILE = "index.json"
#: ``"auto"`` picks the device snapshot only if this fraction of the device's memory stays free after it.
DEVICE_HEADROOM_FRACTION = 0.10
#: ... and at least this many bytes (1 GiB).
DEVICE_HEADROOM_MIN_BYTES = 1 << 30
_INDEX_FORMAT = 1
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def unwrap_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``state_dict`` keys carry no wrapper prefix: strips ``torch.compile``'s
    ``OptimizedModule`` (``_orig_mod``) and ``DistributedDataParallel``/``DataParallel`` (``module``)."""
    while True:
        if hasattr(module, "_orig_mod") and isinstance(getattr(module, "_orig_mod"), torch.nn.Module):
            module = module._orig_mod
        elif isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
        else:
            return module


# ----------------------------------------------------------------------------- state <-> JSON skeleton
#: Tags of the JSON skeleton (a dict holding one of these keys is not a plain dict).
_TAGS = ("__tensor__", "__items__", "__tuple__", "__dtype__", "__device__")
_ALL_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _flatten(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able copy of ``value`` with each tensor replaced by ``{"__tensor__": key}`` (the
    tensor goes into ``tensors``). Dicts with non-string keys (optimizer state is keyed by
    parameter index) and tuples keep their types, ``torch.dtype`` and ``torch.device`` values are
    tagged. A checkpoint is data, never code: any other object raises ValueError naming its place
    in the state (no pickle, which would run code on restore)."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return {"__tensor__": path}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _flatten(v, f"{path}/{k}", tensors) for k, v in value.items()}
        return {"__items__": [[_flatten(k, f"{path}/#key", {}), _flatten(v, f"{path}/{k}", tensors)]
                              for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    raise ValueError(
        f"state entry {path!r} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint "
        "cannot hold: only tensors, numbers, strings, None, lists, tuples, dicts, torch.dtype and torch.device "
        "(checkpoints are data; restoring pickled objects would run code). Keep such objects out of state_dict()")


def _check_data(value: Any, where: str, entries: Mapping[str, Any], path: str = "") -> None:
    """Raise CheckpointError (naming ``where`` and the entry) unless ``value`` is a skeleton
    :func:`_flatten` writes: plain JSON and the tags of :data:`_TAGS` with well-formed contents, every
    tensor reference naming a tensor of the index. Runs before anything is read into live objects."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: state entry {path or '/'!r} {what}; a checkpoint holds only data "
                               "(tensors and JSON), refusing to restore it")

    if isinstance(value, dict):
        tags = [k for k in value if isinstance(k, str) and k.startswith("__")]
        if not tags:
            for k, v in value.items():
                _check_data(v, where, entries, f"{path}/{k}")
            return
        if len(value) != 1 or tags[0] not in _TAGS:
            raise bad(f"holds {sorted(tags)!r}, not one of the data tags {list(_TAGS)}")
        tag, inner = tags[0], value[tags[0]]
        if tag == "__tensor__":
            if not isinstance(inner, str) or inner not in entries:
                raise bad(f"refers to tensor {inner!r}, which the index does not list")
        elif tag == "__items__":
            if not isinstance(inner, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in inner):
                raise bad("is not a list of [key, value] pairs")
            for k, v in inner:
                if isinstance(k, (dict, list)):
                    raise bad(f"has an unhashable key {k!r}")
                _check_data(v, where, entries, f"{path}/{k}")
        elif tag == "__tuple__":
            if not isinstance(inner, list):
                raise bad("is not a list")
            for i, v in enumerate(inner):
                _check_data(v, where, entries, f"{path}/{i}")
        elif tag == "__dtype__" and inner not in _ALL_DTYPES:
            raise bad(f"names no torch dtype ({inner!r})")
        elif tag == "__device__" and not isinstance(inner, str):
            raise bad(f"names no device ({inner!r})")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_data(v, where, entries, f"{path}/{i}")
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        raise bad(f"is a {type(value).__name__}")


def _unflatten(value: Any, tensors: Mapping[str, torch.Tensor] | None) -> Any:
    """The inverse of :func:`_flatten` (``tensors`` None: tensor references stay ``{"__tensor__": key}``).
    Checked by :func:`_check_data` first: nothing here runs code from the checkpoint."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            return value if tensors is None else tensors[value["__tensor__"]]
        if "__items__" in value:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in value["__items__"]}
        if "__tuple__" in value:
            return tuple(_unflatten(v, tensors) for v in value["__tuple__"])
        if "__dtype__" in value:
            return _ALL_DTYPES[value["__dtype__"]]
        if "__device__" in value:
            return torch.device(value["__device__"])
        return {k: _unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value


def _tensor_refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return [value["__tensor__"]]
        return [r for v in value.values() for r in _tensor_refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _tensor_refs(v)]
    return []


def _byte_view(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a numpy uint8 array (no copy; any dtype)."""
    return t.reshape(-1).view(torch.uint8).numpy()


# ----------------------------------------------------------------------------- the adapter
class TorchAdapter(StateAdapter):
    """Captures and restores PyTorch training state for :class:`spot_training.training.core.CheckpointDriver`.

    Args:
        model: the ``nn.Module`` (plain, ``torch.compile``d, or wrapped in DistributedDataParallel).
        optimizer: a ``torch.optim.Optimizer`` or None.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``) or None.
        scaler: a ``torch.amp.GradScaler`` or None.
        extra: ``{name: object with state_dict/load_state_dict}`` checkpointed as well (default none).
        rng: checkpoint the torch CPU and CUDA generator states (default True).
        snapshot_mode: ``"auto"`` (default), ``"device"``, ``"pinned"`` or ``"sync"`` (module docstring).
        every_seconds: distributed jobs only: rank 0's clock asks for a save this often (seconds),
            agreed by all ranks; None: off. (Single process: the driver's own schedule does it.)

    Raises:
        ValueError: a bad ``snapshot_mode``, an ``extra`` object without state_dict, or
            ``$WORLD_SIZE`` > 1 (a ``torchrun`` launch) before ``torch.distributed`` is initialised.
    """

    framework = "pytorch"
    adapter = "torch"
    adapter_format = 1

    def __init__(self, model: torch.nn.Module, optimizer=None, scheduler=None, *, scaler=None,
                 extra: Mapping[str, Any] | None = None, rng: bool = True, snapshot_mode: str = "auto",
                 every_seconds: float | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module. Received: model={type(model).__name__}")
        if snapshot_mode not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot_mode must be one of {SNAPSHOT_MODES}. Received: snapshot_mode={snapshot_mode!r}")
        extra = dict(extra or {})
        for name, obj in extra.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"extra[{name!r}] must have state_dict() and load_state_dict(). "
                                 f"Received: {type(obj).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.components: dict[str, Any] = {}
        for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None:
                self.components[name] = obj
        for name, obj in extra.items():
            self.components[f"extra.{name}"] = obj
        self.rng = rng
        self.snapshot_mode = snapshot_mode
        self.mode: str | None = None if snapshot_mode == "auto" else snapshot_mode
        self.distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        launched = os.environ.get("WORLD_SIZE", "1")
        if not self.distributed and launched.isdigit() and int(launched) > 1:
            # Every rank would write the same directory as if it were alone.
            raise ValueError(f"WORLD_SIZE={launched} (a torchrun launch) but torch.distributed is not initialised; "
                             "call torch.distributed.init_process_group() before building the checkpointer")
        self.rank = torch.distributed.get_rank() if self.distributed else 0
        self.world_size = torch.distributed.get_world_size() if self.distributed else 1
        self.is_writer = self.rank == 0
        self.every_seconds = every_seconds
        self._last_save_time = time.monotonic()
        self._gathered_rng: list[dict[str, torch.Tensor]] | None = None
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None
        self._copy_event: torch.cuda.Event | None = None
        self._hooks = []
        #: ``{"batch_size", "examples"}`` of the data position (set by TorchCheckpointer.batch_sampler).
        self.data: dict[str, int] = {}
        self.early_stop = False  # TorchCheckpointer.finish() ended training inside the loop
        self._optimizer_steps = 0  # optimizer.step() calls so far
        self._optimizer_steps_at_boundary = 0  # ... when the last step boundary was passed
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_args, **_kw: self.wait_for_snapshot()))
            self._hooks.append(optimizer.register_step_post_hook(lambda *_args, **_kw: self._count_optimizer_step()))

    def _count_optimizer_step(self) -> None:
        self._optimizer_steps += 1

    def at_step(self, step: int) -> None:
        """Note the optimizer-step count at the step boundary (see :meth:`StateAdapter.at_step`).

        Args:
            step: completed steps so far; a save after a step without ``optimizer.step()`` (gradient
                accumulation) then keeps the gradients.
        """
        self._optimizer_steps_at_boundary = self._optimizer_steps

    def _mid_accumulation(self) -> bool:
        """True when the step that just ended ran backward but no ``optimizer.step()`` (gradient
        accumulation between optimizer steps): the gradients are then part of the training state."""
        return self.optimizer is not None and self._optimizer_steps == self._optimizer_steps_at_boundary

    # ------------------------------------------------------------------ metadata
    def framework_version(self) -> str:
        """``torch <version>`` (see :meth:`StateAdapter.framework_version`)."""
        return f"torch {torch.__version__}"

    def metadata(self) -> dict:
        """The manifest's metadata: world size, snapshot mode, data position, optimizer class, early stop.

        Returns:
            ``{"world_size", "snapshot_mode", "batch_size"?, "examples"?, "optimizer"?, "early_stop"?}``
            (the data-position keys once :meth:`TorchCheckpointer.batch_sampler` set them).
        """
        meta = {"world_size": self.world_size, "snapshot_mode": self.mode or self.snapshot_mode, **self.data}
        if self.early_stop:
            meta["early_stop"] = True
        if self.optimizer is not None:
            meta["optimizer"] = type(self.optimizer).__name__
        return meta

    def check_metadata(self, ckpt: Checkpoint) -> None:
        """The adapter's checks, then: the same optimizer class and the same per-rank batch size and
        dataset size as the checkpoint (recorded since these were added; older checkpoints pass), before
        anything is read.

        Raises:
            ShapeMismatchError: naming the checkpoint and the difference.
        """
        super().check_metadata(ckpt)
        saved, live = ckpt.metadata, self.metadata()
        labels = {"optimizer": "optimizer", "batch_size": "batch size per rank", "examples": "examples in the dataset"}
        for key, label in labels.items():
            if key in saved and key in live and saved[key] != live[key]:
                raise ShapeMismatchError(
                    f"checkpoint {str(ckpt.path)!r} was written with {label} {saved[key]!r}, this run has "
                    f"{live[key]!r}; resuming would not continue the same training (keep the {label}, or use "
                    "another checkpoint directory)")

    # ------------------------------------------------------------------ capture
    def _rng_state(self) -> dict[str, torch.Tensor]:
        """torch's CPU generator and the CUDA generators: every device in a single process (e.g.
        DataParallel), the rank's current device in a distributed job (reading another device's
        generator would create a CUDA context there)."""
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices = [torch.cuda.current_device()] if self.distributed else range(torch.cuda.device_count())
            for i in devices:
                state[f"cuda{i}"] = torch.cuda.get_rng_state(i)
        return state

    def _collect(self) -> tuple[dict, dict[str, torch.Tensor], set[str]]:
        """(skeleton, tensors by key, keys changed only by optimizer.step) of the live state."""
        tensors: dict[str, torch.Tensor] = {}
        module = unwrap_module(self.model)
        skeleton: dict[str, Any] = {"model": _flatten(dict(module.state_dict(keep_vars=False)), "model", tensors)}
        step_only = {f"model/{name}" for name, _ in module.named_parameters()}
        if self._mid_accumulation():
            grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
            if grads:
                skeleton["grads"] = _flatten(grads, "grads", tensors)
        for name, obj in self.components.items():
            before = set(tensors)
            skeleton[name] = _flatten(obj.state_dict(), name, tensors)
            if name == "optimizer":
                step_only |= set(tensors) - before
        if self.rng:
            ranks = self._gathered_rng if self._gathered_rng is not None else [self._rng_state()]
            skeleton["rng"] = [_flatten(state, f"rng/{r}", tensors) for r, state in enumerate(ranks)]
        return skeleton, tensors, step_only

    def _buffer(self, store: dict[str, torch.Tensor], key: str, like: torch.Tensor, *, device: torch.device,
                pin: bool = False) -> torch.Tensor:
        buf = store.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != device:
            buf = torch.empty(like.shape, dtype=like.dtype, device=device, pin_memory=pin)
            store[key] = buf
        return buf

    def _decide_mode(self, tensors: Mapping[str, torch.Tensor]) -> str:
        cuda = [t for t in tensors.values() if t.is_cuda]
        if not cuda:
            return "sync"
        if self.mode is not None:
            return self.mode
        device = cuda[0].device
        need = sum(t.numel() * t.element_size() for t in cuda)
        free, total = torch.cuda.mem_get_info(device)
        headroom = max(int(total * DEVICE_HEADROOM_FRACTION), DEVICE_HEADROOM_MIN_BYTES)
        self.mode = "device" if free >= need + headroom else "pinned"
        logging.getLogger("training.torch").info(
            "snapshot mode %s: state %.3f GiB on %s, %.3f GiB free", self.mode, need / 2**30, device, free / 2**30)
        return self.mode

    def snapshot(self, directory: Path) -> Callable[[], dict]:
        """Copy the model, optimizer, scheduler, scaler, extra and generator states to host memory.

        See :meth:`StateAdapter.snapshot`. In ``device``/``pinned`` mode the copies run on a side CUDA stream
        and the next ``optimizer.step()`` waits for them (a pre-hook); ``sync`` copies before returning.

        Args:
            directory: the store's empty temporary directory the returned writer fills.

        Returns:
            a function that writes the captured tensors and the index into ``directory`` and returns their
            ``{relative path: {"size", "sha256"}}``.
        """
        self.wait_for_snapshot()  # the previous snapshot's copies are done (the writer waited for them too)
        skeleton, tensors, step_only = self._collect()
        self._gathered_rng = None
        mode = self._decide_mode(tensors)
        keys = list(tensors)
        drain: torch.cuda.Event | None = None
        cuda_keys = [k for k in keys if tensors[k].is_cuda]
        for key in keys:
            t = tensors[key]
            if not t.is_cuda or mode == "sync":
                self._buffer(self._host, key, t, device=torch.device("cpu"), pin=t.is_cuda).copy_(t.detach())
        if cuda_keys and mode != "sync":
            main = torch.cuda.current_stream(tensors[cuda_keys[0]].device)
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=tensors[cuda_keys[0]].device)
            side = self._stream
            staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device source, pinned host)
            # Tensors that the next forward may change (BatchNorm statistics, scheduler/scaler
            # tensors): copied device-to-device on the training stream itself, in stream order.
            for key in cuda_keys:
                if key not in step_only:
                    t = tensors[key]
                    dev = self._buffer(self._device, key, t, device=t.device)
                    dev.copy_(t.detach(), non_blocking=True)
                    staged.append((dev, self._buffer(self._host, key, t, device=torch.device("cpu"), pin=True)))
            ready = torch.cuda.Event()
            ready.record(main)
            copied = torch.cuda.Event()
            drained = torch.cuda.Event()
            with torch.cuda.stream(side):
                side.wait_event(ready)
                for key in cuda_keys:
                    if key in step_only:
                        t = tensors[key].detach()
                        t.record_stream(side)
                        host = self._buffer(self._host, key, t, device=torch.device("cpu"), pin=True)
                        if mode == "device":
                            dev = self._buffer(self._device, key, t, device=t.device)
                            dev.copy_(t, non_blocking=True)
                            staged.append((dev, host))
                        else:
                            host.copy_(t, non_blocking=True)
                copied.record(side)
                for dev, host in staged:
                    host.copy_(dev, non_blocking=True)
                drained.record(side)
            self._copy_event = copied
            drain = drained
        host = {k: self._host[k] for k in keys}
        entries, offset = [], 0
        for key in keys:
            t = tensors[key]
            nbytes = t.numel() * t.element_size()
            entries.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                            "offset": offset, "nbytes": nbytes})
            offset += nbytes
        index = json.dumps({"format": _INDEX_FORMAT, "tensors": entries, "state": skeleton}).encode()

        def write() -> dict:
            if drain is not None:
                drain.synchronize()  # the writer thread waits for the device-to-host drain
            return {TENSORS_FILE: write_file(directory / TENSORS_FILE, [_byte_view(host[k]) for k in keys]),
                    INDEX_FILE: write_file(directory / INDEX_FILE, [index])}

        return write

    def wait_for_snapshot(self) -> None:
        """Make the current CUDA stream wait (on the device, not the host) until the last snapshot's
        copies of parameters and optimizer state are done. Registered as an optimizer step-pre-hook;
        call it before changing a parameter in place outside ``optimizer.step()``."""
        event, self._copy_event = self._copy_event, None
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    # ------------------------------------------------------------------ restore
    def load(self, ckpt: Checkpoint) -> None:
        """Read ``ckpt`` into the live model, optimizer, scheduler, scaler, extra objects and generators.

        See :meth:`StateAdapter.load`: every shape is checked before anything changes.

        Args:
            ckpt: the checkpoint the driver chose to restore.

        Raises:
            ShapeMismatchError: a parameter or an optimizer state has another shape than in the checkpoint
                (the model changed); names the path and the variable.
            CheckpointError: the index is missing, unreadable or of another format, the tensor file is
                truncated, or a tensor has an unsupported dtype.
        """
        path = ckpt.path
        try:
            index = json.loads((path / INDEX_FILE).read_text(encoding="utf-8"))
            entries = {e["key"]: e for e in index["tensors"]}
            state = index["state"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"checkpoint {str(path)!r}: {INDEX_FILE} is not a PyTorch adapter index ({err})") from err
        if index.get("format") != _INDEX_FORMAT:
            raise CheckpointError(f"checkpoint {str(path)!r}: index format {index.get('format')!r}, "
                                  f"this version reads {_INDEX_FORMAT}")
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {str(path)!r}: {INDEX_FILE} holds no state mapping")
        _check_data(state, f"checkpoint {str(path / INDEX_FILE)!r}", entries)
        self._check(path, state, entries)
        tensors: dict[str, torch.Tensor] = {}
        with open(path / TENSORS_FILE, "rb") as f:
            for key, e in entries.items():
                t = torch.empty(e["shape"], dtype=_DTYPES[e["dtype"]])
                f.seek(e["offset"])
                if e["nbytes"] and f.readinto(_byte_view(t)) != e["nbytes"]:
                    raise CheckpointError(f"checkpoint {str(path)!r}: {TENSORS_FILE} ends inside tensor {key!r}")
                tensors[key] = t
        # Everything is read and checked: only now change the live objects.
        unwrap_module(self.model).load_state_dict(_unflatten(state["model"], tensors), strict=True)
        for name, obj in self.components.items():
            obj.load_state_dict(_unflatten(state[name], tensors))
        grads = _unflatten(state.get("grads", {}), tensors)
        for name, p in unwrap_module(self.model).named_parameters():
            p.grad = grads[name].to(p.device).clone() if name in grads else None
        if self.rng and "rng" in state:
            self._set_rng(path, [_unflatten(s, tensors) for s in state["rng"]])

    def _set_rng(self, path: Path, ranks: list[dict[str, torch.Tensor]]) -> None:
        if len(ranks) != self.world_size:
            logging.getLogger("training.torch").warning(
                "checkpoint %s holds generator states of %d ranks, this job has %d: rank %d uses rank %d's",
                path, len(ranks), self.world_size, self.rank, min(self.rank, len(ranks) - 1))
        mine = ranks[min(self.rank, len(ranks) - 1)]
        torch.set_rng_state(mine["cpu"])
        if torch.cuda.is_available():
            for name, value in mine.items():
                if name.startswith("cuda") and int(name[4:]) < torch.cuda.device_count():
                    torch.cuda.set_rng_state(value, int(name[4:]))

    def _check(self, path: Path, state: dict, entries: dict) -> None:
        where = f"checkpoint {str(path)!r}"
        missing = [n for n in ("model", *self.components) if n not in state]
        unexpected = [n for n in state if n not in ("model", "rng", "grads", *self.components)]
        if missing or unexpected:
            raise ShapeMismatchError(
                f"{where} does not match this run's objects: missing {missing}, not in this run {unexpected}; "
                "pass the same model, optimizer, scheduler, scaler and extra objects, or use another checkpoint directory")
        for key, e in entries.items():
            if e.get("dtype") not in _DTYPES:
                raise CheckpointError(f"{where}: tensor {key!r} has unsupported dtype {e.get('dtype')!r}")
        live = unwrap_module(self.model).state_dict()
        saved = {k: v for k, v in state["model"].items()} if isinstance(state["model"], dict) else {}
        if set(saved) != set(live):
            raise ShapeMismatchError(
                f"{where}: model keys differ: missing in checkpoint {sorted(set(live) - set(saved))[:5]}, "
                f"not in the model {sorted(set(saved) - set(live))[:5]}; the model changed (use another checkpoint directory)")
        for name, t in live.items():
            e = entries[saved[name]["__tensor__"]]
            if list(t.shape) != e["shape"] or str(t.dtype).removeprefix("torch.") != e["dtype"]:
                raise ShapeMismatchError(
                    f"{where}: model variable {name!r} has shape {e['shape']} ({e['dtype']}) in the checkpoint, "
                    f"{list(t.shape)} ({str(t.dtype).removeprefix('torch.')}) in the model; the model changed "
                    "(use another checkpoint directory)")
        if self.optimizer is not None:
            self._check_optimizer(where, state["optimizer"], entries)

    def _check_optimizer(self, where: str, saved: dict, entries: dict) -> None:
        groups = _unflatten(saved.get("param_groups", []), None)
        live_groups = self.optimizer.param_groups
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in live_groups]:
            raise ShapeMismatchError(
                f"{where}: optimizer parameter groups hold {[len(g['params']) for g in groups]} parameters, "
                f"this optimizer {[len(g['params']) for g in live_groups]}; the model or optimizer changed")
        params = {i: p for g_saved, g in zip(groups, live_groups) for i, p in zip(g_saved["params"], g["params"])}
        for pid, slots in _unflatten(saved.get("state", {}), None).items():
            if pid not in params or not isinstance(slots, dict):
                continue
            for slot, ref in slots.items():
                e = entries.get(ref["__tensor__"]) if isinstance(ref, dict) and "__tensor__" in ref else None
                if e and e["shape"] and e["shape"] != list(params[pid].shape):
                    raise ShapeMismatchError(
                        f"{where}: optimizer state {slot!r} of parameter {pid} has shape {e['shape']}, the parameter "
                        f"{list(params[pid].shape)}; the model changed (use another checkpoint directory)")

    # ------------------------------------------------------------------ distributed
    def before_save(self) -> None:
        """Restart the seconds cadence and, in a distributed job, gather every rank's generator states to rank 0.

        See :meth:`StateAdapter.before_save`; runs on every rank (``torch.distributed.all_gather_object``).
        """
        self._last_save_time = time.monotonic()
        if self.distributed and self.rng:
            gathered: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(gathered, self._rng_state())
            self._gathered_rng = gathered if self.is_writer else None

    def agree(self, stop: bool, checkpoint: bool) -> tuple[bool, bool]:
        """Combine every rank's stop and checkpoint requests with an all-reduce (MAX), plus rank 0's seconds cadence.

        See :meth:`StateAdapter.agree`. Single process: the arguments unchanged.

        Args:
            stop: this rank wants to stop (a notice arrived).
            checkpoint: this rank wants a checkpoint at this step.

        Returns:
            ``(stop, checkpoint)`` agreed by all ranks (a collective: every rank must call it at every step).
        """
        if not self.distributed:
            return stop, checkpoint
        due = (self.is_writer and self.every_seconds is not None
               and time.monotonic() - self._last_save_time >= self.every_seconds)
        device = (torch.device("cuda", torch.cuda.current_device())
                  if torch.distributed.get_backend() == "nccl" else torch.device("cpu"))
        flags = torch.tensor([int(stop), int(checkpoint or due)], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        stop_all, ckpt_all = (bool(v) for v in flags.tolist())
        return stop_all, ckpt_all

    def barrier(self) -> None:
        """Wait for every rank (``torch.distributed.barrier``); nothing in a single process."""
        if self.distributed:
            torch.distributed.barrier()

    def release(self) -> None:
        """Wait for pending copies, free the host and device buffers and remove the optimizer hooks."""
        if self._stream is not None:
            self._stream.synchronize()
        self._copy_event = None
        self._host.clear()
        self._device.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


# ----------------------------------------------------------------------------- data position
class StepSampler(torch.utils.data.Sampler):
    """A ``DataLoader`` batch sampler whose batch for global step ``s`` is a pure function of
    ``(s, seed)``: :func:`spot_training.training.datasets.batch_indices` (a new permutation each epoch of
    ``n // (batch_size * world_size)`` steps). The data position is the step, so nothing about
    the loader has to be checkpointed.

    Args:
        n: examples in the dataset.
        batch_size: examples per step on this rank.
        seed: permutation seed (default 0).
        start: the first step, an int or a callable evaluated when iteration begins (a
            :class:`TorchCheckpointer` passes its restored step). Default 0.
        total_steps: stop after this step (exclusive); None: endless.
        rank: this rank's shard of each global batch of ``batch_size * world_size`` examples
            (default: from ``torch.distributed`` when initialised, else 0).
        world_size: ranks sharing each global batch (default: from ``torch.distributed`` when
            initialised, else 1).

    Raises:
        ValueError: ``batch_size * world_size > n`` (from batch_indices), or ``rank`` outside ``[0,
            world_size)``.
    """

    def __init__(self, n: int, batch_size: int, *, seed: int = 0, start: int | Callable[[], int] = 0,
                 total_steps: int | None = None, rank: int | None = None, world_size: int | None = None) -> None:
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = rank if rank is not None else (torch.distributed.get_rank() if dist else 0)
        self.world_size = world_size if world_size is not None else (torch.distributed.get_world_size() if dist else 1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size). Received: rank={self.rank}, world_size={self.world_size}")
        self.n, self.batch_size, self.seed, self.start, self.total_steps = n, batch_size, seed, start, total_steps
        batch_indices(0, batch_size=batch_size * self.world_size, n=n, seed=seed)  # validates the arguments

    def indices(self, step: int) -> list[int]:
        """This rank's example indices of global step ``step``."""
        idx = batch_indices(step, batch_size=self.batch_size * self.world_size, n=self.n, seed=self.seed)
        return idx[self.rank * self.batch_size:(self.rank + 1) * self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start() if callable(self.start) else self.start
        while self.total_steps is None or step < self.total_steps:
            yield self.indices(step)
            step += 1

    def __len__(self) -> int:
        if self.total_steps is None:
            raise TypeError("an endless StepSampler has no length (pass total_steps)")
        start = self.start() if callable(self.start) else self.start
        return max(0, self.total_steps - start)


# ----------------------------------------------------------------------------- loader workers
#: Signals a DataLoader worker ignores: the node agent's notice (SIGTERM) and checkpoint request
#: (SIGUSR1, whose default action also terminates) may be sent to the trainer's whole process group.
WORKER_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class IgnoreNoticeSignals:
    """A ``DataLoader`` ``worker_init_fn`` that makes the worker ignore :data:`WORKER_IGNORED_SIGNALS`,
    then calls the user's own ``worker_init_fn`` (if any).

    A SIGTERM sent to the trainer's process group also reaches the loader's worker processes; torch's
    worker-side handler (installed before ``worker_init_fn`` runs) lets it kill them, and the main
    process's SIGCHLD handler then raises ``RuntimeError: DataLoader worker (pid N) is killed by signal:
    Terminated`` in the middle of the notice save. Ignored, the workers keep serving batches until the
    main process has saved and exits; they leave with it (torch's workers stop when their iterator is
    shut down or their parent is gone). A module-level class, so that it pickles for the ``spawn`` and
    ``forkserver`` start methods.

    Args:
        init_fn: the loader's original ``worker_init_fn`` (called with the worker id), or None.
    """

    def __init__(self, init_fn: Callable[[int], Any] | None = None) -> None:
        self.init_fn = init_fn

    def __call__(self, worker_id: int) -> None:
        for sig in WORKER_IGNORED_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if self.init_fn is not None:
            self.init_fn(worker_id)


def protect_loader_workers(loader: Any) -> Any:
    """Make a ``torch.utils.data.DataLoader`` with ``num_workers > 0`` start workers that survive a
    notice sent to the whole process group (:class:`IgnoreNoticeSignals` wraps its ``worker_init_fn``).
    Other iterables, loaders without workers and loaders already protected are returned unchanged.
    Call it before the loader's first ``iter()`` (persistent workers keep the function they started with).

    Returns:
        ``loader``.
    """
    if (isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers > 0
            and not isinstance(loader.worker_init_fn, IgnoreNoticeSignals)):
        loader.worker_init_fn = IgnoreNoticeSignals(loader.worker_init_fn)
    return loader


def worker_draws_random_numbers(loader: Any) -> str | None:
    """Which global generator a ``DataLoader``'s dataset draws from in ``__getitem__`` when its
    workers run it (``num_workers > 0``): ``"torch"``, ``"numpy"`` or ``"random"``; None when it draws
    none, or when it cannot be seen cheaply (an ``IterableDataset``, no workers, another iterable).

    Fetches example 0 once in this process and compares the three generators' states before and
    after (then puts them back, so nothing changes). Workers seed torch and ``random`` from the
    loader's base seed, not from the step, so such draws make a resume not bitwise.
    """
    if not (isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers > 0):
        return None
    dataset = loader.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    import random

    import numpy as np

    before = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        dataset[0]
    except Exception:  # noqa: BLE001 - a dataset that cannot fetch example 0 here: nothing to see
        return None
    finally:
        after = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        torch.set_rng_state(before[0])
        np.random.set_state(before[1])
        random.setstate(before[2])
    if not torch.equal(before[0], after[0]):
        return "torch"
    if any(not np.array_equal(a, b) for a, b in zip(before[1], after[1])):
        return "numpy"
    if before[2] != after[2]:
        return "random"
    return None


# ----------------------------------------------------------------------------- user-facing front-end
class TorchCheckpointer(DriverFront):
    """Resumable PyTorch training: :class:`TorchAdapter` on :class:`spot_training.training.core.CheckpointDriver`.

    The option names are those of every front-end (docs/training-pytorch.md). In a distributed job the
    seconds cadence follows rank 0's clock and is agreed by all ranks.

    Args:
        model, optimizer, scheduler, scaler, extra: what is checkpointed, as for :class:`TorchAdapter`
            (the ``nn.Module``; an optimizer, LR scheduler and ``GradScaler`` or None; named objects with
            ``state_dict``).
        checkpoint_dir: default ``$SPOT_TRAINING_CHECKPOINT_DIR`` or ``/dltraining/checkpoints``.
        every_steps: save every this many completed steps (None: off); default
            ``$SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`` or 50.
        every_seconds: also save when this many seconds passed since the last save (None: off); default
            ``$SPOT_TRAINING_CHECKPOINT_EVERY_SECONDS`` or None.
        background: write checkpoints on a background thread (default True).
        keep: checkpoints kept, >= 2 (default 3).
        steps_per_epoch: records each checkpoint's epoch (default None: epoch 0).
        notices: a :class:`~spot_training.training.notice.NoticeHandler` (default: SIGTERM stops, SIGUSR1
            requests a checkpoint).
        snapshot_mode: ``"auto"`` (default), ``"device"``, ``"pinned"`` or ``"sync"`` (as :class:`TorchAdapter`).
        rng: checkpoint the torch CPU and CUDA generator states (default True).
        metadata: optional callable returning a JSON-serialisable dict stored in each manifest.
        logger: default ``logging.getLogger("training.torch")``.

    Raises:
        SystemExit: a :class:`~spot_training.training.core.CheckpointError` no restart can fix, at
            construction (the directory is a file, read-only, ...: 74 or 78, docs/contracts.md) or on the
            first step of :meth:`steps` (another framework's checkpoint, a changed model).
        ValueError: from :class:`TorchAdapter` (a bad ``snapshot_mode``, an ``extra`` object without
            ``state_dict``, a ``torchrun`` launch before ``torch.distributed`` is initialised).
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, scheduler=None, *, scaler=None,
                 extra: Mapping[str, Any] | None = None, checkpoint_dir: str | os.PathLike | None = None,
                 every_steps: int | None = DEFAULT, every_seconds: float | None = DEFAULT, background: bool = True,
                 keep: int = DEFAULT_KEEP, steps_per_epoch: int | None = None, notices: NoticeHandler | None = None,
                 snapshot_mode: str = "auto", rng: bool = True, metadata: Callable[[], dict] | None = None,
                 logger: logging.Logger | None = None) -> None:
        seconds = default_every_seconds() if every_seconds is DEFAULT else every_seconds
        self.log = logger or logging.getLogger("training.torch")
        self.adapter = TorchAdapter(model, optimizer, scheduler, scaler=scaler, extra=extra, rng=rng,
                                    snapshot_mode=snapshot_mode,
                                    every_seconds=seconds)
        self._in_step = False  # between a step's yield and the loop asking for the next one
        self._finished = False
        with self._exit_on_checkpoint_error():
            self.driver = CheckpointDriver(
                self.adapter, checkpoint_dir=checkpoint_dir, every_steps=every_steps,
                every_seconds=None if self.adapter.distributed else seconds, background=background, keep=keep,
                steps_per_epoch=steps_per_epoch, notices=notices, metadata=metadata, logger=self.log)

    @contextlib.contextmanager
    def _exit_on_checkpoint_error(self) -> Iterator[None]:
        """A checkpoint error that no restart can fix ends the process with the contract's status
        (docs/contracts.md, :func:`~spot_training.training.core.checkpoint_exit_code`): 74 for storage
        that is full or unusable, 78 for a checkpoint that cannot serve this job; logged with its
        message (which names the path). The 4-line recipe needs no mapping of its own."""
        try:
            yield
        except CheckpointError as err:
            code = checkpoint_exit_code(err)
            self.log.error("%s (exit %d, restarting will not help): %s", type(err).__name__, code, err)
            raise SystemExit(code) from err

    @property
    def is_writer(self) -> bool:
        """True on the rank that writes checkpoints (rank 0; every rank restores)."""
        return self.adapter.is_writer

    def batch_sampler(self, n: int, batch_size: int, *, seed: int = 0, rank: int | None = None,
                      world_size: int | None = None) -> StepSampler:
        """A :class:`StepSampler` that starts at this checkpointer's step when iteration begins
        (pass it as ``DataLoader(..., batch_sampler=...)`` and the loader to :meth:`steps`).

        Args:
            n: examples in the dataset.
            batch_size: examples per step on this rank; recorded so that a resume with another batch size
                or dataset size is refused.
            seed: permutation seed (default 0).
            rank: this rank (default: from ``torch.distributed`` when initialised, else 0).
            world_size: ranks (default: from ``torch.distributed`` when initialised, else 1).

        Returns:
            the sampler, starting at :attr:`step` when its iteration begins.

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)`` or ``batch_size * world_size > n``.
        """
        self.adapter.data = {"batch_size": batch_size, "examples": n}  # a resume with others is refused
        return StepSampler(n, batch_size, seed=seed, start=lambda: self.driver.step, rank=rank, world_size=world_size)

    def steps(self, total_steps: int, loader: Iterable | None = None) -> Iterator:
        """Restore, then yield the 0-based global steps still to run (with ``loader``: pairs
        ``(step, batch)``, the loader iterated from after the restore). Saves on the cadence and
        on request; on SIGTERM finishes the step, saves, waits, and raises ``SystemExit(0)``;
        after the last step writes the final checkpoint and ``COMPLETED``.

        The loader's iterator is created after the restore with the torch CPU generator state
        put back afterwards: a ``DataLoader`` draws its workers' base seed from that generator
        when it starts iterating, which would otherwise shift every later draw of a resumed run.

        Args:
            total_steps: the global steps of the whole training (not the steps still to run).
            loader: an iterable of batches (a ``DataLoader`` with :meth:`batch_sampler`), or None.

        Yields:
            the step (``loader`` None) or ``(step, batch)``.

        Raises:
            SystemExit: 0 after the notice's checkpoint; 74 or 78 for a checkpoint error no restart fixes.
            RuntimeError: the loop asked for another step after :meth:`finish`.
            ValueError: ``loader`` ran out of batches before ``total_steps``.
        """
        it = None
        with self._exit_on_checkpoint_error():
            early = self._completed_early(total_steps)
            if early is not None:  # ckpt.finish() ended this training before total_steps: nothing to run
                self.driver.restore()
                self.log.info("training was completed early at step %d (COMPLETED in %s); no step to run",
                              early, self.driver.directory)
                self.driver.close()
                return
            steps = self.driver.steps(total_steps)
            try:
                for step in steps:
                    if self._finished:
                        raise RuntimeError(f"ckpt.finish() ended training at step {self.driver.step}; "
                                           "leave the loop (break) after calling it")
                    if loader is None:
                        item = step
                    else:
                        if it is None:
                            protect_loader_workers(loader)
                            drawn = worker_draws_random_numbers(loader)
                            if drawn is not None:
                                self.log.warning(
                                    "resume is not exact: the DataLoader's %d workers draw from the %s generator in "
                                    "the dataset's __getitem__, seeded when iteration starts, not from the step; draw "
                                    "augmentation in the main process after fetching the batch, or seed it from the "
                                    "example index and the step (docs/training-pytorch.md)", loader.num_workers, drawn)
                            state = torch.get_rng_state()
                            it = iter(loader)
                            torch.set_rng_state(state)
                        try:
                            batch = next(it)
                        except StopIteration:
                            raise ValueError(
                                f"the loader ran out of batches at step {step} of total_steps={total_steps}; give "
                                "the DataLoader batch_sampler=ckpt.batch_sampler(...) (endless, derived from the "
                                "step)") from None
                        item = (step, batch)
                    self._in_step = True
                    try:
                        yield item
                    except GeneratorExit:
                        if not self._finished:
                            self.log.error(
                                "the training loop was left at step %d of total_steps=%d without ckpt.finish(): no "
                                "final checkpoint of this step and no COMPLETED, so the job is not complete and "
                                "will be restarted; to stop early call ckpt.finish() before break "
                                "(docs/training-pytorch.md)", step, total_steps)
                        raise
                    self._in_step = False
            finally:
                steps.close()

    def _completed_early(self, total_steps: int) -> int | None:
        """The step of a ``COMPLETED`` marker that :meth:`finish` wrote inside the loop (an early stop,
        recorded in the final checkpoint's metadata) before ``total_steps``, matching the newest checkpoint;
        None otherwise (no marker, unreadable, a run that completed its own total and is now given more)."""
        try:
            marker = json.loads((self.driver.directory / COMPLETED_FILE).read_text(encoding="utf-8"))
            step = marker["step"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        latest = self.driver.store.latest()
        if (isinstance(step, int) and latest is not None and latest.step == step < total_steps
                and latest.metadata.get("early_stop")):
            return step
        return None

    # For loops that cannot be written as ``for ... in ckpt.steps(...)`` (as CheckpointDriver):
    def install(self) -> "TorchCheckpointer":
        """Install the notice handlers (SIGTERM, SIGUSR1); main thread only."""
        self.driver.install()
        return self

    def restore(self) -> int:
        """Restore the newest valid checkpoint; return the completed steps (0: none)."""
        return self.driver.restore()

    def after_step(self) -> bool:
        """Count a completed step; save if due or requested; on a stop request save and SystemExit(0)."""
        return self.driver.after_step()

    def finish(self) -> Checkpoint | None:
        """End training now: the final checkpoint (waited for), then ``COMPLETED``, as after the last step.

        Inside a ``for ... in ckpt.steps(...)`` loop (early stopping) the step in progress counts as
        completed (call it after that step's ``optimizer.step()``), then leave the loop with ``break``; the
        next run restores that checkpoint and yields no step.

        Returns:
            the final checkpoint (None on ranks that do not write).
        """
        if self._in_step:
            self.driver.step += 1  # the yielded step ran; after_step never will
            self._in_step = False
            self.adapter.early_stop = True  # recorded in the final manifest: a rerun runs no step
        self._finished = True
        with self._exit_on_checkpoint_error():
            return self.driver.finish()

    def save(self, *, wait: bool = False) -> Checkpoint | None:
        """Checkpoint now (between steps); see :meth:`CheckpointDriver.save`."""
        return self.driver.save(wait=wait)

    def wait_for_snapshot(self) -> None:
        """See :meth:`TorchAdapter.wait_for_snapshot`."""
        self.adapter.wait_for_snapshot()

    def close(self) -> None:
        """Wait for a pending write, stop the writer, free the buffers (idempotent)."""
        self.driver.close()
