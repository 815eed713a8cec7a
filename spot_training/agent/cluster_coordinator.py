"""Elastic membership of a parameter-server cluster: registrations, the plan, heartbeats, generations.

Neither MXNet 1.9.1 (no elastic kvstore) nor TensorFlow (the elastic parameter-server pull request was
closed) can add a worker address to a running job, so membership changes by *generations*
(docs/architecture.md, "Clusters run on the frameworks' own engines"). The files live on EFS
(spot_training/agent/cluster_state.py); each node's agent is spot_training/agent/ps_node.py's :class:`NodeAgent`, and this
module's :class:`Coordinator` keeps the plan inside the scheduler's agent.

Roles: the ``scheduler`` node's agent is the coordinator (and runs the ps-lite scheduler or the
TensorFlow chief); ``server`` nodes run parameter servers; ``worker`` nodes train (spot).

A generation goes ``running`` -> (``checkpoint`` ->) ``teardown`` -> the next one ``running``:

- *Join* (a data-ready worker not in the plan, membership stable for ``debounce_s``) and *leave* (a
  worker whose registration says ``leaving``: spot interruption notice, member tag removed, agent
  stopped; no debounce; after a tag removal the agent then lowers its fleet's target capacity and
  terminates its instance, see :func:`leave_fleet`) go through ``checkpoint``: the checkpointing
  processes get SIGTERM (MXNet workers agree on a last step through the kvstore and rank 0 saves;
  the TensorFlow chief joins its coordinator and saves), then ``teardown``.
- *Failure* goes straight to ``teardown`` (a checkpoint cannot complete with a process gone: MXNet
  hangs silently): a member's heartbeat older than ``heartbeat_timeout_s`` (node gone), or a member's
  process exited inside a running generation (any MXNet process; TensorFlow chief or ps; a
  TensorFlow worker is restarted at the same address instead, which TensorFlow tolerates).
- ``teardown``: every agent SIGTERMs its process group and SIGKILLs it after ``kill_grace_s``; when
  every member's process is gone (or ``stop_timeout_s`` passed) the coordinator writes the next
  generation, whose trainers restore the newest checkpoint. Too few nodes: state ``waiting``.
- ``COMPLETED`` in the checkpoint directory: state ``completed``; every agent stops and exits 0; the
  workers' agents cancel their spot fleet (:func:`finish_node`).

Hand-rolled because no library does membership for ps-lite/TF clusters on a shared file system (etcd
or ZooKeeper would be one more service to run on spot capacity); it needs only atomic renames on EFS.
Standard library only; the clock, sleep and monitors are injected.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from spot_training.agent.cluster_state import (CHECKPOINT, COMPLETED, RUNNING, TEARDOWN, WAITING, ClusterConfig, ClusterState,
                                     Plan, make_plan)

log = logging.getLogger("spot_training.agent.cluster")

__all__ = ["Coordinator"]


class Coordinator:
    """Keeps the plan; runs inside the scheduler node's agent, one :meth:`tick` per agent loop.

    Args:
        state: the cluster's state files (:class:`ClusterState`).
        settings: the validated ``cluster`` section (:class:`ClusterConfig`).
        framework: ``mxnet`` or ``tensorflow``.
        node_id: the scheduler node itself (always the plan's scheduler).
        completed: returns True once the trainer wrote ``COMPLETED``.
        clock: wall-clock seconds (heartbeats from other nodes carry wall time; default ``time.time``).
    """

    def __init__(self, state: ClusterState, settings: ClusterConfig, *, framework: str, node_id: str,
                 completed: Callable[[], bool], clock: Callable[[], float] = time.time) -> None:
        self.state, self.settings, self.framework, self.node_id = state, settings, framework, node_id
        self.completed, self.clock = completed, clock
        self._desired: tuple | None = None
        self._desired_since = 0.0

    def _alive(self, node_id: str, regs: Mapping[str, dict], beats: Mapping[str, dict], now: float) -> bool:
        beat = beats.get(node_id)
        if beat is not None:
            return now - float(beat["time"]) <= self.settings.heartbeat_timeout_s
        reg = regs.get(node_id)
        return reg is not None and now - float(reg["registered_at"]) <= self.settings.heartbeat_timeout_s

    def _process_failed(self, plan: Plan, node_id: str, role: str, beat: Mapping[str, Any] | None) -> bool:
        if beat is None or beat.get("generation") != plan.generation or beat.get("proc") != "exited":
            return False
        if self.framework == "tensorflow" and role == "worker":
            return False  # its agent restarts it at the same address; TensorFlow tolerates that
        return True

    def tick(self) -> Plan | None:
        """Look at registrations, heartbeats and the plan once; write the next plan if it changes.

        Returns:
            the current plan.
        """
        now = self.clock()
        regs, beats = self.state.registrations(), self.state.heartbeats()
        for node_id in list(regs):
            if node_id != self.node_id and not self._alive(node_id, regs, beats, now):
                log.warning("cluster node declared dead: no heartbeat", extra={
                    "node_id": node_id, "timeout_s": self.settings.heartbeat_timeout_s})
                self.state.deregister(node_id)
                regs.pop(node_id)
        me = regs.get(self.node_id)
        servers = sorted((r for r in regs.values() if r["role"] == "server"),
                         key=lambda r: (r["registered_at"], r["node_id"]))[: self.settings.num_servers]
        workers = [r for r in regs.values() if r["role"] == "worker" and r.get("data_ready") and not r.get("leaving")]
        desired = (tuple(s["node_id"] for s in servers), tuple(sorted(w["node_id"] for w in workers)))
        if desired != self._desired:
            self._desired, self._desired_since = desired, now
        stable = now - self._desired_since >= self.settings.debounce_s
        enough = me is not None and len(servers) == self.settings.num_servers and len(workers) >= self.settings.min_workers
        plan = self.state.plan()

        def next_generation(reason: str) -> Plan:
            new = make_plan(generation=(plan.generation if plan else 0) + 1, framework=self.framework, scheduler=me,
                            servers=servers, workers=workers, now=now, reason=reason)
            self.state.write_plan(new)
            return new

        if plan is not None and plan.state == COMPLETED:
            return plan
        if self.completed() and (plan is None or plan.state != COMPLETED):
            base = plan or make_plan(generation=0, framework=self.framework, scheduler=me or {"node_id": self.node_id,
                                     "host": "", "port": 0}, servers=[], workers=[], now=now, reason="")
            done = base.with_state(COMPLETED, since=now, reason="COMPLETED written by the trainer")
            self.state.write_plan(done)
            return done
        if plan is None or plan.state == WAITING:
            if enough and stable:
                return next_generation("first generation" if plan is None else "enough nodes registered")
            return plan
        members = plan.members()
        if plan.state == RUNNING:
            gone = [n for n in members if n not in regs]
            failed = [n for n, role in members.items() if self._process_failed(plan, n, role, beats.get(n))]
            if gone or failed:
                why = (f"node(s) gone: {sorted(gone)}" if gone else "") + \
                      ("; " if gone and failed else "") + (f"process exited on {sorted(failed)}" if failed else "")
                return self._set(plan, TEARDOWN, now, why)
            leaving = [n for n, r in regs.items() if r.get("leaving") and n in members]
            if leaving:
                return self._set(plan, CHECKPOINT, now, f"leaving: {sorted(leaving)}")
            if desired != plan.membership() and stable and enough:
                joined = sorted(set(desired[1]) - set(plan.membership()[1]))
                return self._set(plan, CHECKPOINT, now, f"membership changed (joined: {joined})")
            return plan
        if plan.state == CHECKPOINT:
            savers = [n for n, role in members.items()
                      if role == ("worker" if self.framework == "mxnet" else "scheduler")]
            done = all(n not in regs or beats.get(n, {}).get("proc") != "running" for n in savers)
            if done or now - plan.since > self.settings.stop_timeout_s:
                return self._set(plan, TEARDOWN, now, "checkpoint written" if done else
                                 f"checkpoint phase timed out after {self.settings.stop_timeout_s} s")
            return plan
        if plan.state == TEARDOWN:
            done = all(n not in regs or beats.get(n, {}).get("proc") != "running"
                       or beats[n].get("generation") != plan.generation for n in members)
            if done or now - plan.since > self.settings.stop_timeout_s:
                if enough:
                    return next_generation(f"after generation {plan.generation}: {plan.reason}")
                return self._set(plan, WAITING, now, f"waiting for nodes ({len(servers)}/{self.settings.num_servers} "
                                                     f"servers, {len(workers)} workers)")
        return plan

    def _set(self, plan: Plan, state: str, now: float, reason: str) -> Plan:
        new = plan.with_state(state, since=now, reason=reason)
        self.state.write_plan(new)
        return new

