"""``spot-train``: local mode from the command line.

    spot-train local drill [--work-dir out/demo] [--interruptions 3] [--az-moves 1] [--random-az]
                           [--epochs 30] [--seed 0] [--no-baseline] [--timeout 900]
                           [--framework tensorflow|mxnet|pytorch]
    spot-train local drill --training-command "python my_train.py --epochs 2" [--code-dir DIR] [--interruptions 1]
    spot-train local drill --cluster [--framework mxnet|pytorch] [--steps 800] [--workers 2] [--timeout 480]
    spot-train local up    [--work-dir out/local]     # moto server + cdk bootstrap + cdk deploy + the fleet's
                                                      # nodes (node keeper, spot_training/local/keeper.py); stays up
    spot-train local down  [--work-dir out/local]     # nodes stopped, cdk destroy, orphan check, server stopped by PID
    spot-train status      [--stack S] [--job ID] [--region R] [--profile P] [--endpoint-url URL] [--work-dir DIR]
                           [--json] [--watch [--interval 10]]
    spot-train logs        [--stack S] ... [--instance ID] [--follow] [--json]
    spot-train cost        [--stack S] [--job ID] ... [--on-demand-price TYPE=USD ...] [--ebs-gb-month-price USD]
                           [--snapshot-gb-month-price USD] [--json]
    spot-train drill --aws --region R [--instance-types ...] [--keep-stack] [--yes]
                                                      # a real account: deploy, FIS interruption, resume, destroy (spot_training/ops/aws_drill.py)
    spot-train preflight   [--stack single|cluster] [-c key=value ...] [--region R] [--json]
                                                      # a real account before `cdk deploy` (spot_training/infra/preflight.py)

``status``/``logs``/``cost`` read a deployed stack from AWS (spot_training.ops.operations; docs/operations.md):
with ``--stack``/``--region``/``--profile``/``--endpoint-url`` the stack in that account (standard
credentials), otherwise the live local stack of ``spot-train local up`` (its moto server), otherwise
(``status`` only) the last drill's report.

``drill`` exits 0 only when training completed, no step was lost, the final weights equal the
uninterrupted baseline's and nothing is left after ``cdk destroy`` (the report's ``passed``); 1
otherwise; 2 on bad arguments. ``up``/``down`` exit 0 on success and 1 on failure. ``status``/``logs``/``cost``:
0 ok, 1 an AWS call failed (``logs --instance`` an instance without logs) (or, for ``status`` without a stack, nothing to report), 2 usage, 3 the stack
(or its log group) does not exist, 4 AWS unreachable or credentials missing/refused, 130 interrupted.
``preflight`` exits 0 when every check passed, 1 when one failed, 3 when none failed but one could
not be answered, 2 on bad arguments or settings, 4 without AWS credentials.

The live display: a progress bar with step, loss and ETA, and one line per event (interruption
notice, checkpoint, AZ move, resume) as it happens; plain lines when stdout is not a terminal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from spot_training.contract import pid_alive

#: jsii (aws-cdk-lib's Python bridge, imported by the settings and the local commands) prints a banner
#: as raw bytes (b'!!...') on every start under a Node.js release it has not tested, deprecated or past
#: its end of life (@jsii/check-node reads these variables when its Node process starts; the
#: end-of-life one lists the major versions to keep quiet about). Set before any import of aws_cdk;
#: a user's own setting wins. README.md names the Node.js releases CDK supports.
JSII_QUIET_ENV = {
    "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
    "JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION": "1",
    "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "14,16,18,20",
}
for _name, _value in JSII_QUIET_ENV.items():
    os.environ.setdefault(_name, _value)

DEFAULT_DRILL_DIR = Path("out/demo")
DEFAULT_UP_DIR = Path("out/local")
DEFAULT_CLUSTER_DRILL_DIR = Path("out/cluster-drill")
STATE_FILE = "state.json"


# ---- live display --------------------------------------------------------------------------------

#: The line of each event kind that is only the event's fields (``str.format_map`` over the event;
#: ``reason`` may be absent: ''); ``:cluster``: the cluster drill's variant.
_EVENT_LINES = {
    "node-started:cluster": "{role} node {instance_id} ({availability_zone}, {address}) booted: agent pid {pid}",
    "node-started": "node {instance_id} ({availability_zone}) booted: agent pid {pid}",
    "capacity-raised": ">> fleet target capacity raised to {target_capacity} at step {step}",
    "joined": "   generation {generation} trains with {workers} workers, {join_s:.1f} s after the raise",
    "notice-posted:cluster": "!! spot interruption: notice to worker {instance_id} at step {step}",
    "notice-posted": "!! spot interruption #{index}: notice to {instance_id} ({availability_zone}) at step {step}",
    "instance-launched": "fleet launched {instance_id} in {availability_zone}",
    "checkpointed": "   checkpoint at step {step}, {notice_to_checkpoint_s:.1f} s after the notice",
    "instance-terminated": "   instance {instance_id} terminated ({reason})",
    "completed": "training completed at step {step}, test accuracy {test_accuracy}",
    "baseline": "uninterrupted baseline exited {exit_status}; final weights equal: {matches}",
    "error": "ERROR: {message}",
}


class ProgressDisplay:
    """Renders drill events: a redrawn progress bar on a terminal, plain lines otherwise.

    Args:
        stream: where to write (default ``sys.stdout``).
        tty: force terminal mode on or off (default: ``stream.isatty()``).
        width: bar width in characters (default 30).
    """

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.width = width
        self._bar_shown = False
        self._rate: list[tuple[float, int]] = []
        self._last_plain_decile = -1

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "progress":
            self._progress(event)
            return
        line = self.describe(event)
        if line:
            job = f"{event['job']}: " if event.get("job") else ""  # the jobs drill: whose event it is
            self._line(f"[{event.get('t', 0):7.1f}s] {job}{line}")

    def _line(self, text: str) -> None:
        if self._bar_shown:
            self.stream.write("\r\033[K")
            self._bar_shown = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def _progress(self, event: dict[str, Any]) -> None:
        step, total = int(event["step"]), max(1, int(event["total"]))
        now = time.monotonic()
        if self._rate and step < self._rate[-1][1]:
            self._rate.clear()  # a new run resumed from a checkpoint
        self._rate.append((now, step))
        self._rate = [(t, s) for t, s in self._rate if now - t <= 10.0]
        eta = "--"
        if len(self._rate) >= 2 and self._rate[-1][1] > self._rate[0][1]:
            per_s = (self._rate[-1][1] - self._rate[0][1]) / max(1e-6, self._rate[-1][0] - self._rate[0][0])
            eta = f"{max(0, total - step) / per_s:4.0f}s"
        fraction = min(1.0, step / total)
        if self.tty:
            filled = int(round(fraction * self.width))
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r\033[K[{bar}] step {step}/{total} loss {event['loss']:.4f} ETA {eta}")
            self.stream.flush()
            self._bar_shown = True
        else:
            decile = int(fraction * 10)
            if decile != self._last_plain_decile:
                self._last_plain_decile = decile
                self._line(f"[{event.get('t', 0):7.1f}s] step {step}/{total} loss {event['loss']:.4f} ETA {eta}")

    @staticmethod
    def describe(event: dict[str, Any]) -> str:
        """One line for an event, or '' for events not worth a line."""
        kind = event["event"]
        if kind == "phase":
            return f"== {event['phase']}: {event.get('message', '')}"
        if kind == "deployed" and "groups" in event:  # the cluster drill
            return (f"deployed: worker fleet {event['fleet_request_id']}, groups {', '.join(event['groups'].values())}, "
                    f"EFS {event['file_system_id']}")
        if kind == "deployed":
            return (f"deployed: fleet {event['fleet_request_id']}, data volume {event['data_volume_id']}, "
                    f"AZs {', '.join(event['availability_zones'])}")
        if kind == "node-started" and "role" in event:  # the cluster drill
            kind = "node-started:cluster"
        if kind == "notice-posted" and "index" not in event:  # the cluster drill
            kind = "notice-posted:cluster"
        if kind == "resumed":
            move = f"; data volume MOVED to {event['availability_zone']} as {event['volume_id']}" if event["volume_moved"] else ""
            return (f"   resumed at step {event['step']} on {event['instance_id']} ({event['availability_zone']}), "
                    f"{event['boot_to_resume_s']:.1f} s after boot{move}")
        if kind == "destroyed":
            return f"destroyed; orphans: {event['orphans'] or 'none'}"
        if kind == "read-back":
            savings = event.get("savings_pct")
            as_of = f" (prices as of {event['prices_as_of']})" if event.get("prices_as_of") else ""
            return (f"read back from the local AWS (spot-train status / cost): {event['interruptions']} "
                    f"interruption(s), savings {'n/a' if savings is None else f'{savings:.3f} %'}{as_of}")
        if kind in _EVENT_LINES:
            return _EVENT_LINES[kind].format_map({"reason": "", **event})
        return ""


def format_report(report: dict[str, Any]) -> str:
    """The report as terminal tables (summary, then one row per interruption)."""
    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4f}" if value < 1 else f"{value:.1f}"
        if isinstance(value, list):
            return "[]" if not value else ", ".join(map(str, value))
        return str(value)

    keys = ["passed", "completed", "steps_total", "steps_executed", "lost_steps", "interruptions", "az_moves",
            "test_accuracy", "baseline_test_accuracy", "matches_uninterrupted_baseline", "orphans_after_destroy",
            "wall_s"]
    if "framework" in report:  # reports before --framework have none
        keys.insert(1, "framework")
    if report.get("training_command"):  # your own script: what is measured for the example means nothing
        keys = [k for k in keys if k not in ("steps_executed", "lost_steps", "test_accuracy", "baseline_test_accuracy",
                                             "matches_uninterrupted_baseline")]
        keys[2:2] = ["training_command", "code_dir", "agent_exit_status"]
    rows = [(key, fmt(report.get(key))) for key in keys]
    rows += [(f"phase {name} (s)", fmt(value)) for name, value in report.get("phases_s", {}).items()]
    dataset = report.get("dataset")
    if dataset:
        rows.append(("dataset", f"{dataset['uri']} ({dataset['objects']} objects, {dataset['bytes']} bytes uploaded)"))
        syncs = dataset.get("syncs") or []
        rows.append(("dataset on the volume", ", ".join(
            f"{s['status']}" + (f" {s['downloaded_bytes']} bytes" if s["status"] == "synced" else "") for s in syncs) or "-"))
    if report.get("error"):
        rows.append(("error", str(report["error"])))
    rows += [("checked", check) for check in report.get("checks") or []]
    width = max(len(k) for k, _ in rows)
    lines = ["", "Drill report", "-" * (width + 40)]
    lines += [f"{key.ljust(width)}  {value}" for key, value in rows]
    events = report.get("interruption_events") or []
    if events:
        header = ("#", "instance", "AZ", "volume", "notice@", "ckpt@", "resume@", "notice->ckpt s", "boot->resume s")
        table = [header] + [
            (str(e["index"]), e["instance_id"], f"{e['from_az']}->{e['to_az']}", "moved" if e["volume_moved"] else "stayed",
             str(e["step_at_notice"]), str(e["checkpoint_step"]), str(e["resumed_at_step"]),
             f"{e['notice_to_checkpoint_s']:.2f}", f"{e['boot_to_resume_s']:.2f}")
            for e in events
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines += ["", "Interruptions"]
        for n, row in enumerate(table):
            lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)))
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
    lines += _read_back_lines(report)
    return "\n".join(lines) + "\n"


def _read_back_lines(report: dict[str, Any]) -> list[str]:
    """The drill report's part read back from the local AWS (spot-train status / cost)."""
    cost = report.get("cost")
    if not cost:
        return []
    from spot_training.ops import operations as ops

    lines = ["", "Read back from the local AWS (spot-train status / cost)"]
    history = report.get("aws_interruptions") or []
    if history:
        lines.append(ops.table(["#", "instance", "AZ", "n->ckpt s", "ckpt", "resumed on", "b->res s", "step", "volume"], [
            [n + 1, h["instance_id"], ops.az_move(h),
             ops.format_number(h["notice_to_checkpoint_s"]), h["checkpoint_step"], h["replacement_instance_id"],
             ops.format_number(h["boot_to_resume_s"]), h["resumed_at_step"],
             "moved" if h["volume_moved"] else ("stayed" if h["volume_moved"] is False else "-")]
            for n, h in enumerate(history)]))
    lines.append(ops.format_cost(cost).rstrip("\n"))
    prices = report.get("prices")
    if prices:
        spot = "spot price history" if prices.get("spot_from_table") else "spot price history (some types not in it)"
        on_demand = " and on-demand prices" if prices.get("on_demand_from_table") else ""
        lines.append(f"prices: {spot}{on_demand} as of {prices['as_of']}, from {Path(prices['path']).name}")
        import textwrap

        lines += textwrap.wrap(prices["source"], width=100, initial_indent="  source: ", subsequent_indent="  ")
    return lines


