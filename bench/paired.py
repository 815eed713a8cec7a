"""Paired-window statistics and the shared report of the checkpoint benchmarks (pure Python:
imported by the TensorFlow, MXNet and PyTorch benchmarks, each in its own process).

A run trains in windows of ``window`` steps that alternate without and with one save (window k
saves when k is odd). Each saving window is compared with the window just before it, so what one
save adds is measured about a second apart in the same process, and the load of other processes
and the slow drift of a shared machine cancel out (bench/bench_checkpoint.py, 1.).
"""

from __future__ import annotations

import statistics


def saving_window(k: int) -> bool:
    """True for the windows that hold a save (odd k)."""
    return k % 2 == 1


def paired_overhead(seconds: list[float], *, first: int, window: int, save_every: int,
                    blocking: list[float] | None = None) -> dict:
    """Overhead of one save every ``save_every`` steps, from per-window wall (or CPU) times.

    seconds: one figure per window, in order (window k saves when k is odd); the first ``first``
    windows (even, the warm-up) are left out. window: steps per window. save_every: steps between
    two saves in the run the figure is for (50 for a save every 50 steps, an epoch's steps for
    the article's). blocking: optional training-thread seconds of the save in each window.

    Returns ``step_s`` (mean seconds of a step in the windows without a save), ``extra_s`` (per
    pair: saving window - the window before it, seconds), ``overhead_pct`` (mean extra time of a
    save over ``save_every`` steps, %), ``overhead_pct_ci95`` (1.96 standard errors, %),
    ``overhead_pct_median`` and ``blocked_pct`` (mean blocking over ``save_every`` steps, %, or
    None). Raises ValueError for fewer than two pairs, an odd ``first`` or a ragged last pair.
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


def lost_steps_and_report(*, trial, data_dir, scratch, kills: int, spe: int, framework: str, version_key: str,
                          version: str, title: str, size_note: str, n_params: int, batch: int, save_every: int,
                          pairs: int, window: int, step_ms: float, overhead: dict, stats: dict,
                          cpu_overhead: dict, blocked: dict, seconds: dict, blocking: dict, first: int,
                          write_times: list, restore_times: list, size_mb: float, params_mb: float) -> dict:
    """The end every framework's checkpoint benchmark shares: one SIGTERM and ``kills`` SIGKILL
    lost-steps trials (``trial(data_dir, scratch, signal, at_step) -> dict`` with ``signal``, ``at``,
    ``ran``, ``committed``, ``lost``, ``exit_code``), beside what the article's per-epoch checkpoints
    would have lost (``spe`` steps per epoch); then the table, and the result dict printed as the
    last line of JSON (and returned). ``size_note`` is formatted with ``params_mb``."""
    import json
    import random
    import signal

    rng = random.Random()
    trials = [trial(data_dir, scratch, signal.SIGTERM, rng.randrange(55, 110))]
    trials += [trial(data_dir, scratch, signal.SIGKILL, rng.randrange(55, 110))
               for _ in range(kills)]
    for t in trials:
        t["article_lost"] = t["ran"] % spe  # epoch checkpoints: everything since the epoch began
        t["article_lost_1000_step_epoch"] = t["ran"] % 1000
    sigterm = [t for t in trials if t["signal"] == "SIGTERM"]
    sigkill = [t for t in trials if t["signal"] == "SIGKILL"]

    result = {
        "framework": framework,
        version_key: version,
        "model_parameters": n_params,
        "optimizer": "adam",
        "batch_size": batch,
        "save_every_steps": save_every,
        "pairs_per_mode": pairs,
        "window_steps": window,
        "step_ms": round(step_ms, 2),
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
    print(f"{title}: {n_params / 1e6:.2f} M parameters, Adam, batch {batch}, "
          f"{pairs} pairs of {window}-step windows per mode (without, with one save)")
    print(f"{'mode':<36}{'ms/step':>9}{'extra s/save':>14}{'overhead %':>12}{'95% CI +-':>11}{'median %':>10}"
          f"{'blocking s/save':>17}")
    for mode in ("sync", "background"):
        st = stats[mode]
        print(f"{mode + ', a save every 50 steps':<36}{st['step_s'] * 1000:>9.2f}"
              f"{statistics.mean(st['extra_s']):>14.4f}{st['overhead_pct']:>12.2f}{st['overhead_pct_ci95']:>11.2f}"
              f"{st['overhead_pct_median']:>10.2f}{statistics.mean(st['blocking_s']):>17.4f}")
    print(f"training thread held by saves: sync {blocked['sync']:.2f} %, background {blocked['background']:.2f} %; "
          f"extra CPU time of all threads: sync {cpu_overhead['sync']:.2f} %, background "
          f"{cpu_overhead['background']:.2f} %")
    print(f"first two saves of a run (not compared): background {result['save_s']['first_saves_blocking']['background']} s, "
          f"sync {result['save_s']['first_saves_blocking']['sync']} s")
    print(f"background write (writer thread): {result['save_s']['background_write_mean']:.3f} s; "
          f"restore: {result['restore_s']:.3f} s; checkpoint: {size_mb:.1f} MB "
          f"({size_note.format(params_mb=params_mb)})")
    for t in trials:
        print(f"{t['signal']:<8} after step {t['at']:>4}: ran {t['ran']:>4}, committed {t['committed']:>4}, "
              f"lost {t['lost']:>3} (exit {t['exit_code']}); article's epoch checkpoints lose {t['article_lost']}")
    print(json.dumps(result))
    return result
