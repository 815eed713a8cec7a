"""Your own script on the nodes: a local code directory as a CDK asset (``code_dir``), and a private
git repository whose token the node role may read from exactly one Secrets Manager secret
(``code_git_token_secret``). Synthesized with cdk-nag, as app.py does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from infra_helpers import Synth, launch_template_user_data, render_intrinsics, synth_stack

from spot_training.infra.config import StackSettings
from spot_training.infra.userdata import USER_CODE_DIR, extract_config

SECRET = "team/git-token"


@pytest.fixture(scope="module")
def code_dir_synth(tmp_path_factory: pytest.TempPathFactory) -> tuple[Synth, Path]:
    code = tmp_path_factory.mktemp("my-project")
    (code / "my_train.py").write_text("print('hi')\n")
    (code / "lib").mkdir()
    (code / "lib" / "model.py").write_text("X = 1\n")
    for dropped in (".git/HEAD", "__pycache__/m.cpython-311.pyc", ".venv/bin/python", "data/big.bin"):
        (code / dropped).parent.mkdir(parents=True, exist_ok=True)
        (code / dropped).write_text("x")
    # cdk.out inside the code directory (cdk deploy -c code_dir=. in your project) is left out too.
    settings = StackSettings.from_mapping({"code_dir": str(code), "code_exclude": '[".git", ".venv", "__pycache__", "/data"]',
                                           "training_command": "{python} my_train.py --epochs 2", "dataset_uri": "none"})
    return synth_stack(code / "cdk.out", settings), code


@pytest.fixture(scope="module")
def private_git_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    # A git server inside the VPC, reached from isolated subnets: the secret needs its endpoint then.
    settings = StackSettings.from_mapping({"code_git_url": "https://git.internal.example/private.git", "code_git_ref": "v1",
                                           "code_git_token_secret": SECRET, "dataset_uri": "none",
                                           "private_subnets": "true"})
    return synth_stack(tmp_path_factory.mktemp("cdk-private-git"), settings)


def _node_statements(synth: Synth) -> list[dict[str, Any]]:
    return [s for policy in synth.resources("AWS::IAM::Policy").values()
            for s in policy["Properties"]["PolicyDocument"]["Statement"]]


def _config(synth: Synth) -> dict[str, Any]:
    return extract_config(launch_template_user_data(synth.template))


def test_code_dir_is_an_asset_the_node_unpacks_and_runs_in(code_dir_synth: tuple[Synth, Path]) -> None:
    synth, code = code_dir_synth
    assert synth.nag_errors == []
    config = _config(synth)
    assert config["training"]["code"] == {"type": "asset", "path": USER_CODE_DIR}
    assert config["training"]["command"] == ["{python}", "my_train.py", "--epochs", "2"]
    user_data = launch_template_user_data(synth.template)
    assert "step fetch-code fetch_code" in user_data and "step unpack-code unpack_code" in user_data
    assert user_data.index("step unpack-code") < user_data.index("step start-agent")
    # The asset holds the script and its package, not what code_exclude and the cloud assembly name.
    assets = json.loads(next(synth.outdir.glob("*.assets.json")).read_text())["files"]
    staged = [synth.outdir / a["source"]["path"] for a in assets.values()
              if (synth.outdir / a["source"]["path"] / "my_train.py").exists()]
    assert len(staged) == 1
    files = sorted(p.relative_to(staged[0]).as_posix() for p in staged[0].rglob("*") if p.is_file())
    assert files == ["lib/model.py", "my_train.py"]
    # The node role reads exactly that object (and the bootstrap asset), nothing else of the bucket.
    gets = [render_intrinsics(s["Resource"]) for s in _node_statements(synth) if s["Action"] == "s3:GetObject"]
    code_hash = next(h for h, a in assets.items() if synth.outdir / a["source"]["path"] == staged[0])
    assert any(r.endswith(f"/{code_hash}.zip") for r in gets), gets
    assert all(r.endswith(".zip") for r in gets)


def test_private_git_token_secret_is_read_by_the_node_role_only(private_git_synth: Synth) -> None:
    synth = private_git_synth
    assert synth.nag_errors == []
    code = _config(synth)["training"]["code"]
    assert code == {"type": "git", "url": "https://git.internal.example/private.git", "ref": "v1", "token_secret": SECRET}
    services = [json.dumps(e["Properties"]["ServiceName"]) for e in synth.resources("AWS::EC2::VPCEndpoint").values()]
    assert sum(".secretsmanager" in s for s in services) == 1, services
    reads = [s for s in _node_statements(synth) if "secretsmanager:GetSecretValue" in json.dumps(s["Action"])]
    assert len(reads) == 1
    resource = render_intrinsics(reads[0]["Resource"])
    # The one secret: its name plus the 6-character suffix Secrets Manager appends, nothing wider.
    assert resource.endswith(f":secret:{SECRET}-??????"), resource
    assert "secretsmanager:PutSecretValue" not in json.dumps(_node_statements(synth))


@pytest.mark.parametrize(("mapping", "message"), [
    ({"code_dir": "/no/such/dir"}, "'code_dir': '/no/such/dir' is not a directory"),
    ({"code_dir": ".", "code_git_url": "https://x/y.git", "code_git_ref": "v1"}, "one source of training code"),
    ({"code_exclude": "a,b"}, "set only with code_dir"),
    ({"code_git_token_secret": SECRET}, "only with an https:// code_git_url"),
    ({"code_git_url": "git@github.com:a/b.git", "code_git_ref": "v1", "code_git_token_secret": SECRET}, "https://"),
    ({"code_git_url": "https://x/y.git", "code_git_ref": "v1", "code_git_token_secret": "bad name!"}, "secret name"),
    ({"code_git_url": "https://u:pw@x/y.git", "code_git_ref": "v1"}, "without a password"),
])
def test_bad_code_settings_fail_synth_naming_the_key(mapping: dict[str, str], message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        if "code_dir" in mapping and mapping["code_dir"] == "/no/such/dir":
            synth_stack(tmp_path, StackSettings.from_mapping(mapping))
        else:
            StackSettings.from_mapping(mapping)


def test_typed_settings_take_the_code_keys(tmp_path: Path) -> None:
    settings = StackSettings(code_git_url="https://x/y.git", code_git_ref="v1", code_git_token_secret=SECRET)
    assert settings.code_git_token_secret == SECRET
    assert StackSettings(code_dir=str(tmp_path), code_exclude=()).code_exclude == ()