# ---- commands ------------------------------------------------------------------------------------
def _run_reported(options: Any, run: Callable[..., dict[str, Any]]) -> dict[str, Any] | int:
    """Validate ``options`` and run one drill (``run(options, on_event=...)``) under the live display.

    Both drills share this: a bad option prints ``spot-train: error: ...`` and gives exit status 2;
    SIGTERM is turned into KeyboardInterrupt so that it tears down (destroy, stop by PID) as Ctrl-C
    does, and an interrupted drill gives 130. Returns the drill's report dict otherwise.
    """
    try:
        options.validate()
    except ValueError as error:
        print(f"spot-train: error: {error}", file=sys.stderr)
        return 2
    display = ProgressDisplay()

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)  # tear down (destroy, stop by PID) as on Ctrl-C
    try:
        return run(options, on_event=display)
    except KeyboardInterrupt:
        print("\nspot-train: interrupted; the stack was destroyed and every process stopped", file=sys.stderr)
        return 130


def cmd_cluster_drill(args: argparse.Namespace) -> int:
    """``spot-train local drill --cluster``: the DistributedTraining drill (spot_training.local.cluster_drill)."""
    from spot_training.local.cluster_drill import ClusterDrillOptions, format_cluster_report, run_cluster_drill

    options = ClusterDrillOptions(
        work_dir=args.work_dir if args.work_dir is not None else DEFAULT_CLUSTER_DRILL_DIR,
        stack=args.stack if args.stack is not None else "DistributedTraining",
        framework=args.framework if args.framework is not None else ClusterDrillOptions.framework,
        steps=args.steps, workers=args.workers, seed=args.seed,
        timeout_s=args.timeout if args.timeout is not None else ClusterDrillOptions.timeout_s)
    report = _run_reported(options, run_cluster_drill)
    if isinstance(report, int):
        return report
    sys.stdout.write(format_cluster_report(report))
    print(f"report: {Path(report['work_dir']) / 'report.json'}")
    return 0 if report["passed"] else 1


