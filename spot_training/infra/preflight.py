"""``spot-train preflight``: check an AWS account before ``cdk deploy`` and say what to fix.

A stack that deploys is not a stack that trains: in a fresh account the Spot Fleet cannot launch
without its service-linked roles, a spot vCPU quota of 0 for the G and P families lets the stack
deploy while nothing ever launches, and a wrong AMI parameter fails the deploy at change-set
creation. Each check here calls the one AWS API that answers it (boto3, ``standard`` retries) and
returns a :class:`Check`:

==================  =====================================================================  ==========================
check               how                                                                    AWS source (docs/infra.md)
==================  =====================================================================  ==========================
service-linked      ``iam:GetRole`` ``AWSServiceRoleForEC2SpotFleet``,                     EC2 User Guide, "Service-
roles               ``AWSServiceRoleForEC2Spot``                                           linked role for Spot Fleet"
instance types      ``ec2:DescribeInstanceTypes``: offered in the region, vCPUs; family    DLAMI release notes
                    in the Deep Learning Base AMI's ``supported_ec2_instances``
spot vCPU quota     ``servicequotas:GetServiceQuota`` ``ec2`` L-3819A6DF (G and VT),       EC2 User Guide, "Spot
                    L-7212CCBC (P), L-34B43A08 (Standard) against target x largest vCPUs   Instance quotas"
AMI                 ``ssm:GetParameter`` of ``ami_ssm_parameter`` (or                      "Finding the ID of a DLAMI"
                    ``ec2:DescribeImages`` of ``image_id``)
AMI image           ``ec2:DescribeImages`` of the AMI the fleet will launch: available,    EC2 User Guide, "AMI
                    Linux, root device EBS, architecture among each type's                 characteristics"; DLAMI
                    ``SupportedArchitectures``; a Deep Learning AMI's documented Python    release notes
                    and botocore (:data:`DLAMI_RELEASES`) against what the agent needs
capacity            ``ec2:GetSpotPlacementScores`` per Availability Zone                   EC2 User Guide, "Spot
                                                                                           placement score"
==================  =====================================================================  ==========================

What only a booted node can tell (``mkfs.xfs``, ``python3 -m venv``, ``mount.efs``, the AWS CLI on a
non-DLAMI image, the installed botocore) the ``ami-image`` check names as not checked; the agent checks
it at start (spot_training/agent/ami_check.py, exit 78 naming each missing piece).

A check that AWS (or the endpoint, e.g. a moto server that does not implement the API) cannot
answer is ``unknown``, never ``pass``. Exit codes of :func:`main`: 0 every check passed (warnings
allowed), 1 at least one check failed, 3 none failed but at least one could not be answered,
2 bad arguments or settings (nothing was called), 4 no AWS credentials (as ``spot-train status``,
``logs`` and ``cost`` exit 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

PASS, WARN, FAIL, UNKNOWN = "pass", "warn", "fail", "unknown"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNKNOWN = 3
EXIT_NO_CREDENTIALS = 4


class NoCredentials(Exception):
    """boto3 found no AWS credentials: no check can be answered, and the endpoint is not to blame."""

#: Service-linked roles a Spot Fleet created through the API needs, with the service that creates them.
SERVICE_LINKED_ROLES: tuple[tuple[str, str], ...] = (
    ("AWSServiceRoleForEC2SpotFleet", "spotfleet.amazonaws.com"),
    ("AWSServiceRoleForEC2Spot", "spot.amazonaws.com"),
)

#: Service Quotas codes (service ``ec2``) of the spot vCPU quotas, by the class an instance family
#: belongs to. Codes as AWS's Service Quotas console and EC2 User Guide ("Spot Instance quotas") list them.
SPOT_QUOTA_CODES: dict[str, tuple[str, str]] = {
    "G": ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    "P": ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests"),
    "Standard": ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"),
}

#: Below this Spot placement score (1..10, 10 = "highly likely to succeed") capacity is reported as a warning.
LOW_PLACEMENT_SCORE = 3


def quota_class(instance_type: str) -> str | None:
    """The spot quota class of an instance type: ``"G"`` (g*, vt*), ``"P"`` (p2, p3, p4*), ``"Standard"``
    (a, c, d, h, i, m, r, t, z families), or ``None`` (P5 and later, F, X, Inf, Trn, DL: no code known here)."""
    family = instance_type.split(".", 1)[0].lower()
    if family.startswith("vt") or family.startswith("g"):
        return "G"
    if family.startswith(("p2", "p3", "p4")):
        return "P"  # "All P4, P3 and P2 Spot Instance Requests"; P5 and later have quotas of their own
    if family[:1] in set("acdhimrtz") and not family.startswith(("inf", "dl")):
        return "Standard"
    return None


@dataclasses.dataclass
class Check:
    """One preflight result.

    Attributes:
        name: short id (``service-linked-role:AWSServiceRoleForEC2Spot``, ``spot-quota:G`` ...).
        status: ``pass``, ``warn``, ``fail`` or ``unknown`` (could not be answered).
        detail: what was found.
        fix: what to do (a CLI command where one exists); empty on ``pass``.
        image_id: the AMI id the ``ami`` check found (None for every other check).
    """

    name: str
    status: str
    detail: str
    fix: str = ""
    #: The AMI the ``ami`` check resolved (not printed; :func:`run_checks` checks that image next).
    image_id: str | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class Target:
    """What a deploy will ask for: region, spot types, how many instances at once, AMI, AZs."""

    region: str
    instance_types: tuple[str, ...]
    target_capacity: int
    ami_ssm_parameter: str | None
    image_id: str | None
    availability_zones: tuple[str, ...] | None
    #: ``volume_initialization_rate_mibps`` (single node): the agent then needs botocore >= 1.38.10.
    initialization_rate_mibps: int | None = None


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", "")) or type(exc).__name__


def _cannot_answer(name: str, what: str, exc: Exception) -> Check:
    import botocore.exceptions

    if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)):
        raise NoCredentials(str(exc)) from exc
    code = _error_code(exc)
    hint = "grant the caller this read permission" if "AccessDenied" in code or "Unauthorized" in code else \
        "the endpoint did not answer this API (a local emulator such as moto may not implement it); check it in the console"
    first_line = (str(exc).strip().splitlines() or [""])[0][:200]
    return Check(name, UNKNOWN, f"could not check {what}: {code}: {first_line}", hint)


def check_service_linked_roles(iam: Any) -> list[Check]:
    """``iam:GetRole`` for each of :data:`SERVICE_LINKED_ROLES`; a missing one fails with the create command."""
    out = []
    for role, service in SERVICE_LINKED_ROLES:
        name = f"service-linked-role:{role}"
        try:
            iam.get_role(RoleName=role)
            out.append(Check(name, PASS, f"{role} exists"))
        except Exception as exc:  # noqa: BLE001 - botocore ClientError or transport errors, reported as such
            if _error_code(exc) == "NoSuchEntity":
                out.append(Check(name, FAIL, f"{role} does not exist: the Spot Fleet cannot launch instances without it",
                                 f"aws iam create-service-linked-role --aws-service-name {service}"))
            else:
                out.append(_cannot_answer(name, f"role {role}", exc))
    return out


def instance_vcpus(ec2: Any, instance_types: Sequence[str]) -> tuple[dict[str, int], list[Check]]:
    """vCPUs of each type (``ec2:DescribeInstanceTypes``) and a check per type (offered? DLAMI-supported?).

    Args:
        ec2: a boto3 EC2 client.
        instance_types: the instance type names.

    Returns:
        ``({type: default vCPUs}, checks)``; a type the region does not offer has no vCPU entry. API
        errors become ``unknown`` checks, never exceptions.
    """
    from .fleet import DLAMI_SUPPORTED_FAMILIES, instance_family

    checks: list[Check] = []
    vcpus: dict[str, int] = {}
    try:
        pages = ec2.get_paginator("describe_instance_types").paginate(InstanceTypes=list(instance_types))
        for page in pages:
            for info in page["InstanceTypes"]:
                vcpus[info["InstanceType"]] = int(info["VCpuInfo"]["DefaultVCpus"])
    except Exception as exc:  # noqa: BLE001
        if _error_code(exc) in ("InvalidInstanceType", "InvalidParameterValue"):
            # One unknown type fails the whole call: ask per type to name it.
            for t in instance_types:
                try:
                    info = ec2.describe_instance_types(InstanceTypes=[t])["InstanceTypes"][0]
                    vcpus[t] = int(info["VCpuInfo"]["DefaultVCpus"])
                except Exception as one:  # noqa: BLE001
                    if _error_code(one) in ("InvalidInstanceType", "InvalidParameterValue"):
                        continue
                    checks.append(_cannot_answer(f"instance-type:{t}", f"instance type {t}", one))
        else:
            return {}, [_cannot_answer("instance-types", "the instance types", exc)]
    for t in instance_types:
        name = f"instance-type:{t}"
        if any(c.name == name for c in checks):
            continue
        if t not in vcpus:
            checks.append(Check(name, FAIL, f"{t} is not offered in this region",
                                "choose types the region offers: aws ec2 describe-instance-type-offerings "
                                "--location-type availability-zone --filters Name=instance-type,Values=" + t))
        elif instance_family(t) not in DLAMI_SUPPORTED_FAMILIES:
            checks.append(Check(name, WARN, f"{t} ({vcpus[t]} vCPUs): family {instance_family(t)} is not in the Deep Learning "
                                "Base AMI's supported_ec2_instances (docs/infra.md); with the default AMI the GPU may be unusable",
                                "use g6/g5/g4dn/g6e/p4d/p5... types, or set image_id to an AMI that supports this family"))
        else:
            checks.append(Check(name, PASS, f"{t}: {vcpus[t]} vCPUs, supported by the Deep Learning Base AMI"))
    return vcpus, checks


def check_spot_quotas(quotas: Any, vcpus: Mapping[str, int], target_capacity: int, region: str) -> list[Check]:
    """Each quota class of the chosen types must allow ``target_capacity`` x the largest type's vCPUs.

    The fleet may launch any of the types, so the largest one bounds what it needs. Running spot
    instances of the account count against the same quota (not subtracted here).

    Source: Amazon EC2 User Guide, "Spot Instance quotas" (vCPU-based quotas per instance class).

    Args:
        quotas: a boto3 Service Quotas client.
        vcpus: ``{instance type: vCPUs}`` from :func:`instance_vcpus`.
        target_capacity: instances the fleet may run at once.
        region: the region named in the suggested quota request.

    Returns:
        one check per quota class (``unknown`` for a type with no known class or an unanswered call).
    """
    need: dict[str, int] = {}
    checks: list[Check] = []
    for t, n in vcpus.items():
        cls = quota_class(t)
        if cls is None:
            checks.append(Check(f"spot-quota:{t}", UNKNOWN, f"no spot vCPU quota code known here for {t}",
                                "look up its 'Spot Instance Requests' quota in the Service Quotas console"))
            continue
        need[cls] = max(need.get(cls, 0), n * max(1, target_capacity))
    for cls, vcpu_need in sorted(need.items()):
        code, title = SPOT_QUOTA_CODES[cls]
        name = f"spot-quota:{cls}"
        request = (f"aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} "
                   f"--desired-value {vcpu_need} --region {region}")
        try:
            value = float(quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except Exception as exc:  # noqa: BLE001
            if _error_code(exc) == "NoSuchResourceException":
                try:
                    value = float(quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
                except Exception as exc2:  # noqa: BLE001
                    checks.append(_cannot_answer(name, f"quota {code} ({title})", exc2))
                    continue
            else:
                checks.append(_cannot_answer(name, f"quota {code} ({title})", exc))
                continue
        if value >= vcpu_need:
            checks.append(Check(name, PASS, f"{title} ({code}): {value:g} vCPUs, need {vcpu_need}"))
        else:
            checks.append(Check(name, FAIL, f"{title} ({code}): {value:g} vCPUs, need {vcpu_need}: the stack would deploy "
                                "and no instance would launch", request))
    return checks


def check_ami(ssm: Any, ec2: Any, *, ami_ssm_parameter: str | None, image_id: str | None) -> Check:
    """The AMI exists: ``ec2:DescribeImages`` of ``image_id`` when set, else ``ssm:GetParameter``.

    Args:
        ssm: a boto3 SSM client.
        ec2: a boto3 EC2 client.
        ami_ssm_parameter: the SSM parameter holding the AMI id (used when ``image_id`` is not set).
        image_id: the AMI id, or None.

    Returns:
        the ``ami`` check (``unknown`` when the call could not be answered).
    """
    if image_id:
        try:
            images = ec2.describe_images(ImageIds=[image_id])["Images"]
        except Exception as exc:  # noqa: BLE001
            if _error_code(exc).startswith("InvalidAMIID"):
                images = []
            else:
                return _cannot_answer("ami", f"image {image_id}", exc)
        if images:
            return Check("ami", PASS, f"image {image_id} exists", image_id=image_id)
        return Check("ami", FAIL, f"image {image_id} does not exist in this region", "set -c image_id to an AMI of this region")
    try:
        value = ssm.get_parameter(Name=ami_ssm_parameter)["Parameter"]["Value"]
    except Exception as exc:  # noqa: BLE001
        if _error_code(exc) == "ParameterNotFound":
            return Check("ami", FAIL, f"SSM parameter {ami_ssm_parameter} does not exist: the deploy would fail at change-set creation",
                         "list the DLAMI parameters: aws ssm get-parameters-by-path --path /aws/service/deeplearning/ami/x86_64/ "
                         "--recursive --query 'Parameters[].Name', then set -c ami_ssm_parameter=...")
        return _cannot_answer("ami", f"SSM parameter {ami_ssm_parameter}", exc)
    return Check("ami", PASS, f"{ami_ssm_parameter} -> {value}", image_id=value)


@dataclasses.dataclass(frozen=True)
class DlamiRelease:
    """What one Deep Learning AMI release's notes document ("Major package versions" and "Package changes").

    Attributes:
        name_prefix: the AMI name without its date suffix (``DescribeImages`` ``Name`` starts with it).
        release: the release the figures come from (its date, as in the AMI name).
        architecture: ``compute_architecture`` (``x86_64`` or ``arm64``, as DescribeImages spells it).
        operating_system: ``operating_system``.
        python: ``python_location``'s version (``3.10``).
        botocore: botocore in that release's package list (later releases update it).
        source: the release notes page.
    """

    name_prefix: str
    release: str
    architecture: str
    operating_system: str
    python: str
    botocore: str
    source: str


#: Deep Learning AMIs whose release notes were read on 2026-11-28 (AWS DLAMI Developer Guide, "Release
#: notes for DLAMIs"). A name not listed here is not judged by name: its Python and botocore are
#: checked by the agent at boot.
DLAMI_RELEASES: tuple[DlamiRelease, ...] = (
    DlamiRelease("Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)", "20260130", "x86_64",
                 "Ubuntu 22.04.5 LTS", "3.10", "1.42.38",
                 "https://docs.aws.amazon.com/dlami/latest/devguide/aws-deep-learning-ami-gpubaseoss-ul2204-2026-02-03.html"),
    DlamiRelease("Deep Learning ARM64 Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)", "20261006", "arm64",
                 "Ubuntu 22.04.5 LTS", "3.10", "1.43.108",
                 "https://docs.aws.amazon.com/dlami/latest/devguide/aws-deep-learning-ami-gpubaseossarm64-ul2204-2026-10-08.html"),
    DlamiRelease("Deep Learning ARM64 Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04)", "20260929", "arm64",
                 "Ubuntu 24.04.5 LTS", "3.12", "1.43.104",
                 "https://docs.aws.amazon.com/dlami/latest/devguide/aws-deep-learning-ami-gpubaseossarm64-ul2404-2026-09-30.html"),
)

#: What the node code needs: Python 3.10 (tests/test_python310.py); botocore 1.38.10 for CreateVolume's
#: ``VolumeInitializationRate`` (spot_training.agent.ami_check, which checks the installed one at boot).
MIN_PYTHON = (3, 10)
MIN_BOTOCORE_FOR_INITIALIZATION_RATE = (1, 38, 10)
#: Checked by the agent at start, not here: only a booted node can tell.
NOT_CHECKED_WITHOUT_BOOT = ("mkfs.xfs", "python3 -m venv (python3-venv)", "mount.efs when EFS is used",
                            "the installed botocore and AWS CLI")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def dlami_release(name: str) -> DlamiRelease | None:
    """The :data:`DLAMI_RELEASES` entry whose ``name_prefix`` starts ``name`` (longest first), else None."""
    matches = [r for r in DLAMI_RELEASES if name.startswith(r.name_prefix)]
    return max(matches, key=lambda r: len(r.name_prefix)) if matches else None


def instance_architectures(ec2: Any, instance_types: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``ProcessorInfo.SupportedArchitectures`` of each type the region offers (``ec2:DescribeInstanceTypes``).

    Args:
        ec2: a boto3 EC2 client of the target region.
        instance_types: instance type names, e.g. ``["g5.xlarge"]``.

    Returns:
        ``{type: ("x86_64",)}`` for each type the region offers; types it does not offer are left out
        (the ``instance-type`` check fails them).

    Raises:
        botocore.exceptions.ClientError: any error but an unknown instance type.
    """
    out: dict[str, tuple[str, ...]] = {}
    for t in instance_types:
        try:
            info = ec2.describe_instance_types(InstanceTypes=[t])["InstanceTypes"][0]
        except Exception as exc:  # noqa: BLE001
            if _error_code(exc) in ("InvalidInstanceType", "InvalidParameterValue"):
                continue
            raise
        out[t] = tuple(info.get("ProcessorInfo", {}).get("SupportedArchitectures", ()))
    return out


