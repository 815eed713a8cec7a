"""Subprocess for tests/training/test_keras_snapshot.py (TensorFlow never runs in the pytest process).

Trains a small Keras model with Adam and saves through the checkpoint driver with a
:class:`KerasAdapter` in background mode while holding the first write back, so that the next
save must wait for it before copying (one write at a time) and training goes on meanwhile. Prints
one JSON line: for each save, whether the committed checkpoint equals the variables at that step
(bitwise), and which host buffer set each save used.

    python tests/training/snapshot_job.py CHECKPOINT_DIR
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from spot_training.training.core import CheckpointDriver  # noqa: E402
from spot_training.training.keras_adapter import KerasAdapter, KerasCheckpointer, make_deterministic  # noqa: E402
from spot_training.training.notice import NoticeHandler  # noqa: E402


def main(checkpoint_dir: str) -> int:
    make_deterministic(3)
    import keras

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    y = rng.integers(0, 3, 32)
    adapter = KerasAdapter(model)
    driver = CheckpointDriver(adapter, checkpoint_dir=checkpoint_dir, every_steps=None, background=True, keep=5,
                              host_rng=False,
                              notices=NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=()))
    store, ck = driver.store, adapter.checkpointer
    ck.ensure_built(x)

    def values():
        return [np.array(v.numpy()) for _g, v in ck._variables()]

    release_first = threading.Event()
    used = []  # id of the first array of each save's snapshot: which buffer set it copied into
    real_write, real_snapshot = KerasCheckpointer.write_snapshot, ck.snapshot

    def write_snapshot(arrays, index, directory):
        if not release_first.is_set():
            release_first.wait(30)  # the first write reads its snapshot only after training went on
        return real_write(arrays, index, directory)

    def snapshot(out=None):
        arrays, index = real_snapshot(out)
        used.append(id(next(iter(arrays.values()))))
        return arrays, index

    KerasCheckpointer.write_snapshot, ck.snapshot = staticmethod(write_snapshot), snapshot
    expected = {}
    model.train_on_batch(x, y)
    expected[1] = values()
    driver.step = 1
    driver.save()                                 # its write waits for release_first
    model.train_on_batch(x, y)                    # training goes on while the first copy is held
    expected[2] = values()
    threading.Timer(0.5, release_first.set).start()
    driver.step = 2
    driver.save()                                 # waits for write 1, then copies into the other set
    model.train_on_batch(x, y)
    expected[3] = values()
    driver.step = 3
    driver.save(wait=True)                        # write 2 is done: the first set is reused
    driver.close()

    equal = {}
    for ckpt in store.checkpoints():
        index = json.loads((ckpt.path / "keras.variables.json").read_text())["variables"]
        saved = [np.load(ckpt.path / "keras.variables" / f"{e['key']}.npy") for e in index]
        want = expected[ckpt.step]
        equal[ckpt.step] = len(saved) == len(want) and all(
            a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(saved, want))
    changed = any(a.tobytes() != b.tobytes() for a, b in zip(expected[1], expected[2]))
    print(json.dumps({"equal": {str(k): v for k, v in sorted(equal.items())}, "steps_differ": changed,
                      "buffer_ids": used}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
