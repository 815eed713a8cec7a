"""Context-key validation (spot_training.infra.config): every bad value fails with the key, the value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path

import aws_cdk as cdk
import pytest
from infra_helpers import assert_docs_list_context_keys

from spot_training.infra.config import CONTEXT_KEYS, StackSettings
from spot_training.infra.fleet import AllocationStrategy

DOCS = Path(__file__).resolve().parents[2] / "docs" / "infra.md"


def settings_from_app_context(**context: object) -> StackSettings:
    """Read settings the way app.py does: from a real CDK app's context."""
    app = cdk.App(context=context)
    return StackSettings.from_context(app.node.try_get_context)


def test_defaults_match_the_issue() -> None:
    s = settings_from_app_context()
    assert s.stack_name == "SpotTraining"
    assert s.instance_types == ("g6.xlarge", "g5.xlarge", "g4dn.xlarge")
    assert s.allocation_strategy is AllocationStrategy.PRICE_CAPACITY_OPTIMIZED
    assert (s.target_capacity, s.volume_size_gib, s.mount_point) == (1, 100, "/dltraining")
    assert (s.framework, s.efs, s.retain_data, s.account, s.region) == ("tensorflow", False, False, None, None)


def test_fails_when_instance_type_is_malformed() -> None:
    with pytest.raises(ValueError, match=r"instance_types.*'p3\.2xl arge'.*FAMILY\.SIZE such as g5\.xlarge"):
        settings_from_app_context(instance_types=["g5.xlarge", "p3.2xl arge"])
    with pytest.raises(ValueError, match=r"instance_types.*'gpu'.*FAMILY\.SIZE"):
        settings_from_app_context(instance_types="gpu")


@pytest.mark.parametrize("size", [0, -5, 16385, "16385", "big", 1.5, True])
def test_fails_when_volume_size_is_outside_1_to_16384_gib(size: object) -> None:
    with pytest.raises(ValueError, match=rf"'volume_size_gib': got {re.escape(repr(size))}; allowed: an integer \(GiB\) from 1 to 16384"):
        settings_from_app_context(volume_size_gib=size)


@pytest.mark.parametrize("types", [[], "", " , "])
def test_fails_when_instance_type_list_is_empty(types: object) -> None:
    with pytest.raises(ValueError, match=r"'instance_types': got .*; allowed: a non-empty list"):
        settings_from_app_context(instance_types=types)


def test_fails_when_framework_is_unknown() -> None:
    with pytest.raises(ValueError, match=r"'framework': got 'caffe'; allowed: one of tensorflow, mxnet, pytorch"):
        settings_from_app_context(framework="caffe")


def test_fails_when_allocation_strategy_is_unknown() -> None:
    with pytest.raises(
        ValueError,
        match=r"'allocation_strategy': got 'cheapest'; allowed: one of priceCapacityOptimized, capacityOptimized, lowestPrice, diversified",
    ):
        settings_from_app_context(allocation_strategy="cheapest")


@pytest.mark.parametrize("capacity", [-1, "-3"])
def test_fails_when_target_capacity_is_negative(capacity: object) -> None:
    with pytest.raises(ValueError, match=rf"'target_capacity': got {re.escape(repr(capacity))}; allowed: an integer \(instances\) from 0 to 10000"):
        settings_from_app_context(target_capacity=capacity)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("region", "Europe", "an AWS region name"),
        ("account", "1234", "a 12-digit AWS account id"),
        ("availability_zones", ["us-east-1a", "us-east-1a"], "distinct Availability Zone names"),
        ("vpc_id", "vpc-0123456789abcdef0", "an existing VPC only together with an explicit account and region"),
        ("max_price", "-1", "a positive decimal price"),
        ("volume_iops", 100, r"an integer \(IOPS\) from 3000 to 16000"),
        ("volume_throughput_mibps", 5000, r"an integer \(MiB/s\) from 125 to 1000"),
        ("retain_data", "yes", "true or false"),
        ("code_git_url", "https://example.com/x.git", "a commit or tag"),
        ("image_id", "ubuntu", "an AMI id"),
        ("mount_point", "data", "an absolute directory path"),
        ("stack_name", "1stack", "a CloudFormation stack name"),
        # monitoring (docs/operations.md)
        ("log_retention_days", "31", "one of 1, 3, 5"),
        ("alarm_no_progress_minutes", "0", r"an integer \(minutes\) from 1 to 1440"),
        ("alarm_no_capacity_minutes", "4", r"an integer \(minutes\) from 5 to 1440"),
        ("notification_email", "not-an-address", "an e-mail address"),
        ("monitoring_interval_s", "0.5", "a number of seconds from 1 to 300"),
        ("monitoring", "maybe", "true or false"),
    ],
)
def test_fails_when_other_keys_are_bad(key: str, value: object, allowed: str) -> None:
    name = "code_git_ref" if key == "code_git_url" else key
    with pytest.raises(ValueError, match=rf"context key '{name}': got .*; allowed: {allowed}"):
        settings_from_app_context(**{key: value})