def check_ami_image(ec2: Any, image_id: str, instance_types: Sequence[str], *,
                    initialization_rate_mibps: int | None = None) -> Check:
    """Check the AMI the fleet will launch against the instance types and what the agent needs.

    ``ec2:DescribeImages``: the image is ``available``, Linux (no ``Platform: windows``), its root device
    is EBS, and its ``Architecture`` is among each type's ``SupportedArchitectures`` (else the fleet's
    launches fail). A Deep Learning AMI listed in :data:`DLAMI_RELEASES` is also checked for Python >=
    3.10 and, with ``initialization_rate_mibps``, botocore >= 1.38.10 as its release notes give them;
    :data:`NOT_CHECKED_WITHOUT_BOOT` is named in the detail (the agent checks it at start).

    Args:
        ec2: boto3 EC2 client.
        image_id: ``ami-...`` (``image_id`` or the value of ``ami_ssm_parameter``).
        instance_types: the fleet's types.
        initialization_rate_mibps: ``volume_initialization_rate_mibps`` (None: botocore's version does not matter).

    Returns:
        ``Check("ami-image", ...)``: ``fail`` for a wrong image, ``warn`` for an AMI not in the table,
        ``pass`` otherwise; ``unknown`` when DescribeImages/DescribeInstanceTypes could not be answered.
    """
    name = "ami-image"
    not_checked = "not checkable without booting (the agent checks at start, exit 78): " + ", ".join(NOT_CHECKED_WITHOUT_BOOT)
    try:
        images = ec2.describe_images(ImageIds=[image_id])["Images"]
        architectures = instance_architectures(ec2, instance_types)
    except Exception as exc:  # noqa: BLE001
        if _error_code(exc).startswith("InvalidAMIID"):
            images, architectures = [], {}
        else:
            return _cannot_answer(name, f"image {image_id}", exc)
    if not images:
        return Check(name, FAIL, f"image {image_id} does not exist in this region (or is not shared with this account)",
                     "set -c image_id / ami_ssm_parameter to an AMI of this region")
    image = images[0]
    label = f"{image_id} ({image.get('Name', 'no name')})"
    problems = []
    if image.get("State", "available") != "available":
        problems.append(f"its state is {image.get('State')!r}, not 'available'")
    if str(image.get("Platform", "")).lower() == "windows":
        problems.append("it is a Windows image; the nodes run Linux (systemd, bash user data)")
    if image.get("RootDeviceType") == "instance-store":  # AWS: "ebs" or "instance-store"
        problems.append(f"its root device is {image.get('RootDeviceType')!r}; the launch template needs an EBS-backed AMI")
    arch = image.get("Architecture")
    wrong = sorted(t for t, archs in architectures.items() if archs and arch not in archs)
    if wrong:
        problems.append(f"its architecture {arch} is not supported by {', '.join(wrong)} "
                        f"({', '.join(f'{t}: ' + '/'.join(architectures[t]) for t in wrong)})")
    release = dlami_release(str(image.get("Name", "")))
    if release is not None:
        if _version(release.python) < MIN_PYTHON:
            problems.append(f"its Python {release.python} is older than {'.'.join(map(str, MIN_PYTHON))} ({release.source})")
        if initialization_rate_mibps is not None and _version(release.botocore) < MIN_BOTOCORE_FOR_INITIALIZATION_RATE:
            problems.append(f"its botocore {release.botocore} is older than 1.38.10, which volume_initialization_rate_mibps "
                            f"needs ({release.source})")
    if problems:
        return Check(name, FAIL, f"image {label}: " + "; ".join(problems),
                     "choose an AMI that fits (a Deep Learning Base AMI of the types' architecture), or types that fit the AMI")
    if release is None:
        return Check(name, WARN, f"image {label}: {arch}, EBS root, Linux; not a Deep Learning AMI listed in "
                     f"spot_training.infra.preflight.DLAMI_RELEASES, so Python, botocore and the AWS CLI are "
                     f"{not_checked.split(': ', 1)[0]}; also {not_checked.split(': ', 1)[1]}",
                     "make sure the AMI has Python >= 3.10, the AWS CLI, xfsprogs and python3-venv")
    return Check(name, PASS, f"image {label}: {arch}, EBS root, Linux; release notes of {release.name_prefix} "
                 f"{release.release}: {release.operating_system}, Python {release.python}, botocore {release.botocore} "
                 f"({release.source}); {not_checked}")