def cmd_jobs_drill(args: argparse.Namespace) -> int:
    """``spot-train local drill --jobs N``: N training jobs in one stack (spot_training.local.jobs_drill)."""
    from spot_training.local.jobs_drill import JobsDrillOptions, format_jobs_report, run_jobs_drill

    options = JobsDrillOptions(
        work_dir=args.work_dir if args.work_dir is not None else JobsDrillOptions.work_dir,
        stack=args.stack if args.stack is not None else JobsDrillOptions.stack, jobs=args.jobs,
        interruptions=args.interruptions, steps=args.steps, seed=args.seed, baseline=not args.no_baseline,
        timeout_s=args.timeout if args.timeout is not None else JobsDrillOptions.timeout_s)
    report = _run_reported(options, run_jobs_drill)
    if isinstance(report, int):
        return report
    sys.stdout.write(format_jobs_report(report))
    print(f"report: {Path(report['work_dir']) / 'report.json'}; each job's status and cost: "
          f"{Path(report['work_dir']) / 'results' / '<job id>'}/status.txt, cost.txt")
    return 0 if report["passed"] else 1


#: What local mode imports or runs beyond the library: module -> what it is for.
LOCAL_MODE_MODULES = {"moto": "the moto server that emulates AWS", "flask": "moto's server",
                      "awscli": "the AWS CLI the nodes' user data runs"}


