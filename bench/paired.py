"""Paired-window statistics and the shared report of the checkpoint benchmarks (pure Python:
imported by the TensorFlow, MXNet and PyTorch benchmarks, each in its own process).

A run trains in windows of ``window`` steps that alternate without and with one save (window k
saves when k is odd). Each saving window is compared with the window just before it, so what one
save adds is measured about a second apart in the same process, and the load of other processes
and the slow drift of a shared machine cancel out (bench/bench_checkpoint.py, 1.).
"""

from __future__ import annotations

import contextlib
import statistics

# The checkpoint benchmarks' common setup (bench/bench_checkpoint.py and its MXNet and PyTorch parts).
BATCH = 64
SAVE_EVERY = 50
SEED = 0
WINDOW = 10  # steps per measuring window (bench/bench_checkpoint.py, 1.)
WARMUP_PAIRS = 2  # pairs of windows at the start of each run, not compared (a run's first saves)
HIDDEN = (2048, 2048, 512)  # the MLP's hidden layers (64 -> 2048 -> 2048 -> 512 -> 10)


def saving_window(k: int) -> bool:
    """True for the windows that hold a save (odd k)."""
    return k % 2 == 1


def paired_overhead(seconds: list[float], *, first: int, window: int, save_every: int,
                    blocking: list[float] | None = None) -> dict:
    """Overhead of one save every ``save_every`` steps, from per-window wall (or CPU) times.

    Args:
        seconds: one figure per window, in order (window k saves when k is odd).
        first: windows left out at the start (even: the warm-up pairs).
        window: steps per window.
        save_every: steps between two saves in the run the figure is for (50 for a save every 50 steps,
            an epoch's steps for the article's).
        blocking: optional training-thread seconds of the save in each window.

    Returns:
        ``step_s`` (mean seconds of a step in the windows without a save), ``extra_s`` (per pair: saving
        window - the window before it, seconds), ``overhead_pct`` (mean extra time of a save over
        ``save_every`` steps, %), ``overhead_pct_ci95`` (1.96 standard errors, %),
        ``overhead_pct_median``, ``blocking_s`` and ``blocked_pct`` (mean blocking over ``save_every``
        steps, %, or None).

    Raises:
        ValueError: fewer than two pairs, an odd ``first`` or a ragged last pair.
    """
    if first % 2:
        raise ValueError(f"first must be even (whole pairs of windows). Received: first={first}")
    w = seconds[first:]
    if len(w) < 4 or len(w) % 2:
        raise ValueError(f"need at least two whole pairs of windows after the first {first}. "
                         f"Received: {len(seconds)} windows")
    extra = [w[i + 1] - w[i] for i in range(0, len(w), 2)]
    step_s = statistics.mean(w[0::2]) / window
    scale = 100 / (save_every * step_s)
    saves = [b for b in (blocking or [])[first:]][1::2]
    return {
        "step_s": step_s,
        "extra_s": extra,
        "overhead_pct": statistics.mean(extra) * scale,
        "overhead_pct_ci95": 1.96 * statistics.stdev(extra) / len(extra) ** 0.5 * scale,
        "overhead_pct_median": statistics.median(extra) * scale,
        "blocking_s": saves,
        "blocked_pct": statistics.mean(saves) * scale if saves else None,
    }


def dir_bytes(path) -> int:
    """Bytes of every file under ``path`` (a checkpoint's size on disk)."""
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def quiet_notices():
    """A notice handler that installs no signal handler and reads no request file (measuring runs)."""
    from spot_training.training.notice import NoticeHandler

    return NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())


