"""One child of a sweep: our notice watcher beside the user's unchanged resumable script.

AWS Batch runs ``python -m spot_training.agent.sweep_child -- COMMAND`` in every array child (the
``SpotSweep`` job definition, spot_training/infra/sweep.py). The child:

1. reads its index, attempt and job id from the environment AWS Batch gives it
   (``AWS_BATCH_JOB_ARRAY_INDEX``, ``AWS_BATCH_JOB_ATTEMPT``, ``AWS_BATCH_JOB_ID``; AWS Batch User
   Guide, "Array jobs" and "Automated job retries"), the sweep id and the manifest URI from
   ``spot-train sweep submit`` (``SPOT_TRAINING_SWEEP_ID``, ``SPOT_TRAINING_SWEEP_MANIFEST_URI``);
2. takes parameter set ``index`` of the manifest (a JSON list in S3, or a local file) and writes it
   to ``<mount>/<sweep>/<index>/params.json`` (the seed's ``/storage/<index>/``);
3. runs ``COMMAND --key value ...`` (one option per parameter) with the trainer environment of a
   node (``SPOT_TRAINING_CHECKPOINT_DIR`` = ``<index dir>/checkpoints``, ``SPOT_TRAINING_LOG_DIR`` =
   ``<index dir>/logs``, working directory ``<index dir>``): the script does not know whether it runs on a fleet node, a cluster or a
   sweep. On attempt > 1 it resumes from the last committed checkpoint (the store reads only what
   ``LATEST`` names and ignores temporary directories); on attempt 1 a committed checkpoint in the
   folder means the folder belongs to an earlier run, and the child stops (exit 78) instead of
   resuming into it (the failure nextflow-io/nextflow#5215 describes);
4. polls instance metadata for spot notices and rebalance hints (spot_training.agent.interruption,
   the fleet node's watcher): AWS Batch delivers no spot warning to a job (ECS draining leaves Batch
   tasks running; job definitions have no ``stopTimeout``, aws/containers-roadmap#2059), so on a
   notice the child SIGTERMs the trainer, which commits a checkpoint at its current step and exits;
   the child then waits for the host to be taken. If it was not taken by the notice's deadline plus
   :data:`RECLAIM_GRACE_S`, the child exits :data:`spot_training.contract.EXIT_SWEEP_RECLAIM_NOT_TAKEN`,
   which the job definition retries like a reclaim;
5. writes ``metrics.json`` (step, total, loss, accuracy of the newest committed checkpoint) whenever a
   checkpoint is committed, and appends this attempt to ``attempts.json`` (instance id, type and AZ
   from instance metadata, start/end times, the committed step at start and end): the cost of every
   attempt stays visible (``spot-train sweep cost``).

Exit status: the trainer's, except 78 for bad configuration (nothing touched) and 75 as above.
Standard library and boto3 only; Python 3.10.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from spot_training import contract
from spot_training.agent.imds import ImdsClient, ImdsError
from spot_training.agent.interruption import InterruptionWatcher, imds_monitors
from spot_training.agent.process_group import ProcessGroup

log = logging.getLogger("spot_training.agent.sweep_child")

#: Seconds the child waits past a notice's deadline for the host to be taken before it exits 75.
RECLAIM_GRACE_S = 30.0
#: The notice poll interval when ``notice_poll_interval_s`` is not in the environment (the contract's).
POLL_ENV = "SPOT_TRAINING_NOTICE_POLL_INTERVAL_S"


class SweepConfigError(ValueError):
    """The child's environment or manifest is unusable (exit 78, nothing touched)."""