def test_fails_when_gp3_ratios_are_broken() -> None:
    with pytest.raises(ValueError, match=r"'volume_iops': got 8000; allowed: at most 500 IOPS per GiB of volume_size_gib=10 \(max 5000\)"):
        settings_from_app_context(volume_size_gib=10, volume_iops=8000)
    with pytest.raises(ValueError, match=r"'volume_throughput_mibps': got 1000; allowed: at most volume_iops/4 = 750 MiB/s"):
        settings_from_app_context(volume_throughput_mibps=1000)
    ok = settings_from_app_context(volume_iops=4000, volume_throughput_mibps=1000)
    assert (ok.volume_iops, ok.volume_throughput_mibps) == (4000, 1000)


def test_fails_when_azs_are_outside_the_region() -> None:
    with pytest.raises(ValueError, match=r"'availability_zones'.*Availability Zones of region eu-west-1"):
        settings_from_app_context(region="eu-west-1", availability_zones=["us-east-1a"])


def test_fails_on_unknown_setting() -> None:
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['volume_size'\]"):
        StackSettings.from_mapping({"volume_size": 10})


def test_reads_the_strings_that_dash_c_passes() -> None:
    s = settings_from_app_context(
        instance_types="g5.xlarge, g4dn.xlarge",
        target_capacity="0",
        volume_size_gib="16384",
        retain_data="TRUE",
        availability_zones='["us-east-1a","us-east-1b"]',
        allocation_strategy="lowestPrice",
        max_price=0.5,
        training_command='["{python}", "train.py", "--epochs", "3"]',
    )
    assert s.instance_types == ("g5.xlarge", "g4dn.xlarge")
    assert (s.target_capacity, s.volume_size_gib, s.retain_data) == (0, 16384, True)
    assert s.availability_zones == ("us-east-1a", "us-east-1b")
    assert s.allocation_strategy is AllocationStrategy.LOWEST_PRICE
    assert s.max_price == "0.5"
    assert s.training_command == ("{python}", "train.py", "--epochs", "3")


def test_framework_picks_its_requirements_for_the_default_python() -> None:
    mx = settings_from_app_context(framework="mxnet")
    assert (mx.training_python, mx.training_requirements) == ("/usr/bin/python3", ("mxnet-cu112==1.9.1", "numpy<1.24"))
    own = settings_from_app_context(framework="mxnet", training_python="/opt/conda/envs/mxnet/bin/python")
    assert (own.training_python, own.training_requirements) == ("/opt/conda/envs/mxnet/bin/python", ())
    both = settings_from_app_context(training_python="/opt/tf/bin/python", training_requirements='["tensorflow==2.17.1", "keras>=3.5,<4"]')
    assert both.training_requirements == ("tensorflow==2.17.1", "keras>=3.5,<4")
    assert settings_from_app_context(training_requirements="[]").training_requirements == ()
    assert settings_from_app_context(training_requirements="tensorflow>=2.17,<2.18").training_requirements == ("tensorflow>=2.17,<2.18",)


