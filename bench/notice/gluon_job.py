"""The Gluon trainer of the notice phase drill (bench/notice/gluon.py): the example's network and loop
(spot_training/training/examples/gluon_resnet.py) with the phases a real job has.

    .venv/bin/python bench/notice/gluon_job.py --data-dir D --checkpoint-dir C --log-dir L --steps N
        [--workers W] [--validate-every K --validation-seconds S] [--save-every-steps E] [--step-delay T]

* data loading: ``--workers W`` > 0 feeds the steps from a ``gluon.data.DataLoader`` with ``W`` worker
  processes (``thread_pool=False``: forked processes) whose batch sampler yields
  ``batch_indices(step)`` from the restored step on, so the batches are those of the plain loop and a
  resumed run stays bitwise equal. ``--load-delay`` seconds per example in the workers' ``__getitem__``
  (a slow decode) keep them busy while the steps run. The loader is made at the run's first step,
  after ``ckpt.steps()`` installed the notice handlers, so the workers are forked with the stop
  signals ignored (spot_training/training/notice.py); the agent signals only the leader anyway.
* validation: every ``K`` steps a pass over held-out batches of ``S`` seconds inside
  ``ckpt.outside_step()`` (no state changes), as docs/training-mxnet.md asks of an evaluation loop.
* first hybridize: the first forward pass of every process builds the CachedOp.

Prints ``PHASE <name> <time.time()>`` lines (flushed) at ``import``, ``restored``, ``trace``,
``traced``, ``validation`` and ``loader`` so that the drill can aim its notice at a phase; appends
one CSV row per step (the example's ``step,epoch,loss,accuracy,wall_time``); writes the final
parameters to ``--save-final-params`` (.npz) at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `spot_training` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import spot_training.training.early_notice  # noqa: E402,F401  (docs/training.md: SIGTERM during the imports)

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402


def phase(name: str) -> None:
    """Announce that the job enters phase ``name`` (a flushed ``PHASE name time`` line on stdout)."""
    print(f"PHASE {name} {time.time():.6f}", flush=True)


class SlowArrays:
    """A Gluon dataset of ``(x[i], y[i])`` whose ``__getitem__`` sleeps ``delay`` seconds (a decode).

    Args:
        x: inputs, shape ``(n, ...)``.
        y: labels, shape ``(n,)``.
        delay: seconds of sleep per item (0: none).
    """

    def __init__(self, x, y, delay: float) -> None:
        self.x, self.y, self.delay = x, y, delay

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


class StepBatches:
    """A Gluon batch sampler: ``batch_indices(step)`` for ``step`` in ``start .. total-1``.

    Args:
        start: the first step (the restored step count).
        total: the whole run's steps.
        batch_size: examples per batch.
        n: examples in the dataset.
        seed: the shuffle seed (:func:`spot_training.training.datasets.batch_indices`).
    """

    def __init__(self, *, start: int, total: int, batch_size: int, n: int, seed: int) -> None:
        self.start, self.total, self.batch_size, self.n, self.seed = start, total, batch_size, n, seed

    def __iter__(self):
        from spot_training.training.datasets import batch_indices

        for step in range(self.start, self.total):
            yield batch_indices(step, batch_size=self.batch_size, n=self.n, seed=self.seed).tolist()

    def __len__(self) -> int:
        return self.total - self.start


def parse_args(argv=None) -> argparse.Namespace:
    """The job's command line (``--help`` lists it); ``argv`` default: ``sys.argv[1:]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--save-every-steps", type=int, default=25, help="0: only the notice and the end save")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (0: no loader)")
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds per example in a loader worker")
    parser.add_argument("--validate-every", type=int, default=0, help="steps between validation passes (0: none)")
    parser.add_argument("--validation-seconds", type=float, default=0.0, help="length of one validation pass")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds added to every step")
    parser.add_argument("--save-final-params", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Train the phase job (module docstring); returns the exit status (0, or the contract's 74/78)."""
    phase("import")
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # before MXNet loads OpenMP: one summation order (the example's rule)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    from spot_training.training.core import run_script
    from spot_training.training.datasets import load_digits, steps_per_epoch
    from spot_training.training.examples.gluon_resnet import build_net
    from spot_training.training.mxnet_adapter import GluonCheckpointer, batch_indices
    from spot_training.training.training_log import TrainingLog

    def train(_argv) -> int:
        x_train, y_train = load_digits(args.data_dir, "train", layout="NCHW")
        x_test, _ = load_digits(args.data_dir, "test", layout="NCHW")
        n, bs = len(x_train), args.batch_size
        spe = steps_per_epoch(n, bs)
        mx.random.seed(args.seed)
        np.random.seed(args.seed)
        net = build_net(channels=args.channels)
        net.initialize(mx.init.Xavier())
        net.hybridize(static_alloc=True, static_shape=True)
        trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, update_on_kvstore=False)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        ckpt = GluonCheckpointer(net, trainer, checkpoint_dir=args.checkpoint_dir,
                                 every_steps=args.save_every_steps or None, every_seconds=None, steps_per_epoch=spe)
        log = TrainingLog(args.log_dir, steps_total=args.steps)
        batches = first = None
        try:
            for step in ckpt.steps(args.steps):
                if first is None:
                    first = step
                    phase("restored")
                    if args.workers:
                        sampler = StepBatches(start=step, total=args.steps, batch_size=bs, n=n, seed=args.seed)
                        loader = gluon.data.DataLoader(SlowArrays(x_train, y_train.astype(np.float32), args.load_delay),
                                                       batch_sampler=sampler, num_workers=args.workers)
                        batches = iter(loader)
                if batches is not None:
                    phase("loader")
                    data, label = (a.as_in_context(mx.cpu()) for a in next(batches))  # from cpu_shared
                else:
                    idx = batch_indices(step, batch_size=bs, n=n, seed=args.seed)
                    data, label = mx.nd.array(x_train[idx]), mx.nd.array(y_train[idx])
                if step == first:
                    phase("trace")
                with autograd.record():
                    output = net(data)
                    loss = loss_fn(output, label)
                loss.backward()
                trainer.step(bs)
                accuracy = float((output.argmax(axis=1) == label.astype(output.dtype)).mean().asscalar())
                if step == first:
                    phase("traced")
                if args.step_delay:
                    time.sleep(args.step_delay)
                log.write(step + 1, step // spe, float(loss.mean().asscalar()), accuracy)
                if args.validate_every and (step + 1) % args.validate_every == 0:
                    with ckpt.outside_step():  # changes no state: a notice here is saved at once
                        phase("validation")
                        end = time.monotonic() + args.validation_seconds
                        while time.monotonic() < end:
                            for i in range(0, len(x_test) - bs + 1, bs):
                                net(mx.nd.array(x_test[i:i + bs])).wait_to_read()
                                time.sleep(0.01)
        finally:
            log.close()
        if args.save_final_params:
            np.savez(args.save_final_params,
                     **{name: p.data().asnumpy() for name, p in net._collect_params_with_prefix().items()})
        print("DONE", flush=True)
        return 0

    return run_script(train, argv)


if __name__ == "__main__":
    sys.exit(main())
