"""What the Keras, Gluon and PyTorch job helpers (tests/training/keras_jobs.py, tests/mxnet/gluon_jobs.py,
tests/torch/torch_jobs.py) share: one training job of an example script in a subprocess, with its
directories, its CSV step log and its stderr, and the bitwise comparison of final states.

No framework import here, nor at module level of anything it imports: each framework's tests run in
their own pytest process (MXNet under numpy<1.24, PyTorch in .venv-torch), and this module is
imported by all three. The per-framework modules put tests/ on sys.path to import it (the PyTorch
tests run with ``--confcutdir=tests/torch``, so tests/conftest.py does not do it for them).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass
class TrainingJob:
    """One training job's directories and the command that (re)starts it; subclasses give
    ``command(*more)`` and may add environment variables (``extra_env``)."""

    root: Path
    data_dir: Path
    extra_args: tuple[str, ...] = ()
    started: list = field(default_factory=list)

    # Set per framework by the class statement's keywords (__init_subclass__): seconds ``run`` waits
    # for the trainer to exit and ``wait_for_rows`` for the rows; variables added to the environment.
    run_timeout: ClassVar[float] = 180.0
    rows_timeout: ClassVar[float] = 120.0
    extra_env: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, *, run_timeout: float, rows_timeout: float, extra_env: dict[str, str], **kwargs):
        super().__init_subclass__(**kwargs)
        cls.run_timeout, cls.rows_timeout, cls.extra_env = run_timeout, rows_timeout, extra_env

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def log_path(self) -> Path:
        return self.root / "logs" / "training_log.csv"

    @property
    def request_file(self) -> Path:
        return self.root / "checkpoint-request"

    @property
    def final_weights(self) -> Path:
        """Where the trainer writes its final state (.npz) when the command asks it to."""
        return self.root / "final.npz"

    def env(self) -> dict[str, str]:
        """The caller's environment without any SPOT_TRAINING_* variable, then this job's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
        env.update(
            SPOT_TRAINING_DATA_DIR=str(self.data_dir),
            SPOT_TRAINING_CHECKPOINT_DIR=str(self.checkpoint_dir),
            SPOT_TRAINING_LOG_DIR=str(self.root / "logs"),
            SPOT_TRAINING_CHECKPOINT_REQUEST_FILE=str(self.request_file),
            PYTHONPATH=str(REPO),
            **self.extra_env,
        )
        return env

    def command(self, *more: str) -> list[str]:
        raise NotImplementedError

    def start(self, *more: str) -> subprocess.Popen:
        """Start the trainer in a session of its own, stderr to a new ``stderr-*.log`` under ``root``."""
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = self.command(*more)
        with open(self.root / f"stderr-{time.monotonic_ns()}.log", "wb") as stderr:
            proc = subprocess.Popen(cmd, env=self.env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr,
                                    start_new_session=True)
        proc.stderr_path = Path(stderr.name)
        self.started.append(proc)
        return proc

    def kill_leftovers(self) -> None:
        """SIGKILL every trainer this job started that still runs (test teardown), by its process group."""
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def run(self, *more: str, timeout: float | None = None) -> int:
        """Run the trainer to its end (``run_timeout`` seconds unless given; SIGKILL after); its exit code."""
        proc = self.start(*more)
        try:
            return proc.wait(timeout=self.run_timeout if timeout is None else timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def stderr_text(self, proc: subprocess.Popen | None = None) -> str:
        """The stderr of ``proc``, or of every trainer this job's root saw, in start order."""
        if proc is not None:
            return proc.stderr_path.read_text(errors="replace")
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.root.glob("stderr-*.log")))

    def logged_steps(self) -> list[int]:
        """The ``step`` column of every row of training_log.csv, in file order."""
        if not self.log_path.exists():
            return []
        with open(self.log_path, newline="") as handle:
            return [int(row["step"]) for row in csv.DictReader(handle)]

    def wait_for_rows(self, proc: subprocess.Popen, rows: int, timeout: float | None = None) -> None:
        """Wait until the step log has ``rows`` rows; AssertionError (with the trainer's stderr) when
        the trainer exits first or ``timeout`` (default ``rows_timeout``) seconds pass."""
        timeout = self.rows_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while len(self.logged_steps()) < rows:
            if proc.poll() is not None:
                raise AssertionError(f"trainer exited {proc.returncode} before {rows} rows:\n{self.stderr_text(proc)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"trainer did not reach {rows} rows in {timeout} s")
            time.sleep(0.005)

    def signal_at(self, rows: int, sig: int, *more: str) -> subprocess.Popen:
        """Start the trainer and send it ``sig`` once the step log has ``rows`` rows; the process."""
        proc = self.start(*more)
        self.wait_for_rows(proc, rows)
        proc.send_signal(sig)
        return proc

    def request_checkpoints(self, proc: subprocess.Popen, first_rows: int, second_rows: int, reason: str = "") -> None:
        """Ask the running trainer for a checkpoint both ways the contract gives (docs/contracts.md):
        SIGUSR1 once the step log has ``first_rows`` rows, the request file (holding ``reason``) once it
        has ``second_rows``."""
        self.wait_for_rows(proc, first_rows)
        proc.send_signal(signal.SIGUSR1)
        self.wait_for_rows(proc, second_rows)
        self.request_file.write_text(reason)


def notice_during_phase(argv: list[str], *, phase: str, wait_s: float, **env: str) -> tuple[int, float, str]:
    """Start ``argv`` (a phase job: it prints ``PHASE <name>`` lines) with the repository on PYTHONPATH, no
    ``SPOT_TRAINING_*`` variables and ``env`` added; one second into phase ``phase`` send SIGTERM and wait
    up to ``wait_s`` seconds for the exit. Returns ``(returncode, seconds from the signal to the exit,
    stderr)``; fails the test when the phase never starts or the job outlives ``wait_s``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    environment.update(PYTHONPATH=str(REPO), **env)
    proc = subprocess.Popen(argv, env=environment, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith(f"PHASE {phase}"):
                break
        else:
            pytest.fail(f"no {phase} phase: {proc.wait()} {proc.stderr.read()[-3000:]}")
        time.sleep(1.0)  # well inside the phase
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the notice waited for the {phase} phase to end")
        return rc, time.monotonic() - sent, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def child_pids(pid: int) -> list[int]:
    """The process IDs whose parent is ``pid`` (from /proc; Linux), sorted: torchrun's workers."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return sorted(children)


def load_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an .npz file (a job's final weights), by name."""
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def assert_bitwise_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], what: str) -> None:
    """The same names, and for each the same dtype, shape, values and bytes; ``what`` names them in the error."""
    assert sorted(actual) == sorted(expected)
    differing = [k for k in expected
                 if actual[k].dtype != expected[k].dtype or actual[k].shape != expected[k].shape
                 or not np.array_equal(actual[k], expected[k]) or actual[k].tobytes() != expected[k].tobytes()]
    assert not differing, f"{what} differ from the uninterrupted run: {differing}"