@pytest.mark.parametrize("value", ["tensorflow; curl x | sh", ["ok==1", "it's"], "--index-url http://evil"])
def test_fails_when_training_requirements_are_not_pip_specifiers(value: object) -> None:
    with pytest.raises(ValueError, match=r"'training_requirements': got .*; allowed: a list of pip requirement specifiers"):
        settings_from_app_context(training_requirements=value)


def test_docs_list_every_context_key_with_its_default() -> None:
    assert_docs_list_context_keys(CONTEXT_KEYS, "infra.md")


def test_cdk_json_holds_every_context_key_at_its_default() -> None:
    import json

    from spot_training.infra.cluster_config import CLUSTER_CONTEXT_KEYS, SHARED_KEYS, ClusterSettings

    context = json.loads((DOCS.parents[1] / "cdk.json").read_text())["context"]
    ours = {k: v for k, v in context.items() if not k.startswith("@aws-cdk/")}
    assert ours == {k.name: k.default for k in CONTEXT_KEYS + CLUSTER_CONTEXT_KEYS}
    single = {k.name: ours[k.name] for k in CONTEXT_KEYS}
    assert StackSettings.from_mapping(single) == StackSettings()
    cluster = {k: v for k, v in ours.items() if k in SHARED_KEYS or k.startswith("cluster_")}
    assert ClusterSettings.from_mapping(cluster) == ClusterSettings()


def test_default_instance_types_are_all_supported_by_the_current_deep_learning_base_ami() -> None:
    """No default type may be outside the DLAMI release notes' supported_ec2_instances (docs/infra.md):
    p3 (Volta) fell out with the 580 driver branch, and TensorFlow would train on the CPU there."""
    from spot_training.infra.cluster_config import CLUSTER_CONTEXT_KEYS
    from spot_training.infra.fleet import DEFAULT_INSTANCE_TYPES, DLAMI_SUPPORTED_FAMILIES, instance_family

    worker_defaults = next(k.default for k in CLUSTER_CONTEXT_KEYS if k.name == "cluster_worker_instance_types")
    single_defaults = next(k.default for k in CONTEXT_KEYS if k.name == "instance_types")
    for types in (DEFAULT_INSTANCE_TYPES, tuple(worker_defaults), tuple(single_defaults)):
        assert types and {instance_family(t) for t in types} <= DLAMI_SUPPORTED_FAMILIES, types
        assert not any(t.startswith("p3.") for t in types)
    assert instance_family("p6-b200.48xlarge") == "p6-b200" and "p3" not in DLAMI_SUPPORTED_FAMILIES


def test_default_ami_parameter_follows_the_dlami_naming_rule() -> None:
    """AWS's rule: /aws/service/deeplearning/ami/$arch/$ami_type/latest/ami-id, ami_type = the AMI name
    'Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)' without 'deep', 'learning', 'ami'."""
    name = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)"
    words = [w.strip("()").lower() for w in name.split() if w.lower() not in ("deep", "learning", "ami")]
    expected = f"/aws/service/deeplearning/ami/x86_64/{'-'.join(words)}/latest/ami-id"
    assert expected == "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
    assert settings_from_app_context().ami_ssm_parameter == expected


def test_move_settings_defaults_and_bad_values() -> None:
    s = settings_from_app_context()
    assert (s.snapshot_interval_minutes, s.volume_initialization_rate_mibps, s.pin_to_volume_az) == (60, 300, False)
    s = settings_from_app_context(snapshot_interval_minutes="0", volume_initialization_rate_mibps="none", pin_to_volume_az="true")
    assert (s.snapshot_interval_minutes, s.volume_initialization_rate_mibps, s.pin_to_volume_az) == (0, None, True)
    with pytest.raises(ValueError, match=r"'volume_initialization_rate_mibps': got 500; allowed: an integer from 100 to 300 \(MiB/s\), or none"):
        settings_from_app_context(volume_initialization_rate_mibps=500)
    with pytest.raises(ValueError, match=r"'snapshot_interval_minutes': got -5"):
        settings_from_app_context(snapshot_interval_minutes=-5)
