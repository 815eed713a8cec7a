"""A local wheel directory, so that local mode builds the trainer's virtual environment offline.

Local mode's nodes install their ``training_requirements`` with ``PIP_NO_INDEX=1`` and
``PIP_FIND_LINKS=<wheel dir>`` (pip's own environment settings), from wheels this module writes: a
pure-Python probe package, :data:`PROBE_DISTRIBUTION`, whose module records which environment a trainer
ran in. The frameworks themselves come from the project's virtual environment
(``training_inherit_site_packages``), so nothing is downloaded.

A wheel is a zip file with ``<name>-<version>.dist-info/{METADATA,WHEEL,RECORD}`` (PEP 427, the
"Binary distribution format" specification); writing one takes the standard library only, where a
build backend would need setuptools and an index.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

#: The probe distribution local mode's stacks require (importable as ``spot_training_probe``).
PROBE_DISTRIBUTION = "spot-training-probe"
PROBE_VERSION = "1.0"
_PROBE_MODULE = '''"""Local mode's probe package: installed into the trainer's virtual environment from a local wheel."""
import sys

#: Where the environment that imported this lives (``sys.prefix``).
PREFIX = sys.prefix
'''


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(wheel_dir: Path, distribution: str, version: str, modules: dict[str, str]) -> Path:
    """Write a pure-Python wheel ``<distribution>-<version>-py3-none-any.whl`` into ``wheel_dir``.

    Args:
        wheel_dir: directory (created if missing).
        distribution: project name (``-`` allowed; normalized to ``_`` in file names).
        version: a PEP 440 version such as ``1.0``.
        modules: ``{"pkg/__init__.py": source text, ...}`` (paths inside the wheel).

    Returns:
        the wheel's path.

    Raises:
        ValueError: an empty name or version.
        OSError: the directory cannot be written.
    """
    if not distribution or not version:
        raise ValueError(f"distribution and version must be non-empty, got {distribution!r}, {version!r}")
    wheel_dir.mkdir(parents=True, exist_ok=True)
    stem = distribution.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    files = {name: text.encode() for name, text in modules.items()}
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: spot-training localmode\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = wheel_dir / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def write_probe_wheel(wheel_dir: Path) -> Path:
    """Write the :data:`PROBE_DISTRIBUTION` wheel into ``wheel_dir``; returns its path."""
    return write_wheel(wheel_dir, PROBE_DISTRIBUTION, PROBE_VERSION,
                       {"spot_training_probe/__init__.py": _PROBE_MODULE})
