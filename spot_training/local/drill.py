"""The drill: the whole user story of docs/architecture.md on one machine, measured, with a report.

moto server up -> ``cdk bootstrap`` -> ``cdk deploy SpotTraining`` (the real CLI; its digits dataset
goes to the local S3 as a CDK asset, the data volume is created empty) -> the node runner starts the fleet's instance as a local node -> the
injector interrupts it ``interruptions`` times (at least ``az_moves`` of them send the replacement to
another Availability Zone, so the volume moves through a snapshot) -> training completes -> the agent
cancels the fleet -> ``cdk destroy`` -> boto3 checks that no instance, volume, snapshot, fleet or stack
remains. An uninterrupted baseline run of the same trainer (same command, same seed) runs beside it;
the final weights of both must be bitwise equal.

:func:`run_drill` returns the report (and writes ``report.json``, ``training.png`` and
``training_log.csv`` into ``work_dir``). Report fields (times in seconds):

``completed``, ``steps_total`` (the trainer's last step), ``steps_executed`` (step rows the trainers
logged, over all runs), ``lost_steps`` (executed minus total: steps done twice), ``interruptions``
(count), ``az_moves`` (count), ``interruption_events`` (per interruption: ``notice_to_checkpoint_s``,
``boot_to_resume_s``, AZs, instance and volume ids, steps), ``test_accuracy`` (held-out digits, as the
trainer reports it), ``baseline_test_accuracy``, ``matches_uninterrupted_baseline``,
``orphans_after_destroy`` (a list), ``wall_s``, ``phases_s`` (spot_training/agent/deploy/training/destroy),
read back from the local AWS before destroy through ``spot-train status``/``cost``'s code
(:func:`read_back`): ``aws_status``, ``aws_interruptions``, ``cost``, ``savings_pct``; ``prices``: where
the spot and on-demand prices come from (:func:`price_source`: the dated table the moto server's spot
price history is seeded from, spot_training/local/spot_prices.json); and
``passed`` (completed, no lost step, matches the baseline, nothing orphaned, enough interruptions and moves).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from spot_training import contract
from spot_training.local.deploy import CdkCli, clients, destroy_and_check, local_context, stack_resources
from spot_training.local.injector import LOG_NAME, Interruption, InterruptionInjector, read_training_log
from spot_training.local.moto_server import MotoServer
from spot_training.local.nodes import NodeRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
FINAL_WEIGHTS = "final_weights.npz"


@dataclasses.dataclass(frozen=True)
class DrillFramework:
    """What the drill runs and compares for one framework (``spot-train local drill --framework``).

    The trainer is the stack's default for the framework (``spot_training.infra.config.FRAMEWORKS``, the command
    ``-c framework=<name>`` deploys); this table adds only what is local.

    Attributes:
        python: the local interpreter of the trainer on the nodes and of the baseline, relative to
            the repository root; None: the drill's own interpreter (``.venv``, which holds
            TensorFlow and MXNet; the two never share a process). PyTorch has its own environment,
            ``.venv-torch`` (``make setup`` makes it).
        final_weights_option: the example's option that writes its final state to an ``.npz``
            (compared bitwise with :func:`weights_match`).
        compared: what that file holds, in words (for the docs and the report).
    """

    python: str | None
    final_weights_option: str
    compared: str


#: The frameworks the single-node drill runs, with what it compares (default: tensorflow, ``make demo``).
DRILL_FRAMEWORKS: dict[str, DrillFramework] = {
    "tensorflow": DrillFramework(None, "--save-final-weights", "Keras weights and optimizer variables"),
    "mxnet": DrillFramework(None, "--save-final-params", "Gluon parameters"),
    "pytorch": DrillFramework(".venv-torch/bin/python", "--save-final-weights",
                              "the model's state dict (BatchNorm buffers included) and AdamW's state"),
}
# MOUNT_POINT: the stack's default mount point (the contract's); the trainer command's paths are under it.
from spot_training.contract import DEFAULT_MOUNT_POINT as MOUNT_POINT  # noqa: E402
#: Digits training examples and the trainer's default batch (for planning the interruption steps).
DIGITS_TRAIN_EXAMPLES = 1437
_ACCURACY = re.compile(r"done: (\d+) steps, test accuracy ([0-9.]+)")


@dataclasses.dataclass
class DrillOptions:
    """What the drill does. Defaults are ``make demo``'s.

    Attributes:
        work_dir: everything goes here (default ``out/demo``); emptied first.
        stack: stack name (default ``SpotTraining``).
        interruptions: spot interruptions to inject (default 3; >= 0).
        az_moves: how many of them send the replacement to another AZ (default 1; <= interruptions).
        random_az: pick each replacement's AZ at random (seeded) instead of the planned moves; the
            report counts the moves that happened.
        epochs: trainer epochs over the digits (default 30: 1,320 steps of 32 examples).
        batch_size: trainer batch size (default 32).
        seed: trainer seed, and the random AZ seed (default 0).
        save_every_steps: trainer checkpoint cadence in steps (default: the contract's, 50).
        baseline: run the uninterrupted baseline and compare weights (default True).
        timeout_s: the longest the training phase may take (default 900 s).
        framework: ``tensorflow`` (default), ``mxnet`` or ``pytorch``: deployed with
            ``-c framework=...``; the nodes and the baseline run the framework's example with its
            local interpreter (:data:`DRILL_FRAMEWORKS`).
        instance_types: the fleet's instance types (default g5.xlarge, g4dn.xlarge: types the local
            AWS's spot price history prices from its dated table, spot_training/local/spot_prices.json).
        on_demand_prices: the stated on-demand price in USD/hour of each type, an input of the cost
            report (local mode cannot ask the AWS Price List API; default: the same table's us-east-1
            Linux on-demand prices, g5.xlarge 1.006 and g4dn.xlarge 0.526).
        ebs_gb_month_price: stated USD per GB-month of the data volume (default 0.08: gp3's
            us-east-1 list price).
        snapshot_gb_month_price: stated USD per GB-month of snapshots (default 0.05: the us-east-1
            list price).
        training_command: your own trainer command instead of the framework's example (shell-style; a
            leading ``python`` is the node's training interpreter). Deployed with ``-c training_command``
            and ``-c code_dir``: the nodes get ``code_dir`` as the stack's code asset, as a real deploy
            ships it (docs/localmode.md, "Your own script"). Needs ``baseline`` false. What the drill
            checks for it: :data:`USER_COMMAND_CHECKS`.
        code_dir: the directory holding your script (default: the current directory).
        dataset_uri: ``s3://bucket/prefix/`` in the local S3 to train from, as ``-c dataset_uri=...``
            deploys it (default None: the stack's digits asset). The drill first uploads
            ``dataset_dir`` there, one object per file, as a user would with ``aws s3 sync DIR URI``
            (creating the bucket if missing); the data volume starts empty and the agent brings the
            prefix onto it (spot_training/agent/dataset.py).
        dataset_dir: the user's files for ``dataset_uri`` (default: the digits, written by the
            examples' ``prepare_digits`` into ``<work_dir>/user-data``); the trainer reads them under
            ``datasets/`` as it reads the digits, and so does the baseline.
    """

    work_dir: Path = Path("out/demo")
    stack: str = "SpotTraining"
    interruptions: int = 3
    az_moves: int = 1
    random_az: bool = False
    epochs: int = 30
    batch_size: int = 32
    seed: int = 0
    save_every_steps: int = contract.default("checkpoint_every_steps")
    baseline: bool = True
    timeout_s: float = 900.0
    framework: str = "tensorflow"
    instance_types: tuple[str, ...] = ("g5.xlarge", "g4dn.xlarge")
    on_demand_prices: dict[str, float] = dataclasses.field(
        default_factory=lambda: table_on_demand_prices(("g5.xlarge", "g4dn.xlarge")))
    ebs_gb_month_price: float = 0.08
    snapshot_gb_month_price: float = 0.05
    training_command: str | None = None
    code_dir: Path | None = None
    dataset_uri: str | None = None
    dataset_dir: Path | None = None

    @property
    def user_command(self) -> list[str] | None:
        """The user's own trainer command (``training_command``) as the node config's list, a leading
        ``python``/``python3`` made ``{python}`` (the node's training interpreter); None: the example."""
        if self.training_command is None:
            return None
        argv = shlex.split(self.training_command)
        if argv and argv[0] in ("python", "python3"):
            argv[0] = "{python}"
        return argv

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad option, its value and what is allowed."""
        if self.training_command is not None:
            try:
                argv = self.user_command
            except ValueError as error:  # shlex: an unclosed quote
                raise ValueError(f"training_command: {self.training_command!r} is no shell-style command ({error})") from None
            if not argv:
                raise ValueError(f"training_command must be a command such as 'python my_train.py', got {self.training_command!r}")
            code_dir = Path(self.code_dir if self.code_dir is not None else ".").expanduser()
            if not code_dir.is_dir():
                raise ValueError(f"code_dir: {str(code_dir)!r} is not a directory; expected the directory holding your script")
            if (code_dir / "spot_training" / "__init__.py").exists():
                raise ValueError(f"code_dir: {str(code_dir.resolve())!r} is this library's checkout; give the directory "
                                 "of your own script (the nodes bring spot_training themselves)")
            if self.baseline:
                raise ValueError("baseline: a comparison with an uninterrupted run needs the example's final weights; "
                                 "with training_command the drill runs without it (no_baseline)")
        elif self.code_dir is not None:
            raise ValueError(f"code_dir ({str(self.code_dir)!r}) is used only with training_command")
        for name in ("interruptions", "az_moves"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("epochs", "batch_size", "save_every_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.az_moves > self.interruptions and not self.random_az:
            raise ValueError(f"az_moves must be <= interruptions ({self.interruptions}), got {self.az_moves}")
        contract.check_seconds("timeout_s", self.timeout_s)
        check_on_demand_prices(self.instance_types, self.on_demand_prices)
        check_stack_and_framework(self.stack, self.framework, DRILL_FRAMEWORKS)
        if self.dataset_uri is not None:
            dataset_prefix(self.dataset_uri)
        if self.dataset_dir is not None:
            if self.dataset_uri is None:
                raise ValueError(f"dataset_dir {str(self.dataset_dir)!r} needs a dataset_uri (s3://bucket/prefix/) to upload it to")
            if not Path(self.dataset_dir).is_dir() or not any(p.is_file() for p in Path(self.dataset_dir).rglob("*")):
                raise ValueError(f"dataset_dir must be a directory holding the dataset's files, got {str(self.dataset_dir)!r}")

    @property
    def trainer_python(self) -> str:
        """The local interpreter of the trainer (nodes and baseline), an absolute path."""
        return framework_python(self.framework)

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch of the digits training split at ``batch_size``."""
        return DIGITS_TRAIN_EXAMPLES // self.batch_size

    @property
    def planned_steps(self) -> int:
        """The whole training's steps: ``steps_per_epoch * epochs``."""
        return self.steps_per_epoch * self.epochs

    def trainer_args(self, root: str = MOUNT_POINT) -> list[str]:
        """The trainer's arguments (paths under ``root``): the framework's default command of the
        stack (``spot_training.infra.config.FRAMEWORKS``) without ``{python}``, then the drill's options."""
        from spot_training.infra.config import FRAMEWORKS

        script = list(FRAMEWORKS[self.framework].training_command[1:])
        return [*script, "--epochs", str(self.epochs), "--batch-size", str(self.batch_size), "--seed", str(self.seed),
                "--save-every-steps", str(self.save_every_steps),
                DRILL_FRAMEWORKS[self.framework].final_weights_option, f"{root}/{FINAL_WEIGHTS}"]


#: What the drill checks of a user's own command (``training_command``; the report's ``checks``): the
#: example's step log and bitwise comparison need the example's outputs, so a foreign script is held to
#: the contract only (docs/contracts.md, "Trainer contract").
USER_COMMAND_CHECKS = (
    "the code reached the nodes as the stack's code asset (boot steps fetch-code, unpack-code)",
    "each interruption: a checkpoint (LATEST) committed after the notice, the agent exited 0, and the "
    "replacement committed a newer checkpoint (or COMPLETED) after its boot",
    "the trainer ended with the contract's completion: exit 0 and COMPLETED in the checkpoint directory",
    "nothing is left after cdk destroy",
)


#: ``s3://bucket/prefix/``: a bucket name as S3 allows it, then a prefix ending in ``/`` (or none).
_DATASET_PREFIX_URI = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/((?:[^\s*?]+/)?)")


def dataset_prefix(uri: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of a drill's ``dataset_uri``.

    Raises:
        ValueError: ``uri`` is not ``s3://bucket/prefix/`` (a prefix ending in ``/``; the drill
            uploads a directory, so one object ``s3://bucket/key`` is not what it can make), or
            has a ``..`` part.
    """
    match = _DATASET_PREFIX_URI.fullmatch(uri) if isinstance(uri, str) else None
    if match is None or ".." in match.group(2).split("/"):
        raise ValueError(f"dataset_uri must be s3://bucket/prefix/ (a prefix ending in /, where the drill uploads "
                         f"the dataset's files), got {uri!r}")
    return match.group(1), match.group(2)


def upload_dataset(s3: Any, uri: str, source: Path) -> dict[str, Any]:
    """Put every file under ``source`` to ``uri`` (``s3://bucket/prefix/``) as ``aws s3 sync source uri``
    does for a fresh prefix: key = prefix + the file's path relative to ``source`` (``/``-separated),
    creating the bucket when it does not exist. Boto3's ``upload_file`` (managed transfer) sends each one.

    Args:
        s3: a boto3 S3 client of the local AWS.
        uri: ``s3://bucket/prefix/``.
        source: the directory whose files are uploaded.

    Returns:
        ``{"uri", "objects" (count), "bytes" (total), "keys" (sorted)}``.

    Raises:
        ValueError: a bad ``uri`` (:func:`dataset_prefix`) or no file under ``source``.
        botocore.exceptions.ClientError: S3 refused a call.
    """
    bucket, prefix = dataset_prefix(uri)
    files = sorted(p for p in Path(source).rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"no file under {str(source)!r} to upload to {uri}")
    try:
        s3.head_bucket(Bucket=bucket)
    except Exception:  # noqa: BLE001 - missing (404) here; create_bucket says what else is wrong
        s3.create_bucket(Bucket=bucket)
    keys = []
    for path in files:
        key = prefix + path.relative_to(source).as_posix()
        s3.upload_file(str(path), bucket, key)
        keys.append(key)
    return {"uri": uri, "objects": len(keys), "bytes": sum(p.stat().st_size for p in files), "keys": keys}


def dataset_syncs(log_paths: Collection[Path]) -> list[dict[str, Any]]:
    """What each node's agent said about the dataset (its ``dataset ready`` log line) in time order:
    ``{"time", "log", "status" ("synced": brought from S3 onto the volume; "present": the volume
    already held it, verified when it was written), "objects", "downloaded_bytes"}``."""
    syncs = []
    for path in log_paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if '"dataset ready"' not in line:
                continue
            try:
                entry = json.loads(line)
                result = entry["dataset"]
                syncs.append({"time": entry.get("time", ""), "log": str(path), "status": result.get("status"),
                              "objects": result.get("objects"), "downloaded_bytes": result.get("downloaded_bytes")})
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return sorted(syncs, key=lambda sync: sync["time"])


def table_on_demand_prices(instance_types: Collection[str]) -> dict[str, float]:
    """The on-demand USD/hour of ``instance_types`` from local mode's price table
    (:data:`spot_training.local.spot_prices.TABLE_PATH`, the table the moto server's spot price history
    comes from); a type the table lacks is left out (:meth:`DrillOptions.validate` then names it)."""
    from spot_training.local.spot_prices import load_table

    table = load_table()
    return {t: table.on_demand[t] for t in instance_types if t in table.on_demand}


def check_on_demand_prices(instance_types: Collection[str], on_demand_prices: Any) -> None:
    """Check a drill's stated on-demand prices, an input of its cost report.

    Args:
        instance_types: the instance types that run (at least one).
        on_demand_prices: USD/hour per instance type.

    Raises:
        ValueError: no instance type, or a type without a positive USD/hour number (a bool is none),
            naming the types and the prices given.
    """
    prices = on_demand_prices if isinstance(on_demand_prices, dict) else {}
    missing = [t for t in instance_types if isinstance(prices.get(t), bool)
               or not isinstance(prices.get(t), (int, float)) or not prices[t] > 0]
    if not instance_types or missing:
        raise ValueError(f"on_demand_prices must give a positive USD/hour for every instance type "
                         f"{list(instance_types)}, got {on_demand_prices!r}")


def price_source(on_demand_prices: dict[str, float], instance_types: Collection[str]) -> dict[str, Any]:
    """Where a drill's prices come from, for its report's ``prices``.

    Args:
        on_demand_prices: the drill's stated on-demand USD/hour per instance type.
        instance_types: the fleet's instance types.

    Returns:
        the table's ``as_of``, ``source``, ``path``, ``region`` and ``instance_types``
        (:meth:`spot_training.local.spot_prices.PriceTable.describe`), ``spot_from_table`` (every fleet
        type is in the table) and ``on_demand_from_table`` (every stated on-demand price is the table's).
    """
    from spot_training.local.spot_prices import load_table

    table = load_table()
    return {**table.describe(),
            "spot_from_table": all(t in table.spot for t in instance_types),
            "on_demand_from_table": all(table.on_demand.get(t) == on_demand_prices.get(t) for t in instance_types)}


def framework_python(framework: str) -> str:
    """The local interpreter of ``framework``'s processes (a :data:`DRILL_FRAMEWORKS` key), an
    absolute path: ``.venv-torch``'s for PyTorch, this one for the others. Used by both drills."""
    relative = DRILL_FRAMEWORKS[framework].python
    return str(REPO_ROOT / relative) if relative is not None else sys.executable


def check_stack_and_framework(stack: str, framework: str, frameworks: Collection[str]) -> None:
    """A drill's options check, shared by both drills.

    Args:
        stack: the stack name.
        framework: the training framework.
        frameworks: the frameworks this drill supports.

    Raises:
        ValueError: ``stack`` is not a CloudFormation stack name, ``framework`` is not one of
            ``frameworks``, or :func:`framework_python` is not an executable file (``make setup`` makes
            ``.venv-torch``).
    """
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,127}", stack):
        raise ValueError(f"stack must be a CloudFormation stack name (letters, digits, -), got {stack!r}")
    if framework not in frameworks:
        raise ValueError(f"framework must be one of {', '.join(frameworks)}, got {framework!r}")
    python = framework_python(framework)
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"framework {framework!r} trains with {python}, which does not exist; `make setup` makes it")


class DrillError(RuntimeError):
    """The drill could not run to its end (the message says where; the report is still written)."""


# ---- pieces both drills use (this module and spot_training.local.cluster_drill) ----------------------------
class EventLog:
    """A drill's event stream, called as ``record(event)``.

    Stamps each event dict with ``t`` (seconds since ``started``, a ``time.time()`` value), keeps
    every event but ``progress`` in :attr:`events` (for ``events.jsonl``) and passes each one on to
    ``on_event`` (default: nowhere).

    Args:
        started: the drill's start, ``time.time()`` seconds.
        on_event: called with every stamped event (default: nowhere).
    """

    def __init__(self, started: float, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.started = started
        self.events: list[dict[str, Any]] = []
        self._emit = on_event or (lambda event: None)

    def __call__(self, event: dict[str, Any]) -> None:
        event = {"t": round(time.time() - self.started, 3), **event}
        if event["event"] != "progress":
            self.events.append(event)
        self._emit(event)

    def write(self, path: Path) -> None:
        """Write the kept events to ``path``, one JSON object a line."""
        path.write_text("".join(json.dumps(e) + "\n" for e in self.events))


def fresh_work_dir(work_dir: Path) -> Path:
    """``work_dir`` resolved, emptied (removed if it exists) and made again with a ``results/`` in it."""
    work_dir = Path(work_dir).resolve()
    if work_dir.exists():
        shutil.rmtree(work_dir)
    (work_dir / "results").mkdir(parents=True)
    return work_dir


def options_dict(options: Any) -> dict[str, Any]:
    """A drill's options dataclass as the report's ``options`` (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(options).items()}


def bootstrap_and_deploy(cdk: CdkCli, stack: str, context: dict[str, str], *,
                         record: Callable[[dict[str, Any]], None], phases: dict[str, float]) -> None:
    """``cdk bootstrap`` then ``cdk deploy stack`` with the real CLI against moto.

    Each is announced as a ``phase`` event and its duration stored in ``phases``.

    Args:
        cdk: the CLI wrapper.
        stack: the stack name.
        context: the deploy's context values.
        record: the drill's event log.
        phases: gets ``"bootstrap"`` and ``"deploy"`` durations, seconds.

    Raises:
        spot_training.local.deploy.CdkCliError: a command failed.
    """
    for phase, action in (("bootstrap", cdk.bootstrap), ("deploy", lambda: cdk.deploy(stack, context=context))):
        record({"event": "phase", "phase": phase, "message": f"cdk {phase} (real CLI against moto)"})
        t = time.time()
        action()
        phases[phase] = round(time.time() - t, 3)


def az_plan(options: DrillOptions, zones: list[str], first_zone: str) -> list[str]:
    """The target AZ of each interruption's replacement.

    Planned: ``az_moves`` moves spread over the interruptions (the first move at the middle one), the
    others stay in the current AZ. ``random_az``: each AZ drawn with ``random.Random(seed)``.

    Args:
        options: the drill's options (``interruptions``, ``az_moves``, ``random_az``, ``seed``).
        zones: the stack's AZs.
        first_zone: the AZ of the first node.

    Returns:
        one AZ per interruption.
    """
    if options.random_az:
        rng = random.Random(options.seed)
        return [rng.choice(zones) for _ in range(options.interruptions)]
    n, moves = options.interruptions, options.az_moves
    move_at = set()
    if moves:
        start = n // 2 if moves == 1 else 0
        move_at = {min(n - 1, start + round(i * n / moves)) for i in range(moves)} if moves < n else set(range(n))
        while len(move_at) < moves:
            move_at.add(min(set(range(n)) - move_at))
    plan, current = [], first_zone
    for i in range(n):
        if i in move_at:
            current = next(z for z in zones if z != current)
        plan.append(current)
    return plan


def _trigger_steps(options: DrillOptions) -> list[int]:
    n = options.interruptions
    # (i + 1) / (n + 2): the last notice still leaves 2/(n + 2) of the steps, so a notice that the
    # agent sees one polling round late still finds training running.
    return [round(options.planned_steps * (i + 1) / (n + 2)) for i in range(n)]


def _start_baseline(options: DrillOptions, work_dir: Path, dataset: Path | None = None) -> subprocess.Popen[bytes]:
    """The same trainer, same arguments and seed, uninterrupted, in ``<work_dir>/baseline``, on a copy
    of ``dataset`` (the files uploaded to ``dataset_uri``) or, without one, the digits."""
    from spot_training.training.examples.prepare_data import prepare_digits

    root = work_dir / "baseline"
    if dataset is not None:
        shutil.copytree(dataset, root / "datasets")
    else:
        prepare_digits(root / "datasets")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SPOT_TRAINING_"))}
    env.update({contract.ENV_DATA_DIR: str(root / "datasets"), contract.ENV_CHECKPOINT_DIR: str(root / "checkpoints"),
                contract.ENV_LOG_DIR: str(root / "logs"), "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(root / "home")})
    (root / "home").mkdir()
    with open(root / "trainer.log", "ab") as log:
        return subprocess.Popen([options.trainer_python, *options.trainer_args(str(root))], cwd=REPO_ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def weights_match(a: Path, b: Path) -> bool:
    """Whether two ``--save-final-weights`` files hold the same keys with bitwise-equal arrays.

    Args:
        a: one ``.npz`` file.
        b: the other.

    Returns:
        True when keys, dtypes and values are equal.
    """
    import numpy as np

    with np.load(a) as left, np.load(b) as right:
        if sorted(left.files) != sorted(right.files):
            return False
        return all(left[k].dtype == right[k].dtype and np.array_equal(left[k], right[k]) for k in left.files)


def _accuracy(log_path: Path) -> float | None:
    if not log_path.exists():
        return None
    found = _ACCURACY.findall(log_path.read_text(errors="replace"))
    return float(found[-1][1]) if found else None


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=10)


def run_drill(options: DrillOptions, *, on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the drill (see the module docstring); returns the report, also written to ``report.json``.

    Args:
        options: the drill's options.
        on_event: gets every event as a dict with an ``event`` key (``phase``, ``progress`` with
            ``step``/``total``/``loss``, ``notice-posted``, ``checkpointed``, ``resumed`` ...), or None.

    Returns:
        the report (``passed``, the figures, ``error`` when a step failed).

    Raises:
        ValueError: bad options (nothing started). A later failure is recorded in the report's ``error``
            and ``passed`` is false.
    """
    options.validate()
    started = time.time()
    work_dir = fresh_work_dir(options.work_dir)
    record = EventLog(started, on_event)
    report: dict[str, Any] = {
        "stack": options.stack, "framework": options.framework, "work_dir": str(work_dir), "completed": False, "steps_total": 0,
        "steps_executed": 0, "lost_steps": None, "interruptions": 0, "az_moves": 0, "interruption_events": [],
        "test_accuracy": None, "baseline_test_accuracy": None, "matches_uninterrupted_baseline": False,
        "orphans_after_destroy": None, "wall_s": 0.0, "phases_s": {}, "options": options_dict(options),
        "error": None, "aws_status": None, "aws_interruptions": [], "cost": None, "savings_pct": None,
        "prices": price_source(options.on_demand_prices, options.instance_types),
    }
    phases = report["phases_s"]
    user_data = None
    if options.dataset_uri is not None:
        user_data = Path(options.dataset_dir).resolve() if options.dataset_dir is not None else work_dir / "user-data"
        if options.dataset_dir is None:
            from spot_training.training.examples.prepare_data import prepare_digits

            prepare_digits(user_data)
    baseline = _start_baseline(options, work_dir, user_data) if options.baseline else None
    server = MotoServer(work_dir / "moto")
    runner: NodeRunner | None = None
    cdk: CdkCli | None = None
    foreign = options.training_command is not None
    extra = {"training_python": options.trainer_python, "instance_types": ",".join(options.instance_types),
             "monitoring_interval_s": "1"}
    if options.dataset_uri is not None:
        extra["dataset_uri"] = options.dataset_uri  # as -c dataset_uri=s3://bucket/prefix/ deploys it
    if foreign:
        extra.update(user_code_context(Path(options.code_dir if options.code_dir is not None else "."), work_dir))
        report.update({"training_command": options.training_command, "code_dir": extra["code_dir"],
                       "checks": list(USER_COMMAND_CHECKS)})
    context = local_context(training_command=options.user_command or ["{python}", *options.trainer_args()],
                            framework=options.framework, extra=extra)
    interruptions: list[Interruption] = []
    try:
        record({"event": "phase", "phase": "moto", "message": "starting the moto server on 127.0.0.1"})
        server.start()
        aws = clients(server.endpoint_url)
        if options.dataset_uri is not None and user_data is not None:
            report["dataset"] = upload_dataset(aws.s3, options.dataset_uri, user_data)
            record({"event": "phase", "phase": "upload", "message": f"{user_data} -> {options.dataset_uri} "
                    f"({report['dataset']['objects']} objects, {report['dataset']['bytes']} bytes), as aws s3 sync would"})
        cdk = CdkCli(server.endpoint_url, work_dir=work_dir)
        bootstrap_and_deploy(cdk, options.stack, context, record=record, phases=phases)
        stack = stack_resources(aws, options.stack)
        report["fleet_request_id"] = stack.fleet_request_id
        record({"event": "deployed", "fleet_request_id": stack.fleet_request_id,
                "data_volume_id": stack.data_volume_id, "availability_zones": sorted(stack.subnets)})

        runner = NodeRunner(aws=aws, endpoint_url=server.endpoint_url, volumes_dir=server.volumes_dir, stack=stack,
                            work_dir=work_dir, on_event=record)
        # The data volume starts empty: the agent formats it and brings the dataset from the local S3
        # (the stack's digits asset, or -c dataset_uri=...), the product's own path.
        record({"event": "phase", "phase": "data", "message": f"{stack.data_volume_id} starts empty; the agent brings "
                f"the dataset from S3 ({(runner.deployed_config().get('dataset') or {}).get('uri', 'none')})"})

        t = time.time()
        record({"event": "phase", "phase": "training", "message": "fleet instance -> local node"})
        nodes = runner.sync()
        if len(nodes) != 1:
            raise DrillError(f"expected the fleet to run 1 instance, found {len(nodes)}")
        node = nodes[0]
        zones = sorted(stack.subnets)
        plan = az_plan(options, zones, node.availability_zone)
        injector = InterruptionInjector(runner, stack_name=options.stack, on_event=record)
        deadline = t + options.timeout_s
        last_step = [0]

        def tick() -> None:
            rows = (read_training_log(runner.nodes[current[0]].log_dir / LOG_NAME)
                    if current[0] in runner.nodes and not foreign else [])
            if rows and rows[-1]["step"] != last_step[0]:
                last_step[0] = int(rows[-1]["step"])
                record({"event": "progress", "step": last_step[0], "total": options.planned_steps,
                        "loss": rows[-1]["loss"], "accuracy": rows[-1]["accuracy"]})
            if time.time() > deadline:
                raise DrillError(f"training did not finish within timeout_s={options.timeout_s} s")

        current = [node.instance_id]
        for index, (trigger, target_az) in enumerate(zip(_trigger_steps(options), plan)):
            resumed_from = interruptions[-1].resumed_at_step if interruptions else 0
            while foreign and not _has_checkpoint(node, at_least=resumed_from):
                # A foreign script logs no steps the drill reads: it is interrupted once it has checkpointed.
                if not node.alive:
                    raise DrillError(f"node {node.instance_id} ended (agent exit {node.process.returncode}) before the "
                                     f"trainer committed a checkpoint for interruption {index + 1}; a script without "
                                     "the checkpoint API (spot_training.training) runs with --interruptions 0, a short "
                                     f"one with fewer interruptions; see {node.log_path}")
                tick()
                time.sleep(0.2)
            while not foreign and last_step[0] < max(trigger, resumed_from + 10):
                if not node.alive:
                    raise DrillError(f"node {node.instance_id} exited {node.process.returncode} before interruption "
                                     f"{index + 1}; see {node.log_path}")
                tick()
                time.sleep(0.2)
            interruption, node = injector.interrupt(node, index=index + 1, target_az=target_az, tick=tick)
            current[0] = node.instance_id
            interruptions.append(interruption)
            report["interruption_events"] = [i.to_dict() for i in interruptions]
        while node.alive:
            tick()
            time.sleep(0.2)
        phases["training"] = round(time.time() - t, 3)
        if node.process.returncode != 0:
            raise DrillError(f"the last node's agent exited {node.process.returncode}; see {node.log_path}")
        _collect(node, work_dir / "results")
        if "dataset" in report:
            report["dataset"]["syncs"] = dataset_syncs(list((work_dir / "nodes").glob("*/agent.log")))
        completed_file = work_dir / "results" / contract.COMPLETED_FILE
        report["completed"] = completed_file.exists()
        if report["completed"]:
            report["steps_total"] = int(json.loads(completed_file.read_text())["step"])
        if foreign:  # no step log to count: the contract's completion is what is checked
            report["steps_executed"] = report["lost_steps"] = None
            report["agent_exit_status"] = node.process.returncode
        else:
            rows = read_training_log(work_dir / "results" / LOG_NAME)
            report["steps_executed"] = len(rows)
            report["lost_steps"] = len(rows) - report["steps_total"]
            report["test_accuracy"] = _accuracy(node.log_path)
        record({"event": "completed", "step": report["steps_total"], "test_accuracy": report["test_accuracy"]})
        runner.reconcile()
        add_read_back(report, server.endpoint_url, options, record)
    except Exception as error:  # noqa: BLE001 - recorded in the report; teardown still runs below
        report["error"] = f"{type(error).__name__}: {error}"
        record({"event": "error", "message": report["error"]})
    except BaseException:  # Ctrl-C / SIGTERM: tear down, stop the baseline too, then re-raise
        report["error"] = "interrupted by the user"
        _stop(baseline)
        raise
    finally:
        report["interruptions"] = len(interruptions)
        report["az_moves"] = sum(1 for i in interruptions if i.volume_moved)
        report["interruption_events"] = [i.to_dict() for i in interruptions]
        _teardown(report, options, server, runner, cdk, context, record)
        if baseline is not None:
            _finish_baseline(report, baseline, work_dir, record)
        report["wall_s"] = round(time.time() - started, 3)
        report["passed"] = passed(report, options)
        record.write(work_dir / "events.jsonl")
        (work_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        try:
            if foreign:
                raise FileNotFoundError("a foreign script writes no training_log.csv to plot")
            from spot_training.local.plot import plot_training

            plot_training(work_dir / "results" / LOG_NAME, report, work_dir / "training.png")
        except Exception as error:  # noqa: BLE001 - the report stands without the plot; say why
            report["plot_error"] = f"{type(error).__name__}: {error}"
            (work_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def user_code_context(code_dir: Path, work_dir: Path) -> dict[str, str]:
    """The context that ships ``code_dir`` as the stack's code asset (``-c code_dir``, absolute: the
    CDK app runs in the repository) with the default exclusions plus ``work_dir`` when it lies inside
    it (the drill writes there while ``cdk deploy`` packs the directory).

    Args:
        code_dir: the user's code directory.
        work_dir: the drill's work directory.

    Returns:
        ``{"code_dir": <absolute path>, "code_exclude": <JSON list of patterns>}``.
    """
    from spot_training.infra.asset import DEFAULT_CODE_EXCLUDE

    code_dir = code_dir.expanduser().resolve()
    exclude = list(DEFAULT_CODE_EXCLUDE)
    try:
        exclude.append("/" + Path(work_dir).resolve().relative_to(code_dir).as_posix())
    except ValueError:
        pass  # the work directory is elsewhere
    return {"code_dir": str(code_dir), "code_exclude": json.dumps(exclude)}


def _has_checkpoint(node: Any, *, at_least: int) -> bool:
    """Whether ``node``'s trainer has committed a checkpoint (``LATEST``) of step >= ``at_least``."""
    from spot_training.local.injector import latest_checkpoint

    latest = latest_checkpoint(node.checkpoint_dir)
    return latest is not None and latest[0] >= at_least


def add_read_back(report: dict[str, Any], endpoint_url: str, options: Any,
                  record: Callable[[dict[str, Any]], None]) -> None:
    """Put :func:`read_back`'s figures into ``report`` and announce them (a ``read-back`` event); on a
    failure the drill's own figures stand and ``report["read_back_error"]`` says what failed.

    Args:
        report: the drill's report (updated).
        endpoint_url: the moto server.
        options: the drill's options (stack, prices).
        record: the drill's event log.
    """
    try:
        report.update(read_back(endpoint_url, options))
        record({"event": "read-back", "savings_pct": report["savings_pct"],
                "interruptions": len(report["aws_interruptions"]),
                "prices_as_of": (report.get("prices") or {}).get("as_of")})
    except Exception as error:  # noqa: BLE001 - the drill's own figures stand; say what failed
        report["read_back_error"] = f"{type(error).__name__}: {error}"
        record({"event": "error", "message": f"reading back from the local AWS failed: {report['read_back_error']}"})


def read_back(endpoint_url: str, options: Any) -> dict[str, Any]:
    """What ``spot-train status`` and ``spot-train cost`` read from the local AWS for the drill's stack
    (spot_training.ops.operations, the code that reads a deployed stack): the report's ``aws_status``
    (training figures, instances), ``aws_interruptions`` (the history from the agents' published
    logs), ``cost`` (priced with the local AWS's spot price history against
    ``options.on_demand_prices``) and ``savings_pct``. Call it before the stack is destroyed.

    Args:
        endpoint_url: the moto server.
        options: the drill's options (``stack``, ``on_demand_prices``, EBS and snapshot prices).

    Returns:
        ``{"aws_status", "aws_interruptions", "cost", "savings_pct"}``.

    Raises:
        spot_training.ops.operations.OperationsError: an AWS call failed.
    """
    import datetime as dt

    from spot_training.ops import operations as ops

    aws = ops.connect(region="us-east-1", endpoint_url=endpoint_url, credentials=("testing", "testing"))
    now = dt.datetime.now(dt.timezone.utc)
    status = ops.status_report(aws, options.stack, now=now)
    cost = ops.cost_report(aws, options.stack, now=now, on_demand=options.on_demand_prices,
                           ebs_gb_month=options.ebs_gb_month_price, snapshot_gb_month=options.snapshot_gb_month_price)
    cost = json.loads(ops.to_json(cost))
    return {"aws_status": {"training": status["training"], "instances": status["instances"],
                           "alarms": status["alarms"]},
            "aws_interruptions": status["interruptions"], "cost": cost, "savings_pct": cost["savings_pct"]}


def _collect(node: Any, results: Path) -> None:
    """Copy the trainer's log, COMPLETED and final weights off the volume before destroy deletes it."""
    mount = node.mount_point
    for source in (node.log_dir / LOG_NAME, node.checkpoint_dir / contract.COMPLETED_FILE, mount / FINAL_WEIGHTS):
        if source.exists():
            shutil.copy2(source, results / source.name)


def _teardown(report: dict[str, Any], options: DrillOptions, server: MotoServer, runner: NodeRunner | None,
              cdk: CdkCli | None, context: dict[str, str], record: Callable[[dict[str, Any]], None]) -> None:
    try:
        if runner is not None:
            runner.close()
        if cdk is not None and server.process is not None:
            fleets = [report["fleet_request_id"]] if report.get("fleet_request_id") else []
            destroy_and_check(cdk, clients(server.endpoint_url), options.stack, context=context, report=report,
                              record=record, fleet_request_ids=fleets)
    finally:
        server.stop()


def _finish_baseline(report: dict[str, Any], baseline: subprocess.Popen[bytes], work_dir: Path,
                     record: Callable[[dict[str, Any]], None]) -> None:
    try:
        baseline.wait(timeout=600)
    except subprocess.TimeoutExpired:
        _stop(baseline)
    root = work_dir / "baseline"
    report["baseline_test_accuracy"] = _accuracy(root / "trainer.log")
    ours, theirs = work_dir / "results" / FINAL_WEIGHTS, root / FINAL_WEIGHTS
    report["matches_uninterrupted_baseline"] = bool(ours.exists() and theirs.exists() and weights_match(ours, theirs))
    record({"event": "baseline", "exit_status": baseline.returncode,
            "matches": report["matches_uninterrupted_baseline"]})


def passed(report: dict[str, Any], options: DrillOptions) -> bool:
    """Whether the drill shows what ``make demo`` must show (see the module docstring).

    Args:
        report: the drill's report.
        options: its options.

    Returns:
        True when training completed with no lost step, every interruption and AZ move happened, the
        weights match the uninterrupted baseline (when run), and nothing was orphaned.
    """
    return bool(
        report["completed"] and (report["lost_steps"] == 0 or options.training_command is not None)
        and report["error"] is None
        and report["interruptions"] >= options.interruptions
        and report["az_moves"] >= (0 if options.random_az else options.az_moves)
        and (report["matches_uninterrupted_baseline"] or not options.baseline)
        and report["orphans_after_destroy"] == []
    )
