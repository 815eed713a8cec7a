"""A cluster node's entry (``node_role`` scheduler/server/worker): :func:`run_node` picks the agent.

MXNet and TensorFlow change membership by generations (spot_training/agent/cluster_coordinator.py, spot_training/agent/ps_node.py);
PyTorch by TorchElastic (spot_training/agent/torch_elastic.py). Both keep their files on EFS
(spot_training/agent/cluster_state.py), watch the same events through the single node's pipeline (spot_training/agent/interruption.py, :func:`poll_events`)
and act on EC2 the same way when done (spot_training/agent/fleet_actions.py). Standard library only.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, Callable

from spot_training.agent import launch, torch_elastic
from spot_training.agent.cleanup import ec2_client
from spot_training.agent.cluster_state import settings_from_config
from spot_training.agent.errors import ConfigError
from spot_training.agent.fleet_actions import finish_node
from spot_training.agent.interruption import IMDS_FORBIDDEN, cluster_monitors
from spot_training.agent.ps_node import NodeAgent
from spot_training.agent.safepath import open_directory

log = logging.getLogger("spot_training.agent.cluster")

__all__ = ["run_node"]


def run_node(config: Any, imds: Any, *, instance_id: str, local_mode: bool,
             on_environment_ready: Callable[[], None] | None = None) -> str:
    """Run this node as a cluster member (``node_role`` scheduler/server/worker); the CLI's entry.

    Reads the private address from IMDS (``local-ipv4``), the ``cluster`` section from the config's
    extensions, and watches spot interruption notices and the member tag on workers.

    Args:
        config: the validated node config (:class:`~spot_training.agent.config.AgentConfig`).
        imds: the instance metadata client (:class:`~spot_training.agent.imds.ImdsClient`).
        instance_id: this instance's id.
        local_mode: a missing training user runs as the current user, and ``SPOT_TRAINING_NETNS`` names
            the network namespace of the node's processes.
        on_environment_ready: called once the code and the trainer's environment are ready (the boot
            succeeded: the CLI clears the failed-boot count); default None.

    Returns:
        the :meth:`NodeAgent.run` outcome.

    Raises:
        ConfigError: a bad ``cluster`` section, or ``node_role`` ``server`` with PyTorch (exit 78).
    """
    from spot_training.agent.workspace import Workspace  # looked up at call time (tests replace it)

    settings = settings_from_config(config.extensions.get("cluster"), framework=config.training.framework)
    if config.training.framework == "pytorch" and config.node_role == "server":
        raise ConfigError(f"node_role: got 'server' with training.framework 'pytorch'; a PyTorch cluster has no "
                          "parameter servers (node_role 'scheduler' runs the rendezvous, 'worker' runs torchrun)")
    workspace = Workspace(config, run_as_current_user_if_missing=local_mode)
    workdir = workspace.prepare_code()
    python = workspace.prepare_environment()  # once on EFS; every later node reuses it
    if on_environment_ready is not None:
        on_environment_ready()
    user = workspace.user()
    for directory in (config.training.checkpoint_dir, config.training.log_dir):
        os.close(open_directory(directory, create=True))  # on EFS: no planted link followed (safepath)
    netns = os.environ.get(launch.NETNS_ENV) if local_mode else None
    monitors = cluster_monitors(imds, settings.member_tag)
    if config.training.framework == "pytorch":
        # TorchElastic does membership (spot_training/agent/torch_elastic.py); no generations, no servers.
        common = dict(node_id=instance_id, host=imds.private_ipv4(), python=python,
                      environ=workspace.trainer_environment(), workdir=workdir,
                      checkpoint_dir=config.training.checkpoint_dir, log_dir=config.training.log_dir, netns=netns,
                      preexec_user=user)
        if config.node_role == "scheduler":
            agent = torch_elastic.TorchCoordinator(settings, **common)
        else:
            agent = torch_elastic.TorchWorker(settings, training_argv=config.training.argv(python),
                                              run_id_prefix=config.stack_name, dataset_dir=config.training.dataset_dir,
                                              monitors=monitors, monitor_interval_s=config.notice_poll_interval_s,
                                              **common)
    else:
        agent = NodeAgent(settings, framework=config.training.framework, role=config.node_role, node_id=instance_id,
                          host=imds.private_ipv4(), training_argv=config.training.argv(python),
                          python=python, environ=workspace.trainer_environment(), workdir=workdir,
                          checkpoint_dir=config.training.checkpoint_dir, dataset_dir=config.training.dataset_dir,
                          log_dir=config.training.log_dir, monitors=monitors,
                          monitor_interval_s=config.notice_poll_interval_s, netns=netns, preexec_user=user)
    previous = {sig: signal.signal(sig, lambda *_: agent.request_stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        outcome = agent.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("cluster node done", extra={"outcome": outcome, "role": config.node_role})
    if agent.leave_reason == IMDS_FORBIDDEN:
        from spot_training.agent.errors import NodeUnusableError

        # The CLI powers the instance off (terminate behaviour: the fleet replaces it) and exits 69.
        raise NodeUnusableError("IMDS answered 403 during training; this worker left the cluster through a "
                                "checkpoint and hands itself back to the fleet")
    # Local mode has an EC2 API only when a moto server is named (AWS_ENDPOINT_URL).
    if not local_mode or os.environ.get("AWS_ENDPOINT_URL"):
        finish_node(outcome, role=config.node_role, leave_reason=agent.leave_reason,
                    cancel_fleet_on_success=config.cleanup.cancel_fleet_on_success,
                    ec2_factory=lambda: ec2_client(config.region), instance_id=instance_id, stack_name=config.stack_name)
    return outcome
