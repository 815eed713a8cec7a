"""Benchmark: boot -> first training step of a node, with the trainer's environment cold and warm (``make bench-boot``).

In local mode (docs/localmode.md): the real CDK CLI deploys the single-node stack to a moto server (its
digits dataset goes to the local S3 as a CDK asset; the data volume is created empty), and each node runs the launch template's own user data (AWS CLI against
moto), then the agent, which builds or reuses the trainer's virtual environment on the data volume
(``training_requirements`` = the probe wheel, installed offline from a local wheel directory, with
``training_inherit_site_packages``: the frameworks come from the project's venv).

1. **cold**: the fleet's first instance. Its agent builds the environment.
2. **warm**: the node is stopped (SIGTERM: the trainer checkpoints), its instance terminated, and a
   replacement launched into the same Availability Zone; its agent finds the environment complete.

Per node: ``boot_to_first_step_s`` (node start -> the first training-log row that node's trainer
wrote), ``user_data_s`` (the boot script, until the agent's unit is started), ``environment_s`` (the
agent's environment step), ``pip_runs`` (pip processes the environment step ran: 0 is the goal on the
warm path), and ``phases_s``: seconds from node start at which each boot phase ended, read from the
agent's own log lines: ``agent_start`` (its first line), ``volume`` ("data volume mounted"),
``dataset`` ("dataset ready": synced cold, present warm), ``environment`` ("environment built/reused"),
``trainer_start`` ("training started"), then from the trainer's own log lines (``logging`` with
``asctime``, as the example trainers configure it): ``trainer_import`` (the training core's "looking for
a checkpoint": framework imported, data loaded, model built), ``restore`` ("restored ..." or "no
checkpoint ..."), and ``first_step`` (the trainer's first training-log row). ``phase_durations_s``
gives each phase's own length (the time since the phase before; ``agent_start`` counts from node
start, so it holds the user data). ``agent_start_to_first_step_s`` is measured against the goal:
resume within :data:`GOAL_S` seconds of the agent starting on a warm environment. Prints a table,
then the figures as JSON on the last line. The warm path should install and download nothing.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spot_training.local.deploy import CdkCli, clients, local_context, stack_resources  # noqa: E402
from spot_training.infra.config import DEFAULT_FRAMEWORK, FRAMEWORKS  # noqa: E402
from spot_training.local.drill import bootstrap_and_deploy  # noqa: E402
from spot_training.local.injector import LOG_NAME, read_training_log  # noqa: E402
from spot_training.local.moto_server import MotoServer  # noqa: E402
from spot_training.local.nodes import LocalNode, NodeRunner  # noqa: E402

#: The default framework's example trainer (the stack's default command without ``{python}``).
TRAINER = FRAMEWORKS[DEFAULT_FRAMEWORK].training_command[1]
#: Boot phases and the agent log message that ends each (see the module docstring).
PHASE_MESSAGES = (("volume", ("data volume mounted",)), ("dataset", ("dataset ready",)),
                  ("environment", ("environment built", "environment reused")), ("trainer_start", ("training started",)))
#: Trainer phases and the training core's log message (its start) that ends each.
TRAINER_PHASES = (("trainer_import", ("looking for a checkpoint under",)),
                  ("restore", ("restored ", "no checkpoint under ")))
PHASES = ("agent_start", "volume", "dataset", "environment", "trainer_start", "trainer_import", "restore", "first_step")
#: The goal: the first step within this many seconds of the agent starting, on a warm environment.
GOAL_S = 60.0
_USER_DATA_S = re.compile(r"local-init: user data exited with status 0 after ([0-9.]+) s")
#: A trainer log line: ``logging`` format ``%(asctime)s %(levelname)s %(name)s: %(message)s`` (local time).
_TRAINER_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ spot_training\.training[\w.]*: (.*)$")


def _wait_first_step(node: LocalNode, after_step: float, timeout_s: float = 600.0) -> float:
    """Seconds from the node's start to the first training-log row past ``after_step``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        rows = read_training_log(node.log_dir / LOG_NAME)
        if rows and rows[-1]["step"] > after_step:
            return time.time() - node.launched_at
        if not node.alive:
            # The work directory is removed on the way out: show the node's last lines now.
            tail = "\n".join(node.log_path.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"node {node.instance_id} ended before training; its log ends:\n{tail}")
        time.sleep(0.1)
    raise RuntimeError(f"no training step within {timeout_s} s; see {node.log_path}")


def _trainer_times(text: str) -> list[tuple[float, str]]:
    """``(epoch seconds, message)`` of the trainer's ``spot_training.training`` log lines in ``text``."""
    out = []
    for line in text.splitlines():
        match = _TRAINER_LINE.match(line)
        if match:
            when = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")  # local time, as logging writes it
            out.append((when.timestamp(), match.group(2)))
    return out