def missing_local_extra(command: str) -> str | None:
    """A message telling to install the ``[local]`` extra when a module local mode needs is missing, else None."""
    import importlib.util

    missing = [f"{name} ({why})" for name, why in LOCAL_MODE_MODULES.items() if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"spot-train local {command}: local mode needs {', '.join(missing)}, which a plain install of the "
            "library leaves out; install the [local] extra with the trainer's framework, e.g. "
            "pip install 'spot-training[local,tensorflow]' (from a checkout: pip install -e '.[local,tensorflow]')")


def cmd_drill(args: argparse.Namespace) -> int:
    """``spot-train local drill``: the single-node drill (``--cluster``/``--sweep``: the other drills).

    Prints the report and where its JSON and plot are.

    Args:
        args: the parsed options.

    Returns:
        the exit status: 0 passed, 1 failed, 2 a bad option or local mode's extra is not installed,
        130 interrupted.
    """
    message = missing_local_extra("drill")
    if message:
        print(message, file=sys.stderr)
        return 2
    if (args.cluster or args.sweep) and (args.dataset_uri is not None or args.dataset_dir is not None):
        print("spot-train: error: --dataset-uri/--dataset-dir are options of the single-node drill, not of "
              "--cluster or --sweep", file=sys.stderr)
        return 2
    if args.cluster:
        return cmd_cluster_drill(args)
    if args.sweep:
        from spot_training.local.sweep_drill import cmd_sweep_drill

        return cmd_sweep_drill(args)
    if args.jobs is not None:
        return cmd_jobs_drill(args)
    from spot_training.local.drill import DrillOptions, run_drill

    args.work_dir = args.work_dir if args.work_dir is not None else DEFAULT_DRILL_DIR
    args.stack = args.stack if args.stack is not None else "SpotTraining"
    args.timeout = args.timeout if args.timeout is not None else 900.0
    own = args.training_command is not None
    if args.code_dir is not None and not own:
        print("spot-train: error: --code-dir is used only with --training-command", file=sys.stderr)
        return 2
    # Your own script: one interruption (with an AZ move) by default, and no baseline (nothing to compare).
    interruptions = args.interruptions if args.interruptions is not None else (1 if own else 3)
    az_moves = args.az_moves if args.az_moves is not None else min(1, interruptions)
    options = DrillOptions(work_dir=args.work_dir, interruptions=interruptions, az_moves=az_moves,
                           random_az=args.random_az, epochs=args.epochs, seed=args.seed,
                           baseline=not (args.no_baseline or own), timeout_s=args.timeout, stack=args.stack,
                           framework=args.framework if args.framework is not None else DrillOptions.framework,
                           training_command=args.training_command,
                           code_dir=(args.code_dir if args.code_dir is not None else Path.cwd()) if own else None,
                           dataset_uri=args.dataset_uri, dataset_dir=args.dataset_dir)
    report = _run_reported(options, run_drill)
    if isinstance(report, int):
        return report
    sys.stdout.write(format_report(report))
    work = Path(report["work_dir"])
    print(f"report: {work / 'report.json'}\nplot:   {work / 'training.png'}")
    return 0 if report["passed"] else 1


def _state_path(work_dir: Path) -> Path:
    return Path(work_dir) / STATE_FILE


