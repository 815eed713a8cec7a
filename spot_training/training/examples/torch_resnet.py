"""The article's training job, PyTorch twin: a small ResNet-style CNN on the 8x8 digits, resumable.

    python spot_training/training/examples/torch_resnet.py [--steps N | --epochs 5] [--batch-size 32]
        [--save-every-steps 50] [--save-every-seconds S] [--seed 0] [--sync]
        [--snapshot-mode auto|device|pinned|sync] [--device auto|cpu|cuda] [--compile]
    torchrun --standalone --nproc-per-node=2 spot_training/training/examples/torch_resnet.py ...   # DDP

Reads ``<SPOT_TRAINING_DATA_DIR>/digits/{train,test}.npz`` (write it with
``python -m spot_training.training.examples.prepare_data``), checkpoints to ``SPOT_TRAINING_CHECKPOINT_DIR``
(default ``/dltraining/checkpoints``), appends one row per step to
``<SPOT_TRAINING_LOG_DIR>/training_log.csv`` (``step,epoch,loss,accuracy,wall_time``: step =
completed optimizer steps after that step, epoch 0-based, loss and accuracy of that step's batch,
wall_time in seconds since the epoch; the same columns as the Keras and Gluon twins). SIGTERM:
finish the step, save, exit 0. SIGUSR1 or the request file: extra checkpoint. Run it again and it
resumes at the exact step; after the last step it writes the final checkpoint and ``COMPLETED``
and logs ``done: <steps> steps, test accuracy <a>``.

The model has BatchNorm and Dropout, AdamW runs under a OneCycleLR schedule, and each batch is
augmented (a random shift of up to one pixel, and a horizontal flip with ``--flip-prob``) with
draws from torch's global generator: everything a resume must restore exactly.

The change from a plain PyTorch script is the lines marked ``# resumable`` (4 lines).

Determinism: with the same ``--seed`` an interrupted and resumed run ends with a state bitwise
equal to an uninterrupted one on CPU: ``torch.use_deterministic_algorithms(True)`` and
``--threads`` (default 1) intra-op threads fix the kernels and the summation order. On CUDA the
script also sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and asks for deterministic kernels with
warnings only (``warn_only``), so a kernel without a deterministic version warns instead of failing.

Distributed: under ``torchrun`` (``WORLD_SIZE`` > 1) the script joins a process group (gloo on
CPU, NCCL on CUDA), wraps the model in DistributedDataParallel, and each rank trains on its shard
of every global batch; rank 0 writes the checkpoints, the log and the final weights.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `spot_training.training` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

# Before the slow imports (PyTorch: seconds): a SIGTERM meanwhile is remembered and the run exits 0
# at its start instead of dying by the signal (docs/training.md, "A notice in any phase").
import spot_training.training.early_notice  # noqa: E402,F401

import numpy as np  # noqa: E402

from spot_training.training.core import (add_checkpoint_arguments, add_length_arguments, cadence_flag,
                                         parse_trainer_arguments, run_script)
from spot_training.training.datasets import default_data_dir, load_digits, steps_per_epoch
from spot_training.training.training_log import TrainingLog


def build_model(*, channels: int = 16, blocks: int = 2, classes: int = 10, dropout: float = 0.1, width: int = 0):
    """A ResNet-style CNN for (N, 1, 8, 8) inputs: conv-BN-ReLU stem, ``blocks`` residual blocks of
    ``channels`` (two 3x3 conv-BN with identity shortcut), global average pooling, Dropout(``dropout``),
    a hidden dense layer of ``width`` units if > 0, a ``classes``-way linear output (logits).
    Defaults: about 10 K parameters.

    Args:
        channels: convolution channels of the stem and every block (default 16).
        blocks: residual blocks (default 2).
        classes: output logits (default 10).
        dropout: Dropout probability before the head, 0..1 (default 0.1).
        width: units of a hidden dense layer before the output (0: none, the default).

    Returns:
        a ``torch.nn.Sequential`` taking ``(N, 1, 8, 8)`` float inputs.
    """
    from torch import nn

    class ResidualBlock(nn.Module):
        def __init__(self, ch: int) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch, momentum=0.1),
                                      nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch))

        def forward(self, x):
            return nn.functional.relu(self.body(x) + x)

    class GlobalAvgPool(nn.Module):
        # x.mean over H, W: deterministic on CUDA too (AdaptiveAvgPool2d's CUDA backward is not).
        def forward(self, x):
            return x.mean((2, 3))

    layers = [nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
    layers += [ResidualBlock(channels) for _ in range(blocks)]
    layers += [GlobalAvgPool(), nn.Dropout(dropout)]
    if width:
        layers += [nn.Linear(channels, width), nn.ReLU(), nn.Linear(width, classes)]
    else:
        layers += [nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


def augment(x, flip_prob: float):
    """Shift each image by up to one pixel (zero padding) and flip it horizontally with probability ``flip_prob``.

    Draws from torch's global generator (so the checkpointed generator state makes a resume exact).

    Args:
        x: images, a float tensor of shape ``(N, 1, 8, 8)``.
        flip_prob: probability of a horizontal flip per image, 0..1.

    Returns:
        the augmented images, shape ``(N, 1, 8, 8)``.
    """
    import torch

    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1))
    dy, dx = torch.randint(0, 3, (n,)), torch.randint(0, 3, (n,))
    rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None].expand(n, 1, h, w + 2)
    x = padded.gather(2, rows)
    cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :].expand(n, 1, h, w)
    x = x.gather(3, cols)
    flip = torch.rand(n) < flip_prob
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def parse_args(argv=None) -> argparse.Namespace:
    """The example's command line from ``argv`` (default ``sys.argv[1:]``; ``--help`` lists the options),
    checked: a bad value exits 2 naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_length_arguments(parser)  # --steps or --epochs 5, --batch-size 32 (on each rank)
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="OneCycleLR peak learning rate of AdamW")
    add_checkpoint_arguments(parser)  # cadence (no default of its own), --keep, --sync, the directories
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-mode", choices=("auto", "device", "pinned", "sync"), default="auto")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--width", type=int, default=0, help="hidden dense units before the output (0: none)")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--flip-prob", type=float, default=0.0, help="horizontal flip probability (augmentation)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="train a torch.compile'd model (default backend inductor)")
    parser.add_argument("--num-workers", type=int, default=0,
                        help="DataLoader worker processes (persistent; they ignore the notice signals)")
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="sleep this many seconds after each step (tests use it to land signals mid-run)")
    parser.add_argument("--save-final-weights", type=Path, default=None,
                        help="also write the final model and optimizer state to this .npz (for comparisons)")
    return parse_trainer_arguments(parser, argv, "threads")


