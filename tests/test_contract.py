"""The contract between the layers (spot_training.contract): the layers import only it from each
other's domain, it needs nothing but the standard library, and the stack (at synth) and the agent (at
boot) accept and refuse the same values because they run its one validator."""

from __future__ import annotations

import ast
import copy
import re
import sys
from pathlib import Path

import pytest

from spot_training import contract
from spot_training.agent.config import parse_config
from spot_training.agent.errors import ConfigError
from spot_training.infra.cluster_config import ClusterSettings
from spot_training.infra.config import StackSettings

REPO = Path(__file__).resolve().parent.parent
#: The ground-floor layers: none may import another's package; each may import the contract.
LAYERS = ("spot_training.infra", "spot_training.agent", "spot_training.training")
#: Local mode, the operations and the command line sit on top and may import every layer; no layer imports them.
TOPS = ("spot_training.local", "spot_training.ops", "spot_training.cli")
CONTRACT = "spot_training.contract"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in ``path``, function-level ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, _package(alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, _package(node.module)))
    return found


def _package(module: str) -> str:
    """The layer a module belongs to: ``spot_training.agent`` for ``spot_training.agent.config``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "spot_training" else parts[0]


def _files(package: str) -> list[Path]:
    """The Python files of a package (a directory) or a module (``spot_training.cli``), sorted."""
    base = REPO.joinpath(*package.split("."))
    if base.is_dir():
        return sorted(base.rglob("*.py"))
    return [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else []


def _violations(package: str, allowed: set[str]) -> list[str]:
    forbidden = (set(LAYERS) | set(TOPS) | {CONTRACT}) - allowed - {package}
    return [f"{path.relative_to(REPO)}:{line} imports {name}"
            for path in _files(package)
            for line, name in _imports(path) if name in forbidden]


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_contract_of_the_other_layers(layer: str) -> None:
    assert _violations(layer, {CONTRACT}) == []


def test_the_contract_imports_only_the_standard_library() -> None:
    names = {name for path in _files(CONTRACT) for _, name in _imports(path)}
    assert names - set(sys.stdlib_module_names) - {"__future__"} == set()


def test_the_import_rule_catches_a_layer_that_reaches_into_another(tmp_path: Path, monkeypatch) -> None:
    # The check itself can fail: a training module importing the agent is reported with its line.
    (tmp_path / "spot_training" / "training").mkdir(parents=True)
    (tmp_path / "spot_training" / "training" / "bad.py").write_text("import os\n\ndef f():\n    from spot_training.agent.config import STACK_TAG\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert _violations("spot_training.training", {CONTRACT}) == ["spot_training/training/bad.py:4 imports spot_training.agent"]


def _node_config(**changes) -> dict:
    """A valid single-node config, with ``changes`` as ``section.key`` -> value."""
    config = {
        "schema_version": 1, "region": "us-east-1", "stack_name": "SpotTraining", "node_role": "single",
        "volume": {"tags": {contract.STACK_TAG: "SpotTraining", contract.PURPOSE_TAG: "data-volume"},
                   "device_name": "/dev/sdf", "mount_point": "/dltraining", "fs_type": "xfs", "keep_snapshots": 2},
        "efs": None,
        "training": {"framework": "tensorflow", "python": "/usr/bin/python3", "command": ["{python}", "t.py"],
                     "user": "ubuntu", "checkpoint_dir": "/dltraining/checkpoints",
                     "code": {"type": "asset", "path": "/opt/spot-training/code"}},
        "cleanup": {"cancel_fleet_on_success": True}, "imds_endpoint": None,
        "monitoring": {"enabled": True, "log_group": "/spot-training/SpotTraining", "namespace": "SpotTraining"},
    }
    config = copy.deepcopy(config)
    for path, value in changes.items():
        *parents, key = path.split(".")
        section = config
        for parent in parents:
            section = section[parent]
        section[key] = value
    return config


#: context key -> where the stack writes it in the node config.
PLACES = {
    "notice_poll_interval_s": "notice_poll_interval_s",
    "keep_snapshots": "volume.keep_snapshots",
    "monitoring_interval_s": "monitoring.interval_s",
    "checkpoint_every_steps": "training.checkpoint_every_steps",
    "checkpoint_every_seconds": "training.checkpoint_every_seconds",
    "volume_initialization_rate_mibps": "volume.initialization_rate_mibps",
}
BAD = [(key, value) for key, values in {
    "notice_poll_interval_s": (0.4, 0, 61, 1e9),
    "keep_snapshots": (0, 101, 10**6),
    "monitoring_interval_s": (0.5, 301),
    "checkpoint_every_steps": (0, -3),
    "checkpoint_every_seconds": (0, 0.5, 86401),
    "volume_initialization_rate_mibps": (99, 301),
}.items() for value in values]
GOOD = [(key, value) for key, values in {
    "notice_poll_interval_s": (0.5, 1, 5, 60),
    "keep_snapshots": (1, 2, 100),
    "monitoring_interval_s": (1, 10, 300),
    "checkpoint_every_steps": (1, 7, 10**6),
    "checkpoint_every_seconds": (1, 90, 86400),
    "volume_initialization_rate_mibps": (100, 300),
}.items() for value in values]


@pytest.mark.parametrize("key, value", BAD)
def test_a_value_the_stack_refuses_the_agent_refuses(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"context key '{key}': got {value!r}; allowed: "):
        StackSettings.from_mapping({key: value})
    with pytest.raises(ConfigError, match=f"{PLACES[key]}: got "):
        parse_config(_node_config(**{PLACES[key]: value}))


@pytest.mark.parametrize("key, value", GOOD)
def test_a_value_the_stack_accepts_the_agent_accepts(key: str, value: float) -> None:
    settings = StackSettings.from_mapping({key: value, **({"monitoring": True} if "monitoring" in key else {})})
    parse_config(_node_config(**{PLACES[key]: value}))
    # And as `-c key=value` passes it: text.
    assert StackSettings.from_mapping({key: str(value)}) == settings


@pytest.mark.parametrize("port, ok", [(1023, False), (1024, True), (9000, True), (65535, True), (65536, False)])
def test_cluster_ports_agree_between_stack_and_agent(port: int, ok: bool) -> None:
    from spot_training.agent.cluster_state import settings_from_config

    section = {"state_dir": "/mnt/efs/cluster", "num_servers": 1, "min_workers": 1, "scheduler_port": port}
    if ok:
        assert ClusterSettings.from_mapping({"cluster_scheduler_port": port}).ports.scheduler == port
        assert settings_from_config(section).scheduler_port == port
    else:
        with pytest.raises(ValueError, match="context key 'cluster_scheduler_port'"):
            ClusterSettings.from_mapping({"cluster_scheduler_port": port})
        with pytest.raises(ConfigError, match="cluster.scheduler_port"):
            settings_from_config(section)


def test_true_and_text_are_not_numbers_in_the_node_config() -> None:
    for value in (True, "5"):
        with pytest.raises(ConfigError, match="notice_poll_interval_s: got"):
            parse_config(_node_config(notice_poll_interval_s=value))
    with pytest.raises(ValueError):
        StackSettings.from_mapping({"notice_poll_interval_s": True})


def test_one_write_json_atomic_with_the_directory_fsync(tmp_path: Path, monkeypatch) -> None:
    import os

    import spot_training.training.store

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.path.realpath(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    contract.write_json_atomic(tmp_path / "plan.json", {"generation": 3})
    assert (tmp_path / "plan.json").read_text().strip().startswith("{")
    assert str(tmp_path) in synced  # the directory, so the rename survives a power cut
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    import spot_training.agent.cluster_state

    assert spot_training.agent.cluster_state.write_json_atomic is contract.write_json_atomic
    assert spot_training.training.store.write_json_atomic.__module__ == "spot_training.training.store"  # keeps the store's temp prefix


# ---- no module reaches into another's private names --------------------------------
OURS = (*LAYERS, *TOPS, CONTRACT)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_our_module(dotted: str) -> bool:
    """True for a module of this repository (``spot_training.local.nodes``, ``spot_training.agent``), by its file."""
    if not any(dotted == ours or dotted.startswith(ours + ".") for ours in OURS):
        return False
    base = REPO.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private_uses(path: Path) -> list[str]:
    """``path:line name`` for every ``from X import _name`` and ``X._name`` where X is another module of
    this repository (a module bound by ``import X``, ``import X as Y`` or ``from P import X``)."""
    me = _module_of(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bound: dict[str, str] = {}  # local name -> our module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = me.split(".")[: len(me.split(".")) - node.level + (1 if path.name == "__init__.py" else 0)]
                module = ".".join([*package, module] if module else package)
            if not _is_our_module(module) or module == me:
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} from {module} import {alias.name}")
                elif _is_our_module(f"{module}.{alias.name}"):
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_our_module(alias.name):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                module = ".".join([bound[value.id], *chain])
                if _is_our_module(module) and module != me:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {module}.{node.attr}")
    return found


def _all_private_uses() -> list[str]:
    return [use for package in OURS for path in _files(package) for use in _private_uses(path)]


def test_no_module_uses_another_modules_private_names() -> None:
    assert _all_private_uses() == []


def test_the_private_name_rule_catches_both_forms(tmp_path: Path, monkeypatch) -> None:
    # The check itself can fail: both an import of a private name and an attribute through a module.
    (tmp_path / "spot_training" / "local").mkdir(parents=True)
    (tmp_path / "spot_training" / "__init__.py").write_text("")
    (tmp_path / "spot_training" / "local" / "__init__.py").write_text("")
    (tmp_path / "spot_training" / "local" / "nodes.py").write_text("def _rewrite():\n    pass\n")
    (tmp_path / "spot_training" / "local" / "bad.py").write_text(
        "from spot_training.local.nodes import _rewrite\nfrom spot_training.local import nodes as n\nimport spot_training.local.nodes\n\n"
        "def f():\n    return n._rewrite, spot_training.local.nodes._rewrite, n.__name__\n")
    (tmp_path / "spot_training" / "local" / "nodes_ok.py").write_text("def _own():\n    pass\n\n_own()\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert _all_private_uses() == ["spot_training/local/bad.py:1 from spot_training.local.nodes import _rewrite",
                                   "spot_training/local/bad.py:6 spot_training.local.nodes._rewrite",
                                   "spot_training/local/bad.py:6 spot_training.local.nodes._rewrite"]


def test_restart_policy_is_one_table_that_the_systemd_unit_renders():
    from spot_training import contract
    from spot_training.infra.userdata import systemd_unit

    assert [contract.trainer_exit_decision(s) for s in (0, 74, 78, 75, 1, -9, None)] == [
        contract.TRAINER_FINISHED, contract.TRAINER_GIVE_UP, contract.TRAINER_GIVE_UP, contract.TRAINER_RETRY,
        contract.TRAINER_RESTART, contract.TRAINER_RESTART, contract.TRAINER_RESTART]
    line = next(l for l in systemd_unit().splitlines() if l.startswith("RestartPreventExitStatus="))
    given_up = {s for s, d in contract.TRAINER_EXIT_POLICY.items() if d == contract.TRAINER_GIVE_UP}
    assert set(map(int, line.split("=", 1)[1].split())) == given_up | {contract.EXIT_CONFIG, contract.EXIT_UNAVAILABLE}


@pytest.mark.integration  # starts a process
def test_pid_alive_is_the_one_process_check(tmp_path: Path) -> None:
    """A live process and its group exist; a reaped one does not; values ``kill`` would misread are false."""
    import subprocess

    import spot_training.agent.process_group as process_group
    import spot_training.cli as cli
    import spot_training.training.store as store

    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert contract.pid_alive(proc.pid) and contract.pid_alive(proc.pid, group=True)
        assert process_group.group_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not contract.pid_alive(proc.pid) and not contract.pid_alive(proc.pid, group=True)
    assert not process_group.group_alive(proc.pid)
    # 0 and -1 would ask kill(2) about the caller's own group or every process: both "exist".
    for bad in (None, "123", True, 0, -1, 1.5):
        assert contract.pid_alive(bad) is False, bad
    assert contract.pid_alive(1)  # init: another user's process (EPERM for non-root) still counts
    assert cli.pid_alive is contract.pid_alive and store.contract.pid_alive is contract.pid_alive


@pytest.mark.parametrize("value, zero, ok", [
    (0.5, False, True), (3, False, True), (0, True, True), (0, False, False), (-1, True, False),
    (float("nan"), True, False), (float("inf"), False, False), (True, False, False), ("5", False, False), (None, True, False),
])
def test_check_seconds_refuses_what_a_bare_comparison_lets_through(value, zero, ok) -> None:
    """NaN passes ``value <= 0`` (every comparison with NaN is false) and a NaN or infinite timeout never expires."""
    if ok:
        assert contract.check_seconds("timeout_s", value, zero=zero) == float(value)
    else:
        with pytest.raises(ValueError, match=rf"^timeout_s must be {'>=' if zero else '>'} 0 seconds, got "):
            contract.check_seconds("timeout_s", value, zero=zero)


def test_the_agents_and_local_modes_duration_arguments_share_the_check() -> None:
    """One NaN through each former hand-rolled check: each now names the argument."""
    from spot_training.agent.imds import ImdsClient
    from spot_training.agent.lease import VolumeLease
    from spot_training.agent.retry import Deadline
    from spot_training.local.drill import DrillOptions

    cases = [(lambda: ImdsClient(timeout_s=float("nan")), "timeout_s"),
             (lambda: VolumeLease(ec2=None, owner="i-1", settle_s=float("nan")), "settle_s"),
             (lambda: Deadline(float("nan"), "mount"), "deadline for step 'mount'"),
             (lambda: DrillOptions(timeout_s=float("nan")).validate(), "timeout_s")]
    for make, name in cases:
        with pytest.raises(ValueError, match=rf"^{re.escape(name)} must be >?=? ?0 seconds, got nan"):
            make()
