"""spot_training.agent.lease against the moto server: one holder at a time, expiry, conditional release."""

from __future__ import annotations

import pytest
from storage_helpers import DATA_TAGS, create_data_volume

from spot_training.agent.errors import TemporaryError
from spot_training.agent.lease import LEASE_TAG, VolumeLease, lease_of, parse_lease


class _Clock:
    """Wall clock and monotonic clock that only move when slept (no real waiting)."""

    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now
        self.slept = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _lease(ec2, owner, clock, **kwargs):
    params = {"ttl_s": 60.0, "settle_s": 1.0, "wait_s": 10.0, "poll_s": 2.0}
    params.update(kwargs)
    return VolumeLease(ec2=ec2, owner=owner, wall_clock=lambda: clock.now, clock=lambda: clock.now,
                       sleep=clock.sleep, rng=lambda: 0.5, **params)


def _reader(ec2):
    filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in DATA_TAGS.items()]
    return lambda: ec2.describe_volumes(Filters=filters)["Volumes"]


def _reader_after_rival_lease(ec2, volume_id: str, value: str):
    """A reader (as :func:`_reader`) that first writes the lease ``value`` onto ``volume_id``, once: a
    rival's write landing while we settle."""
    read = _reader(ec2)
    wrote = []

    def read_after_rival_wrote():
        if not wrote:
            ec2.create_tags(Resources=[volume_id], Tags=[{"Key": LEASE_TAG, "Value": value}])
            wrote.append(value)
        return read()

    return read_after_rival_wrote


def _tags(ec2, volume_id: str) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0].get("Tags", [])}


def test_acquire_writes_settles_and_reads_back(ec2):
    volume_id = create_data_volume(ec2)
    clock = _Clock()
    lease = _lease(ec2, "i-aaa", clock)
    volumes = lease.acquire(volume_id, _reader(ec2))
    assert clock.slept == [1.0]  # the settle delay, nothing else
    assert lease_of(volumes[0]) == lease.current
    assert lease.current.owner == "i-aaa" and lease.current.expires == 1_800_000_000.0 + 60


def test_second_owner_waits_then_fails_with_the_holder_named(ec2):
    volume_id = create_data_volume(ec2)
    clock = _Clock()
    _lease(ec2, "i-aaa", clock).acquire(volume_id, _reader(ec2))
    with pytest.raises(TemporaryError, match=r"lease is held by i-aaa until \d+ \(waited 10 s\)"):
        _lease(ec2, "i-bbb", clock).acquire(volume_id, _reader(ec2))
    tags = {t["Key"]: t["Value"] for t in ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]["Tags"]}
    assert parse_lease(tags[LEASE_TAG]).owner == "i-aaa"  # the loser never overwrote the holder


def test_expired_lease_is_taken_over(ec2):
    volume_id = create_data_volume(ec2)
    clock = _Clock()
    _lease(ec2, "i-dead", clock).acquire(volume_id, _reader(ec2))
    clock.now += 61  # the holder died; its lease expired
    lease = _lease(ec2, "i-new", clock)
    lease.acquire(volume_id, _reader(ec2))
    assert lease.current.owner == "i-new"


def test_same_owner_takes_its_own_lease_back_at_once(ec2):
    volume_id = create_data_volume(ec2)
    clock = _Clock()
    _lease(ec2, "i-aaa", clock).acquire(volume_id, _reader(ec2))
    again = _lease(ec2, "i-aaa", clock)
    again.acquire(volume_id, _reader(ec2))
    assert clock.slept == [1.0, 1.0]


def test_overwritten_lease_loses_and_withdraws(ec2):
    """Two writers on one volume: the one whose write is not read back loses and leaves the winner's."""
    volume_id = create_data_volume(ec2)
    clock = _Clock()
    loser = _lease(ec2, "i-aaa", clock, wait_s=3.0)
    rival = f"i-bbb {int(clock.now + 60)}"
    # The rival read "no lease" before our write and writes its own while we settle.
    with pytest.raises(TemporaryError, match="held by i-bbb"):
        loser.acquire(volume_id, _reader_after_rival_lease(ec2, volume_id, rival), volumes=_reader(ec2)())
    assert _tags(ec2, volume_id)[LEASE_TAG] == rival
    assert loser.current is None


def test_release_is_conditional_on_the_value(ec2):
    volume_id = create_data_volume(ec2)
    clock = _Clock()
    first = _lease(ec2, "i-aaa", clock)
    first.acquire(volume_id, _reader(ec2))
    clock.now += 61
    second = _lease(ec2, "i-bbb", clock)
    second.acquire(volume_id, _reader(ec2))
    first.release([volume_id])  # late release of an expired lease must not remove the new holder's
    tags = {t["Key"]: t["Value"] for t in ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]["Tags"]}
    assert parse_lease(tags[LEASE_TAG]).owner == "i-bbb"
    second.release([volume_id])
    tags = {t["Key"] for t in ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]["Tags"]}
    assert LEASE_TAG not in tags


@pytest.mark.parametrize("value", ["", "i-aaa", "i-aaa soon", "a b c"])
def test_malformed_lease_values_mean_no_lease(value):
    assert parse_lease(value) is None


def test_fails_on_bad_arguments(ec2):
    with pytest.raises(ValueError, match="owner.*'i 1'"):
        VolumeLease(ec2=ec2, owner="i 1")
    with pytest.raises(ValueError, match="ttl_s must be > 0 seconds, got 0"):
        VolumeLease(ec2=ec2, owner="i-1", ttl_s=0)


def test_rival_leases_on_different_candidates_smaller_owner_wins(ec2):
    """Two agents that chose different candidates both see both leases: the smaller id keeps its lease."""
    first, second = create_data_volume(ec2, "us-east-1a"), create_data_volume(ec2, "us-east-1b")
    clock = _Clock()
    read = _reader(ec2)
    rival_value = f"i-zzz {int(clock.now + 60)}"
    smaller = _lease(ec2, "i-aaa", clock)
    smaller.acquire(first, _reader_after_rival_lease(ec2, second, rival_value), volumes=read())
    assert smaller.current is not None and smaller.current.owner == "i-aaa"

    # Mirror image: i-zzz writes first, and i-aaa's lease appears on the other candidate while it settles.
    smaller.release([first])
    larger = _lease(ec2, "i-zzz", clock, wait_s=2.0)
    smaller_value = f"i-aaa {int(clock.now + 60)}"
    ec2.delete_tags(Resources=[second], Tags=[{"Key": LEASE_TAG, "Value": rival_value}])
    with pytest.raises(TemporaryError, match="held by i-aaa"):
        larger.acquire(second, _reader_after_rival_lease(ec2, first, smaller_value), volumes=read())
    assert LEASE_TAG not in _tags(ec2, second)  # i-zzz withdrew its own lease
