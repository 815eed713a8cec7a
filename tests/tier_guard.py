"""Test tiers by cost (docs/architecture.md, "Tests"), and a guard that keeps the unit tier honest.

- **unit**: in-process, no subprocess, no fork, no network connection, no CDK construct; the whole tier
  runs in well under a minute (``make test-unit``).
- **integration** (``@pytest.mark.integration``): a moto server over HTTP, a CDK synth, a subprocess.
  Tests that use the ``moto_server``/``ec2`` fixtures and every test under ``tests/infra`` are marked
  automatically (:func:`mark_by_fixture`).
- **slow** (``@pytest.mark.slow``): end to end, real training or whole drills.

``make test`` runs all three. With ``TEST_TIER=unit`` (``make test-unit``) a test that reaches outside
its process fails, naming what it started (:func:`guard`), so a costly test cannot hide in the unit tier.
With ``TEST_TIER=record`` it does not fail but appends ``nodeid<TAB>what`` to ``$TEST_TIER_LOG``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

#: Fixtures that make a test an integration test: the moto server over HTTP.
INTEGRATION_FIXTURES = frozenset({"moto_server", "moto_server_session", "ec2", "server"})
#: Directories whose tests are integration tests as a whole (each synthesizes a CDK app).
INTEGRATION_DIRS = ("tests/infra/", "tests/consumer/")


class TierViolation(AssertionError):
    """A unit-tier test reached outside its process."""


def mark_by_fixture(items: list[pytest.Item]) -> None:
    """Add the ``integration`` marker to every collected test that uses a moto fixture or lives in an
    integration directory, unless it is already ``slow``."""
    for item in items:
        path = item.nodeid.replace(os.sep, "/")
        if item.get_closest_marker("slow") or item.get_closest_marker("integration"):
            continue
        if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())) or path.startswith(INTEGRATION_DIRS):
            item.add_marker(pytest.mark.integration)


@contextlib.contextmanager
def guard(nodeid: str, mode: str) -> Iterator[None]:
    """Patch subprocess creation, fork, inet connections and CDK construct creation for one test.

    Args:
        nodeid: the test's pytest node id (named in the error and the record).
        mode: ``"unit"`` raises :class:`TierViolation` on the first reach outside; ``"record"`` appends
            ``nodeid<TAB>what`` to the file named by ``$TEST_TIER_LOG`` and lets the test go on.

    Yields:
        nothing; the patches are undone on exit.
    """
    seen: list[str] = []

    def hit(what: str) -> None:
        if mode == "record":
            if what not in seen:
                seen.append(what)
                with open(os.environ.get("TEST_TIER_LOG", "tier.log"), "a", encoding="utf-8") as log:
                    log.write(f"{nodeid}\t{what}\n")
            return
        raise TierViolation(f"{nodeid} is in the unit tier but {what}: mark it @pytest.mark.integration "
                            "(or slow), or keep it in-process")

    popen_init, fork, connect = subprocess.Popen.__init__, os.fork, socket.socket.connect

    def guarded_popen(self, args, *a, **k):  # type: ignore[no-untyped-def]
        hit(f"starts a subprocess {str(args)[:80]}")
        return popen_init(self, args, *a, **k)

    def guarded_fork():  # type: ignore[no-untyped-def]
        hit("forks")
        return fork()

    def guarded_connect(self, address):  # type: ignore[no-untyped-def]
        if self.family in (socket.AF_INET, socket.AF_INET6):
            hit(f"connects to {address}")
        return connect(self, address)

    patches = [(subprocess.Popen, "__init__", guarded_popen), (os, "fork", guarded_fork),
               (socket.socket, "connect", guarded_connect)]
    constructs = sys.modules.get("constructs")
    if constructs is not None:  # CDK objects talk to the jsii kernel, a node.js process
        construct_init = constructs.Construct.__init__

        def guarded_construct(self, *a, **k):  # type: ignore[no-untyped-def]
            hit("creates a CDK construct")
            return construct_init(self, *a, **k)
        patches.append((constructs.Construct, "__init__", guarded_construct))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_by_fixture(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    mode = os.environ.get("TEST_TIER", "")
    unit = not (item.get_closest_marker("slow") or item.get_closest_marker("integration"))
    if mode not in ("unit", "record") or not unit:
        yield
        return
    with guard(item.nodeid, mode):
        yield
