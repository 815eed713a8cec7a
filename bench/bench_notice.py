"""Phase drill for the notice save: PyTorch trainers stopped the way the node agent stops them.

    .venv-torch/bin/python bench/bench_notice.py [--trials 3] [--workers 0 2 4] [--seed 0]

Each trial starts ``spot_training/training/examples/torch_resnet.py`` as the agent starts a trainer
(:class:`spot_training.agent.process_group.ProcessGroup`: a session of its own) and sends the notice as the
agent does (``ProcessGroup.stop``: SIGTERM to the whole group, SIGKILL only after the notice budget),
at a random time inside one phase:

* ``startup``: 1-3 s after start, while torch is imported and the newest checkpoint restored
  (the directory already holds one: a resume);
* ``step/wN``: after 3-15 steps of a run whose ``DataLoader`` has N workers (persistent);
* ``write``: a checkpoint after every step (``--save-every-steps 1``), so a background write is in
  flight at nearly every notice.

Per phase it reports: notice checkpoint committed (trials whose newest checkpoint holds every step
that ran), steps lost (steps run - steps in the newest checkpoint; goal 0), exit statuses (goal 0),
and notice -> committed seconds p50/p99 (the newest manifest's ``wall_time`` minus the time SIGTERM
was sent; a notice before the first step commits nothing new and counts 0). Not covered here: Keras,
the TF loop and Gluon, a validation pass and the first compile. Prints a table, then a LAST LINE of JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spot_training.agent.process_group import ProcessGroup  # noqa: E402
from spot_training.training.examples.prepare_data import prepare_digits  # noqa: E402
from spot_training.training.store import CheckpointStore  # noqa: E402

EXAMPLE = REPO / "spot_training" / "training" / "examples" / "torch_resnet.py"
#: The agent's notice budget after its margin (docs/contracts.md): SIGKILL after this many seconds.
NOTICE_BUDGET_S = 110.0


def _rows(log: Path) -> int:
    """Completed steps the trainer logged (its CSV's last ``step``; 0 when none)."""
    try:
        with open(log, newline="") as f:
            rows = list(csv.reader(f))
    except FileNotFoundError:
        return 0
    return int(rows[-1][0]) if len(rows) > 1 and rows[-1] and rows[-1][0].isdigit() else 0


def trial(root: Path, data_dir: Path, *, phase: str, workers: int, rng: random.Random) -> dict:
    """One run of the PyTorch example and one notice (SIGTERM to its group) in ``phase``; returns the trial's figures.

    Args:
        root: the trial's scratch directory.
        data_dir: the prepared datasets.
        phase: ``startup`` (during a resume's start), ``step`` (between steps) or ``write`` (while a
            checkpoint is written every step).
        workers: DataLoader worker processes.
        rng: draws the moment of the notice.

    Returns:
        ``{"phase", "exit", "ran", "saved", "lost", "committed", "notice_to_committed_s", "worker_killed"}``.
    """
    ckpt_dir, log_dir = root / "ckpt", root / "logs"
    args = [sys.executable, str(EXAMPLE), "--steps", "400", "--batch-size", "32", "--device", "cpu",
            "--data-dir", str(data_dir), "--checkpoint-dir", str(ckpt_dir), "--log-dir", str(log_dir),
            "--num-workers", str(workers), "--step-delay", "0.02",
            "--save-every-steps", "1" if phase == "write" else "25"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if phase == "startup":  # a resume: one short run leaves a checkpoint to restore
        first = ProcessGroup.start([*args[:2], "--steps", "5", *args[4:]], cwd=REPO, env=env,
                                   log_path=root / "first.log")
        first.proc.wait(timeout=300)
        (ckpt_dir / "COMPLETED").unlink(missing_ok=True)
    group = ProcessGroup.start(args, cwd=REPO, env=env, log_path=root / "trainer.log")
    log = log_dir / "training_log.csv"
    if phase == "startup":
        time.sleep(rng.uniform(1.0, 3.0))
    else:
        target, deadline = rng.randint(3, 15), time.monotonic() + 300
        while _rows(log) < target and time.monotonic() < deadline and group.poll() is None:
            time.sleep(0.01)
    sent = time.time()
    group.stop(kill_after=NOTICE_BUDGET_S)
    while group.poll() is None:
        group.stop(kill_after=NOTICE_BUDGET_S)
        time.sleep(0.05)
    latest = CheckpointStore(ckpt_dir, framework="pytorch").latest()
    saved = latest.step if latest is not None else 0
    ran = _rows(log)
    committed_s = max(0.0, latest.manifest["wall_time"] - sent) if latest is not None and saved == ran else None
    text = (root / "trainer.log").read_text(errors="replace")
    return {"phase": phase if phase != "step" else f"step/w{workers}", "exit": group.poll(), "ran": ran,
            "saved": saved, "lost": ran - saved, "committed": saved == ran,
            "notice_to_committed_s": committed_s, "worker_killed": "killed by signal" in text}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank), or None when there are none.

    Args:
        values: the figures.
        q: the quantile, 0..1.

    Returns:
        one of ``values``, or None.
    """
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarise(results: list[dict]) -> dict:
    """Per phase: trials, committed, most steps lost, exit statuses, killed workers, notice-to-commit p50/p99 seconds.

    Args:
        results: :func:`trial`'s dicts.

    Returns:
        ``{phase: figures}``.
    """
    table = {}
    for phase in dict.fromkeys(r["phase"] for r in results):
        rs = [r for r in results if r["phase"] == phase]
        secs = [r["notice_to_committed_s"] for r in rs if r["notice_to_committed_s"] is not None]
        table[phase] = {"trials": len(rs), "committed": sum(r["committed"] for r in rs),
                        "steps_lost_max": max(r["lost"] for r in rs), "exits": sorted({r["exit"] for r in rs}),
                        "worker_killed": sum(r["worker_killed"] for r in rs),
                        "notice_to_committed_p50_s": None if not secs else round(statistics.median(secs), 3),
                        "notice_to_committed_p99_s": None if not secs else round(percentile(secs, 0.99), 3)}
    return table


def run(trials: int, workers: list[int], seed: int, phases: list[str]) -> dict:
    """Run ``trials`` notices per phase (and per worker count in the ``step`` phase).

    Args:
        trials: notices per phase.
        workers: DataLoader worker counts of the ``step`` phase.
        seed: seeds the notice moments.
        phases: the phases to run.

    Returns:
        :func:`summarise`'s table.
    """
    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-notice-") as tmp:
        data_dir = Path(tmp) / "data"
        prepare_digits(data_dir)
        plan = [(p, w) for p in phases for w in (workers if p == "step" else [0])]
        for i in range(trials):
            for phase, w in plan:
                root = Path(tmp) / f"{phase}-{w}-{i}"
                root.mkdir()
                results.append(trial(root, data_dir, phase=phase, workers=w, rng=rng))
    return summarise(results)


def main(argv: list[str] | None = None) -> int:
    """Run the notice benchmark and print its table; the last line printed is JSON.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="notices per phase (default 3)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4], help="DataLoader workers (step phase)")
    parser.add_argument("--phases", nargs="+", choices=("startup", "step", "write"), default=["startup", "step", "write"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    table = run(args.trials, args.workers, args.seed, args.phases)
    print(f"{'phase':<10} {'trials':>6} {'committed':>9} {'lost max':>8} {'exits':>8} {'p50 s':>7} {'p99 s':>7}")
    for phase, row in table.items():
        print(f"{phase:<10} {row['trials']:>6} {row['committed']:>9} {row['steps_lost_max']:>8} "
              f"{','.join(map(str, row['exits'])):>8} {row['notice_to_committed_p50_s']!s:>7} "
              f"{row['notice_to_committed_p99_s']!s:>7}")
    print(json.dumps({"pytorch": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
