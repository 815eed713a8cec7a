"""What each process of a parameter-server generation is started with: argv and environment.

Standard library only (it also runs as a script: ``python launch.py exec``, see :func:`main`).

MXNet (ps-lite, ``dist_sync``): every process reads the ``DMLC_*`` variables. The scheduler node runs
the ps-lite scheduler, each server node one server, each worker node one worker (the training
command). ps-lite itself assigns worker ranks, by sorting the workers' ``host:port``; the plan's ranks
are informational for MXNet and the trainer uses ``kvstore.rank``.

========================  =====================================================================
``DMLC_ROLE``             ``scheduler`` | ``server`` | ``worker``
``DMLC_PS_ROOT_URI``      the scheduler's private IPv4 address
``DMLC_PS_ROOT_PORT``     the scheduler's port (``cluster.scheduler_port``)
``DMLC_NUM_SERVER``       number of servers in the plan
``DMLC_NUM_WORKER``       number of workers in the plan
``DMLC_NODE_HOST``        this node's private IPv4 address (ps-lite otherwise guesses an interface)
``PORT``                  this node's fixed port; checked free first, because a ps-lite server
                          whose ``PORT`` is taken silently binds a random port instead
========================  =====================================================================

TensorFlow (``ParameterServerStrategy``): ``TF_CONFIG`` is JSON
``{"cluster": {"chief": [...], "ps": [...], "worker": [...]}, "task": {"type": T, "index": I}}``
(https://www.tensorflow.org/guide/distributed_training#setting_up_the_tf_config_environment_variable).
The scheduler node runs the chief (the training command, with ``ClusterCoordinator``); ps and worker
nodes run ``python -m spot_training.training.distributed.tf_server`` (a ``tf.distribute.Server`` that joins).

Every process also gets ``SPOT_TRAINING_GENERATION``, ``SPOT_TRAINING_NUM_WORKERS``,
``SPOT_TRAINING_NODE_ID`` (the instance id) and ``SPOT_TRAINING_WORKER_RANK`` (workers; the plan's
rank) besides the single-node variables.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
from typing import Any, Mapping, Sequence

if not __package__:  # run as a script (``python launch.py exec``): find the package beside this file
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spot_training.contract import ENV_GENERATION, ENV_NODE_ID, ENV_NUM_WORKERS, ENV_WORKER_RANK  # noqa: E402

__all__ = ["ProcessSpec", "dmlc_environment", "tf_config", "process_for", "check_port_free", "NETNS_ENV"]

#: Local mode only: run this node's framework processes inside this network namespace (``ip netns exec``).
NETNS_ENV = "SPOT_TRAINING_NETNS"

#: Framework role of a node role in a plan: (mxnet DMLC_ROLE, tensorflow task type).
_ROLE_NAMES = {"scheduler": ("scheduler", "chief"), "server": ("server", "ps"), "worker": ("worker", "worker")}


class ProcessSpec:
    """One process to start on a cluster node.

    Args:
        argv: the command (list of str).
        env: the variables to add to the environment (str -> str).
        role: ``scheduler``, ``server`` or ``worker``.
        checkpoints: True for the process that must checkpoint before a generation changes (MXNet
            workers, the TensorFlow chief).
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], role: str, checkpoints: bool) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.role = role
        self.checkpoints = checkpoints

    def __repr__(self) -> str:
        return f"ProcessSpec(role={self.role!r}, argv={self.argv!r}, checkpoints={self.checkpoints})"


def _member(plan: Mapping[str, Any], node_id: str) -> tuple[str, Mapping[str, Any]]:
    if plan["scheduler"]["node_id"] == node_id:
        return "scheduler", plan["scheduler"]
    for role, key in (("server", "servers"), ("worker", "workers")):
        for member in plan[key]:
            if member["node_id"] == node_id:
                return role, member
    raise KeyError(f"node {node_id!r} is not in generation {plan.get('generation')!r} of the plan")


def dmlc_environment(plan: Mapping[str, Any], node_id: str) -> dict[str, str]:
    """The ``DMLC_*`` and ``PORT`` variables for ``node_id`` in ``plan`` (see the module docstring).

    Args:
        plan: the plan dict (:meth:`spot_training.agent.cluster_state.Plan.to_dict`).
        node_id: the node whose variables these are.

    Returns:
        ``{"DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER", "DMLC_NUM_WORKER",
        "DMLC_NODE_HOST", "PORT", "PS_VERBOSE"}``, all strings.

    Raises:
        KeyError: the node is not in the plan.
    """
    role, me = _member(plan, node_id)
    scheduler = plan["scheduler"]
    return {
        "DMLC_ROLE": _ROLE_NAMES[role][0],
        "DMLC_PS_ROOT_URI": str(scheduler["host"]),
        "DMLC_PS_ROOT_PORT": str(scheduler["port"]),
        "DMLC_NUM_SERVER": str(len(plan["servers"])),
        "DMLC_NUM_WORKER": str(len(plan["workers"])),
        "DMLC_NODE_HOST": str(me["host"]),
        "PORT": str(me["port"]),
        "PS_VERBOSE": "0",
    }


