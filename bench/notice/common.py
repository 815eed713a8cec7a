"""What every phase-drill module shares: the notice as the agent sends it, the step log, the figures."""

from __future__ import annotations

import csv
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

#: The agent's notice budget after its margin (docs/contracts.md): SIGKILL after this many seconds.
NOTICE_BUDGET_S = 110.0
#: The must-show's validation pass (150 s) against that budget: the drill's pass is this much longer.
VALIDATION_OVER_BUDGET = 150.0 / 110.0


class FrontEnd(Protocol):
    """What each ``bench/notice/<name>.py`` module implements (:mod:`bench.notice` describes the harness).

    A module's own ``prepare`` and ``trial`` say ``Implements :meth:`bench.notice.common.FrontEnd.trial`.``
    (or ``.prepare``) in their docstrings instead of repeating the ``Args:`` below; the docstring check
    (tests/test_docstyle.py) holds them to these parameters.
    """

    #: ``"venv"`` (``.venv/bin/python``: TensorFlow, MXNet) or ``"torch"`` (``.venv-torch/bin/python``).
    PYTHON: str
    #: The phases its trials can land a notice in.
    PHASES: tuple[str, ...]

    def prepare(self, tmp: Path) -> dict:
        """Data and the uninterrupted reference run under ``tmp``.

        Args:
            tmp: the drill's temporary directory.

        Returns:
            the context every trial gets (the runner adds ``budget_s``: the notice budget in seconds, and
            ``resume``: False in the short form, which skips the resume to the end and its comparison).
        """

    def trial(self, root: Path, ctx: dict, *, phase: str, rng: random.Random) -> dict:
        """One run and one notice at a random time inside ``phase``.

        Args:
            root: the trial's own empty directory (checkpoints, logs).
            ctx: what ``prepare`` returned, plus the runner's ``budget_s`` and ``resume``.
            phase: one of ``PHASES``.
            rng: the drill's random source (when in the phase the notice lands).

        Returns:
            the trial's figures (:func:`result`'s keys).
        """