def check_capacity(ec2: Any, *, region: str, instance_types: Sequence[str], target_capacity: int,
                   availability_zones: Sequence[str] | None) -> Check:
    """``ec2:GetSpotPlacementScores`` (single-AZ scores) for the chosen types and AZs.

    Fails when no chosen AZ has a score, warns when the best one is below :data:`LOW_PLACEMENT_SCORE`.

    Source: Amazon EC2 User Guide, "Spot placement score".

    Args:
        ec2: a boto3 EC2 client.
        region: the region to score.
        instance_types: the instance type names.
        target_capacity: instances wanted (at least 1 is asked for).
        availability_zones: the zones the fleet may use (None: every zone).

    Returns:
        the ``capacity`` check.
    """
    try:
        zones = ec2.describe_availability_zones()["AvailabilityZones"]
        id_to_name = {z["ZoneId"]: z["ZoneName"] for z in zones if "ZoneId" in z}
        scores = ec2.get_spot_placement_scores(
            InstanceTypes=list(instance_types), TargetCapacity=max(1, target_capacity), TargetCapacityUnitType="units",
            SingleAvailabilityZone=True, RegionNames=[region],
        )["SpotPlacementScores"]
    except Exception as exc:  # noqa: BLE001
        return _cannot_answer("capacity", "spot placement scores", exc)
    by_zone = {id_to_name.get(s.get("AvailabilityZoneId", ""), s.get("AvailabilityZoneId", "?")): int(s["Score"]) for s in scores}
    chosen = {z: by_zone.get(z) for z in availability_zones} if availability_zones else by_zone
    listed = ", ".join(f"{z}={s if s is not None else 'none'}" for z, s in sorted(chosen.items())) or "none"
    best = max((s for s in chosen.values() if s is not None), default=None)
    fix = "add instance types (-c instance_types=...), or pin availability_zones to the zones with the highest scores"
    if best is None:
        return Check("capacity", FAIL, f"no spot placement score for the chosen zones ({listed})", fix)
    if best < LOW_PLACEMENT_SCORE:
        return Check("capacity", WARN, f"spot placement scores (1..10) per zone: {listed}; best {best} is low", fix)
    return Check("capacity", PASS, f"spot placement scores (1..10) per zone: {listed}")