def cmd_up(args: argparse.Namespace) -> int:
    """``spot-train local up``: start a moto server, ``cdk bootstrap`` and ``cdk deploy`` the stack into it.

    The server's address and PID are kept in the work directory's state file for ``status``, ``logs``,
    ``cost`` and ``down``.

    Args:
        args: the parsed options.

    Returns:
        0 deployed; 1 already up or the deploy failed (the server stays up for ``down``); 2 local mode's
        extra is not installed.
    """
    message = missing_local_extra("up")
    if message:
        print(message, file=sys.stderr)
        return 2
    from spot_training.local.deploy import CdkCli, clients, local_context, stack_resources
    from spot_training.local.moto_server import MotoServer

    state_path = _state_path(args.work_dir)
    if state_path.exists() and pid_alive(json.loads(state_path.read_text()).get("pid")):
        print(f"spot-train: error: local mode is already up ({state_path}); run `spot-train local down` first",
              file=sys.stderr)
        return 1
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    server = MotoServer(work / "moto").start()
    context = local_context()
    state = {"endpoint_url": server.endpoint_url, "pid": server.pid, "stack": args.stack, "context": context,
             "work_dir": str(work)}
    state_path.write_text(json.dumps(state, indent=2))
    display = ProgressDisplay()
    try:
        cdk = CdkCli(server.endpoint_url, work_dir=work)
        display({"event": "phase", "phase": "bootstrap", "message": "cdk bootstrap"})
        cdk.bootstrap()
        display({"event": "phase", "phase": "deploy", "message": f"cdk deploy {args.stack}"})
        cdk.deploy(args.stack, context=context)
        stack = stack_resources(clients(server.endpoint_url), args.stack)
        state["fleet_request_id"] = stack.fleet_request_id
        state_path.write_text(json.dumps(state, indent=2))
        display({"event": "phase", "phase": "nodes", "message": "starting the nodes the fleet asks for (node keeper)"})
        keeper = start_keeper(state_path, work)
        state["keeper_pid"] = keeper.pid
        state_path.write_text(json.dumps(state, indent=2))
        for event in wait_for_nodes(work, keeper):
            display(event)
    except KeyboardInterrupt:  # Ctrl-C while coming up: stop what this command started, by PID
        _stop_pid(state.get("keeper_pid"), str(state_path), timeout_s=KEEPER_STOP_TIMEOUT_S)
        server.stop()
        state_path.unlink(missing_ok=True)
        print("\nspot-train: interrupted; the node keeper and the moto server were stopped "
              f"(the local AWS's data stays in {work})", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - reported; the server stays up for `down`/inspection
        print(f"spot-train: error: {error}", file=sys.stderr)
        return 1
    print(f"up: moto server {server.endpoint_url} (pid {server.pid}), stack {args.stack} deployed, "
          f"fleet {stack.fleet_request_id}; nodes run under the node keeper (pid {state['keeper_pid']}, "
          f"{work / 'nodes'}) until `local down`\n"
          f"use it:  export AWS_ENDPOINT_URL={server.endpoint_url} AWS_ACCESS_KEY_ID=testing "
          f"AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1\n"
          f"stop it: spot-train local down --work-dir {args.work_dir}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """``spot-train local down``: ``cdk destroy`` the stack, check for orphans, stop the moto server.

    Args:
        args: the parsed options.

    Returns:
        0 when nothing is left; 1 when nothing was up, orphans remain, or the server was not running.
    """
    from spot_training.local.deploy import CdkCli, clients, destroy_and_check

    state_path = _state_path(args.work_dir)
    if not state_path.exists():
        print(f"spot-train: error: no {state_path}; nothing is up (start it with `spot-train local up`)", file=sys.stderr)
        return 1
    state = json.loads(state_path.read_text())
    orphans: list[str] | None = None
    # The nodes first: the keeper stops each node it started by PID (agents checkpoint their trainers).
    _stop_pid(state.get("keeper_pid"), str(state_path), timeout_s=KEEPER_STOP_TIMEOUT_S)
    if pid_alive(state["pid"]):
        cdk = CdkCli(state["endpoint_url"], work_dir=Path(state["work_dir"]))
        fleets = [state["fleet_request_id"]] if state.get("fleet_request_id") else []
        report: dict[str, Any] = {"phases_s": {}}
        orphans = destroy_and_check(cdk, clients(state["endpoint_url"]), state["stack"], context=state["context"],
                                    report=report, record=lambda event: None, fleet_request_ids=fleets)
        if "destroy_error" in report:
            print(f"spot-train: cdk destroy failed: {report['destroy_error']}", file=sys.stderr)
        try:
            os.killpg(state["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
        for _ in range(100):
            if not pid_alive(state["pid"]):
                break
            time.sleep(0.1)
    state_path.unlink()
    print(f"down: stack {state['stack']} destroyed, moto server (pid {state['pid']}) stopped; "
          f"orphans: {orphans if orphans is not None else 'unknown (server was not running)'}")
    return 0 if orphans == [] else 1


#: Seconds ``local down`` waits for the node keeper to stop its nodes (each agent gets 60 s).
KEEPER_STOP_TIMEOUT_S = 150.0


def start_keeper(state_path: Path, work: Path) -> Any:
    """Start ``python -m spot_training.local.keeper`` in a session of its own (stopped by PID).

    Args:
        state_path: ``state.json`` of ``local up`` (the stack and moto server the keeper serves).
        work: the work directory; the keeper's output goes to ``<work>/keeper.log``.

    Returns:
        the keeper's ``subprocess.Popen``.
    """
    import subprocess

    from spot_training.local.keeper import EVENTS_FILE

    (work / EVENTS_FILE).unlink(missing_ok=True)  # an earlier up's events must not count as this one's nodes
    with open(work / "keeper.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "spot_training.local.keeper", "--state", str(state_path.resolve())],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def wait_for_nodes(work: Path, keeper: Any, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The keeper's events up to its first ``node-started`` (or an error).

    Args:
        work: the work directory holding the keeper's events file.
        keeper: the keeper's ``subprocess.Popen`` (:func:`start_keeper`).
        timeout_s: seconds to wait for a first node (default 120).

    Returns:
        the ``node-started`` events, each with ``t`` 0.0.

    Raises:
        RuntimeError: the keeper ended, reported an error, or started no node in time.
    """
    from spot_training.local.keeper import EVENTS_FILE

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = work / EVENTS_FILE
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        for event in events:
            if event["event"] == "error":
                raise RuntimeError(f"the node keeper: {event['message']}; see {work / 'keeper.log'}")
        if any(e["event"] == "node-started" for e in events):
            return [{**e, "t": 0.0} for e in events if e["event"] == "node-started"]
        if keeper.poll() is not None:
            raise RuntimeError(f"the node keeper exited {keeper.returncode}; see {work / 'keeper.log'}")
        time.sleep(0.5)
    raise RuntimeError(f"the node keeper started no node within {timeout_s:g} s; see {work / 'keeper.log'}")


def _stop_pid(pid: Any, mentions: str, *, timeout_s: float = 30.0) -> None:
    """SIGTERM process group ``pid`` (then SIGKILL after ``timeout_s``) if it is alive and its command
    line mentions ``mentions`` (ours, not a reused PID)."""
    if not pid_alive(pid):
        return
    try:
        if mentions not in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
            return
        os.killpg(pid, signal.SIGTERM)
    except (OSError, ProcessLookupError):
        return
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        try:  # our own child (Ctrl-C in `up`): reap it, else it stays a zombie that looks alive
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.2)
    if pid_alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _deployed_target(args: argparse.Namespace) -> tuple[dict[str, Any], str] | None:
    """``(connect kwargs, stack)`` for status/logs/cost: the deployed stack named on the command line,
    else the live local stack (``spot-train local up`` in ``--work-dir`` or out/local), else None."""
    explicit = any(getattr(args, k, None) for k in ("stack", "region", "profile", "endpoint_url", "job"))
    if explicit:
        # --job alone: the job by its identity, whatever stack it lives in
        default = None if getattr(args, "job", None) else "SpotTraining"
        return ({"region": args.region, "profile": args.profile, "endpoint_url": args.endpoint_url},
                args.stack or default)
    candidates = [Path(args.work_dir)] if args.work_dir else [DEFAULT_UP_DIR]
    for work in candidates:
        state_path = _state_path(work)
        if state_path.exists():
            state = json.loads(state_path.read_text())
            if pid_alive(state.get("pid")):
                os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")  # moto takes any credentials
                os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
                return ({"region": "us-east-1", "endpoint_url": state["endpoint_url"]}, state["stack"])
            print(f"{work}: local mode state found but its moto server (pid {state.get('pid')}) is not running",
                  file=sys.stderr)
    return None


def _operate(args: argparse.Namespace, action: Callable[[Any, str], int]) -> int:
    """Connect to the target and run ``action(aws, stack)``; OperationsError -> its exit code."""
    from spot_training.ops.operations import OperationsError, connect

    target = _deployed_target(args)
    if target is None:
        target = ({"region": args.region, "profile": args.profile, "endpoint_url": args.endpoint_url}, "SpotTraining")
    kwargs, stack = target
    try:
        return int(action(connect(**kwargs), stack))
    except OperationsError as error:
        print(f"spot-train: error: {error}", file=sys.stderr)
        return int(error.exit_code)


def cmd_status(args: argparse.Namespace) -> int:
    """``spot-train status``: the deployed (or local) stack's training, instances, volume and alarms.

    Without a deployed target, the newest local drill's report is shown instead. ``--watch`` redraws
    every ``--interval`` seconds until training completed or Ctrl-C.

    Args:
        args: the parsed options.

    Returns:
        0 shown; 1 nothing to report; an :class:`~spot_training.ops.operations.Exit` code on an AWS error.
    """
    import datetime as dt

    from spot_training.ops import operations as ops

    if _deployed_target(args) is None:
        candidates = [Path(args.work_dir)] if args.work_dir else [DEFAULT_UP_DIR, DEFAULT_DRILL_DIR]
        for work in candidates:
            report_path = work / "report.json"
            if report_path.exists():
                report = json.loads(report_path.read_text())
                sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else format_report(report))
                return 0
        print("nothing to report: pass --stack (and --region) for a deployed stack, or run `spot-train local "
              "drill` / `spot-train local up`", file=sys.stderr)
        return 1

    def show(aws: Any, stack: str) -> int:
        while True:
            report = ops.status_report(aws, stack, now=dt.datetime.now(dt.timezone.utc), job=args.job)
            if args.json:
                print(ops.to_json(report))
            else:
                if args.watch and sys.stdout.isatty():
                    sys.stdout.write("\033[H\033[2J")
                sys.stdout.write(ops.format_status(report))
            sys.stdout.flush()
            if not args.watch or report["training"]["completed"]:
                return 0
            time.sleep(args.interval)

    try:
        return _operate(args, show)
    except KeyboardInterrupt:
        return 0  # Ctrl-C ends --watch


