"""PyTorch DistributedDataParallel trainer of a spot-training cluster on TorchElastic (the worker command).

    torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=COORD:29400 \\
        --rdzv-id=RUN --max-restarts=100 --rdzv-conf=last_call_timeout=5 \\
        spot_training/training/distributed/torch_ddp.py --steps 300

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` and
``TORCHELASTIC_RESTART_COUNT``; this script joins the process group (gloo on CPU, NCCL when CUDA is
present) and trains an MLP on the 8x8 digits (as the MXNet and TensorFlow cluster trainers) with SGD
(momentum 0.9). Checkpoints go through the training core's PyTorch adapter
(:class:`spot_training.training.torch_adapter.TorchCheckpointer`): rank 0 writes, every rank restores the newest
checkpoint at start, one ``all_reduce`` per step agrees on saves and stops, the cadence comes from
``--save-every-steps`` or ``$SPOT_TRAINING_CHECKPOINT_EVERY_STEPS``/``..._SECONDS``.

Membership changes (docs/training-pytorch.md, "Elastic clusters (TorchElastic)"). torchrun restarts every worker group when a
node joins or leaves; the restarted workers restore the newest checkpoint and continue with the new
world size. On a stop (SIGTERM from torchrun or the agent) all ranks stop after the same step, rank 0
saves it, and a rank that did not get the signal itself exits
:data:`spot_training.training.core.EXIT_PEER_STOPPED` so that its torchrun restarts the group instead of ending it.

Data position. Examples are drawn from an endless stream: epoch ``e`` is
:func:`spot_training.training.datasets.epoch_permutation` ``(e, seed)`` of the ``n`` training examples, epochs back
to back. Step ``s`` takes the next ``B`` positions of the stream (``B``: the global batch,
``--batch-size``, or ``--per-worker-batch`` x world size) and rank ``r`` of ``W`` takes
``numpy.array_split(batch, W)[r]`` (:func:`rank_indices`). The number of examples consumed so far
(``samples``) is saved in every checkpoint, so a resumed group with another world size continues at
the next unread position: no example is skipped or repeated across a resize. With a fixed
``--batch-size`` ``samples = s * B``, a function of the global step alone. Each rank's loss is its
examples' summed loss times ``W / B``; DDP averages gradients over the ``W`` ranks, so the update is
the mean over the global batch whatever the shard sizes.

Outputs, as the other cluster trainers (:class:`spot_training.training.distributed.common.StepLog`): every rank
appends ``<log_dir>/steps-<node_id>.csv``; rank 0 appends ``<log_dir>/training_log.csv``
(``step,generation,num_workers,loss,learning_rate,wall_time``; ``num_workers`` = the world size) and
writes ``<log_dir>/progress.json`` ``{"steps_total": N}`` (docs/contracts.md), ``COMPLETED`` in the
checkpoint directory after the final checkpoint, and ``<log_dir>/result.json`` (``step``,
``test_accuracy`` on the held-out digits, ``generation``, ``num_workers``, ``restart_count``,
``framework``). Exit statuses: 0 (done, or stopped by its own
SIGTERM), 75 (stopped by a peer under torchrun), 74/78 (checkpoint storage unusable / checkpoint of
another job: ``spot_training.training.core.checkpoint_exit_code``), 1 (a crash, e.g. a peer lost mid-collective).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `spot_training.training` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np

from spot_training import contract
from spot_training.training.core import run_script
from spot_training.training.datasets import epoch_permutation
from spot_training.training.distributed.common import (StepLog, flat_digits, generation, global_batch_size, pace, parse_args, run_and_exit,
                                         worker_shard, write_result)
from spot_training.training.distributed.lr import scaled_learning_rate

__all__ = ["TORCHRUN_ENV", "DataPosition", "main", "rank_indices", "run", "stream_indices"]

#: Environment every worker node's torchrun needs (``contract.TORCHRUN_ENV``, so the node agent
#: can set it): ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. Without it torch (checked in 2.14's
#: dynamic_rendezvous.py, ``next_rendezvous``) publishes MASTER_ADDR/MASTER_PORT only in the first
#: round a node takes part in: a node that joins a running job waits for them until
#: ``DistStoreError: wait timeout ... MASTER_ADDR`` and the group never restarts. With it set, rank 0's
#: node publishes them every round and rank 0's worker hosts the process-group store for that round.
TORCHRUN_ENV = contract.TORCHRUN_ENV
#: Seconds a collective (and the process-group setup) may wait for a peer before raising: a peer that
#: hangs without closing its sockets fails the group after this long instead of never.
COLLECTIVE_TIMEOUT_S = 120


def stream_indices(start: int, count: int, *, n: int, seed: int) -> np.ndarray:
    """Example indices at positions ``start .. start+count-1`` of the endless stream of epoch permutations.

    Epoch ``e`` of the stream is :func:`epoch_permutation` ``(e, n=n, seed=seed)``.

    Args:
        start: the first stream position (examples consumed so far), >= 0.
        count: how many indices, >= 0.
        n: examples in the dataset, >= 1.
        seed: permutation seed.

    Returns:
        int64 array of shape ``(count,)``.

    Raises:
        ValueError: a negative ``start`` or ``count``, or ``n`` < 1.
    """
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be >= 0. Received: start={start}, count={count}")
    if n < 1:
        raise ValueError(f"n must be >= 1. Received: n={n}")
    out, pos, end = [], start, start + count
    while pos < end:
        epoch, offset = divmod(pos, n)
        take = min(n - offset, end - pos)
        out.append(epoch_permutation(epoch, n=n, seed=seed)[offset:offset + take])
        pos += take
    return np.concatenate(out) if out else np.zeros((0,), dtype=np.int64)


def rank_indices(samples: int, *, global_batch: int, rank: int, world_size: int, n: int, seed: int) -> np.ndarray:
    """One rank's example indices of the step that starts after ``samples`` consumed examples.

    Its :func:`~spot_training.training.distributed.common.worker_shard` of the global batch
    ``stream_indices(samples, global_batch)``.

    Args:
        samples: examples consumed by all ranks together before this step.
        global_batch: examples per step over all ranks.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: ranks in the group.
        n: examples in the dataset.
        seed: permutation seed.

    Returns:
        int64 array of about ``global_batch / world_size`` indices (``numpy.array_split``: shard sizes
        differ by at most one).

    Raises:
        ValueError: ``rank`` outside ``0..world_size-1``, ``world_size > global_batch``, or the
            arguments of :func:`stream_indices` out of range.
    """
    return worker_shard(stream_indices(samples, global_batch, n=n, seed=seed), rank=rank, num_workers=world_size)


class DataPosition:
    """Checkpointed with the model (an ``extra`` object of the adapter): ``samples`` (examples consumed
    by all ranks together), ``world_size`` of the group that wrote it and ``warmup_start`` (the step
    where the last world-size change began the learning-rate warm-up)."""

    def __init__(self) -> None:
        self.samples = 0
        self.world_size = 0
        self.warmup_start = 0

    def begin_group(self, step: int, world_size: int) -> None:
        """Call at the first step a (re)started worker group runs: a world size other than the one
        that wrote the checkpoint restarts the learning-rate warm-up at ``step`` (the global batch
        changed under ``--per-worker-batch``); a fresh start (``world_size`` 0) keeps step 0.

        Args:
            step: the global step the group starts at.
            world_size: ranks in the new group.
        """
        if self.world_size not in (0, world_size):
            self.warmup_start = step
        self.world_size = world_size

    def state_dict(self) -> dict:
        """``{"samples", "world_size", "warmup_start"}`` (ints) for the checkpoint."""
        return {"samples": self.samples, "world_size": self.world_size, "warmup_start": self.warmup_start}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`'s output.

        Args:
            state: the dict :meth:`state_dict` returned.

        Raises:
            KeyError: a key is missing.
            ValueError: a value is not an integer.
        """
        self.samples = int(state["samples"])
        self.world_size = int(state["world_size"])
        self.warmup_start = int(state["warmup_start"])


