"""Checkpoint cost and lost work for PyTorch, every figure measured in this one run.

    .venv-torch/bin/python bench/bench_checkpoint_torch.py [--pairs 40] [--kills 2]

Model: an MLP on the 8x8 digits (64 -> 2048 -> 2048 -> 512 -> 10, about 5.4 M parameters, the same
as the Keras and Gluon parts) trained with Adam, batch 64, one intra-op thread (as the examples
run), on CPU, checkpoint every 50 steps with :class:`spot_training.training.torch_adapter.TorchCheckpointer`.

1. Overhead, by paired windows, as in bench/bench_checkpoint.py (1.) and with bench/paired.py: one
   run per mode (synchronous, background) trains in windows of 10 steps that alternate without
   and with one save (at the window's first step; a background window ends by waiting for its
   write); each saving window is compared with the window before it. Overhead % = the mean extra
   wall time of one save over the time of 50 steps (a save every 50 steps), with its 95 %
   confidence interval and the median; ``training_thread_blocked_pct`` is the time inside the
   save calls over the same 50 steps (the stall per save, in seconds: ``save_s``);
   ``cpu_overhead_pct`` is the extra CPU time of all threads per save, paired the same way.
2. Save time (sync: full write; background: time the training thread is blocked for the host copy;
   write: time of one full store write of that copy), restore time, checkpoint size on disk.
3. Lost steps: a worker process (this file with ``--worker``) trains and saves every 50 steps in
   the background; it gets SIGTERM at a random step (lost = steps it ran - steps in its last
   checkpoint; goal 0) and, in ``--kills`` other runs, SIGKILL (lost = steps run - steps committed;
   bound: the save interval plus the steps run while the newest write was in flight). The
   article's way (a checkpoint per epoch) loses the steps since the last epoch boundary.

Prints a table, then a LAST LINE of JSON that bench/bench_checkpoint.py merges under ``"pytorch"``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paired import (BATCH, HIDDEN, SAVE_EVERY, SEED, WARMUP_PAIRS, WINDOW,  # noqa: E402
                    dir_bytes, lost_steps_and_report, paired_modes, parse_worker_bench_args,  # noqa: E402
                    digits_scratch, quiet_notices, time_restores, worker_steps)  # (bench/paired.py)

from spot_training.training.datasets import batch_indices, load_digits  # noqa: E402


def build(torch):
    """The benchmark's MLP (64 -> :data:`HIDDEN` -> 10, seeded) and its Adam optimizer.

    Args:
        torch: the ``torch`` module (imported by the caller).

    Returns:
        ``(model, optimizer)`` (learning rate 1e-4).
    """
    torch.manual_seed(SEED)
    layers, units_in = [], 64
    for units in HIDDEN:
        layers += [torch.nn.Linear(units_in, units), torch.nn.ReLU()]
        units_in = units
    model = torch.nn.Sequential(*layers, torch.nn.Linear(units_in, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def make_step(torch, model, optimizer, x, y):
    """The benchmark's training step: forward, backward and update on batch ``index`` (:func:`batch_indices`).

    Args:
        torch: the ``torch`` module.
        model: the model.
        optimizer: its optimizer.
        x: features, float32 of shape ``(N, 64)``.
        y: labels, int64 of shape ``(N,)``.

    Returns:
        ``step(index)``.
    """
    loss_fn = torch.nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    n = len(x)

    def step(index: int) -> None:
        idx = torch.from_numpy(batch_indices(index, batch_size=BATCH, n=n, seed=SEED))
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(xt[idx]), yt[idx])
        loss.backward()
        optimizer.step()

    return step


def worker(args) -> int:
    """Train until signalled; print each completed step (the parent counts lost steps)."""
    import torch

    from spot_training.training.notice import NoticeHandler
    from spot_training.training.torch_adapter import TorchCheckpointer

    torch.set_num_threads(1)
    x, y = load_digits(args.data_dir, "train")
    x = x.reshape(len(x), -1)
    model, optimizer = build(torch)
    step = make_step(torch, model, optimizer, x, y)
    ckpt = TorchCheckpointer(model, optimizer, checkpoint_dir=args.checkpoint_dir, every_steps=SAVE_EVERY,
                             background=True, notices=NoticeHandler(request_file=None))
    return worker_steps(ckpt.steps(10**9), step)


def main() -> int:
    """Run the PyTorch checkpoint benchmark (module docstring); the last line printed is JSON.

    Returns:
        0 (the ``--worker`` mode returns its own status).
    """
    args = parse_worker_bench_args(__doc__.split("\n\n")[0], WINDOW)
    if args.worker:
        return worker(args)

    import torch

    from spot_training.training.store import CheckpointStore
    from spot_training.training.torch_adapter import TENSORS_FILE, TorchAdapter, TorchCheckpointer

    torch.set_num_threads(1)
    with digits_scratch("bench-ckpt-torch-") as (scratch, data_dir, x, y):
        model, optimizer = build(torch)
        n_params = sum(p.numel() for p in model.parameters())
        step = make_step(torch, model, optimizer, x, y)
        for i in range(20):  # warm-up: allocator, Adam state creation
            step(i)

        # Paired windows (bench/bench_checkpoint.py, 1.; bench/paired.py): one run per mode whose
        # WINDOW-step windows alternate without and with one save, at the window's first step.
        def checkpointer(mode):
            return TorchCheckpointer(model, optimizer, checkpoint_dir=scratch / mode, every_steps=SAVE_EVERY,
                                     background=(mode == "background"), notices=quiet_notices()).driver

        run = paired_modes(checkpointer, step, start=20, pairs=args.pairs, warmup_pairs=WARMUP_PAIRS, window=WINDOW,
                           save_every=SAVE_EVERY)
        metadata = run["checkpointers"]["sync"].manifest_metadata()

        # One full background write of a host copy (what the writer thread does per save).
        adapter = TorchAdapter(model, optimizer)
        write_times = []
        store = CheckpointStore(scratch / "writes", framework="pytorch")
        for i in range(3):
            tmp = store.begin(i + 1)
            write = adapter.snapshot(tmp)
            started = time.perf_counter()
            written = write()
            write_times.append(time.perf_counter() - started)
            store.commit(tmp, step=i + 1, epoch=0, metadata=metadata, written=written)
        adapter.release()
        latest = store.latest()
        size_mb = dir_bytes(latest.path) / 1e6
        params_mb = (latest.path / TENSORS_FILE).stat().st_size / 1e6

        def open_checkpointer():
            fresh_model, fresh_opt = build(torch)
            ck = TorchCheckpointer(fresh_model, fresh_opt, checkpoint_dir=scratch / "writes", notices=quiet_notices())
            return ck.driver.restore, ck.close

        restore_times = time_restores(open_checkpointer)

        lost_steps_and_report(
            script=__file__, data_dir=data_dir, scratch=scratch, args=args, n_examples=len(x), framework="pytorch",
            version_key="torch_version", version=torch.__version__, title="PyTorch checkpoint benchmark",
            size_note="tensors {params_mb:.1f} MB + index",
            n_params=n_params, run=run, write_times=write_times, restore_times=restore_times, size_mb=size_mb,
            params_mb=params_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
