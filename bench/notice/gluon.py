"""MXNet Gluon in the notice phase drill: bench/notice/gluon_job.py started and stopped as the node agent does.

Each trial starts the trainer as the agent's supervisor does (:class:`spot_training.agent.process_group.ProcessGroup`,
a session of its own) and sends the notice as it does (:meth:`ProcessGroup.terminate`: SIGTERM to the
leader, the rest of the group once the leader has exited, SIGKILL to everything at the budget), at a
random time inside one phase:

* ``startup``: 0.3-4 s after the start of a resume (the directory holds a checkpoint of 3-10 steps),
  while MXNet is imported and the checkpoint restored (sent at once when the job reports ``restored``
  earlier);
* ``step``: after 3-15 steps of the plain loop (batches from ``batch_indices``);
* ``loader``: after 3-15 steps fed by a ``gluon.data.DataLoader`` with 2 worker processes whose
  ``__getitem__`` takes 2 ms (a slow decode: the main thread mostly waits for the next batch);
* ``validation``: 0-3 s into a validation pass (inside ``ckpt.outside_step()``) of 1.2 x the notice
  budget, after 3-12 steps;
* ``hybridize``: at the first forward pass of a resume (the CachedOp is built; about 0.2 s on the
  development VM): sent as soon as the job reports ``trace``;
* ``write``: a checkpoint after every step; sent while a ``.tmp-ckpt-*`` directory (a background
  write in flight) is in the checkpoint directory.

Then the same job is started again without a notice and runs to the end; its final parameters are
compared with an uninterrupted reference run's, bitwise (docs/training-mxnet.md promises a bitwise
resume after SIGTERM). ``in_phase`` says whether the notice landed where it was aimed (the job prints
``PHASE`` lines with their times). The budget is ``ctx["budget_s"]`` (``$BENCH_NOTICE_BUDGET_S`` or
110 s, the agent's notice budget after its margin); the short form sets a short one and the
validation pass shrinks with it.
"""

from __future__ import annotations

import csv
import os
import random
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from spot_training.agent.process_group import ProcessGroup  # noqa: E402
from spot_training.training.store import TMP_PREFIX, CheckpointStore  # noqa: E402

PYTHON = "venv"
PHASES = ("startup", "step", "loader", "validation", "hybridize", "write")
JOB = Path(__file__).with_name("gluon_job.py")
#: The agent's notice budget after its margin (docs/contracts.md): SIGKILL after this many seconds.
NOTICE_BUDGET_S = 110.0
TOTAL_STEPS = 60
#: Seconds any one run may take before the trial gives up on it (it is killed and the trial fails).
RUN_TIMEOUT_S = 300.0
_PHASE_LINE = re.compile(r"^PHASE (\w+) ([0-9.]+)$", re.M)


def interpreter() -> str:
    """The interpreter with MXNet: the repository's ``.venv``, else the running one."""
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


def _command(ctx: dict, root: Path, *more: str, steps: int | None = None) -> list[str]:
    return [ctx["python"], str(JOB), "--data-dir", str(ctx["data_dir"]), "--checkpoint-dir", str(root / "ckpt"),
            "--log-dir", str(root / "logs"), "--steps", str(steps or ctx["total_steps"]), *more]


def _run(argv: list[str], root: Path, log: str) -> int:
    """Run ``argv`` to its end as the agent starts a trainer; return its exit status."""
    group = ProcessGroup.start(argv, cwd=REPO, env=_environment(), log_path=root / log)
    try:
        return group.proc.wait(timeout=RUN_TIMEOUT_S)
    except BaseException:
        group.kill_and_wait()
        raise


def _phases(log: Path) -> dict[str, float]:
    """The job's ``PHASE name time`` lines: the first time of each phase."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return {}
    found: dict[str, float] = {}
    for name, when in _PHASE_LINE.findall(text):
        found.setdefault(name, float(when))
    return found


def _steps(log: Path) -> list[int]:
    """The ``step`` column of the job's CSV log (every completed step of every run, in order)."""
    try:
        with open(log, newline="") as f:
            return [int(row["step"]) for row in csv.DictReader(f)]
    except FileNotFoundError:
        return []


def prepare(tmp: Path) -> dict:
    """Write the digits and run the job once uninterrupted: the reference parameters.

    Returns:
        The context of :func:`trial`: ``python``, ``data_dir``, ``reference`` (its final parameters,
        .npz), ``total_steps`` and ``budget_s``.

    Raises:
        RuntimeError: the reference run did not exit 0.
    """
    from spot_training.training.examples.prepare_data import prepare_digits

    tmp = Path(tmp)
    ctx = {"python": interpreter(), "data_dir": tmp / "data", "total_steps": TOTAL_STEPS,
           "budget_s": float(os.environ.get("BENCH_NOTICE_BUDGET_S", NOTICE_BUDGET_S)),
           "reference": tmp / "gluon-reference" / "final.npz"}
    prepare_digits(ctx["data_dir"])
    root = tmp / "gluon-reference"
    root.mkdir(parents=True, exist_ok=True)
    code = _run(_command(ctx, root, "--save-final-params", str(ctx["reference"])), root, "trainer.log")
    if code != 0:
        raise RuntimeError(f"the Gluon reference run exited {code}: {(root / 'trainer.log').read_text()[-3000:]}")
    return ctx