def state_arrays(model, optimizer) -> dict[str, np.ndarray]:
    """The model's and the optimizer's state as numpy arrays, for comparing runs.

    The model's state dict is unwrapped (no ``module.``/``_orig_mod.`` prefix).

    Args:
        model: the ``nn.Module`` (plain, compiled or DistributedDataParallel).
        optimizer: its ``torch.optim.Optimizer``.

    Returns:
        ``{"model:<name>": array, "optimizer:<param>:<slot>": array}`` (copies on the CPU).
    """
    from spot_training.training.torch_adapter import unwrap_module

    out = {f"model:{k}": v.detach().cpu().numpy() for k, v in unwrap_module(model).state_dict().items()}
    for pid, slots in optimizer.state_dict()["state"].items():
        for slot, value in slots.items():
            out[f"optimizer:{pid}:{slot}"] = value.detach().cpu().numpy()
    return out


def train(argv=None) -> int:
    """Parse ``argv``, train (resuming from the newest checkpoint), return 0; SIGTERM: SystemExit(0)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before importing torch (a few seconds): a SIGTERM in that window must not kill us half-way.
    from spot_training.training.notice import NoticeHandler

    notices = NoticeHandler().install()
    # cuBLAS is deterministic only with a fixed workspace, set before CUDA starts (PyTorch's
    # "Reproducibility" notes); harmless on CPU.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from spot_training.training.torch_adapter import TorchCheckpointer  # resumable

    torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    # CPU: an error for any nondeterministic kernel. CUDA: a warning, so that a kernel without a
    # deterministic implementation in some CUDA build cannot stop a training job.
    torch.use_deterministic_algorithms(True, warn_only=use_cuda)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = torch.distributed.get_rank() if world_size > 1 else 0
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    data_dir = args.data_dir or default_data_dir()
    x_train, y_train = load_digits(data_dir, "train", layout="NCHW")
    x_test, y_test = load_digits(data_dir, "test", layout="NCHW")
    n, bs = len(x_train), args.batch_size
    spe = steps_per_epoch(n, bs * world_size)
    total_steps = args.steps if args.steps is not None else args.epochs * spe

    torch.manual_seed(args.seed)
    model = build_model(channels=args.channels, blocks=args.blocks, dropout=args.dropout, width=args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.learning_rate, total_steps=total_steps)
    train_model = model
    if world_size > 1:
        train_model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    if args.compile:
        train_model = torch.compile(train_model, backend=args.compile)
    loss_fn = nn.CrossEntropyLoss()

    ckpt = TorchCheckpointer(train_model, optimizer, scheduler, checkpoint_dir=args.checkpoint_dir,  # resumable
                             every_steps=cadence_flag(args.save_every_steps), every_seconds=cadence_flag(args.save_every_seconds),
                             background=not args.sync, keep=args.keep, steps_per_epoch=spe, notices=notices,
                             snapshot_mode=args.snapshot_mode)
    dataset = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    loader = DataLoader(dataset, batch_sampler=ckpt.batch_sampler(n, bs, seed=args.seed),  # resumable
                        num_workers=args.num_workers, persistent_workers=args.num_workers > 0)

    # rank 0 writes training_log.csv and progress.json
    log = TrainingLog(args.log_dir, steps_total=total_steps) if rank == 0 else None
    train_model.train()
    try:
        for step, (x, y) in ckpt.steps(total_steps, loader):  # resumable
            x, y = augment(x, args.flip_prob).to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            logits = train_model(x)
            loss = loss_fn(logits, y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if log is not None:
                log.write(step + 1, step // spe, loss.item(), float((logits.argmax(1) == y).float().mean()))
            if args.step_delay:
                time.sleep(args.step_delay)
    finally:
        if log is not None:
            log.close()

    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test).to(device)).argmax(1).cpu().numpy()
    if rank == 0:
        logging.info("done: %d steps, test accuracy %.4f", total_steps, float((predicted == y_test).mean()))
        if args.save_final_weights:
            np.savez(args.save_final_weights, **state_arrays(model, optimizer))
    if world_size > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    # run_script: a checkpoint error that no restart can fix exits 74 or 78 (docs/contracts.md), naming the path
    sys.exit(run_script(train))