def cmd_logs(args: argparse.Namespace) -> int:
    """``spot-train logs``: the stack's (or a job's, or one instance's) log events; ``--follow`` polls for more.

    Args:
        args: the parsed options.

    Returns:
        0 shown (Ctrl-C ends ``--follow``); an :class:`~spot_training.ops.operations.Exit` code on an
        AWS error or an instance without a log stream.
    """
    from spot_training.ops import operations as ops

    def show(aws: Any, stack: str) -> int:
        group = args.job or stack  # a job's log group is /spot-training/<job id>
        if args.instance:
            streams = ops.log_stream_names(aws, group)
            if args.instance not in streams:
                raise ops.OperationsError(
                    f"instance {args.instance!r} has no log stream in {ops.log_group(group)!r}; instances with logs: "
                    + (", ".join(streams) if streams else "none yet"), ops.Exit.AWS_ERROR)
        events = (ops.follow_logs(aws, group, instance=args.instance, start_ms=None) if args.follow
                  else ops.log_events(aws, group, instance=args.instance))
        for event in events:
            print(json.dumps(event) if args.json else ops.format_log_line(event), flush=args.follow)
        return 0

    try:
        return _operate(args, show)
    except KeyboardInterrupt:
        return 0  # Ctrl-C ends --follow


def _finite_or_nan(text: str) -> float:
    """``text`` as a finite float, else nan, which every range check refuses (``float`` takes "nan" and "inf")."""
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def _prices(values: list[str] | None) -> dict[str, float]:
    """``TYPE=USD`` items of ``--on-demand-price`` as a dict; ValueError naming a bad item."""
    prices = {}
    for item in values or []:
        itype, _, price = item.partition("=")
        value = _finite_or_nan(price)
        if not itype or not value > 0:
            raise ValueError(f"--on-demand-price: got {item!r}; expected TYPE=USD_PER_HOUR such as g5.xlarge=1.006")
        prices[itype] = value
    return prices