def reference(path: Path, run: Callable[[Path], bool]) -> Path:
    """The uninterrupted reference run's final state, run on first use: the short form never needs it.

    Args:
        path: where the run leaves its ``.npz`` (its parent directory is created).
        run: makes the run that writes ``path``; returns whether it succeeded.

    Returns:
        ``path``.

    Raises:
        RuntimeError: the run failed.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not run(path):
            raise RuntimeError(f"the uninterrupted reference run for {path} failed; see the logs beside it")
    return path


def rows(log: Path) -> int:
    """Completed steps the trainer logged (its CSV's last ``step``; 0 when none)."""
    try:
        with open(log, newline="") as f:
            lines = list(csv.reader(f))
    except FileNotFoundError:
        return 0
    return int(lines[-1][0]) if len(lines) > 1 and lines[-1] and lines[-1][0].isdigit() else 0


def wait_for(predicate, group, *, timeout_s: float = 300.0) -> bool:
    """Poll ``predicate()`` every 10 ms until it holds, the trainer ends or ``timeout_s`` passes.

    Args:
        predicate: a callable without arguments.
        group: the trainer's :class:`~spot_training.agent.process_group.ProcessGroup`.
        timeout_s: seconds to wait at most (default 300).

    Returns:
        whether the predicate holds at the end.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and group.poll() is None:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def send_notice(group, budget_s: float) -> float:
    """The agent's notice: SIGTERM to the group now, SIGKILL once ``budget_s`` has passed.

    Waits for the trainer to end; the seconds from the SIGTERM to the trainer's end are left in
    ``group.notice_to_exit_s``.

    Args:
        group: the trainer's :class:`~spot_training.agent.process_group.ProcessGroup`.
        budget_s: seconds from SIGTERM to SIGKILL.

    Returns:
        the time (``time.time()``) the SIGTERM was sent.
    """
    sent = time.time()
    group.stop(kill_after=budget_s)
    while group.poll() is None:
        group.stop(kill_after=budget_s)
        time.sleep(0.05)
    group.notice_to_exit_s = time.time() - sent
    return sent


def result(phase: str, *, exit_status, ran: int, latest, sent: float, log_text: str,
           bitwise: bool | None = None, notice_to_exit_s: float | None = None) -> dict:
    """One trial's figures.

    Committed: the newest checkpoint holds every step that ran; notice -> committed: its manifest's
    ``wall_time`` minus ``sent`` (0 when the notice found nothing new to save).

    Args:
        phase: the phase the notice aimed at.
        exit_status: the trainer's exit status.
        ran: steps the trainer logged.
        latest: the newest :class:`~spot_training.training.store.Checkpoint`, or None.
        sent: when the SIGTERM was sent (``time.time()``).
        log_text: the trainer's log (a loader worker's death is looked for).
        bitwise: the resumed run equals the reference (None: not compared).
        notice_to_exit_s: seconds until the trainer ended (SIGKILL included), when measured.

    Returns:
        the trial dict (``phase``, ``exit``, ``ran``, ``saved``, ``lost``, ``committed``,
        ``notice_to_committed_s``, ``worker_killed``, ``bitwise``, ``notice_to_exit_s``).
    """
    saved = latest.step if latest is not None else 0
    committed_s = max(0.0, latest.manifest["wall_time"] - sent) if latest is not None and saved == ran else None
    if latest is None and ran == 0:
        committed_s = 0.0
    return {"phase": phase, "exit": exit_status, "ran": ran, "saved": saved, "lost": ran - saved,
            "committed": saved == ran, "notice_to_committed_s": committed_s,
            "worker_killed": "killed by signal" in log_text, "bitwise": bitwise,
            "notice_to_exit_s": notice_to_exit_s}


def same_arrays(a: Path, b: Path) -> bool:
    """Whether two ``.npz`` files hold the same keys with bitwise equal arrays.

    Args:
        a: one ``.npz`` file.
        b: the other.

    Returns:
        True when both exist and every array is bitwise equal; False if one is missing.
    """
    if not (a.exists() and b.exists()):
        return False
    with np.load(a) as x, np.load(b) as y:
        return sorted(x.files) == sorted(y.files) and all(
            x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and x[k].tobytes() == y[k].tobytes()
            for k in x.files)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` by nearest rank.

    Args:
        values: the samples.
        q: the quantile, 0 to 1.

    Returns:
        the sample at that rank; None when ``values`` is empty.
    """
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarise(results: list[dict]) -> dict:
    """Per phase (in first-seen order): trials, committed, steps lost (max), exit statuses, worker
    deaths, bitwise resumes (equal/compared; None when no trial compared), notice -> committed p50/p99
    and the longest notice -> exit."""
    table = {}
    for phase in dict.fromkeys(r["phase"] for r in results):
        rs = [r for r in results if r["phase"] == phase]
        secs = [r["notice_to_committed_s"] for r in rs if r["notice_to_committed_s"] is not None]
        compared = [r["bitwise"] for r in rs if r.get("bitwise") is not None]
        table[phase] = {"trials": len(rs), "committed": sum(r["committed"] for r in rs),
                        "steps_lost_max": max(r["lost"] for r in rs), "exits": sorted({r["exit"] for r in rs}),
                        "worker_killed": sum(r["worker_killed"] for r in rs),
                        "bitwise": None if not compared else f"{sum(compared)}/{len(compared)}",
                        "notice_to_committed_p50_s": None if not secs else round(statistics.median(secs), 3),
                        "notice_to_committed_p99_s": None if not secs else round(percentile(secs, 0.99), 3),
                        "notice_to_exit_max_s": max((round(r["notice_to_exit_s"], 3) for r in rs
                                                     if r.get("notice_to_exit_s") is not None), default=None)}
    return table
