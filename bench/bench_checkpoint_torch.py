"""Checkpoint cost and lost work for PyTorch, every figure measured in this one run.

    .venv-torch/bin/python bench/bench_checkpoint_torch.py [--pairs 40] [--kills 2]

Model: an MLP on the 8x8 digits (64 -> 2048 -> 2048 -> 512 -> 10, about 5.4 M parameters, the same
as the Keras and Gluon parts) trained with Adam, batch 64, one intra-op thread (as the examples
run), on CPU, checkpoint every 50 steps with :class:`training.torch_adapter.TorchCheckpointer`.

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

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from paired import lost_steps_and_report, paired_overhead, saving_window  # noqa: E402  (bench/paired.py)

from training.datasets import batch_indices, load_digits, steps_per_epoch  # noqa: E402

SAVE_EVERY = 50
WINDOW = 10  # steps per measuring window
WARMUP_PAIRS = 2  # pairs of windows at the start of each run, not compared (a run's first saves)
BATCH = 64
SEED = 0
HIDDEN = (2048, 2048, 512)


def build(torch):
    torch.manual_seed(SEED)
    layers, units_in = [], 64
    for units in HIDDEN:
        layers += [torch.nn.Linear(units_in, units), torch.nn.ReLU()]
        units_in = units
    model = torch.nn.Sequential(*layers, torch.nn.Linear(units_in, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def make_step(torch, model, optimizer, x, y):
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


def quiet_notices():
    from training.notice import NoticeHandler

    return NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def worker(args) -> int:
    """Train until signalled; print each completed step (the parent counts lost steps)."""
    import torch

    from training.notice import NoticeHandler
    from training.torch_adapter import TorchCheckpointer

    torch.set_num_threads(1)
    x, y = load_digits(args.data_dir, "train")
    x = x.reshape(len(x), -1)
    model, optimizer = build(torch)
    step = make_step(torch, model, optimizer, x, y)
    ckpt = TorchCheckpointer(model, optimizer, checkpoint_dir=args.checkpoint_dir, every_steps=SAVE_EVERY,
                             background=True, notices=NoticeHandler(request_file=None))
    print("ready", flush=True)
    for index in ckpt.steps(10**9):
        step(index)
        print(f"step {index + 1}", flush=True)
    return 0


def lost_steps_trial(data_dir: Path, scratch: Path, sig: int, at: int) -> dict:
    """Run a worker, send ``sig`` once it completed ``at`` steps; return steps run and committed."""
    from training.store import CheckpointStore

    ckdir = scratch / f"ck-{sig}-{at}-{time.monotonic_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, __file__, "--worker", "--data-dir", str(data_dir),
                             "--checkpoint-dir", str(ckdir)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env, start_new_session=True)
    ran = 0
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                ran = int(line.split()[1])
                if ran == at:
                    os.killpg(proc.pid, sig)
                    break
        for line in proc.stdout:  # a SIGTERMed worker finishes its current step first
            if line.startswith("step "):
                ran = int(line.split()[1])
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    latest = CheckpointStore(ckdir, framework="pytorch").latest()
    committed = latest.step if latest is not None else 0
    shutil.rmtree(ckdir, ignore_errors=True)
    return {"signal": signal.Signals(sig).name, "at": at, "ran": ran, "committed": committed,
            "lost": ran - committed, "exit_code": code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=40,
                        help=f"pairs of {WINDOW}-step windows (without, with a save) compared per mode (default 40)")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILL trials (default 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.pairs < 2:
        parser.error(f"--pairs must be >= 2, got {args.pairs}")

    import torch

    from training.examples.prepare_data import prepare_digits
    from training.notice import SaveSchedule
    from training.store import CheckpointStore
    from training.torch_adapter import TENSORS_FILE, TorchAdapter, TorchCheckpointer

    torch.set_num_threads(1)
    scratch = Path(tempfile.mkdtemp(prefix="bench-ckpt-torch-"))
    try:
        data_dir = scratch / "datasets"
        prepare_digits(data_dir)
        x, y = load_digits(data_dir, "train")
        x = x.reshape(len(x), -1)
        model, optimizer = build(torch)
        n_params = sum(p.numel() for p in model.parameters())
        step = make_step(torch, model, optimizer, x, y)
        for i in range(20):  # warm-up: allocator, Adam state creation
            step(i)

        # Paired windows (bench/bench_checkpoint.py, 1.; bench/paired.py): one run per mode whose
        # WINDOW-step windows alternate without and with one save, at the window's first step.
        windows_total = 2 * (WARMUP_PAIRS + args.pairs)
        first = 2 * WARMUP_PAIRS

        class WindowSchedule(SaveSchedule):
            def due(self, step, now=None):
                return (step - 1) % WINDOW == 0 and saving_window((step - 1) // WINDOW)

        checkpointers, seconds, cpu_seconds, blocking = {}, {}, {}, {}
        index = 20
        for mode in ("background", "sync"):
            front = TorchCheckpointer(model, optimizer, checkpoint_dir=scratch / mode, every_steps=SAVE_EVERY,
                                      background=(mode == "background"), notices=quiet_notices())
            ck = front.driver
            ck.schedule = WindowSchedule(every_steps=SAVE_EVERY)
            checkpointers[mode] = ck
            seconds[mode], cpu_seconds[mode], blocking[mode] = [], [], []
            for _k in range(windows_total):
                n0 = len(ck.save_seconds)
                started, cpu_started = time.perf_counter(), time.process_time()
                for _ in range(WINDOW):
                    step(index)
                    index += 1
                    ck.after_step(exit_on_stop=False)
                if ck.saver is not None:
                    ck.saver.wait()
                seconds[mode].append(time.perf_counter() - started)
                cpu_seconds[mode].append(time.process_time() - cpu_started)
                blocking[mode].append(sum(ck.save_seconds[n0:]))
            ck.close()
        stats = {m: paired_overhead(seconds[m], first=first, window=WINDOW, save_every=SAVE_EVERY,
                                    blocking=blocking[m]) for m in seconds}
        # Extra CPU time of every thread per save: what checkpointing costs when no core is spare.
        cpu_stats = {m: paired_overhead(cpu_seconds[m], first=first, window=WINDOW, save_every=SAVE_EVERY)
                     for m in seconds}
        overhead = {m: st["overhead_pct"] for m, st in stats.items()}
        cpu_overhead = {m: st["overhead_pct"] for m, st in cpu_stats.items()}
        blocked = {m: st["blocked_pct"] for m, st in stats.items()}
        step_ms = stats["background"]["step_s"] * 1000

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
            store.commit(tmp, step=i + 1, epoch=0, metadata=checkpointers["sync"].manifest_metadata(), written=written)
        adapter.release()
        latest = store.latest()
        size_mb = dir_bytes(latest.path) / 1e6
        params_mb = (latest.path / TENSORS_FILE).stat().st_size / 1e6

        restore_times = []
        for _ in range(3):
            fresh_model, fresh_opt = build(torch)
            ck = TorchCheckpointer(fresh_model, fresh_opt, checkpoint_dir=scratch / "writes", notices=quiet_notices())
            started = time.perf_counter()
            ck.driver.restore()
            restore_times.append(time.perf_counter() - started)
            ck.close()

        spe = steps_per_epoch(len(x), BATCH)
        lost_steps_and_report(
            trial=lost_steps_trial, data_dir=data_dir, scratch=scratch, kills=args.kills, spe=spe,
            framework="pytorch", version_key="torch_version", version=torch.__version__, title="PyTorch checkpoint benchmark",
            size_note="tensors {params_mb:.1f} MB + index", n_params=n_params, batch=BATCH, save_every=SAVE_EVERY, pairs=args.pairs,
            window=WINDOW, step_ms=step_ms, overhead=overhead, stats=stats, cpu_overhead=cpu_overhead,
            blocked=blocked, seconds=seconds, blocking=blocking, first=first, write_times=write_times,
            restore_times=restore_times, size_mb=size_mb, params_mb=params_mb)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