def cmd_cost(args: argparse.Namespace) -> int:
    """``spot-train cost``: what the stack's (or a job's) instances, volume and snapshots cost, and on demand.

    Args:
        args: the parsed options.

    Returns:
        0 shown; 2 a bad ``--on-demand-price``; an :class:`~spot_training.ops.operations.Exit` code on an
        AWS error.
    """
    import datetime as dt

    from spot_training.ops import operations as ops

    try:
        prices = _prices(args.on_demand_price)
    except ValueError as error:
        print(f"spot-train: error: {error}", file=sys.stderr)
        return 2

    def show(aws: Any, stack: str) -> int:
        if stack is not None:
            ops.describe_stack(aws, stack)
        report = ops.cost_report(aws, stack, now=dt.datetime.now(dt.timezone.utc), on_demand=prices,
                                 ebs_gb_month=args.ebs_gb_month_price, snapshot_gb_month=args.snapshot_gb_month_price,
                                 job=args.job)
        sys.stdout.write(ops.to_json(report) + "\n" if args.json else ops.format_cost(report))
        return 0

    return _operate(args, show)


def _seconds(text: str) -> float:
    """``--interval``: seconds from 1 to 86400 (0 would redraw in a busy loop; negative sleeps fail)."""
    value = _finite_or_nan(text)
    if not 1 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected seconds from 1 to 86400")
    return value


