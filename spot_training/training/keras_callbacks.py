"""The state of Keras callbacks in a checkpoint: what ``EarlyStopping``, ``ReduceLROnPlateau`` and your own
stateful callbacks carry across a resume, and its two files in the checkpoint directory.

:class:`spot_training.training.keras_adapter.KerasAdapter` captures the states of the callbacks given to
``ResumableFit.fit`` with each snapshot and puts them back after a restore, so that a resumed ``fit``
stops early, or lowers the learning rate, exactly where the uninterrupted one would have.

Files (inside the store's ``ckpt-<step>`` directory, written only when some callback has state):
``keras.callbacks.json`` (``{"<position>-<class name>": {name: JSON value, or the array count for a
name ending in "_arrays"}}``) and ``keras.callbacks.npz`` (the arrays, as ``<key>/<name>/<j>``; read
with ``allow_pickle=False``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import keras
import numpy as np

from spot_training.training.store import write_file

__all__ = ["CALLBACKS_FILE", "CALLBACK_ARRAYS_FILE", "apply_callback_states", "callback_state",
           "capture_callback_states", "read_callback_states", "set_callback_state", "write_callback_states"]

CALLBACKS_FILE = "keras.callbacks.json"
CALLBACK_ARRAYS_FILE = "keras.callbacks.npz"


def callback_state(callback) -> dict | None:
    """The state of one callback that a checkpoint keeps, or None for a callback without state.

    A callback of your own takes part by defining ``get_checkpoint_state() -> dict`` (JSON values,
    or lists of numpy arrays under keys ending in ``_arrays``) and ``set_checkpoint_state(dict)``.
    Built in: ``EarlyStopping`` (wait, stopped_epoch, best, best_epoch, best_weights) and
    ``ReduceLROnPlateau`` (wait, cooldown_counter, best; the learning rate itself is an optimizer
    variable). ``CSVLogger`` has no state: a resumed ``fit`` opens it in append mode.
    """
    if hasattr(callback, "get_checkpoint_state"):
        return dict(callback.get_checkpoint_state())
    if isinstance(callback, keras.callbacks.EarlyStopping):
        return {"wait": int(callback.wait), "stopped_epoch": int(callback.stopped_epoch),
                "best": None if getattr(callback, "best", None) is None else float(callback.best),
                "best_epoch": int(getattr(callback, "best_epoch", 0)),
                "best_weights_arrays": None if callback.best_weights is None else list(callback.best_weights)}
    if isinstance(callback, keras.callbacks.ReduceLROnPlateau):
        return {"wait": int(callback.wait), "cooldown_counter": int(callback.cooldown_counter),
                "best": None if getattr(callback, "best", None) is None else float(callback.best)}
    return None


def set_callback_state(callback, state: dict) -> None:
    """Put a :func:`callback_state` back into ``callback``.

    Args:
        callback: the Keras callback (its ``set_checkpoint_state`` is used when it has one).
        state: the dict :func:`callback_state` returned for it (arrays under ``*_arrays`` keys).
    """
    if hasattr(callback, "set_checkpoint_state"):
        callback.set_checkpoint_state(dict(state))
        return
    for key, value in state.items():
        name = key[: -len("_arrays")] if key.endswith("_arrays") else key
        setattr(callback, name, list(value) if isinstance(value, (list, tuple)) else value)


def _callback_key(position: int, callback) -> str:
    return f"{position:02d}-{type(callback).__name__}"




def capture_callback_states(callbacks: Sequence) -> dict[str, dict]:
    """The stateful callbacks' states, keyed ``<position>-<class name>``.

    Args:
        callbacks: the callbacks given to ``fit``, in their order.

    Returns:
        ``{key: state}`` for every callback :func:`callback_state` knows (others are left out).
    """
    states = {}
    for i, cb in enumerate(callbacks):
        state = callback_state(cb)
        if state is not None:
            states[_callback_key(i, cb)] = state
    return states


def apply_callback_states(callbacks: Sequence, states: dict[str, dict] | None) -> None:
    """Put states from :func:`capture_callback_states` back into the callbacks at the same positions.

    Args:
        callbacks: the callbacks given to the resumed ``fit``, in their order.
        states: ``{key: state}``; None or empty: nothing to do. A callback whose key (position and
            class name) has no state is left as it is.
    """
    for i, cb in enumerate(callbacks):
        state = (states or {}).get(_callback_key(i, cb))
        if state is not None:
            set_callback_state(cb, state)


def write_callback_states(states: dict[str, dict], directory: Path) -> dict[str, dict]:
    """Write ``states`` as ``keras.callbacks.json`` and ``keras.callbacks.npz`` into ``directory``.

    Args:
        states: ``{key: state}`` from :func:`capture_callback_states`.
        directory: the checkpoint's temporary directory.

    Returns:
        the two files' manifest entries (``store.write_file``), keyed by file name; ``{}`` when
        ``states`` is empty (nothing is written).

    Raises:
        OSError: a write failed (ENOSPC included).
    """
    if not states:
        return {}
    plain, packed = {}, {}
    for key, state in states.items():
        plain[key] = {}
        for name, value in state.items():
            if name.endswith("_arrays") and value is not None:
                plain[key][name] = len(value)
                for j, array in enumerate(value):
                    packed[f"{key}/{name}/{j}"] = np.asarray(array)
            else:
                plain[key][name] = value
    buffer = io.BytesIO()
    np.savez(buffer, **packed)
    return {CALLBACK_ARRAYS_FILE: write_file(directory / CALLBACK_ARRAYS_FILE, [buffer.getbuffer()]),
            CALLBACKS_FILE: write_file(directory / CALLBACKS_FILE, [json.dumps(plain).encode()])}


def read_callback_states(directory: Path) -> dict[str, dict] | None:
    """The callback states a checkpoint holds.

    Args:
        directory: the checkpoint's directory.

    Returns:
        ``{key: state}`` with the arrays back as lists of numpy arrays; None when the checkpoint has no
        ``keras.callbacks.json``.

    Raises:
        OSError: ``keras.callbacks.npz`` is missing or unreadable.
        ValueError: a file is not valid JSON or npz.
    """
    path = directory / CALLBACKS_FILE
    if not path.is_file():
        return None
    plain = json.loads(path.read_text())
    with np.load(directory / CALLBACK_ARRAYS_FILE, allow_pickle=False) as packed:
        for key, state in plain.items():
            for name, value in state.items():
                if name.endswith("_arrays") and value is not None:
                    state[name] = [packed[f"{key}/{name}/{j}"] for j in range(int(value))]
    return plain
