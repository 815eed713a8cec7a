"""Checkpoint cost and lost work for PyTorch, every figure measured in this one run.

    .venv-torch/bin/python bench/bench_checkpoint_torch.py [--pairs 40] [--kills 2]

Model: an MLP on the 8x8 digits (64 -> 2048 -> 2048 -> 512 -> 10, about 5.4 M parameters, the same
as the Keras and Gluon parts) trained with Adam, batch 64, one intra-op thread (as the examples
run), on CPU, checkpoint every 50 steps with :class:`spot_training.training.torch_adapter.TorchCheckpointer`.

Measured as bench/paired.py's ``checkpoint_cost_bench`` describes: overhead by paired windows,
save, write and restore times, checkpoint size, steps lost to SIGTERM and SIGKILL.

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

from paired import (BATCH, HIDDEN, SAVE_EVERY, SEED, WINDOW, checkpoint_cost_bench,  # noqa: E402
                    checkpoint_worker, parse_worker_bench_args)  # (bench/paired.py)

from spot_training.training.datasets import batch_indices  # noqa: E402


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


def main() -> int:
    """Run the PyTorch checkpoint benchmark (module docstring) and return 0 (``--worker``: the worker's status);
    the last line printed is JSON."""
    args = parse_worker_bench_args(__doc__.split("\n\n")[0], WINDOW)

    import torch

    from spot_training.training.torch_adapter import TENSORS_FILE, TorchAdapter, TorchCheckpointer

    torch.set_num_threads(1)

    def checkpointer(model, optimizer, directory, background, notices):
        return TorchCheckpointer(model, optimizer, checkpoint_dir=directory, every_steps=SAVE_EVERY,
                                 background=background, notices=notices)

    def timed_write(model, optimizer, store, step, metadata):
        adapter = TorchAdapter(model, optimizer)
        tmp = store.begin(step)
        write = adapter.snapshot(tmp)
        started = time.perf_counter()
        written = write()
        seconds = time.perf_counter() - started
        store.commit(tmp, step=step, epoch=0, metadata=metadata, written=written)
        adapter.release()
        return seconds

    parts = dict(build=lambda: build(torch), checkpointer=checkpointer,
                 make_step=lambda model, optimizer, x, y: make_step(torch, model, optimizer, x, y))
    if args.worker:
        return checkpoint_worker(args, **parts)
    checkpoint_cost_bench(
        script=__file__, args=args, prefix="bench-ckpt-torch-", framework="pytorch", **parts,
        count_params=lambda model: sum(p.numel() for p in model.parameters()),
        timed_write=timed_write, params_file=TENSORS_FILE, version_key="torch_version",
        version=torch.__version__, title="PyTorch checkpoint benchmark", size_note="tensors {params_mb:.1f} MB + index")
    return 0


if __name__ == "__main__":
    sys.exit(main())
