"""A lease on the stack's data volume, kept in one EC2 tag, so that only one node moves or attaches it.

EC2 has no conditional tag write, so the lease is "write, let it settle, read back", and EC2's own
atomic operations stay the final arbiter:

1. Read the data volume candidates (the caller's DescribeVolumes). If any carries a live lease of
   another owner, wait (polling, bounded by ``wait_s``) or raise :class:`TemporaryError` (exit 75).
2. Write ``spot-training:lease = "<owner> <expires>"`` on the volume with CreateTags (one tag, so two
   writers can never leave a torn mix of owner and expiry). ``expires`` is Unix time in seconds
   (wall clock, shared between machines), ``now + ttl_s``.
3. Sleep ``settle_s`` (longer than the read-to-write gap of a competing agent, one API round trip),
   then read the candidates again. Two writers on the same volume: the last write is the one both
   read back, so exactly one sees itself. Writers on different candidates: the lexically smallest
   owner wins and the others withdraw. The loser deletes its own tag (DeleteTags with the value, which
   EC2 applies only if the value still matches) and goes back to step 1.
4. The holder renews (:meth:`VolumeLease.renew`) at each step of a long move, hands the lease to the
   new copy by tagging it at creation, and releases it (:meth:`VolumeLease.release`, conditional on
   its own value) once the volume is attached and verified. An attached volume needs no lease: an
   attachment blocks every other AttachVolume (``VolumeInUse``) and every move (a move starts only
   from an ``available`` volume).

Residual risk: EC2 tags are eventually consistent; if a competitor's write stays invisible for longer
than ``settle_s``, two agents may both believe they hold the lease. Then AttachVolume still lets only
one attach a given volume, and a move re-checks the lease on the source before it marks its copy
verified and before it retires the source (see spot_training/agent/ebs.py), so no data is deleted on that basis.
A holder that dies leaves a lease that expires after ``ttl_s``; the same instance (same owner)
rebooting takes its own lease back at once.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

from spot_training.agent.errors import TemporaryError
from spot_training.contract import LEASE_TAG, check_seconds  # tag keys: the contract's



@dataclass(frozen=True)
class Lease:
    """A lease read from a tag: ``owner`` (instance id) and ``expires`` (Unix time, seconds)."""

    owner: str
    expires: float

    @property
    def value(self) -> str:
        """The tag value ``"<owner> <expires>"``."""
        return f"{self.owner} {int(self.expires)}"

    def live(self, now: float) -> bool:
        """True while ``now`` (Unix seconds) is before ``expires``."""
        return now < self.expires


def parse_lease(value: str | None) -> Lease | None:
    """Parse a lease tag value; ``None`` for a missing or malformed value (treated as no lease)."""
    if not value:
        return None
    parts = value.split()
    if len(parts) != 2:
        return None
    try:
        return Lease(owner=parts[0], expires=float(parts[1]))
    except ValueError:
        return None


def lease_of(volume: dict[str, Any]) -> Lease | None:
    """The lease recorded on a DescribeVolumes volume dict, if any."""
    for tag in volume.get("Tags", []):
        if tag["Key"] == LEASE_TAG:
            return parse_lease(tag["Value"])
    return None


class VolumeLease:
    """The data-volume lease of one agent (see the module docstring for the protocol).

    Args:
        ec2: boto3 EC2 client.
        owner: this agent's identity (the instance id); no spaces.
        ttl_s: seconds a lease lives without renewal (default 900; longer than any step).
        settle_s: seconds between writing the lease and reading it back (default 1.0).
        wait_s: seconds to wait for another owner's lease before raising (default 120).
        poll_s: seconds between reads while waiting, jittered by +-50 % (default 5).
        wall_clock: Unix time in seconds (default ``time.time``); clock: monotonic seconds for the
            wait deadline (default ``time.monotonic``); sleep: default ``time.sleep``.
        rng: uniform [0, 1) for jitter; log: logger for ``lease_*`` events.

    Raises:
        ValueError: bad arguments (owner with spaces, non-positive times).
    """

    def __init__(
        self,
        *,
        ec2: Any,
        owner: str,
        ttl_s: float = 900.0,
        settle_s: float = 1.0,
        wait_s: float = 120.0,
        poll_s: float = 5.0,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rng: Callable[[], float] = random.random,
        log: logging.Logger | None = None,
    ) -> None:
        if not owner or any(c.isspace() for c in owner):
            raise ValueError(f"lease owner must be a non-empty id without spaces, got {owner!r}")
        for name, value in (("ttl_s", ttl_s), ("poll_s", poll_s), ("settle_s", settle_s), ("wait_s", wait_s)):
            check_seconds(name, value, zero=name in ("settle_s", "wait_s"))
        self.ec2 = ec2
        self.owner = owner
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self.wait_s = wait_s
        self.poll_s = poll_s
        self._now = wall_clock
        self._clock = clock
        self._sleep = sleep
        self._rng = rng
        self._log = log or logging.getLogger(__name__)
        self.current: Lease | None = None

    def _new_lease(self, ttl_s: float | None = None) -> Lease:
        return Lease(owner=self.owner, expires=self._now() + (self.ttl_s if ttl_s is None else ttl_s))

    def tag(self) -> dict[str, str]:
        """The lease tag of the held lease, for a TagSpecifications list (hands the lease to a new copy)."""
        if self.current is None:
            raise RuntimeError("lease is not held; call acquire() first")
        return {"Key": LEASE_TAG, "Value": self.current.value}

    def others(self, volumes: list[dict[str, Any]]) -> list[tuple[str, Lease]]:
        """``(volume_id, lease)`` for every live lease of another owner on ``volumes``."""
        now = self._now()
        found = []
        for volume in volumes:
            lease = lease_of(volume)
            if lease is not None and lease.owner != self.owner and lease.live(now):
                found.append((volume["VolumeId"], lease))
        return found

    def holds(self, volume: dict[str, Any]) -> bool:
        """True if ``volume`` (a DescribeVolumes dict) carries this agent's live lease."""
        lease = lease_of(volume)
        return lease is not None and lease.owner == self.owner and lease.live(self._now())

    def acquire(self, volume_id: str, read: Callable[[], list[dict[str, Any]]],
                volumes: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Take the lease on ``volume_id``.

        Args:
            volume_id: the volume to write the lease on (the current data volume).
            read: returns the current candidate volumes (DescribeVolumes by the stack's tags).
            volumes: a fresh result of ``read()`` to start from (saves one call), optional.

        Returns:
            the candidates as read back after the lease settled (use them, not older reads).

        Raises:
            TemporaryError: another owner held the lease for longer than ``wait_s``.
        """
        deadline = self._clock() + self.wait_s
        current = volumes if volumes is not None else read()
        while True:
            held = self.others(current)
            if not held:
                lease = self._new_lease()
                self.ec2.create_tags(Resources=[volume_id], Tags=[{"Key": LEASE_TAG, "Value": lease.value}])
                self._log.info("lease written; letting it settle", extra={
                    "event": "lease_written", "volume_id": volume_id, "owner": self.owner,
                    "expires": int(lease.expires), "settle_s": self.settle_s})
                if self.settle_s:
                    self._sleep(self.settle_s)
                current = read()
                mine = next((lease_of(v) for v in current if v["VolumeId"] == volume_id), None)
                rivals = self.others(current)
                if mine is not None and mine.owner == self.owner and all(l.owner > self.owner for _, l in rivals):
                    self.current = mine
                    self._log.info("lease acquired", extra={"event": "lease_acquired", "volume_id": volume_id,
                                                            "owner": self.owner, "expires": int(mine.expires)})
                    return current
                self.ec2.delete_tags(Resources=[volume_id], Tags=[{"Key": LEASE_TAG, "Value": lease.value}])
                held = rivals
            holder = held[0][1] if held else None
            remaining = deadline - self._clock()
            if remaining <= 0:
                who = f"{holder.owner} until {int(holder.expires)}" if holder else "another node"
                raise TemporaryError(f"the data volume lease is held by {who} (waited {self.wait_s:g} s); "
                                     "try again later")
            pause = min(remaining, self.poll_s * (0.5 + self._rng()))
            self._log.info("lease held by another node; waiting", extra={
                "event": "lease_wait", "holder": holder.owner if holder else None, "delay_s": round(pause, 3)})
            self._sleep(pause)
            current = read()

    def renew(self, volume_ids: list[str], ttl_s: float | None = None) -> None:
        """Push the expiry of the held lease ``ttl_s`` seconds (default: the lease's TTL) into the
        future on ``volume_ids`` (one CreateTags call).

        Args:
            volume_ids: the volumes carrying the lease tag.
            ttl_s: the new lease's lifetime in seconds (default: the lease's TTL).

        Raises:
            RuntimeError: the lease is not held (call :meth:`acquire` first).
            botocore.exceptions.ClientError: CreateTags failed.
        """
        if self.current is None:
            raise RuntimeError("lease is not held; call acquire() first")
        self.current = self._new_lease(ttl_s)
        self.ec2.create_tags(Resources=volume_ids, Tags=[self.tag()])

    def release(self, volume_ids: list[str]) -> None:
        """Remove this agent's lease tag from ``volume_ids`` (EC2 deletes it only if the value still
        matches, so a lease another node took meanwhile is left alone)."""
        if self.current is None:
            return
        self.ec2.delete_tags(Resources=volume_ids, Tags=[self.tag()])
        self._log.info("lease released", extra={"event": "lease_released", "volume_ids": volume_ids})
        self.current = None