def _phases(lines: list[dict], launched_at: float, boot_to_step_s: float, trainer: list[tuple[float, str]] = ()) -> dict:
    """Seconds from node start at which each phase ended (None: not seen in the log)."""
    def at(entry: dict) -> float:
        when = datetime.datetime.strptime(entry["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc)
        return round(when.timestamp() - launched_at, 2)

    timed = [e for e in lines if "time" in e]
    phases: dict = {"agent_start": at(timed[0]) if timed else None}
    for phase, messages in PHASE_MESSAGES:
        found = next((e for e in timed if e.get("message") in messages), None)
        phases[phase] = at(found) if found else None
    for phase, starts in TRAINER_PHASES:
        found = next((when for when, message in trainer if message.startswith(starts)), None)
        phases[phase] = round(found - launched_at, 2) if found is not None else None
    phases["first_step"] = round(boot_to_step_s, 2)
    return phases


def _durations(phases: dict) -> dict:
    """Each phase's own seconds: its end minus the end of the last phase seen before it."""
    out, before = {}, 0.0
    for name in PHASES:
        end = phases.get(name)
        out[name] = round(end - before, 2) if end is not None else None
        before = end if end is not None else before
    return out


def _node_figures(node: LocalNode, boot_to_step_s: float) -> dict:
    text = node.log_path.read_text(errors="replace")
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
    env_lines = [e for e in lines if str(e.get("message", "")).startswith("environment ")]
    user_data = _USER_DATA_S.search(text)
    figures = {
        "instance_id": node.instance_id,
        "boot_to_first_step_s": round(boot_to_step_s, 2),
        "user_data_s": float(user_data.group(1)) if user_data else None,
        "environment": env_lines[-1]["message"] if env_lines else None,
        "environment_s": env_lines[-1].get("seconds") if env_lines else None,
        "pip_runs": env_lines[-1].get("pip_attempts") if env_lines else None,
        "phases_s": _phases(lines, node.launched_at, boot_to_step_s, _trainer_times(text)),
    }
    figures["phase_durations_s"] = _durations(figures["phases_s"])
    start = figures["phases_s"]["agent_start"]
    figures["agent_start_to_first_step_s"] = round(boot_to_step_s - start, 2) if start is not None else None
    return figures


def _version() -> str:
    """The project's version (pyproject.toml) and the commit it was measured at."""
    import subprocess
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return f"{version}+{commit}{'.dirty' if dirty else ''}" if commit else version


def main() -> int:
    """Run the benchmark (see the module docstring); returns 0."""
    work = Path(tempfile.mkdtemp(prefix="bench-boot-"))
    server = MotoServer(work / "moto").start()
    runner = None
    try:
        aws = clients(server.endpoint_url)
        context = local_context(training_command=["{python}", TRAINER, "--epochs", "3", "--save-every-steps", "20"])
        bootstrap_and_deploy(CdkCli(server.endpoint_url, work_dir=work), "SpotTraining", context,
                             record=lambda event: None, phases={})
        stack = stack_resources(aws, "SpotTraining")
        runner = NodeRunner(aws=aws, endpoint_url=server.endpoint_url, volumes_dir=server.volumes_dir, stack=stack,
                            work_dir=work)
        (cold,) = runner.sync()
        cold_figures = _node_figures(cold, _wait_first_step(cold, 0))
        time.sleep(3)  # a few steps and a checkpoint (every 20 steps) before the stop
        cold.stop()
        last = read_training_log(cold.log_dir / LOG_NAME)[-1]["step"]
        runner.terminate_instance(cold.instance_id)
        warm = runner.start_node(runner.launch_for_fleet(cold.availability_zone, instance_type="g5.xlarge"))
        warm_figures = _node_figures(warm, _wait_first_step(warm, last))
        warm.stop()
    finally:
        if runner is not None:
            runner.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'path':6} {'boot->first step s':>19} {'user data s':>12} {'environment':>20} {'env s':>7} {'pip runs':>8}")
    for name, f in (("cold", cold_figures), ("warm", warm_figures)):
        print(f"{name:6} {f['boot_to_first_step_s']:>19} {f['user_data_s']!s:>12} {f['environment']!s:>20} "
              f"{f['environment_s']!s:>7} {f['pip_runs']!s:>8}")
        print("       phases (s from node start): " + ", ".join(f"{k} {v}" for k, v in f["phases_s"].items()))
        print("       phase lengths (s):          " + ", ".join(f"{k} {v}" for k, v in f["phase_durations_s"].items()))
        print(f"       agent start -> first step: {f['agent_start_to_first_step_s']} s (goal on warm: <= {GOAL_S:g} s)")
    result = {
        "benchmark": "boot", "date": datetime.date.today().isoformat(), "version": _version(),
        "cold": cold_figures, "warm": warm_figures,
        "warm_installs_nothing": warm_figures["environment"] == "environment reused" and warm_figures["pip_runs"] == 0,
        "phases": list(PHASES), "goal_s": GOAL_S,
        "warm_meets_goal": warm_figures["agent_start_to_first_step_s"] is not None
        and warm_figures["agent_start_to_first_step_s"] <= GOAL_S,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
