"""Exit codes and the exception hierarchy of the node agent.

Exit codes follow sysexits.h so that systemd (``RestartPreventExitStatus=78``) can stop a restart
loop on bad config while still retrying temporary failures (docs/contracts.md, "Agent exit codes").
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit status of ``python3 -m bootstrap``.

    ``OK`` (0): done. ``CHECKPOINT_STORAGE`` (74, EX_IOERR): the trainer exited 74 because its
    checkpoint storage is full or unusable; a restart would fail the same way, so systemd does not
    restart (``RestartPreventExitStatus``). ``TEMPFAIL`` (75, EX_TEMPFAIL): try again later (lease
    held by another node, volume still detaching). ``CONFIG`` (78, EX_CONFIG): bad configuration;
    nothing was touched. ``GAVE_UP`` (69, EX_UNAVAILABLE): a boot failure was reported and the node is
    shutting down or its fleet was cancelled (docs/agent.md, "Boot failures"); systemd must not restart
    the agent.
    """

    OK = 0
    CHECKPOINT_STORAGE = 74
    GAVE_UP = 69
    TEMPFAIL = 75
    CONFIG = 78


class AgentError(Exception):
    """An error the agent reports and exits on, carrying the exit code to use.

    ``exit_code`` defaults to the class attribute (``ExitCode.TEMPFAIL`` for the base class, since an
    unclassified failure is worth a retry by systemd); pass ``exit_code=`` to override it.
    """

    exit_code: ExitCode = ExitCode.TEMPFAIL

    def __init__(self, message: str, *, exit_code: ExitCode | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = ExitCode(exit_code)


class ConfigError(AgentError):
    """The configuration (file, values, or what it names in AWS) is wrong: exit 78, nothing touched.

    ``problems`` lists every individual problem found (each names the key path, the bad value and
    what is allowed); ``str(error)`` joins them.
    """

    exit_code = ExitCode.CONFIG

    def __init__(self, message: str | None = None, *, problems: list[str] | tuple[str, ...] = ()) -> None:
        self.problems: tuple[str, ...] = tuple(problems) if problems else ((message,) if message else ())
        if message is None:
            message = "invalid configuration:\n  - " + "\n  - ".join(self.problems)
        super().__init__(message)


class TemporaryError(AgentError):
    """A transient condition (lease held elsewhere, volume still detaching, throttling): exit 75."""

    exit_code = ExitCode.TEMPFAIL
