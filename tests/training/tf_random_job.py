"""A custom TensorFlow loop whose step draws from TensorFlow generators; run by test_tf_random.py.

    python tf_random_job.py CHECKPOINT_DIR OUT.npz --steps N [--stop-after K]

The step adds input noise drawn from ``tf.random.get_global_generator()`` (seeded by
make_deterministic) and a dropout-style mask from a ``tf.random.Generator`` of the script's own
(passed to TFCheckpointer), the documented resumable path (docs/training.md). ``--stop-after K``:
the process sends itself a real SIGTERM after K steps of this run. OUT.npz: the final weights and
the two generators' states.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stop-after", type=int, default=None)
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    from spot_training.training.keras_adapter import make_deterministic
    from spot_training.training.tf_loop import TFCheckpointer

    make_deterministic(0)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((64, 16), dtype=np.float32))
    y = tf.constant(rng.integers(0, 4, 64))
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    mask_rng = tf.random.Generator.from_seed(1)

    @tf.function
    def train_step(xb, yb):
        noisy = xb + tf.random.get_global_generator().normal(tf.shape(xb), stddev=0.1)
        keep = tf.cast(mask_rng.uniform(tf.shape(xb)) > 0.3, xb.dtype)
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(noisy * keep, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    ckpt = TFCheckpointer(checkpoint_dir=args.checkpoint_dir, every_steps=10, model=model, optimizer=optimizer,
                          mask_rng=mask_rng)
    ran = 0
    for step in ckpt.steps(args.steps):
        idx = np.arange(step * 16, step * 16 + 16) % 64
        train_step(tf.gather(x, idx), tf.gather(y, idx))
        ran += 1
        if ran == args.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
    out = {f"w{i}": v.numpy() for i, v in enumerate(model.weights)}
    out["global_rng"] = tf.random.get_global_generator().state.numpy()
    out["mask_rng"] = mask_rng.state.numpy()
    np.savez(args.out, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