def run_checks(target: Target, client: Callable[[str], Any]) -> list[Check]:
    """Every check for ``target``; ``client(service)`` returns a boto3 client (standard retries).

    Args:
        target: what to check.
        client: returns a boto3 client for a service name.

    Returns:
        the checks, in a fixed order (roles, instance types, quotas, AMI, capacity).
    """
    ec2 = client("ec2")
    checks = check_service_linked_roles(client("iam"))
    vcpus, type_checks = instance_vcpus(ec2, target.instance_types)
    checks += type_checks
    if vcpus:
        checks += check_spot_quotas(client("service-quotas"), vcpus, target.target_capacity, target.region)
    ami = check_ami(client("ssm"), ec2, ami_ssm_parameter=target.ami_ssm_parameter, image_id=target.image_id)
    checks.append(ami)
    if ami.image_id:
        checks.append(check_ami_image(ec2, ami.image_id, target.instance_types,
                                      initialization_rate_mibps=target.initialization_rate_mibps))
    checks.append(check_capacity(ec2, region=target.region, instance_types=target.instance_types,
                                 target_capacity=target.target_capacity, availability_zones=target.availability_zones))
    return checks


def exit_code(checks: Iterable[Check]) -> int:
    """0 all passed (warnings allowed), 1 a check failed, 3 none failed but one could not be answered."""
    statuses = {c.status for c in checks}
    if FAIL in statuses:
        return EXIT_FAILED
    if UNKNOWN in statuses:
        return EXIT_UNKNOWN
    return EXIT_OK