def _env_int(environ: dict[str, str], name: str, default: int | None, minimum: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise SweepConfigError(f"${name} is not set; AWS Batch sets it for an array child")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SweepConfigError(f"${name}={raw!r} is not an integer >= {minimum}") from None
    if value < minimum:
        raise SweepConfigError(f"${name}={raw!r} is not an integer >= {minimum}")
    return value


def load_manifest(uri: str, *, s3: Any = None) -> list[dict[str, Any]]:
    """The sweep's parameter sets: a JSON list of objects at ``uri`` (``s3://bucket/key``, ``file://path``
    or a path). ``s3``: a boto3 S3 client (default: one from the environment).

    Args:
        uri: ``s3://bucket/key``, ``file://path`` or a path.
        s3: a boto3 S3 client (default: one from the environment).

    Returns:
        the parameter sets, index i = array child i.

    Raises:
        SweepConfigError: unreadable, not JSON, or not a non-empty list of objects with string keys.
    """
    try:
        if uri.startswith("s3://"):
            bucket, _, key = uri[len("s3://"):].partition("/")
            if not bucket or not key:
                raise SweepConfigError(f"manifest URI {uri!r} must look like s3://bucket/key")
            if s3 is None:
                import boto3

                s3 = boto3.client("s3")
            text = s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode("utf-8")
        else:
            text = Path(uri[len("file://"):] if uri.startswith("file://") else uri).read_text(encoding="utf-8")
        data = json.loads(text)
    except SweepConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure to read it is a configuration error here
        raise SweepConfigError(f"cannot read the sweep manifest {uri!r}: {type(error).__name__}: {error}") from error
    return check_manifest(data, where=uri)


def check_manifest(data: Any, *, where: str = "manifest") -> list[dict[str, Any]]:
    """``data`` if it is a non-empty JSON list of parameter objects (string keys, scalar values).

    Args:
        data: the parsed manifest.
        where: how the manifest is named in messages (default ``"manifest"``).

    Returns:
        ``data`` unchanged.

    Raises:
        SweepConfigError: naming the bad entry and what is allowed.
    """
    if not isinstance(data, list) or not data:
        raise SweepConfigError(f"{where}: expected a non-empty JSON list of parameter objects, got {type(data).__name__}")
    if len(data) > contract.MAX_BATCH_ARRAY_SIZE:
        raise SweepConfigError(f"{where}: {len(data)} parameter sets; AWS Batch array jobs hold at most {contract.MAX_BATCH_ARRAY_SIZE}")
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise SweepConfigError(f"{where}[{i}]: expected an object of parameters, got {entry!r}")
        for key, value in entry.items():
            if not isinstance(key, str) or not key.replace("_", "-").replace("-", "").isalnum():
                raise SweepConfigError(f"{where}[{i}]: parameter name {key!r} must be letters, digits, - or _")
            if not isinstance(value, (str, int, float, bool)) and value is not None:
                raise SweepConfigError(f"{where}[{i}].{key}: expected a string, number or boolean, got {value!r}")
    return data


def trainer_argv(command: list[str], params: dict[str, Any]) -> list[str]:
    """``command`` followed by ``--name value`` for each parameter.

    In the manifest's order; ``true`` gives the bare flag, ``false``/``null`` are left out.

    Args:
        command: the training command.
        params: this child's parameter set.

    Returns:
        a new argv list.
    """
    argv = list(command)
    for key, value in params.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not False and value is not None:
            argv += [f"--{key}", str(value)]
    return argv


def committed_step(checkpoint_dir: Path) -> int | None:
    """The step of the checkpoint ``LATEST`` names, or None (no committed checkpoint)."""
    try:
        return int(json.loads((checkpoint_dir / contract.LATEST_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def metrics_at(log_path: Path, step: int) -> dict[str, float]:
    """The trainer log's row for ``step``, the last one written for that step; empty when there is none.

    Args:
        log_path: the trainer's ``training_log.csv`` (step, epoch, loss, accuracy, ...).
        step: the committed checkpoint's step.

    Returns:
        ``{column: value}`` of the row's numeric cells (an unreadable file: empty).
    """
    found: dict[str, float] = {}
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return found
    if not lines:
        return found
    header = lines[0].split(",")
    for line in lines[1:]:
        cells = line.split(",")
        if len(cells) != len(header):
            continue
        try:
            row = {k: float(v) for k, v in zip(header, cells)}
        except ValueError:
            continue
        if int(row.get("step", -1)) == step:
            found = row
    return found


class SweepChild:
    """One attempt of one array child (see the module docstring).

    Args:
        command: the user's script (argv).
        environ: the environment (default ``os.environ``).
        imds: an IMDSv2 client (default: from ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``).
        s3: a boto3 S3 client for an ``s3://`` manifest (default: one from the environment).

    Raises:
        SweepConfigError: from the constructor, before anything is written.
    """

    def __init__(self, command: list[str], *, environ: dict[str, str] | None = None, imds: ImdsClient | None = None,
                 s3: Any = None) -> None:
        env = dict(os.environ if environ is None else environ)
        if not command:
            raise SweepConfigError("no training command after --")
        self.command = shlex.split(command[0]) if len(command) == 1 else list(command)
        self.index = _env_int(env, contract.ENV_BATCH_ARRAY_INDEX, 0, 0)
        self.attempt = _env_int(env, contract.ENV_BATCH_JOB_ATTEMPT, 1, 1)
        self.job_id = env.get(contract.ENV_BATCH_JOB_ID, "local")
        self.sweep_id = env.get(contract.ENV_SWEEP_ID, "")
        if not self.sweep_id or "/" in self.sweep_id or self.sweep_id.startswith("."):
            raise SweepConfigError(f"${contract.ENV_SWEEP_ID}={self.sweep_id!r} must be a sweep id (no /), set by spot-train sweep submit")
        uri = env.get(contract.ENV_SWEEP_MANIFEST_URI, "")
        if not uri:
            raise SweepConfigError(f"${contract.ENV_SWEEP_MANIFEST_URI} is not set (spot-train sweep submit sets it)")
        if uri.startswith("s3://") and s3 is None:
            import boto3

            s3 = boto3.client("s3")
        self.s3 = s3
        # Where metrics.json and attempts.json are mirrored for spot-train sweep (S3 manifests only).
        self.mirror = (uri[len("s3://"):].partition("/")[0], uri[len("s3://"):].partition("/")[2].rpartition("/")[0]) \
            if uri.startswith("s3://") else None
        manifest = load_manifest(uri, s3=s3)
        if self.index >= len(manifest):
            raise SweepConfigError(f"${contract.ENV_BATCH_ARRAY_INDEX}={self.index}, but the manifest has {len(manifest)} parameter sets")
        self.params = manifest[self.index]
        try:
            self.poll_interval_s = contract.check("notice_poll_interval_s", env.get(POLL_ENV) or contract.default("notice_poll_interval_s"),
                                                  label=f"${POLL_ENV}")
        except contract.SettingError as error:
            raise SweepConfigError(str(error)) from None
        mount = env.get(contract.ENV_ROOT, "") + contract.SWEEP_MOUNT_POINT
        self.dir = Path(mount) / self.sweep_id / str(self.index)
        self.checkpoint_dir, self.log_dir = self.dir / contract.CHECKPOINTS_DIR, self.dir / contract.LOGS_DIR
        if self.attempt == 1 and committed_step(self.checkpoint_dir) is not None:
            raise SweepConfigError(f"{self.dir} already holds a committed checkpoint on attempt 1: it belongs to an earlier run; "
                                   "submit the sweep again under a new id instead of resuming into it")
        self.env = env
        self.imds = imds if imds is not None else ImdsClient(timeout_s=1.0, attempts=2)
        self.group: ProcessGroup | None = None
        self.metrics_step: int | None = None

    # ---- TrainerControl for InterruptionWatcher ----
    def terminate(self, *, timeout_s: float, reason: str) -> int | None:
        """SIGTERM the trainer's group and wait up to ``timeout_s`` seconds.

        Args:
            timeout_s: seconds to wait.
            reason: why (unused here; part of the TrainerControl protocol).

        Returns:
            its exit status, or None when it is still running or none was started.
        """
        if self.group is None or self.group.poll() is not None:
            return None if self.group is None else self.group.poll()
        self.group.stop(kill_after=None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.group.poll() is None:
            time.sleep(0.05)
        return self.group.poll()

    def request_checkpoint(self) -> bool:
        """SIGUSR1 to the trainer (docs/contracts.md: an extra checkpoint); False when none runs."""
        if self.group is None or self.group.poll() is not None:
            return False
        self.group.signal(signal.SIGUSR1)
        return True

    # ---- files ----
    def _mirror(self, name: str) -> None:
        """Copy ``<index dir>/name`` to ``s3://<bucket>/<sweep prefix>/<index>/name`` (best effort)."""
        if self.mirror is None:
            return
        bucket, prefix = self.mirror
        try:
            self.s3.put_object(Bucket=bucket, Key=f"{prefix}/{self.index}/{name}", Body=(self.dir / name).read_bytes())
        except Exception as error:  # noqa: BLE001 - EFS holds the truth; the mirror only feeds spot-train sweep
            log.warning("could not mirror %s to S3: %s", name, error)

    def _instance(self) -> dict[str, str]:
        try:
            return {"instance_id": self.imds.instance_id(), "instance_type": self.imds.instance_type(),
                    "availability_zone": self.imds.availability_zone()}
        except ImdsError as error:
            log.warning("instance metadata unavailable; the attempt is recorded without its instance", extra={"error": str(error)})
            return {"instance_id": "", "instance_type": "", "availability_zone": ""}

    def _record_attempt(self, **fields: Any) -> None:
        path = self.dir / contract.SWEEP_ATTEMPTS_FILE
        try:
            attempts = json.loads(path.read_text())["attempts"]
        except (OSError, ValueError, KeyError):
            attempts = []
        attempts = [a for a in attempts if a.get("attempt") != self.attempt] + [fields]
        contract.write_json_atomic(path, {"attempts": sorted(attempts, key=lambda a: a["attempt"])})
        self._mirror(contract.SWEEP_ATTEMPTS_FILE)

    def _update_metrics(self) -> None:
        step = committed_step(self.checkpoint_dir)
        if step is None or step == self.metrics_step:
            return
        row = metrics_at(self.log_dir / contract.TRAINING_LOG_FILE, step)
        total = self.params.get("steps")
        contract.write_json_atomic(self.dir / contract.SWEEP_METRICS_FILE, {
            "step": step, "total_steps": total if isinstance(total, int) else None,
            "loss": row.get("loss"), "accuracy": row.get("accuracy"), "attempt": self.attempt,
            "completed": (self.checkpoint_dir / contract.COMPLETED_FILE).exists(), "committed_at": time.time()})
        self.metrics_step = step
        self._mirror(contract.SWEEP_METRICS_FILE)

    # ---- the attempt ----
    def run(self) -> int:
        """Run the attempt; returns the exit status (see the module docstring)."""
        for directory in (self.checkpoint_dir, self.log_dir):
            directory.mkdir(parents=True, exist_ok=True)
        contract.write_json_atomic(self.dir / contract.SWEEP_PARAMS_FILE, {"index": self.index, "params": self.params})
        start_step = committed_step(self.checkpoint_dir) or 0
        attempt = {"attempt": self.attempt, "job_id": self.job_id, **self._instance(), "started_at": time.time(),
                   "start_step": start_step, "ended_at": None, "end_step": None, "exit_status": None}
        self._record_attempt(**attempt)
        env = {**self.env, contract.ENV_CHECKPOINT_DIR: str(self.checkpoint_dir), contract.ENV_LOG_DIR: str(self.log_dir),
               contract.ENV_CHECKPOINT_REQUEST_FILE: str(self.checkpoint_dir / contract.CHECKPOINT_REQUEST_FILE),
               "PYTHONUNBUFFERED": "1"}
        argv = trainer_argv(self.command, self.params)
        log.info("starting the trainer", extra={"index": self.index, "attempt": self.attempt, "resume_step": start_step, "argv": argv})
        watcher = InterruptionWatcher(imds_monitors(self.imds), self, poll_interval_s=self.poll_interval_s, margin_s=1.0)
        stop = {"signal": None}

        def on_term(signum: int, _frame: Any) -> None:  # Batch/ECS stopping the job: let the trainer checkpoint
            stop["signal"] = signum
            if self.group is not None:
                self.group.signal(signal.SIGTERM)

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            # The index's folder is the trainer's working directory: relative paths (a final model, as the
            # seed's /storage/<index>/model/) land beside its checkpoints, one folder per index.
            self.group = ProcessGroup.start(argv, cwd=self.dir, env=env,
                                            log_path=self.log_dir / f"trainer-attempt-{self.attempt}.log")
            while self.group.poll() is None:
                watcher.tick()
                self._update_metrics()
                time.sleep(0.1)
            status = self.group.poll()
            self._update_metrics()
            completed = (self.checkpoint_dir / contract.COMPLETED_FILE).exists()
            if watcher.interrupted is not None and not completed:
                status = self._wait_for_reclaim(watcher.interrupted.deadline)
            elif stop["signal"] is not None and not completed:
                status = 128 + stop["signal"]
            elif status == 0 and not completed:
                log.error("the trainer exited 0 without writing COMPLETED; failing the attempt")
                status = 1
        finally:
            signal.signal(signal.SIGTERM, previous)
        self._record_attempt(**{**attempt, "ended_at": time.time(), "end_step": committed_step(self.checkpoint_dir),
                                "exit_status": status})
        return int(status if status is not None else 1)

    def _wait_for_reclaim(self, deadline: Any) -> int:
        """The trainer stopped for a notice: wait for the host to go (it takes this process with it)."""
        until = (deadline.timestamp() if deadline is not None else time.time()) + RECLAIM_GRACE_S
        log.warning("checkpoint committed after the spot notice; waiting for the host to be reclaimed",
                    extra={"step": committed_step(self.checkpoint_dir), "until": until})
        while time.time() < until:
            time.sleep(0.2)
        log.warning("the host was not reclaimed by the notice deadline; exiting for a retry",
                    extra={"exit_status": contract.EXIT_SWEEP_RECLAIM_NOT_TAKEN})
        return contract.EXIT_SWEEP_RECLAIM_NOT_TAKEN


def main(argv: list[str] | None = None) -> int:
    """``python -m spot_training.agent.sweep_child -- COMMAND...``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m spot_training.agent.sweep_child", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s sweep-child %(levelname)s %(message)s")
    try:
        child = SweepChild(command)
    except SweepConfigError as error:
        log.error("%s", error)
        return contract.EXIT_CONFIG
    return child.run()


if __name__ == "__main__":
    raise SystemExit(main())