def job_fixtures(job_class, *, total_steps: int, reference_name: str, final_file: str):
    """The fixtures a framework's conftest.py shares: ``digits_dir`` (session: the 8x8 digits
    prepared once), ``job`` (a fresh ``job_class`` under tmp_path; trainers it started that still
    run at teardown are killed) and ``reference_name`` (session: the final state, from the job's
    ``final_file`` attribute, of one uninterrupted run that logged every step 1..``total_steps``).
    Assign the three to module names of the conftest so that pytest finds them."""

    @pytest.fixture(scope="session", name="digits_dir")
    def digits_dir(tmp_path_factory) -> Path:
        from spot_training.training.examples.prepare_data import prepare_digits

        out = tmp_path_factory.mktemp("datasets")
        prepare_digits(out)
        return out

    @pytest.fixture(name="job")
    def job(tmp_path, digits_dir):
        (tmp_path / "job").mkdir()
        fresh = job_class(root=tmp_path / "job", data_dir=digits_dir)
        try:
            yield fresh
        finally:
            fresh.kill_leftovers()

    @pytest.fixture(scope="session", name=reference_name)
    def reference(tmp_path_factory, digits_dir) -> dict[str, np.ndarray]:
        ref = job_class(root=tmp_path_factory.mktemp("reference"), data_dir=digits_dir)
        code = ref.run()
        assert code == 0, ref.stderr_text()
        assert ref.logged_steps() == list(range(1, total_steps + 1))
        return load_npz(getattr(ref, final_file))

    return digits_dir, job, reference
