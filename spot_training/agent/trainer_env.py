"""The trainer's virtual environment, built once on the shared storage and reused by every node.

Installing the framework into the system Python at every boot costs minutes of paid spot time per
interruption (``tensorflow[and-cuda]`` is TensorFlow plus a dozen ``nvidia-*-cu12`` wheels) and can
upgrade packages the operating system relies on. Instead, once the data volume (single node) or the
EFS file system (cluster) is mounted, the agent makes a virtual environment (PEP 405, the standard
library's :mod:`venv`) under ``training.venv.root`` and every later node on that storage reuses it.

Layout under the root (``<mount point>/envs`` by default)::

    <key>                  symlink to the finished build; made last, atomically (rename of a symlink)
    .build-<key>-<nonce>/  one build: ``python -m venv``, then ``pip install``, then ``COMPLETE``

``key`` = the first 16 hex digits of SHA-256 over the interpreter (version, implementation, machine,
base executable), the sorted requirements and ``inherit_site_packages``: a change of any of them makes
a new environment, never a half-updated one. A build directory whose ``<key>`` link is missing (a node
that died while building) is not used; the next node builds again beside it and removes build
directories older than :data:`STALE_BUILD_S`. Two nodes building at once (cluster nodes on one EFS)
both finish; the first rename wins and the other's build is removed.

The venv keeps its real path (the ``.build-...`` directory) for ever, so the absolute paths pip writes
into console scripts stay valid; only the link is swapped in.

``inherit_site_packages``: the environment also sees the base interpreter's own ``site-packages``
(through a ``.pth`` file that adds them with ``site.addsitedir``, which works for a base interpreter that is itself a venv, where
``venv --system-site-packages`` would see only the system Python's). For AMIs that ship a framework and
need a few extra requirements on top, and for local mode, whose frameworks live in the project's venv.

Runs as a separate process, as the training user (``python -m spot_training.agent.trainer_env ensure ...``),
so root never writes into, or follows links in, a directory the training user controls. Standard
library only; pip reads its usual ``PIP_*`` environment variables (local mode serves wheels offline
with ``PIP_NO_INDEX=1`` and ``PIP_FIND_LINKS=<dir>``).

Why hand-rolled: :mod:`venv` and pip do the work; what they lack is the cache key, the complete-last
marker and the retry around an install that fails half way (pip's own ``--retries`` covers single HTTP
requests only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

#: File written into a build as its last step; its JSON names the key and the requirements.
COMPLETE_FILE = "COMPLETE"
#: ``.pth`` file that adds the base interpreter's site-packages with their own ``.pth`` files (``inherit_site_packages``).
INHERIT_PTH = "spot_training_inherit.pth"
#: A build directory without a link, older than this (seconds), is left over from a dead node.
STALE_BUILD_S = 6 * 3600
#: Whole ``pip install`` attempts (pip retries single requests itself, ``--retries``).
DEFAULT_ATTEMPTS = 3
#: Seconds before the n-th retry of ``pip install``: ``BACKOFF_S * n`` (pip already retries each HTTP
#: request 5 times with its own backoff; a whole-install retry is for a download cut short).
BACKOFF_S = 5.0
#: Exit status of ``ensure`` when pip failed on every attempt (sysexits EX_UNAVAILABLE).
EXIT_INSTALL_FAILED = 69

_PROBE = ("import json, platform, site, sys; print(json.dumps({'version': sys.version, "
          "'implementation': sys.implementation.name, 'machine': platform.machine(), "
          "'base_executable': getattr(sys, '_base_executable', sys.executable), "
          "'site_packages': site.getsitepackages(), "
          "'has_pip': __import__('importlib.util').util.find_spec('pip') is not None}))")


class EnvironmentBuildError(RuntimeError):
    """Building the environment failed (the message has pip's last lines)."""


def probe(python: str) -> dict:
    """What ``python`` is: ``version``, ``implementation``, ``machine``, ``base_executable``,
    ``site_packages`` (list of paths). Raises EnvironmentBuildError when it cannot be run."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise EnvironmentBuildError(f"training.python {python!r} cannot be run: {exc}") from None
    return json.loads(out.stdout)


def env_key(interpreter: dict, requirements: Sequence[str], inherit_site_packages: bool) -> str:
    """16 hex digits identifying the environment (see the module docstring)."""
    material = json.dumps({"python": [interpreter["version"], interpreter["implementation"], interpreter["machine"],
                                      interpreter["base_executable"]],
                           "requirements": sorted(r.strip() for r in requirements),
                           "inherit_site_packages": bool(inherit_site_packages)}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def env_python(env_dir: Path) -> Path:
    """The interpreter of the environment at ``env_dir`` (``bin/python``)."""
    return env_dir / "bin" / "python"


def _complete(env_dir: Path, key: str) -> bool:
    try:
        return json.loads((env_dir / COMPLETE_FILE).read_text()).get("key") == key and env_python(env_dir).exists()
    except (OSError, ValueError, AttributeError):
        return False


def _remove_stale(root: Path, key: str, now: float) -> None:
    for build in root.glob(f".build-{key}-*"):
        try:
            if now - build.lstat().st_mtime > STALE_BUILD_S and not build.is_symlink():
                shutil.rmtree(build, ignore_errors=True)
        except OSError:
            continue


def _run(argv: list[str], log: Callable[[str], None]) -> subprocess.CompletedProcess:
    log(" ".join(argv))
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def _make_venv(python: str, build: Path, interpreter: dict, inherit: bool, log: Callable[[str], None]) -> None:
    # An environment that inherits the base's packages can use the base's pip (it installs into the
    # running interpreter's prefix): no ensurepip run, seconds faster.
    without_pip = ["--without-pip"] if inherit and interpreter.get("has_pip") else []
    made = _run([python, "-m", "venv", *without_pip, str(build)], log)
    if made.returncode != 0:
        # Debian/Ubuntu split ensurepip into the python3-venv package; without it venv cannot seed pip.
        raise EnvironmentBuildError(f"'{python} -m venv' failed: {made.stderr.strip()[-800:]} (on Ubuntu the "
                                    "interpreter needs the python3-venv package; the Deep Learning AMIs have it)")
    if inherit:
        probe_env = probe(str(env_python(build)))
        target = Path(probe_env["site_packages"][0])
        # site.addsitedir, not a plain path line: it also runs the .pth files in those directories
        # (editable installs, a base interpreter that is itself an overlay of another environment),
        # which a path line alone leaves unread.
        (target / INHERIT_PTH).write_text("".join(f"import site; site.addsitedir({str(p)!r})\n"
                                                  for p in interpreter["site_packages"]))


def _pip_install(build: Path, requirements: Sequence[str], attempts: int, backoff_s: float,
                 log: Callable[[str], None], sleep: Callable[[float], None]) -> int:
    argv = [str(env_python(build)), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
            "--retries", "5", "--timeout", "30", *requirements]
    for attempt in range(1, attempts + 1):
        done = _run(argv, log)
        if done.returncode == 0:
            return attempt
        tail = (done.stdout + done.stderr).strip()[-1500:]
        log(f"pip install failed (attempt {attempt} of {attempts}): {tail}")
        if attempt == attempts:
            raise EnvironmentBuildError(f"pip install {' '.join(requirements)} failed {attempts} times; last "
                                        f"output: {tail}")
        sleep(backoff_s * attempt)
    return attempts  # pragma: no cover - the loop returns or raises


def ensure(python: str, root: Path, requirements: Sequence[str], *, inherit_site_packages: bool = False,
           attempts: int = DEFAULT_ATTEMPTS, backoff_s: float = BACKOFF_S, log: Callable[[str], None] = print,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time) -> dict:
    """Reuse or build the environment for ``python`` + ``requirements`` under ``root``.

    Args:
        python: the base interpreter (absolute path; ``training.python``).
        root: directory the environments live in (created if missing; must be writable).
        requirements: pip requirement specifiers (may be empty: a bare venv).
        inherit_site_packages: see the module docstring (default False).
        attempts: whole ``pip install`` attempts, >= 1 (default 3), ``backoff_s * n`` seconds apart.
        log: receives progress lines.

    Returns:
        ``{"status": "reused" | "built", "key": ..., "python": "<root>/<key>/bin/python",
        "seconds": wall time, "attempts": pip attempts (0 when reused)}``.

    Raises:
        EnvironmentBuildError: the interpreter cannot be run, venv fails, or pip fails every attempt
            (nothing half built is left under the key).
    """
    started = clock()
    interpreter = probe(python)
    key = env_key(interpreter, requirements, inherit_site_packages)
    root.mkdir(parents=True, exist_ok=True)
    link = root / key
    result = {"key": key, "python": str(env_python(link)), "root": str(root)}
    if _complete(link, key):
        return {**result, "status": "reused", "seconds": round(clock() - started, 3), "attempts": 0}
    _remove_stale(root, key, clock())
    build = root / f".build-{key}-{uuid.uuid4().hex[:8]}"
    try:
        _make_venv(python, build, interpreter, inherit_site_packages, log)
        used = _pip_install(build, requirements, attempts, backoff_s, log, sleep) if requirements else 0
        (build / COMPLETE_FILE).write_text(json.dumps({"key": key, "requirements": list(requirements),
                                                       "inherit_site_packages": inherit_site_packages,
                                                       "python": interpreter["version"], "built_at": clock()}))
        tmp_link = root / f".link-{key}-{uuid.uuid4().hex[:8]}"
        os.symlink(build.name, tmp_link)
        if _complete(link, key):  # another node finished first: keep its build, drop ours
            os.unlink(tmp_link)
            shutil.rmtree(build, ignore_errors=True)
            return {**result, "status": "reused", "seconds": round(clock() - started, 3), "attempts": used}
        os.replace(tmp_link, link)  # the commit point: a link to a COMPLETE build
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return {**result, "status": "built", "seconds": round(clock() - started, 3), "attempts": used}


def main(argv: list[str] | None = None) -> int:
    """``python -m spot_training.agent.trainer_env ensure --python P --root DIR [--requirement R ...]
    [--inherit-site-packages] [--attempts N]``: print progress on stderr and the :func:`ensure` result
    as the last line of stdout (JSON). Exit 0, or :data:`EXIT_INSTALL_FAILED` (69) with the reason on
    stderr and ``{"error": ...}`` on stdout."""
    parser = argparse.ArgumentParser(prog="python -m spot_training.agent.trainer_env")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("ensure", help="reuse or build the trainer's virtual environment")
    cmd.add_argument("--python", required=True)
    cmd.add_argument("--root", required=True, type=Path)
    cmd.add_argument("--requirement", action="append", default=[])
    cmd.add_argument("--inherit-site-packages", action="store_true")
    cmd.add_argument("--attempts", type=int, default=DEFAULT_ATTEMPTS)
    cmd.add_argument("--backoff-s", type=float, default=BACKOFF_S)
    args = parser.parse_args(argv)
    try:
        result = ensure(args.python, args.root, args.requirement, inherit_site_packages=args.inherit_site_packages,
                        attempts=max(1, args.attempts), backoff_s=args.backoff_s,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    except (EnvironmentBuildError, OSError) as exc:
        print(f"trainer_env: {exc}", file=sys.stderr)
        print(json.dumps({"error": str(exc)}))
        return EXIT_INSTALL_FAILED
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