def parse_worker_bench_args(description: str, window: int):
    """The command line of the MXNet and PyTorch checkpoint benchmarks.

    ``--pairs`` (default 40, at least 2), ``--kills`` (default 2) and the hidden ``--worker``,
    ``--data-dir`` and ``--checkpoint-dir`` of the worker process that :func:`data_worker_trial` starts.

    Args:
        description: the benchmark's ``--help`` description.
        window: steps per window (named in ``--help``).

    Returns:
        the parsed namespace.

    Raises:
        SystemExit: 2 (argparse), naming a ``--pairs`` under 2.
    """
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--pairs", type=int, default=40,
                        help=f"pairs of {window}-step windows (without, with a save) compared per mode (default 40)")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILL trials (default 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker and args.pairs < 2:
        parser.error(f"--pairs must be >= 2, got {args.pairs}")
    return args


def worker_steps(steps, step) -> int:
    """A worker's loop: ``ready``, then ``step N`` after each completed step (:func:`run_kill_trial` counts them).

    Args:
        steps: a checkpointer's ``steps(...)`` iterator of step indices.
        step: runs one training step, given its index.

    Returns:
        0 (the worker's exit status).
    """
    print("ready", flush=True)
    for index in steps:
        step(index)
        print(f"step {index + 1}", flush=True)
    return 0


def data_worker_trial(script, *, data_dir, scratch, framework: str, sig: int, at: int) -> dict:
    """:func:`run_kill_trial` of ``script --worker --data-dir data_dir`` with one OpenMP thread.

    The checkpoint directory is a fresh one under ``scratch``; the worker gets 120 seconds to exit.

    Args:
        script: the benchmark script (its ``--worker`` mode).
        data_dir: the prepared datasets.
        scratch: where the checkpoint directory goes.
        framework: the checkpoint store's framework name.
        sig: the signal to send.
        at: the completed step after which it is sent.

    Returns:
        :func:`run_kill_trial`'s dict.
    """
    import os
    import sys
    import time
    from pathlib import Path

    ckdir = Path(scratch) / f"ck-{sig}-{at}-{time.monotonic_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(script).resolve().parents[1]))
    return run_kill_trial([sys.executable, str(script), "--worker", "--data-dir", str(data_dir),
                           "--checkpoint-dir", str(ckdir)], env=env, checkpoint_dir=ckdir, framework=framework,
                          sig=sig, at=at, timeout=120)


def run_kill_trial(argv: list, *, env: dict, checkpoint_dir, framework: str, sig: int, at: int,
                   timeout: float) -> dict:
    """Run a worker, signal its process group after ``at`` steps, and count the steps its checkpoints lost.

    A SIGTERMed worker finishes its current step first, and its later ``step`` lines count. The newest
    committed checkpoint of ``framework`` is read from ``checkpoint_dir``, then the directory is removed.

    Args:
        argv: the worker's command: a process printing ``step N`` after each completed step and saving
            into ``checkpoint_dir``.
        env: its environment.
        checkpoint_dir: its checkpoint directory.
        framework: the checkpoint store's framework name.
        sig: the signal to send.
        at: the completed step after which it is sent.
        timeout: seconds to wait for it to exit (SIGKILL after that).

    Returns:
        ``signal`` (name), ``at``, ``ran`` (steps completed), ``committed`` (step of the newest
        checkpoint, 0 if none), ``lost`` (ran - committed) and ``exit_code``.
    """
    import os
    import shutil
    import signal
    import subprocess

    from spot_training.training.store import CheckpointStore

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
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
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    latest = CheckpointStore(checkpoint_dir, framework=framework).latest()
    committed = latest.step if latest is not None else 0
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    return {"signal": signal.Signals(sig).name, "at": at, "ran": ran, "committed": committed,
            "lost": ran - committed, "exit_code": code}


def kill_trials(trial, *, kills: int, steps: range, spe: int) -> list[dict]:
    """One SIGTERM and ``kills`` SIGKILL trials, each at a random step of ``steps``.

    Each gets what the article's per-epoch checkpoints would have lost at that step: ``article_lost``
    (an epoch of ``spe`` steps) and ``article_lost_1000_step_epoch``.

    Args:
        trial: ``trial(signal, at_step) -> dict`` as :func:`run_kill_trial` returns.
        kills: SIGKILL trials.
        steps: the steps to draw from.
        spe: steps per epoch of the article's per-epoch checkpoints.

    Returns:
        the trials' dicts.
    """
    import random
    import signal

    rng = random.Random()
    trials = [trial(signal.SIGTERM, rng.choice(steps))]
    trials += [trial(signal.SIGKILL, rng.choice(steps)) for _ in range(kills)]
    for t in trials:
        t["article_lost"] = t["ran"] % spe  # epoch checkpoints: everything since the epoch began
        t["article_lost_1000_step_epoch"] = t["ran"] % 1000
    return trials


def lost_steps_summary(trials: list[dict], spe: int) -> dict:
    """The ``lost_steps`` part of a checkpoint benchmark's result, from :func:`kill_trials`.

    Args:
        trials: :func:`kill_trials`'s result.
        spe: steps per epoch of the article's per-epoch checkpoints.

    Returns:
        lost steps per SIGTERM and SIGKILL trial, their exit codes, and the article's figures.
    """
    sigterm = [t for t in trials if t["signal"] == "SIGTERM"]
    sigkill = [t for t in trials if t["signal"] == "SIGKILL"]
    return {
        "sigterm": [t["lost"] for t in sigterm],
        "sigterm_exit_codes": [t["exit_code"] for t in sigterm],
        "sigkill": [t["lost"] for t in sigkill],
        "sigkill_max": max(t["lost"] for t in sigkill) if sigkill else None,
        "article_epoch_checkpoint": [t["article_lost"] for t in trials],
        "article_steps_per_epoch": spe,
        "article_1000_step_epoch": [t["article_lost_1000_step_epoch"] for t in trials],
    }


def print_trials(trials: list[dict]) -> None:
    """One table line per kill trial."""
    for t in trials:
        print(f"{t['signal']:<8} after step {t['at']:>4}: ran {t['ran']:>4}, committed {t['committed']:>4}, "
              f"lost {t['lost']:>3} (exit {t['exit_code']}); article's epoch checkpoints lose {t['article_lost']}")


def print_table_header() -> None:
    """The column heads of the per-mode overhead table."""
    print(f"{'mode':<36}{'ms/step':>9}{'extra s/save':>14}{'overhead %':>12}{'95% CI +-':>11}{'median %':>10}"
          f"{'blocking s/save':>17}")


def print_table_row(label: str, st: dict, blocking_s: float) -> None:
    """One line of the per-mode overhead table under :func:`print_table_header`.

    Args:
        label: the mode's label.
        st: one mode's :func:`paired_overhead`.
        blocking_s: the mean seconds the training thread spent in a save.
    """
    print(f"{label:<36}{st['step_s'] * 1000:>9.2f}{statistics.mean(st['extra_s']):>14.4f}"
          f"{st['overhead_pct']:>12.2f}{st['overhead_pct_ci95']:>11.2f}{st['overhead_pct_median']:>10.2f}"
          f"{blocking_s:>17.4f}")


def window_schedule(window: int, every_steps: int):
    """A :class:`spot_training.training.notice.SaveSchedule` with one save at the first step of every saving window.

    Saving windows: :func:`saving_window`. The write overlaps the window's other steps, as it overlaps
    the steps after it in a run saving every ``every_steps`` steps.

    Args:
        window: steps per window.
        every_steps: the schedule's own step cadence (kept for its ``repr``).

    Returns:
        the schedule.
    """
    from spot_training.training.notice import SaveSchedule

    class WindowSchedule(SaveSchedule):
        def due(self, step, now=None):
            return (step - 1) % window == 0 and saving_window((step - 1) // window)

    return WindowSchedule(every_steps=every_steps)


def paired_modes(make_checkpointer, step, *, start: int, pairs: int, warmup_pairs: int, window: int,
                 save_every: int) -> dict:
    """Train one run per mode (``"background"``, then ``"sync"``) in windows alternating without and with one save.

    The save is at the window's first step (the MXNet and PyTorch benchmarks' way; bench/bench_checkpoint.py,
    1.); ``warmup_pairs`` pairs come first and are not compared. A background window ends by waiting for
    its write.

    Args:
        make_checkpointer: ``make_checkpointer(mode)`` returns a checkpoint driver (``after_step``,
            ``save_seconds``, ``saver``, ``schedule``, ``close``; its schedule is replaced by the windows').
        step: ``step(index)`` runs one training step; indices go on from ``start``.
        start: the first step index.
        pairs: compared pairs of windows per mode.
        warmup_pairs: pairs at the start, not compared.
        window: steps per window.
        save_every: the save cadence the overhead is stated for (steps).

    Returns:
        ``checkpointers`` (closed), per mode ``seconds``, ``cpu_seconds`` and ``blocking`` (seconds inside
        save calls) per window, ``first`` (windows left out), ``stats`` and ``cpu_stats``
        (:func:`paired_overhead` of wall and CPU time) and ``index`` (the next step).
    """
    import time

    windows_total = 2 * (warmup_pairs + pairs)
    first = 2 * warmup_pairs
    checkpointers, seconds, cpu_seconds, blocking = {}, {}, {}, {}
    index = start
    for mode in ("background", "sync"):
        ck = make_checkpointer(mode)
        ck.schedule = window_schedule(window, save_every)
        checkpointers[mode] = ck
        seconds[mode], cpu_seconds[mode], blocking[mode] = [], [], []
        for _k in range(windows_total):
            n0 = len(ck.save_seconds)
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(window):
                step(index)
                index += 1
                ck.after_step(exit_on_stop=False)
            if ck.saver is not None:
                ck.saver.wait()
            seconds[mode].append(time.perf_counter() - started)
            cpu_seconds[mode].append(time.process_time() - cpu_started)
            blocking[mode].append(sum(ck.save_seconds[n0:]))
        ck.close()
    stats = {m: paired_overhead(seconds[m], first=first, window=window, save_every=save_every,
                                blocking=blocking[m]) for m in seconds}
    # Extra CPU time of every thread per save: what checkpointing costs when no core is spare.
    cpu_stats = {m: paired_overhead(cpu_seconds[m], first=first, window=window, save_every=save_every)
                 for m in seconds}
    return {"checkpointers": checkpointers, "seconds": seconds, "cpu_seconds": cpu_seconds, "blocking": blocking,
            "first": first, "stats": stats, "cpu_stats": cpu_stats, "index": index}


@contextlib.contextmanager
def digits_scratch(prefix: str):
    """A scratch directory (removed on exit) with the 8x8 digits prepared under ``datasets/``.
    Yields ``(scratch, data_dir, x, y)``: the training images flattened to rows of 64 features."""
    import shutil
    import tempfile
    from pathlib import Path

    from spot_training.training.datasets import load_digits
    from spot_training.training.examples.prepare_data import prepare_digits

    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        data_dir = scratch / "datasets"
        prepare_digits(data_dir)
        x, y = load_digits(data_dir, "train")
        yield scratch, data_dir, x.reshape(len(x), -1), y
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def time_restores(open_checkpointer, n: int = 3) -> list[float]:
    """Seconds of ``n`` restores, each into fresh process state; only ``restore()`` is timed.

    Args:
        open_checkpointer: builds a new model and returns ``(restore, close)``.
        n: how many restores (default 3).

    Returns:
        one duration per restore, seconds.
    """
    import time

    times = []
    for _ in range(n):
        restore, close = open_checkpointer()
        started = time.perf_counter()
        restore()
        times.append(time.perf_counter() - started)
        close()
    return times


def lost_steps_and_report(*, script, data_dir, scratch, args, n_examples: int, framework: str, version_key: str,
                          version: str, title: str, size_note: str, n_params: int, run: dict, write_times: list,
                          restore_times: list, size_mb: float, params_mb: float, batch: int = BATCH,
                          save_every: int = SAVE_EVERY, window: int = WINDOW) -> dict:
    """The end the MXNet and PyTorch checkpoint benchmarks share: lost-steps trials, the table and the result.

    :func:`kill_trials` (one SIGTERM and ``kills`` SIGKILL trials of ``script``'s worker,
    :func:`data_worker_trial`) beside what the article's per-epoch checkpoints would have lost; then the
    table, and the result dict printed as the last line of JSON.

    Args:
        script: the benchmark script (its ``--worker`` mode).
        data_dir: the prepared datasets.
        scratch: where the trials' checkpoint directories go.
        args: the command line (``pairs``, ``kills``).
        n_examples: training examples (an epoch of the article's checkpoints).
        framework: the checkpoint store's framework name.
        version_key: the result's key for the framework version (``"mxnet"``, ``"torch"``).
        version: the framework version.
        title: the table's title.
        size_note: what the checkpoint holds, formatted with ``params_mb``.
        n_params: the model's parameters.
        run: what :func:`paired_modes` returned.
        write_times: background write durations, seconds.
        restore_times: :func:`time_restores`'s durations, seconds.
        size_mb: the checkpoint's size, MB.
        params_mb: the parameters' size, MB.
        batch: examples per step (default :data:`BATCH`).
        save_every: the save cadence, steps (default :data:`SAVE_EVERY`).
        window: steps per window (default :data:`WINDOW`).

    Returns:
        the result dict (also printed as JSON).
    """
    import json

    def trial(sig: int, at: int) -> dict:
        return data_worker_trial(script, data_dir=data_dir, scratch=scratch, framework=framework, sig=sig, at=at)

    from spot_training.training.datasets import steps_per_epoch

    pairs, spe = args.pairs, steps_per_epoch(n_examples, batch)
    trials = kill_trials(trial, kills=args.kills, steps=range(55, 110), spe=spe)
    stats, seconds, blocking, first = run["stats"], run["seconds"], run["blocking"], run["first"]
    overhead = {m: st["overhead_pct"] for m, st in stats.items()}
    cpu_overhead = {m: st["overhead_pct"] for m, st in run["cpu_stats"].items()}
    blocked = {m: st["blocked_pct"] for m, st in stats.items()}
    result = {
        "framework": framework,
        version_key: version,
        "model_parameters": n_params,
        "optimizer": "adam",
        "batch_size": batch,
        "save_every_steps": save_every,
        "pairs_per_mode": pairs,
        "window_steps": window,
        "step_ms": round(stats["background"]["step_s"] * 1000, 2),
        "overhead_pct": {m: round(v, 2) for m, v in overhead.items()},
        "overhead_pct_ci95": {m: round(st["overhead_pct_ci95"], 2) for m, st in stats.items()},
        "overhead_pct_median": {m: round(st["overhead_pct_median"], 2) for m, st in stats.items()},
        "extra_s_per_save_mean": {m: round(statistics.mean(st["extra_s"]), 4) for m, st in stats.items()},
        "cpu_overhead_pct": {m: round(v, 2) for m, v in cpu_overhead.items()},
        "training_thread_blocked_pct": {m: round(v, 2) for m, v in blocked.items()},
        "window_s": {m: [round(v, 4) for v in seconds[m]] for m in seconds},
        "save_s": {
            "sync_mean": round(statistics.mean(stats["sync"]["blocking_s"]), 4),
            "background_blocking_mean": round(statistics.mean(stats["background"]["blocking_s"]), 4),
            "first_saves_blocking": {m: [round(t, 4) for t in blocking[m][:first][1::2]] for m in blocking},
            "background_write_mean": round(statistics.mean(write_times), 4),
        },
        "restore_s": round(statistics.median(restore_times), 4),
        "checkpoint_mb": round(size_mb, 1),
        "params_mb": round(params_mb, 1),
        "lost_steps": lost_steps_summary(trials, spe),
    }
    print(f"{title}: {n_params / 1e6:.2f} M parameters, Adam, batch {batch}, "
          f"{pairs} pairs of {window}-step windows per mode (without, with one save)")
    print_table_header()
    for mode in ("sync", "background"):
        st = stats[mode]
        print_table_row(mode + ', a save every 50 steps', st, statistics.mean(st['blocking_s']))
    print(f"training thread held by saves: sync {blocked['sync']:.2f} %, background {blocked['background']:.2f} %; "
          f"extra CPU time of all threads: sync {cpu_overhead['sync']:.2f} %, background "
          f"{cpu_overhead['background']:.2f} %")
    print(f"first two saves of a run (not compared): background {result['save_s']['first_saves_blocking']['background']} s, "
          f"sync {result['save_s']['first_saves_blocking']['sync']} s")
    print(f"background write (writer thread): {result['save_s']['background_write_mean']:.3f} s; "
          f"restore: {result['restore_s']:.3f} s; checkpoint: {size_mb:.1f} MB "
          f"({size_note.format(params_mb=params_mb)})")
    print_trials(trials)
    print(json.dumps(result))
    return result


def checkpoint_cost_bench(*, script, args, prefix: str, framework: str, build, make_step, count_params, checkpointer,
                          timed_write, params_file: str, version_key: str, version: str, title: str,
                          size_note: str) -> None:
    """The run the MXNet and PyTorch checkpoint benchmarks share, on the 8x8 digits in a scratch directory:
    20 warm-up steps, :func:`paired_modes`, three timed full store writes of a host copy, restores into
    fresh state (:func:`time_restores`), then :func:`lost_steps_and_report`. What it measures:

    1. Overhead, by paired windows, as in bench/bench_checkpoint.py (1.): one run per mode
       (synchronous, background) trains in windows of 10 steps that alternate without and with one
       save (at the window's first step; a background window ends by waiting for its write); each
       saving window is compared with the window before it. Overhead % = the mean extra wall time
       of one save over the time of 50 steps (a save every 50 steps), with its 95 % confidence
       interval and the median; ``training_thread_blocked_pct`` is the time inside the save calls
       over the same 50 steps (the stall per save, in seconds: ``save_s``); ``cpu_overhead_pct`` is
       the extra CPU time of all threads per save, paired the same way (what a node without a
       spare core pays).
    2. Save time (sync: full write; background: time the training thread is blocked for the host
       copy; write: time of one full store write of that copy), restore time (fresh process state:
       a new model, the checkpointer's restore), checkpoint size on disk.
    3. Lost steps: a worker process (the benchmark's file with ``--worker``) trains and saves every
       50 steps in the background; it gets SIGTERM at a random step (lost = steps it ran - steps in
       its last checkpoint; goal 0) and, in ``--kills`` other runs, SIGKILL (lost = steps run -
       steps committed; bound: the save interval plus the steps run while the newest write was in
       flight). The article's way (a checkpoint per epoch, a notice handler that sleeps) loses the
       steps since the last epoch boundary: computed for the same kill steps with this dataset's
       epoch of 22 steps, and for a larger epoch of 1,000 steps for scale.

    Args:
        script: the benchmark's own file (run again with ``--worker`` for the lost-steps part).
        args: its parsed command line (``pairs``, ``kills``, ...).
        prefix: the scratch directory's name prefix.
        framework: the checkpoint store's framework name (``"mxnet"``, ``"pytorch"``).
        build: ``build()`` returns a fresh ``(model, optimizer)``.
        make_step: ``make_step(model, optimizer, x, y)`` returns the step function (``step(i)``).
        count_params: ``count_params(model)`` returns its parameter count.
        checkpointer: ``checkpointer(model, optimizer, directory, background, notices)`` returns the
            front-end's checkpointer (a checkpoint driver, or one in its ``driver`` attribute: what
            :func:`paired_modes` uses and ``restore``; and ``close``).
        timed_write: ``timed_write(model, optimizer, store, step, metadata)`` writes one checkpoint of a
            host copy into ``store`` and returns the seconds of the write alone.
        params_file: the checkpoint's parameter file (its size is reported).
        version_key: the JSON key of the framework's version (``"torch_version"``).
        version: the framework's version.
        title: the report's title line.
        size_note: a note printed beside the checkpoint size.
    """
    import time

    from spot_training.training.store import CheckpointStore

    with digits_scratch(prefix) as (scratch, data_dir, x, y):
        model, optimizer = build()
        step = make_step(model, optimizer, x, y)
        for i in range(20):  # warm-up: graph caching, allocator, Adam state creation
            step(i)

        # Paired windows (bench/bench_checkpoint.py, 1.): one run per mode whose WINDOW-step windows
        # alternate without and with one save, at the window's first step.
        def driver(mode):
            ck = checkpointer(model, optimizer, scratch / mode, mode == "background", quiet_notices())
            return getattr(ck, "driver", ck)

        run = paired_modes(driver, step, start=20, pairs=args.pairs, warmup_pairs=WARMUP_PAIRS, window=WINDOW, save_every=SAVE_EVERY)
        metadata = run["checkpointers"]["sync"].manifest_metadata()

        # One full background write of a host copy (what the writer thread does per save).
        store = CheckpointStore(scratch / "writes", framework=framework)
        write_times = [timed_write(model, optimizer, store, i + 1, metadata) for i in range(3)]
        latest = store.latest()
        params_mb = (latest.path / params_file).stat().st_size / 1e6

        def open_checkpointer():
            ck = checkpointer(*build(), scratch / "writes", True, quiet_notices())
            return getattr(ck, "driver", ck).restore, ck.close

        lost_steps_and_report(
            script=script, data_dir=data_dir, scratch=scratch, args=args, n_examples=len(x), framework=framework,
            version_key=version_key, version=version, title=title, size_note=size_note,
            n_params=count_params(model), run=run, write_times=write_times,
            restore_times=time_restores(open_checkpointer), size_mb=dir_bytes(latest.path) / 1e6, params_mb=params_mb)


def checkpoint_worker(args, *, build, make_step, checkpointer, **_bench) -> int:
    """The worker process of :func:`data_worker_trial` for :func:`checkpoint_cost_bench`'s framework parts.

    Trains on ``args.data_dir`` with background saves into ``args.checkpoint_dir`` until signalled,
    printing each completed step (:func:`worker_steps`).

    Args:
        args: the worker's parsed command line (``data_dir``, ``checkpoint_dir``).
        build: as in :func:`checkpoint_cost_bench`.
        make_step: as in :func:`checkpoint_cost_bench`.
        checkpointer: as in :func:`checkpoint_cost_bench`.
        **_bench: the bench's other keywords, ignored.

    Returns:
        the process's exit status (:func:`worker_steps`).
    """
    from spot_training.training.datasets import load_digits
    from spot_training.training.notice import NoticeHandler

    x, y = load_digits(args.data_dir, "train")
    model, optimizer = build()
    step = make_step(model, optimizer, x.reshape(len(x), -1), y)
    ckpt = checkpointer(model, optimizer, args.checkpoint_dir, True, NoticeHandler(request_file=None))
    return worker_steps(ckpt.steps(10**9), step)