def tf_config(plan: Mapping[str, Any], node_id: str) -> dict[str, Any]:
    """The ``TF_CONFIG`` dict for ``node_id``: chief = scheduler, ps = servers in plan order, worker = by rank.

    Args:
        plan: the plan dict (:meth:`spot_training.agent.cluster_state.Plan.to_dict`).
        node_id: the node whose ``TF_CONFIG`` this is.

    Returns:
        ``{"cluster": {"chief", "ps", "worker": ["host:port", ...]}, "task": {"type", "index"}}``.

    Raises:
        KeyError: the node is not in the plan.
    """
    role, me = _member(plan, node_id)
    address = lambda m: f"{m['host']}:{m['port']}"  # noqa: E731
    workers = sorted(plan["workers"], key=lambda m: m["rank"])
    cluster = {"chief": [address(plan["scheduler"])], "ps": [address(m) for m in plan["servers"]],
               "worker": [address(m) for m in workers]}
    if role == "scheduler":
        index = 0
    elif role == "server":
        index = [m["node_id"] for m in plan["servers"]].index(node_id)
    else:
        index = int(me["rank"])
    return {"cluster": cluster, "task": {"type": _ROLE_NAMES[role][1], "index": index}}


def process_for(plan: Mapping[str, Any], node_id: str, *, framework: str, training_argv: Sequence[str],
                python: str, launcher: Sequence[str] = ()) -> ProcessSpec:
    """The process ``node_id`` runs in ``plan``.

    Args:
        plan: the plan dict (:meth:`spot_training.agent.cluster_state.Plan.to_dict`).
        node_id: this node.
        framework: ``mxnet`` or ``tensorflow``.
        training_argv: the training command (placeholders already replaced); it runs on MXNet workers and
            on the TensorFlow chief.
        python: the training interpreter, for the framework-only processes (MXNet scheduler/server:
            ``import mxnet`` starts them when ``DMLC_ROLE`` says so; TensorFlow ps/worker:
            ``-m spot_training.training.distributed.tf_server``).
        launcher: argv prefix (e.g. the port check and ``ip netns exec``); default none.

    Returns:
        the process to start, with the generation, worker count, node id (and rank) in its environment.

    Raises:
        ValueError: an unknown framework.
        KeyError: the node is not in the plan.
    """
    role, me = _member(plan, node_id)
    env = {ENV_GENERATION: str(plan["generation"]), ENV_NUM_WORKERS: str(len(plan["workers"])), ENV_NODE_ID: node_id}
    if role == "worker":
        env[ENV_WORKER_RANK] = str(me["rank"])
    if framework == "mxnet":
        env.update(dmlc_environment(plan, node_id))
        argv = list(training_argv) if role == "worker" else [python, "-c", "import mxnet"]
        checkpoints = role == "worker"
    elif framework == "tensorflow":
        env["TF_CONFIG"] = json.dumps(tf_config(plan, node_id), sort_keys=True)
        argv = list(training_argv) if role == "scheduler" else [python, "-m", "spot_training.training.distributed.tf_server"]
        checkpoints = role == "scheduler"
    else:
        raise ValueError(f"framework must be 'mxnet' or 'tensorflow', got {framework!r}")
    return ProcessSpec([*launcher, *argv], env, role, checkpoints)


def check_port_free(host: str, port: int) -> None:
    """Raise OSError (naming host, port and the fix) unless a TCP socket can bind ``host:port``.

    Uses SO_REUSEADDR as ps-lite and gRPC do, so a port in TIME_WAIT after the previous generation
    counts as free.

    Args:
        host: the address to bind (IPv4).
        port: the TCP port.

    Raises:
        OSError: the port cannot be bound (its errno kept).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
    except OSError as exc:
        raise OSError(exc.errno or errno.EADDRINUSE,
                      f"port {port} on {host} is not free ({exc.strerror}); a ps-lite server given a taken PORT "
                      "silently binds a random one, so the node refuses to start. Stop what holds the port or "
                      "change cluster.*_port") from None
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    """``python launch.py exec --check-port HOST:PORT -- CMD...``: check the port, then exec CMD.

    Runs inside the node's network (namespace), right before the framework process, so the check
    sees the same sockets the process will. Exits 75 (EX_TEMPFAIL) when the port is taken.
    """
    parser = argparse.ArgumentParser(prog="launch.py")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("exec", help="check the node's port, then exec the command")
    ex.add_argument("--check-port", default=None, help="HOST:PORT that must be free")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("exec needs a command after --")
    if args.check_port:
        host, _, port = args.check_port.rpartition(":")
        try:
            check_port_free(host, int(port))
        except OSError as exc:
            print(f"launch: {exc.strerror}", file=sys.stderr)
            return 75
    os.execvp(cmd[0], cmd)
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
