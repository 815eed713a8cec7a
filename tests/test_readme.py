"""The README is the user's manual: it must name every context key with its default, the two
commands, and the picture it shows must exist. Nothing here imports TensorFlow or MXNet."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _context_keys() -> dict[str, object]:
    context = json.loads((ROOT / "cdk.json").read_text(encoding="utf-8"))["context"]
    return {key: value for key, value in context.items() if not key.startswith("@")}


def _readme_rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in README.splitlines():
        match = re.match(r"\| `([a-z_]+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def _rendered_default(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(str(item) for item in value)
    return str(value)


def test_every_context_key_is_documented_with_its_cdk_json_default() -> None:
    rows = _readme_rows()
    keys = _context_keys()
    assert keys, "cdk.json has no context keys"
    missing = sorted(set(keys) - set(rows))
    assert not missing, f"README.md documents no row for context keys {missing}"
    wrong = {
        key: (rows[key][0], _rendered_default(value))
        for key, value in keys.items()
        if rows[key][0].strip("`") != _rendered_default(value)
    }
    assert not wrong, f"README.md default differs from cdk.json (README, cdk.json): {wrong}"


def test_readme_rows_are_real_context_keys() -> None:
    stale = sorted(set(_readme_rows()) - set(_context_keys()))
    assert not stale, f"README.md documents context keys that cdk.json does not have: {stale}"


def test_the_two_commands_and_the_ci_entry_point_agree() -> None:
    assert "make demo" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo: setup$", makefile, re.M) and re.search(r"^test: setup$", makefile, re.M)


def test_every_local_link_and_image_in_the_readme_exists() -> None:
    targets = re.findall(r"\]\(((?:docs|bench|spot_training)/[^)#]+)\)", README)
    assert targets, "README.md links to nothing under docs/"
    absent = [target for target in targets if not (ROOT / target).exists()]
    assert not absent, f"README.md links to missing files: {absent}"


@pytest.mark.integration  # imports aws_cdk: jsii starts Node.js (tests/tier_guard.py)
def test_context_key_tables_agree_with_the_contract() -> None:
    """Every context key whose default and limits the contract owns (spot_training.contract): the
    README row shows the contract's range, cdk.json holds the contract's default (or null, and the row
    names the default the agent or trainer then applies); the mount points are the contract's."""
    from spot_training import contract
    from spot_training.infra.cluster_config import CLUSTER_CONTRACT_SETTINGS, CLUSTER_CONTEXT_KEYS
    from spot_training.infra.config import CONTEXT_KEYS, CONTRACT_SETTINGS

    rows, keys = _readme_rows(), _context_keys()
    owned = {**CONTRACT_SETTINGS, **CLUSTER_CONTRACT_SETTINGS}
    infra_defaults = {k.name: k.default for k in CONTEXT_KEYS + CLUSTER_CONTEXT_KEYS}
    port_defaults = {"cluster_scheduler_port": contract.DEFAULT_SCHEDULER_PORT,
                     "cluster_server_port": contract.DEFAULT_SERVER_PORT,
                     "cluster_worker_port": contract.DEFAULT_WORKER_PORT}
    for key, name in owned.items():
        setting = contract.SETTINGS[name]
        text = " | ".join(rows[key])
        shown = f"{setting.minimum:g}.." + (f"{setting.maximum:g}" if setting.maximum is not None else "")
        assert shown in text, f"README row of {key!r} does not show the contract's range {shown}: {text}"
        default = port_defaults.get(key, setting.default)
        assert infra_defaults[key] in (None, default), f"infra's default of {key!r} is not the contract's {default}"
        if keys[key] is not None:
            assert keys[key] == default, f"cdk.json's {key}={keys[key]!r}; the contract's default is {default!r}"
        elif default is not None:
            assert re.search(rf"default: the \w+'s \(?{default:g}\b", text), \
                f"README row of {key!r} does not name the default {default:g}: {text}"
    assert keys["mount_point"] == contract.DEFAULT_MOUNT_POINT
    assert contract.EFS_MOUNT_POINT in " ".join(rows["efs"])


@pytest.mark.integration  # imports aws_cdk: jsii starts Node.js (tests/tier_guard.py)
def test_the_contract_check_of_the_readme_can_fail(monkeypatch) -> None:
    from spot_training import contract

    monkeypatch.setattr(contract, "SETTINGS", {**contract.SETTINGS, "keep_snapshots": contract.Setting(
        "keep_snapshots", int, 2, 1, 50, "snapshots")})
    try:
        test_context_key_tables_agree_with_the_contract()
    except AssertionError as exc:
        assert "1..50" in str(exc)
    else:
        raise AssertionError("a README range that differs from the contract's went unnoticed")


def test_the_first_screen_says_what_it_is_costs_needs_and_how_to_deploy_destroy_and_bring_a_script() -> None:
    first_screen = " ".join(README[:README.index("## Try it locally")].split())
    for needed in ("What it costs", "Prerequisites for a real account", "cdk deploy", "cdk destroy", "Your own script",
                   "training_command", "PyTorch", "USD"):
        assert needed in first_screen, needed
    assert "as of 2026-11, spot-training 0.1.0" in first_screen  # the prices are dated, with the version


def test_the_readme_names_no_path_outside_the_repository_and_pytorch_with_the_frameworks() -> None:
    assert not re.search(r"(?<![\w.])\.\./", README), "README.md points outside the repository"
    for match in re.finditer(r"TensorFlow(/Keras)?,? (and )?(Apache )?MXNet", README):
        line = README[README.rfind("\n", 0, match.start()) + 1:README.find("\n", match.end())]
        assert "PyTorch" in line, f"frameworks listed without PyTorch: {line}"
