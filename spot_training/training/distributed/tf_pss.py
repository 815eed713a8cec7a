"""TensorFlow ``ParameterServerStrategy`` chief: a Keras 3 custom loop driven by ``ClusterCoordinator``.

    TF_CONFIG='{"cluster": {"chief": [...], "ps": [...], "worker": [...]}, "task": {"type": "chief", "index": 0}}' \\
        python -m spot_training.training.distributed.tf_pss --steps 300

Started by the scheduler node's agent (spot_training/agent/launch.py); the ps and worker tasks run
:mod:`spot_training.training.distributed.tf_server`. Variables live on the parameter servers; the chief schedules one
closure per step on whichever worker is free (asynchronous training, as PSS is). Each closure gets its
global batch as arguments, computed on the chief from the step number (spot_training/training/datasets.py), so the
data position is the step. The step counter is the chief's own: it counts closures that completed
(``ClusterCoordinator`` retries a closure whose worker died on another worker), kept in the
:class:`~spot_training.training.tf_loop.TFCheckpointer` step variable (Keras 3's ``optimizer.iterations`` under-counts
with asynchronous parameter servers; docs/architecture.md, "Checkpoints").

The loop schedules ``--save-every-steps`` closures (at most), joins, then checkpoints (the chief is the
only writer; synchronous ``tf.train.Checkpoint`` write of the PS variables through the store). SIGTERM is
honoured at the next join: save, exit 0. A lost worker is tolerated (its closures run elsewhere and a
worker restarted at the same address rejoins); a lost parameter server makes ``join`` raise, the chief
exits 1 and the agents start the next generation from the newest checkpoint. After the last step:
test accuracy on the held-out digits in ``<log_dir>/result.json``, then the final checkpoint and
``COMPLETED`` (last: the coordinator tears the generation down when it appears).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from spot_training.training.distributed.common import StepLog, flat_digits, generation, global_batch, parse_args, write_result
from spot_training.training.distributed.lr import scaled_learning_rate

#: Most closures scheduled before a join (bounds the work a SIGTERM waits for).
MAX_IN_FLIGHT = 10


def main(argv=None) -> int:
    """Run the ParameterServerStrategy chief's training loop, resuming from the newest checkpoint.

    Args:
        argv: the arguments (:func:`~spot_training.training.distributed.common.parse_args`); default ``sys.argv[1:]``.

    Returns:
        the exit status (module docstring): 0 after the last step or a SIGTERM's checkpoint.
    """
    args = parse_args(argv, description="TensorFlow ParameterServerStrategy chief of a spot-training cluster")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import keras
    import numpy as np
    import tensorflow as tf

    from spot_training.training.tf_loop import TFCheckpointer

    log = logging.getLogger("training.tf_pss")
    for noisy in ("tensorflow", "absl"):  # one INFO line per scheduled closure otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    num_workers = len(resolver.cluster_spec().as_dict().get("worker", []))
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    x_train, y_train, x_test, y_test = flat_digits(args.data_dir)
    n = len(x_train)
    batch = args.per_worker_batch or args.batch_size

    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(args.hidden, activation="relu"),
                                  keras.layers.Dense(args.hidden, activation="relu"), keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(learning_rate=args.learning_rate, momentum=0.9)
        optimizer.build(model.trainable_variables)  # slots exist before a restore (Keras 3 creates them lazily)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica_fn, args=(x, y))

    ckpt = TFCheckpointer(model=model, optimizer=optimizer, checkpoint_dir=args.checkpoint_dir, every_steps=None,
                          background=False,
                          # --per-worker-batch: the global batch, so the epoch length, changes with the
                          # workers; no epoch is recorded then (the data position is the step either way).
                          steps_per_epoch=None if args.per_worker_batch else max(1, n // batch))
    ckpt.install()
    step = ckpt.restore()
    log.info("chief of %d workers, generation %d, starting at step %d of %d", num_workers, generation(), step,
             args.steps)
    steps_log = StepLog(args.log_dir, steps_total=args.steps)
    try:
        while step < args.steps:
            if ckpt.notices.stop_requested:
                ckpt.step = step
                ckpt.save(wait=True)
                log.info("stop requested: checkpoint at step %d written, exiting 0", step)
                return 0
            began = time.perf_counter()
            chunk = min(MAX_IN_FLIGHT, args.steps - step, args.save_every_steps or MAX_IN_FLIGHT)
            lr = (scaled_learning_rate(args.learning_rate, num_workers=num_workers, step=step,
                                       warmup_steps=args.warmup_steps) if args.scale_lr else args.learning_rate)
            optimizer.learning_rate.assign(lr)
            pending = []
            for s in range(step, step + chunk):
                idx = global_batch(s, batch_size=batch, n=n, seed=args.seed)
                pending.append(coordinator.schedule(train_step, args=(tf.constant(x_train[idx]),
                                                                      tf.constant(y_train[idx]))))
            coordinator.join()  # raises when a parameter server is gone: exit 1, next generation
            for offset, value in enumerate(pending):
                steps_log.write(step=step + offset + 1, rank=0, num_workers=num_workers,
                                loss=float(value.fetch()), learning_rate=lr)
            step += chunk
            ckpt.step = step
            if ckpt.notices.consume_checkpoint_request() or (args.save_every_steps and
                                                               step % args.save_every_steps == 0):
                ckpt.save()
            left = args.min_step_seconds * chunk - (time.perf_counter() - began)
            if left > 0:
                time.sleep(left)
        ckpt.step = step
        # result.json before COMPLETED: the coordinator tears the generation down as soon as COMPLETED
        # appears, and the evaluation reads the variables from the parameter servers.
        logits = model(tf.constant(x_test), training=False)
        accuracy = float(np.mean(np.argmax(np.asarray(logits), axis=1) == y_test))
        write_result(args.log_dir, {"step": step, "test_accuracy": accuracy, "generation": generation(),
                                    "num_workers": num_workers, "framework": "tensorflow"})
        ckpt.finish()
        log.info("done at step %d: test accuracy %.4f", step, accuracy)
        return 0
    finally:
        steps_log.close()
        ckpt.close()


if __name__ == "__main__":
    sys.exit(main())