def format_checks(checks: Sequence[Check]) -> str:
    """One line per check (``[FAIL] name: detail``), with its fix indented below."""
    lines = []
    for c in checks:
        lines.append(f"[{c.status.upper():7}] {c.name}: {c.detail}")
        if c.fix and c.status != PASS:
            lines.append(f"          fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, UNKNOWN)}
    lines.append("preflight: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


# ---- settings ---------------------------------------------------------------------------------------


def _context(cdk_json: Path, overrides: Sequence[str]) -> dict[str, Any]:
    context: dict[str, Any] = {}
    if cdk_json.is_file():
        context = dict(json.loads(cdk_json.read_text(encoding="utf-8")).get("context", {}))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"-c {item!r}: expected key=value")
        context[key] = value
    return {k: v for k, v in context.items() if not k.startswith("@")}


def target_from_context(context: Mapping[str, Any], *, stack: str, region: str) -> Target:
    """The :class:`Target` of the single-node (``stack="single"``) or cluster (``"cluster"``) stack,
    validated with the stacks' own settings classes.

    Args:
        context: the context values (cdk.json plus ``-c``).
        stack: ``"single"`` or ``"cluster"``.
        region: the region to check.

    Returns:
        the target.

    Raises:
        ValueError: a bad context value (the message names the key, the value and what is allowed).
    """
    from .cluster_config import ClusterSettings
    from .config import CONTEXT_KEYS, StackSettings, check_context_keys

    from .sweep import SweepSettings

    check_context_keys(context, StackSettings.context_keys + ClusterSettings.context_keys
                       + SweepSettings.context_keys)  # as app.py does
    if stack == "cluster":
        from .cluster_config import CLUSTER_CONTEXT_KEYS, SHARED_KEYS, ClusterSettings

        names = set(SHARED_KEYS) | {k.name for k in CLUSTER_CONTEXT_KEYS}
        cs = ClusterSettings.from_mapping({k: v for k, v in context.items() if k in names})
        return Target(region, cs.worker_instance_types, cs.max_workers, None if cs.base.image_id else cs.base.ami_ssm_parameter,
                      cs.base.image_id, cs.base.availability_zones)
    names = {k.name for k in CONTEXT_KEYS}
    s = StackSettings.from_mapping({k: v for k, v in context.items() if k in names})
    return Target(region, s.instance_types, s.target_capacity, None if s.image_id else s.ami_ssm_parameter,
                  s.image_id, s.availability_zones, s.volume_initialization_rate_mibps)


def default_client_factory(region: str, endpoint_url: str | None = None) -> Callable[[str], Any]:
    """boto3 clients in ``region`` with standard retries (``endpoint_url``: e.g. a moto server), from one
    session of their own, which reads the credentials as they are now (boto3's default session keeps
    the ones it found first in this process).

    Args:
        region: the clients' region.
        endpoint_url: an endpoint for every client (default None: AWS's).

    Returns:
        ``make(service) -> client``.
    """
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": 3})
    session = boto3.session.Session()

    def make(service: str) -> Any:
        return session.client(service, region_name=region, endpoint_url=endpoint_url, config=config)

    return make


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``spot-train preflight`` options."""
    parser.add_argument("--stack", choices=("single", "cluster"), default="single",
                        help="check for SpotTraining (single, default) or DistributedTraining (cluster: worker types, max workers)")
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE",
                        help="a context value as for cdk deploy (-c instance_types=g5.xlarge,g6.xlarge); repeatable")
    parser.add_argument("--cdk-json", type=Path, default=Path("cdk.json"), help="context defaults (default ./cdk.json)")
    parser.add_argument("--region", default=None, help="AWS region (default: -c region, else the CLI's configured region)")
    parser.add_argument("--endpoint-url", default=None, help="AWS endpoint (tests: a moto server)")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace, client_factory: Callable[..., Callable[[str], Any]] = default_client_factory) -> int:
    """``spot-train preflight``: print the checks, return the exit code (module docstring).

    Args:
        args: the parsed ``spot-train preflight`` options (:func:`add_arguments`).
        client_factory: ``client_factory(region, endpoint_url)`` returns a client maker (default
            :func:`default_client_factory`; tests pass their own).

    Returns:
        the exit code (:data:`EXIT_OK` 0 passed, :data:`EXIT_FAILED` 1 a check failed,
        :data:`EXIT_USAGE` 2 a bad option or context value, :data:`EXIT_UNKNOWN` 3 a check could not be
        answered, :data:`EXIT_NO_CREDENTIALS` 4 no AWS credentials).
    """
    try:
        context = _context(args.cdk_json, args.context)
        region = args.region or context.get("region")
        if not region:
            import boto3

            region = boto3.session.Session().region_name
        if not region:
            raise ValueError("no region: pass --region or -c region=..., or configure one for the AWS CLI")
        target = target_from_context(context, stack=args.stack, region=region)
    except ValueError as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        checks = run_checks(target, client_factory(region, args.endpoint_url))
    except NoCredentials as exc:
        print(f"preflight: no AWS credentials ({exc}); configure a profile (AWS_PROFILE) or the AWS_ACCESS_KEY_ID / "
              "AWS_SECRET_ACCESS_KEY variables", file=sys.stderr)
        return EXIT_NO_CREDENTIALS
    if args.json:
        print(json.dumps({"region": region, "exit_code": exit_code(checks), "checks": [dataclasses.asdict(c) for c in checks]}, indent=2))
    else:
        print(f"preflight for {args.stack} stack in {region}: types {', '.join(target.instance_types)}, "
              f"{target.target_capacity} instance(s) at once")
        print(format_checks(checks))
    return exit_code(checks)
