"""The coordinator's rendezvous store for PyTorch clusters: one long-lived c10d ``TCPStore`` server.

    python -m spot_training.training.distributed.torch_rendezvous --host 0.0.0.0 --port 29400

Every worker node runs ``torchrun --rdzv-backend=c10d --rdzv-endpoint=<coordinator>:<port> ...``. The
c10d rendezvous backend (``torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py``) hosts
the store itself only when it is told it is the host or its hostname matches the endpoint's host;
on a worker it is neither, so each worker's torchrun is a client of this process, and no spot worker
holds the rendezvous: losing any worker keeps the store (docs/training-pytorch.md, "Elastic clusters (TorchElastic)").

This is ``torch.distributed.TCPStore(host, port, is_master=True, wait_for_workers=False)``, the
framework's own store (no server of ours). The store keeps its keys in memory only: a restarted
coordinator starts empty, so the worker agents relaunch torchrun with a new rendezvous id, and every
worker resumes from the newest checkpoint.

Logs one line (``rendezvous store listening on HOST:PORT``) once it accepts connections, then waits.
Exit statuses: 0 on SIGTERM or SIGINT; 78 (EX_CONFIG) when the port is out of range or cannot be
bound (in use, no permission), with a message naming the host and port.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `spot_training.contract` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from spot_training import contract  # noqa: E402

__all__ = ["EXIT_CONFIG", "main", "serve"]

#: Exit status for a bad address (EX_CONFIG, as the node agents' bad configuration).
EXIT_CONFIG = contract.EXIT_CONFIG

log = logging.getLogger("training.torch_rendezvous")


def serve(host: str, port: int, stop: threading.Event, *, timeout_s: float = 300.0) -> None:
    """Host a ``TCPStore`` on ``host:port`` until ``stop`` is set.

    Args:
        host: address to listen on (``0.0.0.0``: every interface; the security group limits who connects).
        port: TCP port, 1..65535.
        stop: set it to shut the store down.
        timeout_s: the store's operation timeout (seconds) for its own calls, default 300.

    Raises:
        ValueError: port outside 1..65535.
        OSError / RuntimeError (torch's ``DistNetworkError``): the port cannot be bound.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer in 1..65535. Received: port={port!r}")
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    log.info("rendezvous store listening on %s:%d", host, store.port)
    try:
        while not stop.wait(0.5):  # a timed wait: the signal handler runs between waits
            pass
    finally:
        del store


def main(argv: list[str] | None = None) -> int:
    """Parse ``--host``/``--port``, serve until SIGTERM/SIGINT; return 0, or 78 on a bad address."""
    p = argparse.ArgumentParser(description="c10d TCPStore server for torchrun's rendezvous (the coordinator)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=29400, help="TCP port (default 29400, torchrun's default)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    if not 1 <= args.port <= 65535:
        log.error("--port must be in 1..65535. Received: --port=%d", args.port)
        return EXIT_CONFIG
    try:
        serve(args.host, args.port, stop)
    except (OSError, RuntimeError) as err:  # torch's DistNetworkError is a RuntimeError
        log.error("cannot listen on %s:%d (port in use or not permitted; pick another --port): %s",
                  args.host, args.port, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return EXIT_CONFIG
    log.info("rendezvous store on %s:%d stopped", args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
