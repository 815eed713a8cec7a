"""Catch SIGTERM (and SIGUSR1) from the very first line of a training script.

    import spot_training.training.early_notice          # first line of the script, before any slow import
    import tensorflow as tf               # a SIGTERM during these seconds no longer kills the process
    ...

Importing this module (standard library only; it costs microseconds) installs signal handlers that
only set flags, in the main thread. Without it, a SIGTERM that arrives before the training library
installed its own handlers (``import tensorflow`` alone takes seconds; so does building a model)
kills the process with status -15 and no say in the matter. With it, the stop is remembered: the
first :class:`spot_training.training.notice.NoticeHandler` installed later (every front-end installs one) takes
the flags over, so the driver sees a stop before the first step and exits 0 without training (the
restored checkpoint is already the state on disk); a SIGUSR1 becomes a checkpoint request.
(docs/contracts.md: SIGTERM = save and exit 0.)

After the front-end uninstalls its handlers (training over), these flag-setting handlers are the
ones in place again, so a later SIGTERM only sets a flag; the node agent's stop timeout, then
SIGKILL, still ends a script that keeps running after training.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["checkpoint_requested", "installed", "stop_requested", "stop_signal"]

stop_requested = threading.Event()
checkpoint_requested = threading.Event()
stop_signal: int | None = None


def _on_stop(signum, _frame) -> None:
    global stop_signal
    stop_signal = signum
    stop_requested.set()


def _on_checkpoint(_signum, _frame) -> None:
    checkpoint_requested.set()


installed = threading.current_thread() is threading.main_thread()
if installed:
    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGUSR1, _on_checkpoint)
