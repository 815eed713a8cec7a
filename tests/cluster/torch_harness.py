"""A PyTorch (TorchElastic) cluster on one machine: the parameter-server harness (cluster_harness.py) with
PyTorch nodes: no servers, torchrun settings, the trainer and store on .venv-torch's interpreter (the
agents stay on the caller's: stdlib + boto3). Used by test_cluster_torch.py and bench/bench_elastic.py."""

from __future__ import annotations

import csv
import json

from cluster_harness import REPO, Cluster

from spot_training.agent.process_group import kill_tree
from spot_training.agent.torch_elastic import RendezvousState

TORCH_PYTHON = REPO / ".venv-torch" / "bin" / "python"
BUDGET_S = 180.0


class TorchCluster(Cluster):
    """The harness's cluster with PyTorch nodes: no servers, torchrun settings, the torch interpreter."""

    def add_node(self, role, *, start=True):
        node = super().add_node(role, start=False)
        config = json.loads(node.config_path.read_text())
        config["training"]["python"] = str(TORCH_PYTHON)
        config["cluster"].update({"num_servers": 0, "max_workers": 4, "torch_max_restarts": 50,
                                  "torch_shutdown_timeout_s": 30})
        node.config_path.write_text(json.dumps(config))
        if start:
            self.start(node)
        return node

    def kill_node(self, node) -> None:
        """The instance is gone: SIGKILL its agent and every process under it (torchrun's ranks run in
        sessions of their own, so process groups alone would leave them running)."""
        node.extra["killed"] = True
        kill_tree(node.agent.pid)
        node.agent.wait(timeout=10)

    def close(self) -> None:
        for node in self.nodes:
            if node.alive():
                self.kill_node(node)
        super().close()

    def rows(self) -> list[dict]:
        path = self.log_dir / "training_log.csv"
        if not path.exists():
            return []
        with open(path, newline="") as handle:
            return [r for r in csv.DictReader(handle) if r.get("step")]

    def rdzv(self) -> dict | None:
        return RendezvousState(self.state_dir).read()

    def diagnostics(self) -> str:
        return "\n".join([f"rendezvous: {self.rdzv()}", f"last rows: {self.rows()[-5:]}", self.log_tails(12)])

    def wait_rows(self, predicate, what: str, timeout: float = BUDGET_S) -> list[dict]:
        """Wait until ``predicate(rows)`` holds; return the rows (training_log.csv of rank 0)."""
        return self.wait_for(lambda: predicate(self.rows()) and self.rows(), timeout, what)
