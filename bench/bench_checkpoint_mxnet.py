"""Checkpoint cost and lost work for MXNet Gluon, every figure measured in this one run.

    .venv/bin/python bench/bench_checkpoint_mxnet.py [--rounds 3] [--block-steps 100] [--kills 2]

Model: an MLP on the 8x8 digits (64 -> 2048 -> 2048 -> 512 -> 10, about 5.4 M parameters) trained
with Adam, batch 64, one OpenMP thread (as the examples run), checkpoint every 50 steps with
:class:`training.mxnet_adapter.GluonCheckpointer`.

1. Overhead: the same model trains in blocks of ``--block-steps`` steps with no checkpoints,
   synchronous saves and background saves; blocks are interleaved (none, sync, background, then
   rotated) for ``--rounds`` rounds, so load from other processes on the machine falls on all three
   alike. Saves fall at steps 25 and 75 of each block; background blocks end by waiting for their
   last write (any time it still needs counts). Overhead % = median over rounds of (mode's block
   wall time - none's block wall time) / none's block wall time; ``overhead_total_pct`` sums all
   rounds instead; ``training_thread_blocked_pct`` is the time spent inside the save calls;
   ``cpu_overhead_pct`` is the extra CPU time of all threads (what a node without a spare core pays).
2. Save time (sync: full write; background: time the training thread is blocked for the host copy;
   write: time of one full store write of that copy), restore time (fresh process state: new model,
   ``GluonCheckpointer.restore``), checkpoint size on disk.
3. Lost steps: a worker process (this file with ``--worker``) trains and saves every 50 steps in
   the background; it gets SIGTERM at a random step (lost = steps it ran - steps in its last
   checkpoint; goal 0) and, in ``--kills`` other runs, SIGKILL (lost = steps run - steps committed;
   goal <= the save interval). The article's way (a checkpoint per epoch, a notice handler that
   sleeps) loses the steps since the last epoch boundary: computed for the same kill steps with
   this dataset's epoch of 22 steps, and for a larger epoch of 1,000 steps for scale.

Prints a table, then a LAST LINE of JSON that bench/bench_checkpoint.py merges.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from training.datasets import batch_indices, load_digits, steps_per_epoch  # noqa: E402

SAVE_EVERY = 50
BATCH = 64
SEED = 0
HIDDEN = (2048, 2048, 512)


def build(mx, gluon):
    from mxnet.gluon import nn

    mx.random.seed(SEED)
    net = nn.HybridSequential()
    with net.name_scope():
        units_in = 64
        for units in HIDDEN:
            net.add(nn.Dense(units, activation="relu", in_units=units_in))
            units_in = units
        net.add(nn.Dense(10, in_units=units_in))
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-4}, update_on_kvstore=False)
    return net, trainer


def make_step(mx, autograd, gluon, net, trainer, x, y):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    n = len(x)

    def step(index: int) -> None:
        idx = batch_indices(index, batch_size=BATCH, n=n, seed=SEED)
        data, label = mx.nd.array(x[idx]), mx.nd.array(y[idx])
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(BATCH)
        loss.wait_to_read()

    return step


def quiet_notices():
    from training.notice import NoticeHandler

    return NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def worker(args) -> int:
    """Train until signalled; print each completed step (the parent counts lost steps)."""
    import mxnet as mx
    from mxnet import autograd, gluon

    from training.mxnet_adapter import GluonCheckpointer
    from training.notice import NoticeHandler

    x, y = load_digits(args.data_dir, "train")
    x = x.reshape(len(x), -1)
    net, trainer = build(mx, gluon)
    step = make_step(mx, autograd, gluon, net, trainer, x, y)
    ckpt = GluonCheckpointer(net, trainer, directory=args.checkpoint_dir, every_steps=SAVE_EVERY,
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
    latest = CheckpointStore(ckdir, framework="mxnet").latest()
    committed = latest.step if latest is not None else 0
    shutil.rmtree(ckdir, ignore_errors=True)
    return {"signal": signal.Signals(sig).name, "at": at, "ran": ran, "committed": committed,
            "lost": ran - committed, "exit_code": code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three modes (default 3)")
    parser.add_argument("--block-steps", type=int, default=100, help="steps per block (default 100: 2 saves)")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILL trials (default 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.block_steps % SAVE_EVERY:
        parser.error(f"--block-steps must be a multiple of {SAVE_EVERY}, got {args.block_steps}")

    import mxnet as mx
    from mxnet import autograd, gluon

    from training.examples.prepare_data import prepare_digits
    from training.mxnet_adapter import PARAMS_FILE, GluonCheckpointer, capture_state
    from training.store import CheckpointStore

    scratch = Path(tempfile.mkdtemp(prefix="bench-ckpt-mxnet-"))
    try:
        data_dir = scratch / "datasets"
        prepare_digits(data_dir)
        x, y = load_digits(data_dir, "train")
        x = x.reshape(len(x), -1)
        net, trainer = build(mx, gluon)
        n_params = sum(int(np.prod(p.shape)) for p in net.collect_params().values())
        step = make_step(mx, autograd, gluon, net, trainer, x, y)
        for i in range(20):  # warm-up: graph caching, allocator, Adam state creation
            step(i)

        checkpointers = {
            "sync": GluonCheckpointer(net, trainer, directory=scratch / "sync", every_steps=SAVE_EVERY,
                                      background=False, notices=quiet_notices()),
            "background": GluonCheckpointer(net, trainer, directory=scratch / "background",
                                            every_steps=SAVE_EVERY, background=True, notices=quiet_notices()),
        }
        wall = {"none": 0.0, "sync": 0.0, "background": 0.0}
        steps_done = {mode: 0 for mode in wall}
        block_wall: dict[str, list[float]] = {mode: [] for mode in wall}
        cpu = {mode: 0.0 for mode in wall}  # CPU seconds of all threads of this process
        order = ["none", "sync", "background"]
        index = 20
        for round_no in range(args.rounds):
            for mode in order[round_no % 3:] + order[: round_no % 3]:
                ck = checkpointers.get(mode)
                if ck is not None:
                    # The cadence counts this mode's own steps, offset by half an interval so the
                    # saves fall at steps 25 and 75 of a block: the background write of the second
                    # one has 25 steps to finish before the block ends (and is waited for there).
                    ck.step = steps_done[mode] + SAVE_EVERY // 2
                started = time.perf_counter()
                cpu_started = time.process_time()
                for _ in range(args.block_steps):
                    step(index)
                    index += 1
                    if ck is not None:
                        ck.after_step(exit_on_stop=False)
                if mode == "background":
                    ck.saver.wait()
                wall[mode] += time.perf_counter() - started
                block_wall[mode].append(time.perf_counter() - started)
                cpu[mode] += time.process_time() - cpu_started
                steps_done[mode] += args.block_steps
        for ck in checkpointers.values():
            ck.close()
        step_ms = wall["none"] / steps_done["none"] * 1000
        # Each round's blocks ran back to back, so compare within a round and take the median over
        # rounds: a load spike from other processes then spoils one round, not the figure.
        overhead = {m: statistics.median((b - n) / n * 100 for b, n in zip(block_wall[m], block_wall["none"]))
                    for m in ("sync", "background")}
        overhead_total = {m: (wall[m] - wall["none"]) / wall["none"] * 100 for m in ("sync", "background")}
        # Extra CPU time (every thread): what checkpointing costs when no core is spare, and the
        # figure least disturbed by other processes' load.
        cpu_overhead = {m: (cpu[m] - cpu["none"]) / cpu["none"] * 100 for m in ("sync", "background")}
        # The training thread's own cost: time spent inside the save calls (sync: the whole write;
        # background: the host copy and hand-over), as % of the no-checkpoint wall time.
        blocked = {m: sum(checkpointers[m].save_seconds) / wall["none"] * 100 for m in ("sync", "background")}

        # One full background write of a host copy (what the writer thread does per save).
        state = capture_state(net, trainer)
        write_times = []
        store = CheckpointStore(scratch / "writes", framework="mxnet")
        for i in range(3):
            started = time.perf_counter()
            store.save(state.write, step=i + 1, epoch=0, metadata=checkpointers["sync"].manifest_metadata())
            write_times.append(time.perf_counter() - started)
        latest = store.latest()
        size_mb = dir_bytes(latest.path) / 1e6
        params_mb = (latest.path / PARAMS_FILE).stat().st_size / 1e6

        restore_times = []
        for _ in range(3):
            fresh_net, fresh_trainer = build(mx, gluon)
            ck = GluonCheckpointer(fresh_net, fresh_trainer, directory=scratch / "writes", notices=quiet_notices())
            started = time.perf_counter()
            ck.restore()
            restore_times.append(time.perf_counter() - started)
            ck.close()

        rng = random.Random()
        spe = steps_per_epoch(len(x), BATCH)
        trials = [lost_steps_trial(data_dir, scratch, signal.SIGTERM, rng.randrange(55, 110))]
        trials += [lost_steps_trial(data_dir, scratch, signal.SIGKILL, rng.randrange(55, 110))
                   for _ in range(args.kills)]
        for t in trials:
            t["article_lost"] = t["ran"] % spe  # epoch checkpoints: everything since the epoch began
            t["article_lost_1000_step_epoch"] = t["ran"] % 1000
        sigterm = [t for t in trials if t["signal"] == "SIGTERM"]
        sigkill = [t for t in trials if t["signal"] == "SIGKILL"]

        result = {
            "framework": "mxnet",
            "mxnet_version": mx.__version__,
            "model_parameters": n_params,
            "optimizer": "adam",
            "batch_size": BATCH,
            "save_every_steps": SAVE_EVERY,
            "steps_per_mode": steps_done["none"],
            "step_ms": round(step_ms, 2),
            "overhead_pct": {m: round(v, 2) for m, v in overhead.items()},
            "overhead_total_pct": {m: round(v, 2) for m, v in overhead_total.items()},
            "cpu_overhead_pct": {m: round(v, 2) for m, v in cpu_overhead.items()},
            "training_thread_blocked_pct": {m: round(v, 2) for m, v in blocked.items()},
            "save_s": {
                "sync_mean": round(statistics.mean(checkpointers["sync"].save_seconds), 4),
                "background_blocking_mean": round(statistics.mean(checkpointers["background"].save_seconds), 4),
                "background_write_mean": round(statistics.mean(write_times), 4),
            },
            "restore_s": round(statistics.median(restore_times), 4),
            "checkpoint_mb": round(size_mb, 1),
            "params_mb": round(params_mb, 1),
            "lost_steps": {
                "sigterm": [t["lost"] for t in sigterm],
                "sigterm_exit_codes": [t["exit_code"] for t in sigterm],
                "sigkill": [t["lost"] for t in sigkill],
                "sigkill_max": max(t["lost"] for t in sigkill) if sigkill else None,
                "article_epoch_checkpoint": [t["article_lost"] for t in trials],
                "article_steps_per_epoch": spe,
                "article_1000_step_epoch": [t["article_lost_1000_step_epoch"] for t in trials],
            },
        }
        print(f"MXNet Gluon checkpoint benchmark: {n_params / 1e6:.2f} M parameters, Adam, batch {BATCH}, "
              f"save every {SAVE_EVERY} steps, {steps_done['none']} steps per mode, interleaved")
        print(f"{'mode':<12}{'wall s':>10}{'ms/step':>10}{'overhead %':>12}{'blocking s/save':>17}{'blocked %':>11}")
        blocking = {"none": 0.0, "sync": result["save_s"]["sync_mean"],
                    "background": result["save_s"]["background_blocking_mean"]}
        for mode in ("none", "sync", "background"):
            pct = 0.0 if mode == "none" else overhead[mode]
            print(f"{mode:<12}{wall[mode]:>10.2f}{wall[mode] / steps_done[mode] * 1000:>10.2f}"
                  f"{pct:>12.2f}{blocking[mode]:>17.4f}{blocked.get(mode, 0.0):>11.2f}")
        print(f"extra CPU time: sync {cpu_overhead['sync']:.2f} %, background {cpu_overhead['background']:.2f} %; "
              f"overhead over all rounds: sync {overhead_total['sync']:.2f} %, "
              f"background {overhead_total['background']:.2f} %")
        print(f"background write (writer thread): {result['save_s']['background_write_mean']:.3f} s; "
              f"restore: {result['restore_s']:.3f} s; checkpoint: {size_mb:.1f} MB "
              f"(parameters {params_mb:.1f} MB + trainer states)")
        for t in trials:
            print(f"{t['signal']:<8} after step {t['at']:>4}: ran {t['ran']:>4}, committed {t['committed']:>4}, "
                  f"lost {t['lost']:>3} (exit {t['exit_code']}); article's epoch checkpoints lose {t['article_lost']}")
        print(json.dumps(result))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
