"""``BootstrapAsset``: the node code (``bootstrap/`` and ``training/``) as one CDK S3 asset."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import constructs
from aws_cdk import aws_s3_assets as s3_assets

#: The project root when running from a checkout, or site-packages when pip-installed: both hold
#: ``bootstrap/`` and ``training/`` beside ``infra/``.
DEFAULT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PACKAGES: tuple[str, ...] = ("bootstrap", "training")
#: Left out of the asset: tests, bytecode, editor and build droppings.
EXCLUDED = ("tests", "__pycache__", "*.pyc", "*.pyo", ".pytest_cache", "*.egg-info")


def stage_packages(root: Path, packages: Sequence[str]) -> Path:
    """Copy ``root/<package>`` for each package (minus :data:`EXCLUDED`) into a new temporary
    directory and return it; the directory is removed when the process exits.

    Staging a copy keeps CDK from fingerprinting the whole project (virtual environment,
    node_modules) or, when pip-installed, all of site-packages.

    Raises:
        ValueError: a package directory does not exist (names it and where it was looked for).
    """
    missing = [p for p in packages if not (root / p / "__init__.py").is_file()]
    if missing:
        raise ValueError(f"packages {missing} not found under {root} (each needs an __init__.py); the bootstrap asset needs them")
    staging = Path(tempfile.mkdtemp(prefix="spot-training-asset-"))
    atexit.register(shutil.rmtree, staging, True)
    for package in packages:
        shutil.copytree(root / package, staging / package, ignore=shutil.ignore_patterns(*EXCLUDED))
    return staging


class BootstrapAsset(constructs.Construct):
    """One S3 asset (a zip file) holding the node agent and the training library.

    Nodes download it with ``aws s3 cp`` (see :func:`infra.userdata.agent_commands`) and unpack it
    to ``/opt/spot-training/code``; grant them ``asset.grant_read``.

    Attributes:
        asset: the ``s3_assets.Asset``.
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        root: Path | None = None,
        packages: Sequence[str] = DEFAULT_PACKAGES,
    ) -> None:
        """Stage and define the asset.

        Args:
            root: directory holding the packages; default: the directory above ``infra/``.
            packages: package directories to include; default ``("bootstrap", "training")``.

        Raises:
            ValueError: a package is missing under ``root``.
        """
        super().__init__(scope, construct_id)
        staging = stage_packages(Path(root) if root is not None else DEFAULT_ROOT, packages)
        self.asset = s3_assets.Asset(self, "Resource", path=str(staging))