def _price(text: str) -> float:
    """A price in USD: a finite number >= 0 (a negative one would print $-0.00)."""
    value = _finite_or_nan(text)
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a price in USD >= 0 such as 0.08")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line (argparse exits 2 on a usage error)."""
    parser = argparse.ArgumentParser(prog="spot-train", description="Spot training: local mode (moto server, real CDK CLI).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    local = sub.add_parser("local", help="local mode: drill, up, down")
    local_sub = local.add_subparsers(dest="local_command", required=True, metavar="ACTION")

    drill = local_sub.add_parser("drill", help="deploy, train through interruptions and an AZ move, destroy, report")
    drill.add_argument("--cluster", action="store_true",
                       help="the DistributedTraining drill: 2 workers, a third joins, one is interrupted (MXNet "
                            "parameter-server cluster, or with --framework pytorch TorchElastic)")
    drill.add_argument("--sweep", action="store_true",
                       help="the SpotSweep drill: 8 children on local AWS Batch, 3 reclaimed (one twice), one code error")
    drill.add_argument("--work-dir", type=Path, default=None,
                       help="output and state (default out/demo, with --cluster out/cluster-drill, with --sweep out/sweep-drill; emptied first)")
    drill.add_argument("--stack", default=None, help="stack name (default SpotTraining, with --cluster DistributedTraining)")
    drill.add_argument("--interruptions", type=int, default=None,
                       help="spot interruptions to inject (default 3; with --training-command 1, and 0 for a script "
                            "that does not checkpoint with spot_training.training)")
    drill.add_argument("--az-moves", type=int, default=None, help="interruptions whose replacement lands in another AZ (default 1)")
    drill.add_argument("--random-az", action="store_true", help="pick each replacement's AZ at random (seeded)")
    drill.add_argument("--epochs", type=int, default=30, help="training epochs over the digits (default 30 = 1,320 steps)")
    drill.add_argument("--seed", type=int, default=0, help="trainer and AZ seed (default 0)")
    drill.add_argument("--no-baseline", action="store_true", help="skip the uninterrupted baseline comparison")
    drill.add_argument("--timeout", type=float, default=None, help="seconds the training phase may take (default 900, with --cluster 480)")
    drill.add_argument("--framework", choices=("tensorflow", "mxnet", "pytorch"), default=None,
                       help="the framework: deployed with -c framework=... (with --cluster -c cluster_framework=...), "
                            "its example runs on the nodes (default tensorflow, with --cluster mxnet; --cluster takes "
                            "mxnet or pytorch; pytorch trains with .venv-torch)")
    drill.add_argument("--training-command", default=None, metavar="COMMAND",
                       help="train your own script instead of the example, e.g. \"python my_train.py --epochs 2\" "
                            "(a leading python is the node's training interpreter); its directory is shipped as the "
                            "stack's code asset (-c code_dir); checked: the contract's completion through the "
                            "interruptions (docs/localmode.md, \"Your own script\")")
    drill.add_argument("--code-dir", type=Path, default=None,
                       help="with --training-command: the directory holding your script (default: the current directory)")
    drill.add_argument("--steps", type=int, default=800, help="--cluster, --jobs: total optimizer steps (of each job; default 800)")
    drill.add_argument("--workers", type=int, default=2, help="--cluster: workers at the start; one more joins (default 2)")
    drill.add_argument("--jobs", type=int, default=None, metavar="N",
                       help="the jobs drill: N training jobs (2..4) in one stack, each interrupted --interruptions "
                            "times on its own volume and trained --steps steps; status and cost read back per job")
    drill.add_argument("--dataset-uri", default=None, metavar="s3://BUCKET/PREFIX/",
                       help="train from this prefix of the local S3, deployed as -c dataset_uri=...: the drill uploads "
                            "--dataset-dir there first (as aws s3 sync would), the volume starts empty and the agent "
                            "brings the prefix onto it (default: the stack's digits asset)")
    drill.add_argument("--dataset-dir", type=Path, default=None,
                       help="with --dataset-uri: the files to upload (default: the digits, written by prepare_digits)")
    drill.set_defaults(handler=cmd_drill)

    for name, handler, text in (("up", cmd_up, "start the moto server, cdk bootstrap, cdk deploy and the fleet's nodes; "
                                                "leave them up (training runs until it completes or `local down`)"),
                                ("down", cmd_down, "stop the nodes, cdk destroy, check for orphans, stop the moto server")):
        command = local_sub.add_parser(name, help=text)
        command.add_argument("--work-dir", type=Path, default=DEFAULT_UP_DIR, help="state directory (default out/local)")
        command.add_argument("--stack", default="SpotTraining", help="stack name (default SpotTraining)")
        command.set_defaults(handler=handler)

    preflight = sub.add_parser("preflight", help="check an AWS account before cdk deploy: service-linked roles, spot vCPU quota, "
                               "AMI parameter, spot capacity; exit 0 ok, 1 a check failed, 3 a check could not be answered")
    from spot_training.infra import preflight as preflight_module  # boto3 only until it reads the settings

    preflight_module.add_arguments(preflight)
    preflight.set_defaults(handler=preflight_module.run)

    aws_drill = sub.add_parser("drill", help="the drill on a real AWS account (--aws --region R --yes): preflight, deploy, "
                               "one FIS spot interruption, resume check, destroy, orphans, cost; exit 0 passed, 1 failed, 2 plan only")
    from spot_training.ops import aws_drill as aws_drill_module  # boto3 only until it runs

    aws_drill_module.add_arguments(aws_drill)
    aws_drill.set_defaults(handler=aws_drill_module.run)


    def target(command: argparse.ArgumentParser) -> None:
        command.add_argument("--stack", default=None, help="stack name (default SpotTraining)")
        command.add_argument("--job", default=None, help="a job id (TrainingJob; the spot-training:stack tag of its "
                             "resources) instead of, or within, --stack")
        command.add_argument("--region", default=None, help="AWS region (default: the profile's / AWS_DEFAULT_REGION)")
        command.add_argument("--profile", default=None, help="AWS profile (default: the standard credential chain)")
        command.add_argument("--endpoint-url", default=None, help="one endpoint for every AWS API (local mode's moto server)")
        command.add_argument("--work-dir", type=Path, default=None,
                             help="local mode state/report directory (default: out/local, then out/demo)")
        command.add_argument("--json", action="store_true", help="print JSON instead of tables")

    status = sub.add_parser("status", help="fleet, instances, training progress, interruptions, data volume")
    target(status)
    status.add_argument("--watch", action="store_true", help="redraw until training completes (Ctrl-C stops)")
    status.add_argument("--interval", type=_seconds, default=10.0, help="--watch: seconds between redraws, 1..86400 (default 10)")
    status.set_defaults(handler=cmd_status)
    logs = sub.add_parser("logs", help="the agents' and trainers' logs of every instance, in time order")
    target(logs)
    logs.add_argument("--instance", default=None, help="only this instance's stream")
    logs.add_argument("--follow", action="store_true", help="keep printing new lines (Ctrl-C stops)")
    logs.set_defaults(handler=cmd_logs)
    cost = sub.add_parser("cost", help="instance-hours by type and AZ at spot prices vs on demand; savings")
    target(cost)
    cost.add_argument("--on-demand-price", action="append", metavar="TYPE=USD",
                      help="on-demand USD/hour of a type (repeatable); default: the AWS Price List API")
    cost.add_argument("--ebs-gb-month-price", type=_price, default=None, help="USD per GB-month of the data volume")
    cost.add_argument("--snapshot-gb-month-price", type=_price, default=None, help="USD per GB-month of snapshots")
    cost.set_defaults(handler=cmd_cost)
    from spot_training.ops import sweep as sweep_module  # boto3 only until it runs

    sweep_module.add_parser(sub)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spot-train`` console script; returns the exit status."""
    args = parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
