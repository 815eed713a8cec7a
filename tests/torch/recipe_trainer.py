"""The 4-line recipe of docs/training-pytorch.md as a new user writes it (no ``run_script``, no exit-code
mapping), on the 8x8 digits, with the loop shapes real scripts have: DataLoader workers, gradient
accumulation, early stopping with ``break``. The tests run it as a subprocess; every step prints
``step N`` on stdout (flushed) so that a test can signal it at a known point.

Usage: recipe_trainer.py CHECKPOINT_DIR DATA_DIR [--steps N] [--workers K] [--persistent] [--pin]
[--accumulate K] [--stop-at S] [--optimizer sgd|adamw] [--batch-size B] [--step-delay S]
[--random-dataset] [--final FILE] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from spot_training.training.datasets import load_digits
from spot_training.training.torch_adapter import TorchCheckpointer
from spot_training.training.training_log import TrainingLog


class NoisyDigits(Dataset):
    """A dataset whose ``__getitem__`` draws noise from torch's generator (worker-side randomness)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.randn_like(self.x[i]), self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint_dir")
    p.add_argument("data_dir")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--pin", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--stop-at", type=int, default=None, help="break out of the loop after this step (early stop)")
    p.add_argument("--finish-on-stop", action="store_true", help="call ckpt.finish() before the early-stop break")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--hidden", type=int, default=32, help="hidden units (another value: a changed model)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--every-steps", type=int, default=10)
    p.add_argument("--random-dataset", action="store_true")
    p.add_argument("--final", default=None, help="write the final model and optimizer state here (.npz)")
    p.add_argument("--log-dir", default=None, help="write the recipe's optional progress files (TrainingLog) here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    x, y = load_digits(args.data_dir, "train", layout="NCHW")
    x, y = torch.from_numpy(x).flatten(1), torch.from_numpy(y)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds = NoisyDigits(x, y) if args.random_dataset else TensorDataset(x, y)

    ckpt = TorchCheckpointer(model, optimizer, checkpoint_dir=args.checkpoint_dir, every_steps=args.every_steps)
    loader = DataLoader(ds, batch_sampler=ckpt.batch_sampler(len(ds), batch_size=args.batch_size, seed=0),
                        num_workers=args.workers, persistent_workers=args.persistent and args.workers > 0,
                        pin_memory=args.pin)
    loss_fn = nn.CrossEntropyLoss()
    log = TrainingLog(args.log_dir, steps_total=args.steps) if args.log_dir else None  # the docs' "Progress" lines
    for step, (xb, yb) in ckpt.steps(args.steps, loader):
        logits = model(xb)
        loss = loss_fn(logits, yb) / args.accumulate
        loss.backward()
        if log is not None:
            log.write(step + 1, epoch=step // (len(ds) // args.batch_size), loss=loss.item(),
                      accuracy=float((logits.argmax(1) == yb).float().mean()))
        if (step + 1) % args.accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
        print(f"step {step}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
        if args.stop_at is not None and step >= args.stop_at:
            if args.finish_on_stop:
                ckpt.finish()
            break
    if args.final:
        state = {f"model/{k}": v.numpy() for k, v in model.state_dict().items()}
        for pid, slots in optimizer.state_dict()["state"].items():
            state.update({f"opt/{pid}/{k}": np.asarray(v) for k, v in slots.items()})
        np.savez(args.final, **state)
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
