"""Run a real moto server process on loopback, with our compatibility patches applied inside it.

Local mode and the tests talk to AWS through this server over HTTP, exactly as the agents talk to
AWS: boto3 clients pointed at ``endpoint_url`` (or ``AWS_ENDPOINT_URL``) with fake credentials.

The server is started through our own entry (``python -m spot_training.local.moto_server _serve ...``) that
imports moto, applies :func:`spot_training.local.moto_compat.apply` (moto 5.2.5's gaps, plus the local EBS data
plane: a volume's bytes are a directory under ``<work_dir>/ebs``) and :func:`spot_training.local.spot_prices.apply`
(``DescribeSpotPriceHistory`` answers from a dated table of real prices, not moto's placeholder), then runs moto's own server
(``moto.server.main``). Nothing here is needed on AWS.

Usage::

    with MotoServer(work_dir) as server:          # starts, waits until it answers
        ec2 = boto3.client("ec2", endpoint_url=server.endpoint_url, region_name="us-east-1")
        ...
        server.reset()                             # POST /moto-api/reset: empty every backend
    # stopped by PID, log kept in <work_dir>/moto_server.log

or from a shell (foreground until Ctrl-C, prints one JSON line with the endpoint)::

    python -m spot_training.local.moto_server --work-dir /tmp/spot-local
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from spot_training.contract import check_seconds

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Fake credentials for the moto server: never real ones, so nothing can reach AWS by mistake.
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (the kernel's choice for port 0).

    Another process may take it before the server binds; :meth:`MotoServer.start` retries then.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class MotoServerError(RuntimeError):
    """The moto server process did not start or did not answer (the message names the log file)."""


class MotoServer:
    """A moto server process on loopback, stopped by its PID.

    Args:
        work_dir: directory for the server's log (``moto_server.log``) and the EBS data plane
            (``ebs/volumes/<vol-id>/``, ``ebs/snapshots/<snap-id>/``); created if missing.
        host: address to bind; loopback only (default ``127.0.0.1``). Anything else raises
            ``ValueError``: the server has no authentication.
        port: TCP port (default: a free one chosen by the kernel).
        compat: apply :mod:`spot_training.local.moto_compat` inside the server (default ``True``).
        startup_timeout: seconds to wait for the server to answer HTTP (default 60).
        load_default_amis: load moto's catalogue of public AMIs into every fresh EC2 backend
            (default ``False``: it costs seconds after each reset; moto accepts any ``ImageId``
            since AMI validation is off by default).

    Raises:
        MotoServerError: from :meth:`start` when the process exits or does not answer in time.
    """

    def __init__(
        self,
        work_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        compat: bool = True,
        startup_timeout: float = 60.0,
        load_default_amis: bool = False,
    ) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"host must be a loopback address (127.0.0.1), got host={host!r}")
        check_seconds("startup_timeout", startup_timeout)
        self.work_dir = Path(work_dir)
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        self.compat = compat
        self.startup_timeout = startup_timeout
        self.load_default_amis = load_default_amis
        self.process: subprocess.Popen[bytes] | None = None

    # -- paths and addresses ------------------------------------------------------------------
    @property
    def log_path(self) -> Path:
        """The server's combined stdout/stderr log (``<work_dir>/moto_server.log``)."""
        return self.work_dir / "moto_server.log"

    @property
    def ebs_dir(self) -> Path:
        """Root of the local EBS data plane: ``volumes/<vol-id>/`` and ``snapshots/<snap-id>/``."""
        return self.work_dir / "ebs"

    @property
    def volumes_dir(self) -> Path:
        """Directory holding one directory per volume (``DirectoryBlockDevices`` root)."""
        return self.ebs_dir / "volumes"

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the running server."""
        if self.port is None:
            raise MotoServerError("moto server is not started; call start() or use it as a context manager")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the server process, or ``None`` when not running."""
        return self.process.pid if self.process else None

    def env(self, region: str = "us-east-1") -> dict[str, str]:
        """Environment variables that point boto3 (and the AWS CLI / CDK CLI) at this server."""
        return {
            **FAKE_CREDENTIALS,
            "AWS_DEFAULT_REGION": region,
            "AWS_REGION": region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "MotoServer":
        """Start the process and wait until it answers HTTP; retries once on a port race."""
        if self.process is not None:
            return self
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.volumes_dir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self._requested_port else 3
        last_error: MotoServerError | None = None
        for _ in range(attempts):
            try:
                self._start_once(self._requested_port or free_port(self.host))
                return self
            except MotoServerError as error:
                last_error = error
        assert last_error is not None
        raise last_error

    def _start_once(self, port: int) -> None:
        command = [
            sys.executable, "-m", "spot_training.local.moto_server", "_serve",
            "--host", self.host, "--port", str(port), "--ebs-dir", str(self.ebs_dir),
        ]
        if not self.compat:
            command.append("--no-compat")
        env = {**os.environ, "MOTO_EC2_LOAD_DEFAULT_AMIS": "true" if self.load_default_amis else "false",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        self.port = port
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                self.port = None
                raise MotoServerError(f"moto server exited with code {code} on port {port}; see {self.log_path}")
            if self._answers():
                return
            time.sleep(0.05)
        self.stop()
        raise MotoServerError(f"moto server did not answer on port {port} within {self.startup_timeout} s; see {self.log_path}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/reset", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # it answered HTTP, even if with an error status
        except (urllib.error.URLError, OSError):
            return False

    def reset(self) -> None:
        """Empty every moto backend (``POST /moto-api/reset``); the data-plane directories stay."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            if response.status != 200:
                raise MotoServerError(f"moto reset answered HTTP {response.status}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server by PID: SIGTERM its process group, then SIGKILL after ``timeout`` seconds."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=timeout)
        self.port = None

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _serve(host: str, port: int, ebs_dir: str, compat: bool) -> None:
    """Inside the server process: apply the compatibility patches, then run moto's own server."""
    if compat:
        from spot_training.local import cfn_compat, moto_batch, moto_compat, spot_prices

        moto_compat.apply(ebs_dir=Path(ebs_dir))
        spot_prices.apply()  # real, dated spot prices instead of moto's placeholder (spot_prices.json)
        moto_batch.apply()
        cfn_compat.apply(endpoint_url=f"http://{host}:{port}", work_dir=Path(ebs_dir).parent)
    from moto import server

    server.main(["--host", host, "--port", str(port)])


def main(argv: list[str] | None = None) -> int:
    """``python -m spot_training.local.moto_server [--work-dir DIR] [--port N]``: run until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m spot_training.local.moto_server", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("_serve", help=argparse.SUPPRESS)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--ebs-dir", required=True)
    serve.add_argument("--no-compat", action="store_true")
    parser.add_argument("--work-dir", default=".spot-local/moto", help="log and EBS data plane (default: .spot-local/moto)")
    parser.add_argument("--port", type=int, default=None, help="TCP port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--no-compat", action="store_true", help="run plain moto, without spot_training.local.moto_compat")
    args = parser.parse_args(argv)
    if args.command == "_serve":
        _serve(args.host, args.port, args.ebs_dir, not args.no_compat)
        return 0
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    with MotoServer(args.work_dir, port=args.port, compat=not args.no_compat) as server:
        print(json.dumps({"endpoint_url": server.endpoint_url, "pid": server.pid, "log": str(server.log_path),
                          "ebs_dir": str(server.ebs_dir)}), flush=True)
        try:
            while not stopping and server.process is not None and server.process.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
