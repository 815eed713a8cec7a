"""A local node's init: run the launch template's user data, then start the units it enabled.

On an instance, cloud-init runs the user data as root and systemd starts the agent's unit. A local node
is a process tree instead (docs/localmode.md, "The boot script"): this module is its first process.

1. It runs the user data with ``bash`` (the real script, as the launch template carries it), with the
   environment the node runner gives: ``SPOT_TRAINING_ROOT`` (the node's file-system root),
   ``SPOT_TRAINING_AGENT_PYTHON``, ``SPOT_TRAINING_CONSOLE``, the AWS CLI pointed at the moto server
   (``AWS_ENDPOINT_URL``), ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (the node's IMDS emulator), and
   :data:`STANDINS_DIR` first on ``PATH``, whose ``systemctl`` only records the units to start and whose
   ``shutdown`` only records the request (the runner then terminates the instance, as EC2 does with the
   launch template's terminate shutdown behaviour).
2. If the user data succeeded, it starts each recorded unit's ``ExecStart`` in the unit's
   ``WorkingDirectory`` with its ``Environment=`` lines, and applies its restart rules: ``Restart=on-failure``
   restarts after a non-zero exit unless the status is in ``RestartPreventExitStatus`` or a shutdown was
   requested, ``RestartSec`` seconds later. SIGTERM (a stop) is passed to the unit's process, which gets
   ``TimeoutStopSec`` seconds before SIGKILL.

Exit status: the user data's when it failed, else the unit's main process's last status.
Standard library only. Not systemd: only what the agent's unit uses (nothing else is read).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from spot_training import contract

#: Executables that stand in for root-only commands on a local node (``systemctl``, ``shutdown``).
STANDINS_DIR = Path(__file__).resolve().parent / "standins"
#: Under ``$SPOT_TRAINING_ROOT``: the stand-ins' records (``start``: units to start; ``shutdown``).
STATE_DIR = "run/local-init"


def parse_unit(text: str) -> dict[str, list[str]]:
    """``{key: [values...]}`` of a unit file's ``[Service]`` section (repeated keys keep every value)."""
    values: dict[str, list[str]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        if section == "Service" and "=" in line:
            key, _, value = line.partition("=")
            values.setdefault(key.strip(), []).append(value.strip())
    return values


class _Stop:
    requested = False


def run_unit(unit_file: Path, *, root: Path, stop: _Stop) -> int:
    """Run the unit's ``ExecStart`` with its restart rules (see the module docstring).

    Args:
        unit_file: the systemd unit file the user data wrote.
        root: the node's file-system root (the shutdown marker is under it).
        stop: set ``requested`` to stop (from the SIGTERM handler).

    Returns:
        the service's last exit status.
    """
    unit = parse_unit(unit_file.read_text())
    argv = shlex.split(unit["ExecStart"][-1])
    env = dict(os.environ)
    for assignment in unit.get("Environment", []):
        for item in shlex.split(assignment):
            key, _, value = item.partition("=")
            env[key] = value
    cwd = unit.get("WorkingDirectory", [None])[-1]
    restart = unit.get("Restart", ["no"])[-1]
    restart_s = float(unit.get("RestartSec", ["0.1"])[-1].rstrip("s"))
    prevent = {int(s) for v in unit.get("RestartPreventExitStatus", []) for s in v.split()}
    stop_timeout_s = float(unit.get("TimeoutStopSec", ["90"])[-1].rstrip("s"))
    shutdown = root / STATE_DIR / "shutdown"
    while True:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL)
        print(f"local-init: started {unit_file.name} (pid {proc.pid})", flush=True)
        status = _wait(proc, stop, stop_timeout_s)
        print(f"local-init: {unit_file.name} exited with status {status}", flush=True)
        if stop.requested or shutdown.exists() or restart != "on-failure" or status == 0 or status in prevent:
            return status
        deadline = time.monotonic() + restart_s
        while time.monotonic() < deadline and not stop.requested:
            time.sleep(0.1)
        if stop.requested:
            return status


def _wait(proc: subprocess.Popen, stop: _Stop, stop_timeout_s: float) -> int:
    signalled = None
    while True:
        try:
            status = proc.wait(timeout=0.1)
            return status if status >= 0 else 128 - status
        except subprocess.TimeoutExpired:
            pass
        if stop.requested and signalled is None:
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        if signalled is not None and time.monotonic() - signalled > stop_timeout_s:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    """``python -m spot_training.local.node_init --user-data FILE``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m spot_training.local.node_init")
    parser.add_argument("--user-data", required=True, type=Path)
    args = parser.parse_args(argv)
    root = Path(os.environ[contract.ENV_ROOT])
    stop = _Stop()

    def on_term(*_: object) -> None:
        stop.requested = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    env = dict(os.environ)
    env["PATH"] = f"{STANDINS_DIR}{os.pathsep}{env.get('PATH', '')}"
    os.environ["PATH"] = env["PATH"]
    started = time.time()
    print(f"local-init: running the user data {args.user_data}", flush=True)
    proc = subprocess.Popen(["bash", str(args.user_data)], env=env, stdin=subprocess.DEVNULL)
    status = _wait(proc, stop, 30.0)
    print(f"local-init: user data exited with status {status} after {time.time() - started:.1f} s", flush=True)
    if status != 0 or stop.requested:
        return status
    start_file = root / STATE_DIR / "start"
    units = start_file.read_text().split() if start_file.exists() else []
    status = 0
    for name in units:
        status = run_unit(root / "etc/systemd/system" / name, root=root, stop=stop)
    return status


if __name__ == "__main__":
    sys.exit(main())
