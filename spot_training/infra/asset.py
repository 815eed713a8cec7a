"""``BootstrapAsset``: the node code (``spot_training/contract/``, ``spot_training/agent/`` and ``spot_training/training/``) as one CDK S3 asset."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import constructs
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_s3_assets as s3_assets

from .userdata import DEFAULT_MAX_FAILED_BOOTS, STOP_TIMEOUT_S, boot_script

#: What the node agents install when the AMI's system Python lacks boto3 or has one older than the
#: agent needs (requirements-agent.txt): botocore 1.38.10 is the first with CreateVolume's
#: VolumeInitializationRate (spot_training.agent.ami_check), and boto3 1.38.10 requires it.
BOTO3_REQUIREMENT = "boto3>=1.38.10,<2"
#: Where the node downloads the asset.
ARCHIVE_PATH = "/opt/spot-training/bootstrap.zip"

#: The project root when running from a checkout, or site-packages when pip-installed: both hold
#: ``spot_training/`` with ``contract/``, ``agent/`` and ``training/`` beside ``infra/``.
DEFAULT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PACKAGES: tuple[str, ...] = ("spot_training/contract", "spot_training/agent", "spot_training/training")
#: Left out of the asset: tests, bytecode, editor and build droppings.
EXCLUDED = ("tests", "__pycache__", "*.pyc", "*.pyo", ".pytest_cache", "*.egg-info")


def stage_packages(root: Path, packages: Sequence[str]) -> Path:
    """Copy ``root/<package>`` for each package (minus :data:`EXCLUDED`) into a new temporary
    directory and return it; the directory is removed when the process exits.

    Staging a copy keeps CDK from fingerprinting the whole project (virtual environment,
    node_modules) or, when pip-installed, all of site-packages.

    Args:
        root: the directory holding the packages (the repository, or site-packages when installed).
        packages: package directories relative to ``root`` (``spot_training/agent``...); each needs an
            ``__init__.py``, and a subpackage's parents' ``__init__.py`` files are copied too.

    Returns:
        the staging directory.

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
        # A subpackage (spot_training/agent) needs its parents' __init__.py to import on the node.
        for parent in Path(package).parents:
            if parent != Path(".") and not (staging / parent / "__init__.py").exists():
                shutil.copy2(root / parent / "__init__.py", staging / parent / "__init__.py")
    return staging


class BootstrapAsset(constructs.Construct):
    """One S3 asset (a zip file) holding the node agent and the training library.

    Nodes download it with ``aws s3 cp`` (see :func:`spot_training.infra.userdata.boot_script`) and unpack it
    to ``/opt/spot-training/code``; grant them ``TrainingNodeRole.grant_read_asset`` (its one object).

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
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            root: directory holding the packages; default: the directory above ``spot_training/``.
            packages: package directories to include; default ``("spot_training/contract",
                "spot_training/agent", "spot_training/training")``.

        Raises:
            ValueError: a package is missing under ``root`` (at synth).
        """
        super().__init__(scope, construct_id)
        staging = stage_packages(Path(root) if root is not None else DEFAULT_ROOT, packages)
        self.asset = s3_assets.Asset(self, "Resource", path=str(staging))

    def user_data(
        self,
        config: Mapping[str, Any],
        *,
        region: str,
        stop_timeout_s: int = STOP_TIMEOUT_S,
        max_failed_boots: int = DEFAULT_MAX_FAILED_BOOTS,
        code_asset: s3_assets.Asset | None = None,
    ) -> ec2.UserData:
        """Linux user data (:func:`spot_training.infra.userdata.boot_script`) that boots a node from this asset.

        It writes the boot-failure script and ``config`` to ``/etc/spot-training/config.json``, then, each
        step retried and reported on failure, downloads and unpacks this asset and starts the agent under
        systemd. The trainer's framework is not installed at boot: ``config["training"]["venv"]`` has the
        agent build it once on the data volume (or EFS). The nodes need ``TrainingNodeRole.grant_read_asset``.

        Args:
            config: the node config dict (docs/contracts.md); its values may be tokens.
            region: the stack's region (may be a token).
            stop_timeout_s: systemd's ``TimeoutStopSec`` for the agent, seconds (default 120).
            max_failed_boots: failed boots in a row after which a node cancels its fleet instead of being
                replaced again (default 3).
            code_asset: the user's training code (a directory asset, :func:`code_asset`), downloaded and
                unpacked to :data:`~spot_training.infra.userdata.USER_CODE_DIR` before the agent starts
                (grant it too); default: none.

        Returns:
            the ``ec2.UserData``. Raises nothing.
        """
        user_data = ec2.UserData.for_linux()
        # json.dumps, not Stack.to_json_string: the latter drops null values ("efs": null), which the
        # contract spells out. The only tokens here (region, EFS ids) need no JSON escaping, and
        # CDK resolves tokens embedded in strings.
        user_data.add_commands(*boot_script(
            asset_url=self.asset.s3_object_url,
            region=region,
            stack_name=config["stack_name"],
            volume_tags=config["volume"]["tags"],
            config_json=json.dumps(config, indent=2),
            boto3_requirement=BOTO3_REQUIREMENT,
            stop_timeout_s=stop_timeout_s,
            max_failed_boots=max_failed_boots,
            # The agent mounts EFS only with amazon-efs-utils (TLS + IAM); no anonymous NFS fallback.
            efs=bool(config.get("efs")),
            code_asset_url=code_asset.s3_object_url if code_asset is not None else None,
        ))
        return user_data


#: Left out of a training code directory by default (``code_exclude``; .gitignore syntax): version
#: control, virtual environments, bytecode, CDK output and node modules, which a node never needs.
DEFAULT_CODE_EXCLUDE: tuple[str, ...] = (".git", ".venv", "venv", "__pycache__", "*.pyc", "node_modules", "cdk.out")


def code_asset(scope: constructs.Construct, construct_id: str, code_dir: str | Path,
               exclude: Sequence[str] = DEFAULT_CODE_EXCLUDE) -> s3_assets.Asset:
    """The user's training code directory as a CDK S3 asset (a zip, uploaded by ``cdk deploy`` and
    hashed by its content, like the bootstrap asset), for ``BootstrapAsset.user_data(code_asset=...)``.

    Args:
        code_dir: the local directory (relative paths: to the CDK app's working directory).
        exclude: .gitignore-style patterns left out (default :data:`DEFAULT_CODE_EXCLUDE`); the app's
            own output directory is always left out when it lies inside ``code_dir``.

    Raises:
        ValueError: ``code_dir`` is not a directory (names it), or holds a ``spot_training`` package
            (it would shadow the library the node provides).
    """
    from aws_cdk import IgnoreMode, Stage

    directory = Path(code_dir).expanduser().resolve()
    if not directory.is_dir():
        raise ValueError(f"context key 'code_dir': {str(code_dir)!r} is not a directory; expected the directory "
                         "that holds your training script")
    if (directory / "spot_training" / "__init__.py").exists():
        raise ValueError(f"context key 'code_dir': {str(directory)!r} holds a spot_training package; the nodes "
                         "bring the library themselves (give the directory of your own script)")
    patterns = list(exclude)
    outdir = Stage.of(scope).outdir if Stage.of(scope) is not None else None
    if outdir:
        try:
            patterns.append("/" + Path(outdir).resolve().relative_to(directory).as_posix())
        except ValueError:
            pass  # the cloud assembly is elsewhere
    return s3_assets.Asset(scope, construct_id, path=str(directory), exclude=patterns, ignore_mode=IgnoreMode.GIT)