def _bitwise(actual: Path, expected: Path) -> bool:
    import numpy as np

    with np.load(actual) as a, np.load(expected) as b:
        return sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)


def _wait(predicate, group: ProcessGroup, timeout: float = RUN_TIMEOUT_S, poll: float = 0.005) -> bool:
    """Poll ``predicate`` until it holds (True), the job exits or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if group.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def trial(root: Path, ctx: dict, *, phase: str, rng: random.Random) -> dict:
    """One run with one notice in ``phase``, then the resume to the end.

    Implements :meth:`bench.notice.common.FrontEnd.trial` (``ctx``: data, reference run, ``budget_s``).

    Returns:
        ``phase``, ``exit`` (the notified run's status; goal 0), ``ran`` (steps it logged), ``saved``
        (the newest checkpoint's step), ``lost`` (ran - saved; goal 0), ``committed`` (saved == ran),
        ``notice_to_committed_s`` (the newest manifest's wall time minus the time SIGTERM was sent,
        0 when it was committed before; None when not committed), ``worker_killed`` (a loader worker
        error in the log), ``bitwise`` (the resumed run's final parameters equal the reference's),
        ``in_phase`` (the notice landed in the phase aimed at), ``group_exit_s`` (SIGTERM to the
        end of the whole process group), ``resume_exit`` and ``steps_once`` (the CSV holds every
        step exactly once).

    Raises:
        ValueError: ``phase`` is not one of :data:`PHASES`.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}. Received: phase={phase!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    ckpt_dir, csv_log, trainer_log = root / "ckpt", root / "logs" / "training_log.csv", root / "trainer.log"
    budget = float(ctx["budget_s"])
    more: list[str] = []
    if phase == "loader":
        more = ["--workers", "2", "--load-delay", "0.002"]
    elif phase == "validation":
        more = ["--validate-every", str(rng.randint(3, 12)), "--validation-seconds", f"{1.2 * budget:.1f}"]
    elif phase == "write":
        more = ["--save-every-steps", "1", "--step-delay", "0.01"]
    if phase in ("startup", "hybridize"):  # a resume: a short run leaves a checkpoint to restore
        if _run(_command(ctx, root, steps=rng.randint(3, 10)), root, "first.log") != 0:
            raise RuntimeError(f"the first run exited non-zero: {(root / 'first.log').read_text()[-3000:]}")
        (ckpt_dir / "COMPLETED").unlink(missing_ok=True)

    group = ProcessGroup.start(_command(ctx, root, *more), cwd=REPO, env=_environment(), log_path=trainer_log)
    started = time.monotonic()
    in_phase: bool | None = None
    try:
        if phase == "startup":
            target = started + rng.uniform(0.3, 4.0)
            _wait(lambda: time.monotonic() >= target or "restored" in _phases(trainer_log), group)
        elif phase == "hybridize":
            _wait(lambda: "trace" in _phases(trainer_log), group, poll=0.002)
        elif phase == "validation":
            _wait(lambda: "validation" in _phases(trainer_log), group)
            time.sleep(rng.uniform(0.0, min(3.0, budget / 4)))
        else:
            target_steps = rng.randint(3, 15)
            _wait(lambda: len(_steps(csv_log)) >= target_steps, group)
            if phase == "write":
                in_phase = _wait(lambda: any(p.name.startswith(TMP_PREFIX) for p in ckpt_dir.iterdir()),
                                 group, timeout=5.0, poll=0.001)
            else:
                time.sleep(rng.uniform(0.0, 0.05))
        sent, sent_clock = time.time(), time.monotonic()
        status = group.terminate(budget)
        group_exit_s = time.monotonic() - sent_clock
    except BaseException:
        group.kill_and_wait()
        raise
    marks = _phases(trainer_log)
    if phase == "startup":
        in_phase = sent < marks.get("restored", float("inf"))
    elif phase == "hybridize":
        in_phase = marks.get("trace", float("inf")) <= sent < marks.get("traced", float("inf"))
    elif phase == "validation":
        in_phase = marks.get("validation", float("inf")) <= sent
    latest = CheckpointStore(ckpt_dir, framework="mxnet").latest()
    saved = latest.step if latest is not None else 0
    ran = len(_steps(csv_log))
    committed = saved == ran
    committed_s = max(0.0, latest.manifest["wall_time"] - sent) if latest is not None and committed else None
    text = trainer_log.read_text(errors="replace")
    worker_killed = bool(re.search(r"worker.{0,40}(killed|timed out|died)|Worker timed out", text, re.I))

    final = root / "final.npz"
    resume_exit = _run(_command(ctx, root, "--save-final-params", str(final)), root, "resume.log")
    steps = _steps(csv_log)
    return {"phase": phase, "exit": status, "ran": ran, "saved": saved, "lost": ran - saved, "committed": committed,
            "notice_to_committed_s": committed_s, "worker_killed": worker_killed,
            "bitwise": resume_exit == 0 and final.exists() and _bitwise(final, Path(ctx["reference"])),
            "in_phase": in_phase, "group_exit_s": round(group_exit_s, 3), "resume_exit": resume_exit,
            "steps_once": steps == list(range(1, int(ctx["total_steps"]) + 1))}

