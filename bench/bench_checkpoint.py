"""Checkpoint cost and lost work for TensorFlow/Keras (and MXNet Gluon), every figure measured in this one run.

    .venv/bin/python bench/bench_checkpoint.py [--rounds 3] [--kills 2] [--threads 1] [--no-mxnet]
    (make bench-checkpoint)

Model: an MLP (64 -> 2048 -> 2048 -> 512 -> 10, about 5.4 M parameters, the same as the MXNet
part) trained with Adam, batch 64, on synthetic data of 6,400 examples (an epoch is 100 steps),
one TensorFlow intra-op thread (as the examples run; design.md: fastest on small nodes).

1. Overhead. Blocks of one epoch (100 steps) through :class:`training.keras_adapter.ResumableFit`
   with no checkpoints (``none``), synchronous saves every 50 steps (``sync``) and background
   saves every 50 steps (``background``, the default), and the article's way: a plain
   ``model.fit(x, y, shuffle=True)`` with ``keras.callbacks.ModelCheckpoint`` writing a full
   ``.h5`` model every epoch (``article``) beside the same plain fit without it (``plain``).
   Saves fall at steps 25 and 75 of each block (the cadence offset by half an interval, as in
   the MXNet part): a background block ends by waiting for its last write, and a write submitted
   at the block's very last step would put one whole write on the clock of every 100 steps (a
   4-5 % artefact on an idle 2-CPU machine that a long run pays once, at its final save).
   Blocks are interleaved and rotated for ``--rounds`` rounds, so load from other processes
   falls on every mode alike. Each block's clock runs from its first step to its last, including
   its saves (a background block also waits for its last write). Overhead % = (mode - its
   baseline) / baseline, baseline ``none`` for ours and ``plain`` for the article's; the headline
   is the median over rounds of each round's ratio, the ratio of the totals is printed beside it.
   Beside it, the share of the no-save training time during which saves held the training thread
   (sync: the whole write; background: the host copy), which load from other processes cannot
   blur, and the load average (wall-time ratios mean little when it exceeds the CPU count).
2. Save time (sync: the whole write; background: time the training thread is blocked for the host
   copy; write: one full store write of that copy, what the writer thread does), restore time
   (a fresh model: verify sha256, load, assign), checkpoint size; the same for the article's .h5.
3. Lost steps. A worker process (this file with ``--worker``) trains with ResumableFit and
   background saves every 50 steps; it gets SIGTERM at a random step (lost = steps it ran - steps
   in its newest checkpoint; goal 0) and, in ``--kills`` other runs, SIGKILL (goal: at most the
   save interval, plus any step run while the newest write was still in flight). The article's
   way (a checkpoint per epoch, a notice handler that sleeps) loses the steps since the epoch
   began: computed for the same kill steps with this epoch of 100 steps.
4. MXNet: runs bench/bench_checkpoint_mxnet.py in a subprocess (never in this process, which has
   TensorFlow) when it exists, and merges its last JSON line under ``"mxnet"``.

Prints a table, then a LAST LINE of JSON.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

BATCH = 64
SAVE_EVERY = 50
EXAMPLES = 6400  # 100 steps per epoch
SEED = 0
GOAL_BACKGROUND_PCT = 2.0


def make_data():
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((EXAMPLES, 64), dtype=np.float32)
    y = rng.integers(0, 10, EXAMPLES).astype(np.int64)
    return x, y


def build_model(keras):
    """The 5.4 M-parameter MLP, compiled with Adam (built, optimizer slots built)."""
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    return model


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def quiet_notice():
    from training.notice import NoticeHandler

    return NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())


def worker(args) -> int:
    """Train until signalled; print each completed step (the parent counts lost steps)."""
    import keras

    from training.keras_adapter import ResumableFit, make_deterministic

    make_deterministic(SEED, intra_op_threads=args.threads)
    x, y = make_data()
    model = build_model(keras)
    fitter = ResumableFit(model, args.checkpoint_dir, save_every_steps=SAVE_EVERY, background=True)

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print(f"step {fitter.step}", flush=True)

    print("ready", flush=True)
    fitter.fit(x, y, batch_size=BATCH, epochs=1000, callbacks=[Progress()], verbose=0)
    return 0


def lost_steps_trial(scratch: Path, sig: int, at: int, threads: int) -> dict:
    """Run a worker, send ``sig`` once it completed ``at`` steps; return steps run and committed."""
    from training.store import CheckpointStore

    ckdir = scratch / f"ck-{sig}-{at}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("SPOT_TRAINING_CHECKPOINT_REQUEST_FILE", None)
    proc = subprocess.Popen([sys.executable, __file__, "--worker", "--checkpoint-dir", str(ckdir),
                             "--threads", str(threads)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
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
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    latest = CheckpointStore(ckdir, framework="tensorflow").latest()
    committed = latest.step if latest is not None else 0
    shutil.rmtree(ckdir, ignore_errors=True)
    return {"signal": signal.Signals(sig).name, "at": at, "ran": ran, "committed": committed,
            "lost": ran - committed, "exit_code": code}


def run_mxnet_part() -> dict | None:
    script = REPO / "bench" / "bench_checkpoint_mxnet.py"
    if not script.exists():
        return None
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600)
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), flush=True)  # its table; its last line (JSON) is merged below
    if proc.returncode != 0 or not lines:
        return {"error": f"bench_checkpoint_mxnet.py exited {proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the five modes (default 3)")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILL trials (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads (default 1)")
    parser.add_argument("--no-mxnet", action="store_true", help="skip the MXNet part")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows up at once when piped to a file
    if args.worker:
        return worker(args)
    for name in ("rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    started_all = time.perf_counter()
    load_start = round(os.getloadavg()[0], 2)  # the wall-time figures mean little when this exceeds the CPUs
    import keras
    import tensorflow as tf

    from training.keras_adapter import KerasCheckpointer, ResumableFit, make_deterministic
    from training.notice import SaveSchedule
    from training.store import CheckpointStore

    make_deterministic(SEED, intra_op_threads=args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="bench-ckpt-tf-"))
    try:
        x, y = make_data()
        model = build_model(keras)
        n_params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
        spe = EXAMPLES // BATCH

        class Clock(keras.callbacks.Callback):
            """Wall time from the first step's start to the last step's end (and its saves)."""

            def __init__(self, fitter=None):
                super().__init__()
                self.fitter, self.seconds = fitter, 0.0

            def on_train_batch_begin(self, batch, logs=None):
                if batch == 0:
                    self.t0 = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                if self.fitter is not None and batch == spe - 1:
                    self.fitter.checkpointer.wait()  # a background block pays for its last write
                    self.seconds = time.perf_counter() - self.t0
                    self.save_seconds = list(self.fitter.checkpointer.save_seconds)

            def on_epoch_end(self, epoch, logs=None):  # after ModelCheckpoint (placed before us)
                if self.fitter is None:
                    self.seconds = time.perf_counter() - self.t0

        counter = iter(range(10**6))
        block_saves: dict[str, list] = {"sync": [], "background": []}

        class OffsetSchedule(SaveSchedule):
            """Every SAVE_EVERY steps, offset by half an interval: steps 25 and 75 of a block."""

            def due(self, step, now=None):
                return step % SAVE_EVERY == SAVE_EVERY // 2

        def ours(mode: str) -> float:
            every = None if mode == "none" else SAVE_EVERY
            fitter = ResumableFit(model, scratch / f"{mode}-{next(counter)}", save_every_steps=every,
                                  background=(mode != "sync"), notice=quiet_notice())
            if every is not None:
                fitter.schedule = OffsetSchedule(every_steps=every)
            clock = Clock(fitter)
            fitter.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[clock], verbose=0)
            if mode in block_saves:  # the saves inside the clock (not fit's final one, after it)
                block_saves[mode].extend(clock.save_seconds)
            shutil.rmtree(fitter.store.directory, ignore_errors=True)
            return clock.seconds

        def article(mode: str) -> float:
            clock = Clock()
            callbacks = [clock]
            directory = scratch / f"article-{next(counter)}"
            if mode == "article":
                directory.mkdir()
                callbacks.insert(0, keras.callbacks.ModelCheckpoint(str(directory / "model-{epoch:03d}.h5")))
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=True, callbacks=callbacks, verbose=0)
            shutil.rmtree(directory, ignore_errors=True)
            return clock.seconds

        runners = {"none": ours, "sync": ours, "background": ours, "plain": article, "article": article}
        for warm in ("none", "plain"):  # trace both input paths before any clock runs
            runners[warm](warm)
        wall = {m: [] for m in runners}
        order = list(runners)
        for round_no in range(args.rounds):
            for mode in order[round_no % len(order):] + order[: round_no % len(order)]:
                wall[mode].append(runners[mode](mode))
        total = {m: sum(v) for m, v in wall.items()}
        pairs = {"sync": "none", "background": "none", "article_h5_every_epoch": ("article", "plain")}

        def pct(mode_wall, base_wall):
            return (mode_wall - base_wall) / base_wall * 100

        # Headline: the median over rounds of each round's own ratio (a round's blocks run minutes
        # apart at most, so a burst of load elsewhere rarely spans a whole comparison); the ratio of
        # the totals is reported beside it.
        overhead, overhead_total = {}, {}
        for key, base in pairs.items():
            mode, base = (key, base) if isinstance(base, str) else base
            overhead[key] = statistics.median(pct(m, b) for m, b in zip(wall[mode], wall[base]))
            overhead_total[key] = pct(total[mode], total[base])
        step_ms = total["none"] / (args.rounds * spe) * 1000

        # Save, write, restore, size.
        sync_saves = block_saves["sync"]
        blocking = block_saves["background"]
        # The part of the overhead that load elsewhere cannot blur: seconds the training thread was
        # held by saves, over the training time without saves (the rest of a wall-time overhead is
        # the writer thread competing for CPU, which its lower priority keeps to idle cycles).
        blocked_pct = {"sync": sum(sync_saves) / total["none"] * 100,
                       "background": sum(blocking) / total["none"] * 100}
        store = CheckpointStore(scratch / "writes", framework="tensorflow")
        ck = KerasCheckpointer(model, store, background=False)
        arrays, index = ck.snapshot()
        write_times = []
        for i in range(3):
            t = time.perf_counter()
            store.save(lambda d: ck.write_snapshot(arrays, index, d), step=i + 1, epoch=0)
            write_times.append(time.perf_counter() - t)
        latest = store.latest()
        size_mb = dir_bytes(latest.path) / 1e6
        restore_times = []
        for _ in range(3):
            fresh = build_model(keras)
            reader = KerasCheckpointer(fresh, CheckpointStore(scratch / "writes", framework="tensorflow"),
                                       background=False)
            t = time.perf_counter()
            reader.store.restore(reader.read)
            restore_times.append(time.perf_counter() - t)
        restored_equal = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(fresh.weights, model.weights))
        h5_times, h5_restore = [], []
        for i in range(3):
            path = scratch / f"article-{i}.h5"
            t = time.perf_counter()
            model.save(str(path))
            h5_times.append(time.perf_counter() - t)
        h5_mb = path.stat().st_size / 1e6
        for i in range(2):
            t = time.perf_counter()
            keras.models.load_model(str(path))
            h5_restore.append(time.perf_counter() - t)

        # Lost steps per interruption (real signals to real worker processes).
        rng = random.Random()
        trials = [lost_steps_trial(scratch, signal.SIGTERM, rng.randrange(60, 140), args.threads)]
        trials += [lost_steps_trial(scratch, signal.SIGKILL, rng.randrange(60, 140), args.threads)
                   for _ in range(args.kills)]
        for trial in trials:
            trial["article_lost"] = trial["ran"] % spe  # epoch checkpoints: everything since the epoch began
        sigterm = [t for t in trials if t["signal"] == "SIGTERM"]
        sigkill = [t for t in trials if t["signal"] == "SIGKILL"]

        result = {
            "framework": "tensorflow",
            "tensorflow_version": tf.__version__,
            "keras_version": keras.__version__,
            "model_parameters": n_params,
            "optimizer": "adam",
            "batch_size": BATCH,
            "save_every_steps": SAVE_EVERY,
            "steps_per_epoch": spe,
            "intra_op_threads": args.threads,
            "steps_per_mode": args.rounds * spe,
            "step_ms": round(step_ms, 2),
            "wall_s": {m: round(v, 3) for m, v in total.items()},
            "overhead_pct": {m: round(v, 2) for m, v in overhead.items()},
            "overhead_pct_of_totals": {m: round(v, 2) for m, v in overhead_total.items()},
            "training_thread_blocked_pct": {m: round(v, 2) for m, v in blocked_pct.items()},
            "load_average_1min": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
            "cpus": os.cpu_count(),
            "block_wall_s": {m: [round(x, 3) for x in v] for m, v in wall.items()},
            "save_s": {
                "sync_mean": round(statistics.mean(sync_saves), 4),
                "background_blocking_mean": round(statistics.mean(blocking), 4),
                "background_write_mean": round(statistics.mean(write_times), 4),
                "article_h5_mean": round(statistics.mean(h5_times), 4),
            },
            "restore_s": round(statistics.median(restore_times), 4),
            "restore_bitwise_equal": restored_equal,
            "article_h5_restore_s": round(statistics.median(h5_restore), 4),
            "checkpoint_mb": round(size_mb, 1),
            "article_h5_mb": round(h5_mb, 1),
            "lost_steps": {
                "sigterm": [t["lost"] for t in sigterm],
                "sigterm_exit_codes": [t["exit_code"] for t in sigterm],
                "sigkill": [t["lost"] for t in sigkill],
                "sigkill_max": max(t["lost"] for t in sigkill) if sigkill else None,
                "article_epoch_checkpoint": [t["article_lost"] for t in trials],
                "article_steps_per_epoch": spe,
            },
        }

        print(f"TensorFlow/Keras checkpoint benchmark: {n_params / 1e6:.2f} M parameters, Adam, batch {BATCH}, "
              f"save every {SAVE_EVERY} steps, {args.rounds * spe} steps per mode, interleaved, "
              f"{args.threads} intra-op thread(s)")
        print(f"{'mode':<34}{'wall s':>9}{'ms/step':>9}{'overhead %':>12}{'of totals %':>13}{'blocking s/save':>17}")
        rows = [("none (ResumableFit, no saves)", "none", None, 0.0),
                ("sync (every 50 steps)", "sync", "sync", result["save_s"]["sync_mean"]),
                ("background (every 50 steps)", "background", "background",
                 result["save_s"]["background_blocking_mean"]),
                ("plain model.fit", "plain", None, 0.0),
                ("article: ModelCheckpoint .h5/epoch", "article", "article_h5_every_epoch",
                 result["save_s"]["article_h5_mean"])]
        for label, mode, key, block in rows:
            print(f"{label:<34}{total[mode]:>9.2f}{total[mode] / (args.rounds * spe) * 1000:>9.2f}"
                  f"{overhead[key] if key else 0.0:>12.2f}{overhead_total[key] if key else 0.0:>13.2f}{block:>17.4f}")
        print(f"training thread held by saves: sync {blocked_pct['sync']:.2f} %, background "
              f"{blocked_pct['background']:.2f} % of the no-save training time; load average "
              f"{load_start} -> {result['load_average_1min']['end']} on {os.cpu_count()} CPUs")
        print(f"background write (writer thread): {result['save_s']['background_write_mean']:.3f} s; "
              f"restore: {result['restore_s']:.3f} s (bitwise equal: {restored_equal}); checkpoint: "
              f"{size_mb:.1f} MB; article .h5: {h5_mb:.1f} MB, save {result['save_s']['article_h5_mean']:.3f} s, "
              f"load {result['article_h5_restore_s']:.3f} s")
        for t in trials:
            print(f"{t['signal']:<8} after step {t['at']:>4}: ran {t['ran']:>4}, committed {t['committed']:>4}, "
                  f"lost {t['lost']:>3} (exit {t['exit_code']}); article's epoch checkpoints lose {t['article_lost']}")

        output = {"tensorflow": result}
        if not args.no_mxnet:
            mxnet = run_mxnet_part()
            if mxnet is not None:
                output["mxnet"] = mxnet
        backgrounds = {"tensorflow": result["overhead_pct"]["background"]}
        if isinstance(output.get("mxnet"), dict) and "overhead_pct" in output["mxnet"]:
            backgrounds["mxnet"] = output["mxnet"]["overhead_pct"]["background"]
        sigterm_lost = {"tensorflow": result["lost_steps"]["sigterm"]}
        if isinstance(output.get("mxnet"), dict) and "lost_steps" in output["mxnet"]:
            sigterm_lost["mxnet"] = output["mxnet"]["lost_steps"]["sigterm"]
        output["goals"] = {
            "background_overhead_pct": backgrounds,
            "background_under_2pct": all(v < GOAL_BACKGROUND_PCT for v in backgrounds.values()),
            "lost_steps_with_notice": sigterm_lost,
            "zero_lost_with_notice": all(all(v == 0 for v in lst) for lst in sigterm_lost.values()),
        }
        output["bench_seconds"] = round(time.perf_counter() - started_all, 1)
        print(f"goals: background overhead {backgrounds} (< {GOAL_BACKGROUND_PCT} %: "
              f"{output['goals']['background_under_2pct']}); lost steps with notice {sigterm_lost}; "
              f"{output['bench_seconds']} s")
        print(json.dumps(output))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