def build_mlp(hidden: int, classes: int = 10):
    """64 -> ``hidden`` (ReLU) -> ``hidden`` (ReLU) -> ``classes`` (no BatchNorm: nothing rank-local).

    Args:
        hidden: units in each of the two hidden layers.
        classes: output logits (default 10, the digits).

    Returns:
        a ``torch.nn.Sequential`` taking float inputs of shape ``(batch, 64)``.
    """
    from torch import nn

    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def main(argv=None) -> int:
    """Train (resuming from the newest checkpoint); return the exit status (module docstring)."""
    return run_script(train, argv)


def train(argv=None) -> int:
    """Parse ``argv`` (:func:`spot_training.training.distributed.common.parse_args`), join the process group, train."""
    args = parse_args(argv, description="PyTorch DDP trainer of a spot-training cluster (launched by torchrun)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before importing torch (seconds): a SIGTERM in that window must not kill the worker half-way.
    from spot_training.training.notice import NoticeHandler

    notices = NoticeHandler().install()
    import torch
    from torch import nn

    from spot_training.training.torch_adapter import TorchCheckpointer

    log = logging.getLogger("training.torch_ddp")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    use_cuda = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world_size > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo",
                                             timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    distributed = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    world_size = torch.distributed.get_world_size() if distributed else 1
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    x_train, y_train, x_test, y_test = flat_digits(args.data_dir)
    n = len(x_train)
    batch = global_batch_size(args, world_size)
    if batch < world_size:
        raise ValueError(f"the global batch of {batch} cannot be split across {world_size} ranks; raise --batch-size")

    torch.manual_seed(args.seed)
    model = build_mlp(args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)
    train_model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None) \
        if distributed else model
    position = DataPosition()
    ckpt = TorchCheckpointer(train_model, optimizer, extra={"data": position}, checkpoint_dir=args.checkpoint_dir,
                             every_steps=args.save_every_steps or None, notices=notices, snapshot_mode="sync")
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    steps_log = StepLog(args.log_dir, steps_total=args.steps)  # rank 0 also: training_log.csv, progress.json
    x_all = torch.from_numpy(x_train)
    y_all = torch.from_numpy(y_train)
    started = None
    try:
        for step in ckpt.steps(args.steps):
            began = time.perf_counter()
            if started is None:  # first step of this group, after the restore
                started = step
                position.begin_group(step, world_size)
                log.info("rank %d of %d (restart %d) starting at step %d of %d, %d examples consumed",
                         rank, world_size, restart_count, step, args.steps, position.samples)
            lr = (scaled_learning_rate(args.learning_rate, num_workers=world_size, step=step,
                                       warmup_steps=args.warmup_steps, warmup_start_step=position.warmup_start)
                  if args.scale_lr else args.learning_rate)
            for group in optimizer.param_groups:
                group["lr"] = lr
            idx = torch.from_numpy(rank_indices(position.samples, global_batch=batch, rank=rank,
                                                world_size=world_size, n=n, seed=args.seed))
            x, y = x_all[idx].to(device), y_all[idx].to(device)
            optimizer.zero_grad(set_to_none=True)
            logits = train_model(x)
            # Summed loss x W / B: DDP's mean over W ranks makes it the mean over the global batch.
            loss = loss_fn(logits, y) * (world_size / batch)
            loss.backward()
            optimizer.step()
            position.samples += batch
            local_mean = loss.item() * batch / (world_size * len(idx))  # this rank's mean loss per example
            steps_log.write(step=step + 1, rank=rank, num_workers=world_size, loss=local_mean, learning_rate=lr)
            pace(began, args.min_step_seconds)
    except SystemExit as stop:  # an agreed stop: the checkpoint is committed and every rank met
        if distributed:
            began = time.perf_counter()
            torch.distributed.destroy_process_group()
            log.info("process group destroyed in %.2f s; exiting %s", time.perf_counter() - began, stop.code)
        raise
    finally:
        steps_log.close()

    if rank == 0:
        model.eval()
        with torch.no_grad():
            predicted = model(torch.from_numpy(x_test).to(device)).argmax(1).cpu().numpy()
        accuracy = float((predicted == y_test).mean())
        write_result(args.log_dir, {"step": ckpt.step, "test_accuracy": accuracy, "generation": generation(),
                                    "num_workers": world_size, "restart_count": restart_count,
                                    "framework": "pytorch"})
        log.info("done at step %d: test accuracy %.4f", ckpt.step, accuracy)
    if distributed:
        torch.distributed.destroy_process_group()
    return 0


def run() -> None:
    """``main()``, then exit. Under torchrun the worker leaves with ``os._exit`` after flushing its
    logs: after an agreed stop, interpreter shutdown was seen to take 5-12 s (torch 2.14, gloo, the
    process-group store hosted by rank 0's worker), during which torchrun still counts the worker as
    running and the whole group waits to re-rendezvous. Everything durable is done by then (the
    checkpoint was written, fsynced and committed, and every rank met at the barrier)."""
    run_and_exit(main, hard_exit=bool(os.environ.get("TORCHELASTIC_RUN_ID")))


if __name__ == "__main__":
    run()
