"""One way to run a child process: the single-node trainer and every cluster process.

:class:`ProcessGroup` starts a process in a session (process group) of its own, as the training user,
and stops it the contract's way (docs/contracts.md, "Signals and files"): SIGTERM to the trainer's
leader process, a wait, then SIGKILL to the whole group and every descendant at the deadline.
Standard library only; Linux (``/proc`` for the descendants).
"""

from __future__ import annotations

import logging
import os
import pwd
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from spot_training.agent.safepath import open_file
from spot_training.contract import pid_alive

log = logging.getLogger("spot_training.agent.supervisor")

__all__ = ["ProcessGroup", "descendants", "group_alive", "kill_tree", "signal_group", "user_ids", "user_kwargs"]


def user_ids(account: pwd.struct_passwd | None) -> tuple[int, int, list[int]] | None:
    """``(uid, gid, supplementary groups)`` of ``account``, or None for None (run as the current user)."""
    if account is None:
        return None
    return account.pw_uid, account.pw_gid, os.getgrouplist(account.pw_name, account.pw_gid)


def user_kwargs(user: tuple[int, int, list[int]] | None) -> dict[str, Any]:
    """subprocess's privilege-drop arguments for ``user`` (``user``/``group``/``extra_groups``, Python 3.9+)."""
    if user is None:
        return {}
    uid, gid, groups = user
    return {"user": uid, "group": gid, "extra_groups": list(groups)}


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pgid``; a group that is already gone is fine.

    Args:
        pgid: the process group id (the leader's pid).
        sig: the signal number.

    Raises:
        PermissionError: the group belongs to another user.
    """
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL the process group ``pid``, the process ``pid`` and every descendant of it, wherever
    their sessions are; processes already gone are fine."""
    # The descendants are listed before any signal: once the process dies, its children (torchrun's
    # ranks, a trainer in a session of its own) are reparented and no longer found under its pid.
    pids = [pid, *descendants(pid)]
    signal_group(pid, signal.SIGKILL)
    for each in pids:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def group_alive(pgid: int) -> bool:
    """True while any process of the process group ``pgid`` exists (:func:`spot_training.contract.pid_alive`)."""
    return pid_alive(pgid, group=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first seen in /proc; Linux). Empty when /proc is missing."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # fields after "(comm)": state ppid ...
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class ProcessGroup:
    """One child process in a session (process group) of its own: how the agent runs the single-node
    trainer (:class:`Supervisor`) and every cluster process (spot_training/agent/ps_node.py, spot_training/agent/torch_elastic.py).

    :meth:`start` runs ``argv`` with ``start_new_session``, stdin from /dev/null, as ``user``
    (``(uid, gid, groups)``; None: the current user), inside the network namespace ``netns`` when given
    (local mode: ``ip netns exec NS``), its output appended to ``log_path`` or sent to ``stdout``
    (``subprocess.PIPE`` or None: the agent's own). :meth:`stop` is SIGTERM once, then SIGKILL after
    ``kill_after`` seconds; :meth:`kill` reaches every descendant too (torchrun starts each rank in a
    session of its own, so its group alone would orphan the ranks).

    Attributes: ``proc`` (the Popen), ``term_sent`` (clock seconds, when SIGTERM was sent), ``killed``.

    Args:
        proc: the started process (the leader of its own session).
        clock: monotonic seconds (default ``time.monotonic``).
    """

    def __init__(self, proc: subprocess.Popen, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.proc, self.clock = proc, clock
        self.term_sent: float | None = None
        self.killed = False

    @classmethod
    def start(cls, argv: list[str], *, cwd: str | os.PathLike, env: Mapping[str, str],
              user: tuple[int, int, list[int]] | None = None, netns: str | None = None,
              log_path: Path | None = None, stdout: int | None = None,
              clock: Callable[[], float] = time.monotonic) -> "ProcessGroup":
        """Start ``argv`` in a session of its own (see the class docstring).

        Args:
            argv: the command.
            cwd: its working directory.
            env: its whole environment.
            user: ``(uid, gid, supplementary gids)`` to run as (None: the current user; dropping needs root).
            netns: the network namespace to run in (``ip netns exec``), or None.
            log_path: a file its stdout and stderr are appended to (opened without following links and given
                to ``user``), or None.
            stdout: with no ``log_path``: ``subprocess.PIPE`` or None (the agent's own streams).
            clock: monotonic seconds for :meth:`stop` (default ``time.monotonic``).

        Returns:
            the started group.

        Raises:
            OSError: the command cannot be run, or the log file cannot be opened safely.
        """
        prefix = ["ip", "netns", "exec", netns] if netns else []
        # The log is on storage the training user writes (EFS on clusters): appended to without following a
        # planted link, hard link or FIFO (safepath), and owned by the user the process runs as.
        log_file = None
        if log_path is not None:
            log_file = os.fdopen(open_file(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")
            if user is not None:
                try:
                    os.fchown(log_file.fileno(), user[0], user[1])
                except PermissionError:
                    pass  # an EFS access point that enforces a POSIX user already owns it as that user
        out = log_file if log_file is not None else stdout
        streams = {} if out is None else {"stdout": out, "stderr": subprocess.STDOUT}
        try:
            proc = subprocess.Popen([*prefix, *argv], cwd=cwd, env=dict(env), start_new_session=True,
                                    stdin=subprocess.DEVNULL, **streams, **user_kwargs(user))
        finally:
            if log_file is not None:
                log_file.close()  # the child writes through its own copy of the descriptor
        return cls(proc, clock=clock)

    @property
    def pid(self) -> int:
        """The process id (also the process group id)."""
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit status once the process exited, else None."""
        return self.proc.poll()

    def signal(self, sig: int, *, group: bool = True) -> None:
        """Send ``sig`` to the process group (``group``) or the process alone; gone is fine.

        Args:
            sig: the signal number.
            group: the whole process group (default True).
        """
        if group:
            signal_group(self.proc.pid, sig)
        else:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, *, kill_after: float | None, group: bool = True) -> None:
        """Call repeatedly: SIGTERM once (to the group, or the process alone when not ``group``), then
        :meth:`kill` once ``kill_after`` seconds have passed since (None: never).

        Args:
            kill_after: seconds after the SIGTERM before SIGKILL (None: never).
            group: signal the whole group (default True) or the process alone.
        """
        now = self.clock()
        if self.term_sent is None:
            self.term_sent = now
            self.signal(signal.SIGTERM, group=group)
        elif kill_after is not None and not self.killed and now - self.term_sent >= kill_after:
            log.warning("process did not stop after SIGTERM; SIGKILL", extra={"pid": self.proc.pid})
            self.kill()

    def terminate(self, timeout_s: float, *, poll_s: float = 0.05) -> int:
        """The contract's stop (docs/contracts.md, "Signals and files"), waiting for it; blocks up to
        ``timeout_s`` seconds (plus the time SIGKILL takes).

        1. SIGTERM to the leader process only: the trainer saves and exits, and its worker processes
           (DataLoader workers, a ``multiprocessing`` pool, subprocesses it started) keep running until
           it has, so none of them dies under it and turns the notice into a crash;
        2. when the leader exits while processes of its group remain (a shell wrapper that does not
           forward signals, a child the trainer left behind), SIGTERM to the group;
        3. at the deadline, SIGKILL to the group and every descendant (:meth:`kill`).

        Args:
            timeout_s: seconds from now to the deadline (the notice's deadline minus the agent's margin,
                or the agent's stop timeout).
            poll_s: how often the group is checked, seconds.

        Returns:
            The leader's exit status (negative: the signal that ended it).
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self.term_sent is None:
            self.term_sent = self.clock()
            self.signal(signal.SIGTERM, group=False)
        forwarded = False
        while True:
            status = self.proc.poll()
            if status is not None:
                if not group_alive(self.proc.pid):
                    return status
                if not forwarded:
                    forwarded = True
                    log.info("the trainer's leader exited; SIGTERM to the rest of its process group",
                             extra={"pgid": self.proc.pid, "exit_status": status})
                    signal_group(self.proc.pid, signal.SIGTERM)
            if time.monotonic() >= deadline:
                log.warning("the trainer did not stop by the deadline; SIGKILL to its process group",
                            extra={"pgid": self.proc.pid, "timeout_s": round(timeout_s, 1)})
                self.kill()
                self.proc.wait()
                return self.proc.returncode
            time.sleep(poll_s)

    def kill(self) -> None:
        """SIGKILL the group, the process and every descendant of it."""
        self.killed = True
        kill_tree(self.proc.pid)

    def kill_and_wait(self) -> int:
        """:meth:`kill`, then reap; returns the exit status."""
        self.kill()
        self.proc.wait()
        return self.poll()
