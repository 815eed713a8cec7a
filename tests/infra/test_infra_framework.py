"""`framework` picks the single-node trainer: the command and the GPU build the node installs.

Each stack here is built as app.py builds it, from cdk.json's context plus the `-c` value under test,
so a default that cdk.json pins (a bug once: `-c framework=mxnet` kept the Keras command)
shows. The node config is read back out of the launch template's user data (aws_cdk.assertions finds
the launch template; spot_training.infra.userdata.extract_config reads the config as local mode and the agent do).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from infra_helpers import Synth, launch_template_user_data, synth_stack

from spot_training.agent.config import parse_config
from spot_training.infra.config import FRAMEWORKS, StackSettings
from spot_training.infra.userdata import extract_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def _app_context(**overrides: str) -> dict[str, Any]:
    """cdk.json's context with ``-c key=value`` overrides (strings, as the CLI passes them)."""
    context = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
    return {**context, **overrides}


def _settings(**overrides: str) -> StackSettings:
    app = cdk.App(context=_app_context(**overrides))
    return StackSettings.from_context(app.node.try_get_context)


@pytest.fixture(scope="module")
def mxnet_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return synth_stack(tmp_path_factory.mktemp("cdk-mxnet"), _settings(framework="mxnet"))


@pytest.fixture(scope="module")
def pytorch_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return synth_stack(tmp_path_factory.mktemp("cdk-pytorch"), _settings(framework="pytorch"))


def test_framework_mxnet_synthesizes_the_gluon_command_and_installs_mxnet(mxnet_synth: Synth) -> None:
    text = launch_template_user_data(mxnet_synth.template)
    training = extract_config(text)["training"]
    assert training["framework"] == "mxnet"
    assert training["command"] == ["{python}", "spot_training/training/examples/gluon_resnet.py"]
    assert training["python"] == "/usr/bin/python3"
    # The agent builds the framework into a venv on the data volume once (not a pip install at every boot).
    assert training["venv"] == {"requirements": ["mxnet-cu112==1.9.1", "numpy<1.24"], "root": "/dltraining/envs",
                                "inherit_site_packages": False}
    assert "pip install --quiet 'mxnet" not in text
    assert "tensorflow" not in text and "keras_resnet" not in text
    assert mxnet_synth.nag_errors == []


def test_framework_pytorch_synthesizes_the_torch_command_and_installs_the_cuda_build(pytorch_synth: Synth) -> None:
    text = launch_template_user_data(pytorch_synth.template)
    config = extract_config(text)
    training = config["training"]
    assert training["framework"] == "pytorch"
    assert training["command"] == ["{python}", "spot_training/training/examples/torch_resnet.py"]
    assert training["python"] == "/usr/bin/python3"
    # PyPI's Linux x86_64 torch wheel is the CUDA build: no CPU-only index, no TensorFlow, no MXNet.
    assert training["venv"]["requirements"] == ["torch>=2.5,<3", "numpy>=1.26"]
    assert "download.pytorch.org" not in text and "tensorflow" not in text and "mxnet" not in text
    # Only in the config: the trainer's environment is the agent's job, after the volume is mounted.
    assert text.index("torch>=2.5,<3") < text.index("# END spot-training config") < text.index("systemctl enable --now")
    # The agent accepts what the stack wrote (region and ids as a deploy resolves them).
    assert parse_config(config).training.framework == "pytorch"
    assert pytorch_synth.nag_errors == []


def test_the_example_each_framework_runs_by_default_is_in_the_repository() -> None:
    for name, defaults in FRAMEWORKS.items():
        script = defaults.training_command[1]
        if name == "pytorch" and not (REPO_ROOT / script).exists():
            pytest.fail(f"{script} (the PyTorch example) is not in this checkout yet")
        assert (REPO_ROOT / script).is_file(), (name, script)


@pytest.mark.parametrize("framework,command,requirements", [
    ("tensorflow", ("{python}", "spot_training/training/examples/keras_resnet.py"), ("tensorflow[and-cuda]>=2.17,<2.18",)),
    ("mxnet", ("{python}", "spot_training/training/examples/gluon_resnet.py"), ("mxnet-cu112==1.9.1", "numpy<1.24")),
    ("pytorch", ("{python}", "spot_training/training/examples/torch_resnet.py"), ("torch>=2.5,<3", "numpy>=1.26")),
])
def test_each_framework_brings_its_command_and_requirements(framework: str, command: tuple[str, ...],
                                                              requirements: tuple[str, ...]) -> None:
    from_cli = _settings(framework=framework)
    assert (from_cli.training_command, from_cli.training_requirements) == (command, requirements)
    # Built in Python (a team's own CDK app) the same defaults follow the framework.
    direct = StackSettings(framework=framework)
    assert (direct.training_command, direct.training_requirements) == (command, requirements)
    assert StackSettings(framework=framework, training_python="/opt/venv/bin/python").training_requirements == ()


def test_a_given_training_command_wins_over_the_framework_default() -> None:
    s = _settings(framework="pytorch", training_command='["{python}", "train.py", "--epochs", "3"]')
    assert s.training_command == ("{python}", "train.py", "--epochs", "3")
    assert s.training_requirements == ("torch>=2.5,<3", "numpy>=1.26")
    assert StackSettings(framework="mxnet", training_command=("{python}", "mine.py")).training_command == ("{python}", "mine.py")


def test_a_bad_framework_fails_naming_the_value_and_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"^context key 'framework': got 'torch'; allowed: one of tensorflow, mxnet, pytorch"):
        _settings(framework="torch")
    with pytest.raises(ValueError, match=r"'framework': got 'jax'; allowed: one of tensorflow, mxnet, pytorch"):
        StackSettings(framework="jax")
