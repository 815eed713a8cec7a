"""Bring the job's dataset from S3 onto the data volume before the trainer starts: once, verified.

The node config's ``dataset`` section (docs/contracts.md) names ``uri``:

- ``s3://bucket/prefix/`` (ends with ``/``): every object under the prefix, each written to
  ``<training.dataset_dir>/<key without the prefix>``;
- ``s3://bucket/key``: that one object, written to ``<dataset_dir>/<last part of the key>``; with
  ``unpack`` true it is a zip archive (the stack's default dataset, a CDK S3 asset) whose members
  are extracted into ``dataset_dir`` once it is verified, and the archive is removed.

:func:`sync_dataset` is the whole step:

1. **Complete already?** ``<dataset_dir>/.spot-training-dataset.json`` (the completion marker)
   names the same ``uri``: nothing is listed or downloaded (a replacement node finds the dataset on
   the volume it inherits). The marker is written last, after every object was verified.
2. **Manifest.** ``ListObjectsV2`` over the prefix gives every key with its size and ETag.
3. **Download, resumable.** Each object goes to a hidden ``.<name>.partial`` beside its target;
   an interrupted download continues from the partial file's length with an HTTP ``Range`` request.
   Every ``GetObject`` carries ``IfMatch=<manifest ETag>``, so S3 refuses (412) to serve any other
   version of the object than the one listed (Amazon S3 API Reference, GetObject, "If-Match").
   A finished object is **verified**: its size equals the manifest's and, for an ETag that is the
   MD5 of the content (a single-part upload stored unencrypted or with SSE-S3; Amazon S3 API
   Reference, "Object", ETag), its MD5 equals the ETag; then it is renamed into place and recorded
   in ``.spot-training-dataset.progress.json`` so a resumed sync skips it.
4. **Marker.** ``.spot-training-dataset.json`` with the URI, the manifest and the time.

Transient failures (connection errors, throttling and 5xx, which botocore retries in standard mode,
then whole rounds here with jittered backoff for up to ``deadline_s``) raise
:class:`~spot_training.agent.errors.TemporaryError` (exit 75: systemd runs the agent again and the
sync resumes); a missing bucket, an empty prefix or a denied read raise
:class:`~spot_training.agent.errors.ConfigError` (exit 78: a replacement would fail the same way).

The agent runs as root and ``dataset_dir`` is on the volume the training user owns: every directory
is opened with :func:`spot_training.agent.safepath.open_directory` and every file with ``O_NOFOLLOW``
(no link the user planted is followed), and both are handed to the training user.

Why hand-rolled rather than ``aws s3 sync`` or boto3's ``download_file``: neither resumes a cut
download of one object nor checks it against a manifest taken before the transfer; a ranged
``GetObject`` with ``IfMatch`` does both in a few lines.
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import json
import logging
import os
import pwd
import random
import re
import shutil
import stat
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from spot_training.agent.errors import ConfigError, TemporaryError
from spot_training.agent.safepath import UnsafePathError, open_directory, open_file, write_bytes_atomic
from spot_training.contract import split_dataset_uri

log = logging.getLogger(__name__)

#: The completion marker in ``dataset_dir`` (written after every object was verified).
MARKER_NAME = ".spot-training-dataset.json"
#: Objects verified so far by an unfinished sync (keys and ETags), for resuming.
PROGRESS_NAME = ".spot-training-dataset.progress.json"
PARTIAL_SUFFIX = ".partial"
_CHUNK = 8 * 1024 * 1024
#: S3 error codes that no retry fixes: the setting or the role is wrong.
_PERMANENT_CODES = frozenset({"NoSuchBucket", "AccessDenied", "AllAccessDisabled", "InvalidBucketName",
                              "NoSuchKey", "InvalidObjectState"})


@dataclass(frozen=True)
class ManifestEntry:
    """One object of the dataset: S3 ``key``, ``size`` (bytes), ``etag`` (quoted, as S3 returns
    it) and ``path`` (relative to ``dataset_dir``, POSIX)."""

    key: str
    size: int
    etag: str
    path: str

    def to_dict(self) -> dict[str, Any]:
        """The entry as a JSON object ``{"key", "size", "etag", "path"}``."""
        return {"key": self.key, "size": self.size, "etag": self.etag, "path": self.path}


def _relative_path(key: str, prefix: str) -> str | None:
    """Where ``key`` goes under ``dataset_dir`` (None: a folder placeholder ``.../``); ValueError
    when the key would leave ``dataset_dir`` or hide among the agent's own files."""
    rel = key[len(prefix):] if prefix.endswith("/") or not prefix else PurePosixPath(key).name
    if not rel or rel.endswith("/"):
        return None
    parts = PurePosixPath(rel).parts
    if rel.startswith("/") or any(p in ("..", ".") for p in parts) or rel.startswith(".spot-training-") \
            or parts[-1].endswith(PARTIAL_SUFFIX):
        raise ValueError(f"S3 key {key!r} cannot be written under the dataset directory (relative path {rel!r})")
    return rel


def manifest(s3: Any, uri: str) -> list[ManifestEntry]:
    """List the objects of ``uri`` (``ListObjectsV2``, every page), sorted by key.

    Args:
        s3: a boto3 S3 client.
        uri: ``s3://bucket/prefix/`` (every object under it) or ``s3://bucket/key`` (one object).

    Returns:
        one entry per object, sorted by key (folder placeholders left out).

    Raises:
        ConfigError: no object under the URI, or a key that cannot be a file under ``dataset_dir``.
        botocore.exceptions.ClientError: the listing failed (classified by the caller).
    """
    bucket, key = split_dataset_uri(uri)
    entries = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
        for obj in page.get("Contents", []):
            if not (key.endswith("/") or not key) and obj["Key"] != key:
                continue  # one object named: s3://b/data.zip lists data.zip2 too
            try:
                rel = _relative_path(obj["Key"], key)
            except ValueError as exc:
                raise ConfigError(f"dataset.uri {uri!r}: {exc}") from None
            if rel is not None:
                entries.append(ManifestEntry(obj["Key"], int(obj["Size"]), obj["ETag"], rel))
    if not entries:
        raise ConfigError(f"dataset.uri {uri!r}: no object found there; upload the dataset first "
                          f"(aws s3 sync ./my-data {uri if uri.endswith('/') else uri + '/'}) or fix the URI")
    return sorted(entries, key=lambda e: e.key)


def is_complete(dataset_dir: Path, uri: str) -> bool:
    """Whether the completion marker in ``dataset_dir`` names ``uri``.

    Args:
        dataset_dir: the node's dataset directory.
        uri: the dataset's S3 URI.

    Returns:
        True when the marker is readable, names ``uri`` and says complete; False otherwise.
    """
    try:
        marker = json.loads((dataset_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("uri") == uri and marker.get("complete") is True


def _md5_etag(etag: str, encryption: str | None) -> str | None:
    """The MD5 an ETag stands for, or None when it is not one (multipart upload, SSE-KMS, SSE-C)."""
    bare = etag.strip('"')
    if encryption not in (None, "AES256") or not re.fullmatch(r"[0-9a-f]{32}", bare):
        return None
    return bare


def _open_dir(path: Path, owner: tuple[int, int] | None) -> int:
    try:
        return open_directory(path, create=True, owner=owner)
    except (UnsafePathError, NotADirectoryError, FileExistsError) as exc:
        raise ConfigError(f"dataset directory {str(path)!r}: {exc}") from exc


def _download(s3: Any, bucket: str, entry: ManifestEntry, target: Path, owner: tuple[int, int] | None) -> int:
    """Download ``entry`` to ``target`` through its ``.partial`` file, resuming; verify; rename into
    place. Returns the bytes transferred now."""
    dir_fd = _open_dir(target.parent, owner)
    os.close(dir_fd)
    partial = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
    fd = open_file(partial, os.O_RDWR | os.O_CREAT, mode=0o644, owner=owner)
    transferred = 0
    try:
        have = os.fstat(fd).st_size
        if have > entry.size:
            os.ftruncate(fd, 0)
            have = 0
        digest = hashlib.md5(usedforsecurity=False)
        os.lseek(fd, 0, os.SEEK_SET)
        left = have
        while left:  # the bytes an earlier attempt wrote count towards the MD5
            block = os.read(fd, min(_CHUNK, left))
            if not block:
                break
            digest.update(block)
            left -= len(block)
        os.lseek(fd, have, os.SEEK_SET)
        encryption = None
        if have < entry.size or entry.size == 0:
            kwargs = {"Range": f"bytes={have}-"} if have else {}
            response = s3.get_object(Bucket=bucket, Key=entry.key, IfMatch=entry.etag, **kwargs)
            encryption = response.get("ServerSideEncryption")
            body = response["Body"]
            for block in iter(lambda: body.read(_CHUNK), b""):
                digest.update(block)
                os.write(fd, block)
                transferred += len(block)
        else:
            encryption = s3.head_object(Bucket=bucket, Key=entry.key, IfMatch=entry.etag).get("ServerSideEncryption")
        os.fsync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size != entry.size:
        os.unlink(partial)
        raise TemporaryError(f"s3://{bucket}/{entry.key}: downloaded {size} bytes, the manifest says {entry.size}; "
                             "starting the object again at the next attempt")
    expected = _md5_etag(entry.etag, encryption)
    if expected is not None and digest.hexdigest() != expected:
        os.unlink(partial)
        raise TemporaryError(f"s3://{bucket}/{entry.key}: MD5 {digest.hexdigest()} does not match the ETag {expected}; "
                             "starting the object again at the next attempt")
    os.rename(partial, target)  # in a directory opened without following links; rename replaces, never follows
    return transferred


def _unpack(archive: Path, dataset_dir: Path, owner: tuple[int, int] | None) -> list[str]:
    """Extract the zip ``archive`` into ``dataset_dir`` (regular files only; no absolute or ``..``
    member), each file through its own ``.partial`` then renamed; remove the archive. Returns the members."""
    members = []
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            if stat.S_ISLNK(info.external_attr >> 16):
                raise ConfigError(f"dataset archive {archive.name}: member {info.filename!r} is a symbolic link; "
                                  "the agent extracts regular files only")
            rel = _relative_path(info.filename, "")
            if rel is None:
                continue
            target = dataset_dir / rel
            os.close(_open_dir(target.parent, owner))
            partial = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
            fd = open_file(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, owner=owner)
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                shutil.copyfileobj(src, out, _CHUNK)
                out.flush()
                os.fsync(out.fileno())
            os.rename(partial, target)
            members.append(rel)
    os.unlink(archive)
    return members


def sync_dataset(s3: Any, uri: str, dataset_dir: Path, *, unpack: bool = False,
                 owner: tuple[int, int] | None = None, deadline_s: float = 1800.0,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 rng: Callable[[], float] = random.random) -> dict[str, Any]:
    """Make ``dataset_dir`` hold the objects of ``uri``, verified (see the module docstring).

    Args:
        s3: boto3 S3 client (standard retry mode).
        uri: ``s3://bucket/prefix/`` or ``s3://bucket/key`` (one object; a zip when ``unpack``).
        dataset_dir: absolute directory on the data volume (created, handed to ``owner``).
        unpack: extract the one object (a zip archive) into ``dataset_dir`` after verifying it.
        owner: ``(uid, gid)`` of the training user, who gets every directory and file; None: unchanged.
        deadline_s: how long transient failures are retried, seconds (default 1800), with jittered
            exponential backoff from 2 s up to 60 s between rounds.
        sleep: sleeps the given seconds (default ``time.sleep``).
        clock: monotonic seconds (default ``time.monotonic``).
        rng: jitter source, uniform in [0, 1) (default ``random.random``).

    Returns:
        ``{"status": "present"|"synced", "objects": N, "bytes": total size, "downloaded_bytes":
        bytes transferred by this call, "seconds": float}``.

    Raises:
        ConfigError: a bad URI, nothing under it, a denied read, a missing bucket, a dataset larger
            than the volume or a directory the agent cannot write (exit 78).
        TemporaryError: transient failures went on past ``deadline_s`` (exit 75; a later run resumes).
    """
    from botocore.exceptions import BotoCoreError, ClientError

    started = clock()
    try:
        split_dataset_uri(uri)
    except ValueError as exc:
        raise ConfigError(f"dataset.uri: {exc}") from None
    if unpack and uri.endswith("/"):
        raise ConfigError(f"dataset.uri {uri!r}: unpack needs one object (an s3://bucket/key.zip), not a prefix")
    os.close(_open_dir(dataset_dir, owner))
    if is_complete(dataset_dir, uri):
        log.info("dataset present", extra={"event": "dataset_present", "uri": uri, "dir": str(dataset_dir)})
        return {"status": "present", "objects": None, "bytes": None, "downloaded_bytes": 0, "seconds": 0.0}
    attempt = 0
    while True:
        try:
            return _sync_once(s3, uri, dataset_dir, unpack=unpack, owner=owner, started=started, clock=clock)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in _PERMANENT_CODES or code == "403":
                raise ConfigError(f"dataset.uri {uri!r}: S3 answered {code} ({exc}); check the URI and that the node "
                                  "role may read it (the stack grants s3:GetObject on the prefix and s3:ListBucket "
                                  "for it)") from exc
            error: Exception = exc
        except (BotoCoreError, TemporaryError, OSError) as exc:
            if isinstance(exc, (UnsafePathError, ConfigError)):
                raise
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ConfigError(f"dataset {uri!r} does not fit on the data volume under {dataset_dir} ({exc}); "
                                  "deploy with a larger volume_size_gib") from exc
            if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise ConfigError(f"dataset directory {dataset_dir}: {exc}; the agent cannot write there") from exc
            error = exc
        attempt += 1
        delay = min(60.0, 2.0 * 2 ** (attempt - 1)) * (0.5 + rng() / 2)
        if clock() - started + delay > deadline_s:
            raise TemporaryError(f"dataset sync of {uri!r} still failing after {attempt} attempts "
                                 f"({clock() - started:.0f} s): {error}; the next agent run resumes it") from error
        log.warning("dataset sync failed; retrying after backoff", extra={
            "event": "dataset_retry", "uri": uri, "attempt": attempt, "backoff_s": round(delay, 2), "error": str(error)})
        sleep(delay)


def _sync_once(s3: Any, uri: str, dataset_dir: Path, *, unpack: bool, owner: tuple[int, int] | None,
               started: float, clock: Callable[[], float]) -> dict[str, Any]:
    bucket, _ = split_dataset_uri(uri)
    entries = manifest(s3, uri)
    progress_path = dataset_dir / PROGRESS_NAME
    try:
        progress = json.loads(progress_path.read_text())
        done = {k: v for k, v in progress.get("done", {}).items()} if progress.get("uri") == uri else {}
    except (OSError, ValueError, AttributeError):
        done = {}
    downloaded = 0
    for entry in entries:
        target = dataset_dir / entry.path
        if done.get(entry.key) == entry.etag and target.is_file() and not target.is_symlink() \
                and target.stat().st_size == entry.size:
            continue
        downloaded += _download(s3, bucket, entry, target, owner)
        done[entry.key] = entry.etag
        write_bytes_atomic(progress_path, json.dumps({"uri": uri, "done": done}).encode(), owner=owner)
        log.info("dataset object verified", extra={"event": "dataset_object", "key": entry.key, "bytes": entry.size})
    members = None
    if unpack:
        members = _unpack(dataset_dir / entries[0].path, dataset_dir, owner)
    total = sum(e.size for e in entries)
    marker = {"uri": uri, "complete": True, "objects": [e.to_dict() for e in entries], "unpacked": members,
              "completed_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    write_bytes_atomic(dataset_dir / MARKER_NAME, json.dumps(marker, indent=1).encode(), owner=owner)
    try:
        os.unlink(progress_path)
    except FileNotFoundError:
        pass
    seconds = round(clock() - started, 3)
    log.info("dataset synced", extra={"event": "dataset_synced", "uri": uri, "objects": len(entries), "bytes": total,
                                      "downloaded_bytes": downloaded, "seconds": seconds})
    return {"status": "synced", "objects": len(entries), "bytes": total, "downloaded_bytes": downloaded,
            "seconds": seconds}


def prepare_dataset(config: Any, *, owner: tuple[int, int] | None = None) -> dict[str, Any] | None:
    """The agent's dataset step: :func:`sync_dataset` of ``config.dataset`` into ``config.training.dataset_dir``.

    Uses an S3 client of the node's region.

    Args:
        config: the validated node config.
        owner: ``(uid, gid)`` the files are handed to (default: ``training.user``'s when the agent runs
            as root; else the files stay the agent's user's, who is then also the trainer's).

    Returns:
        :func:`sync_dataset`'s result, or None when the config has no ``dataset`` section.

    Raises:
        ConfigError: as :func:`sync_dataset` (exit 78).
        TemporaryError: as :func:`sync_dataset` (exit 75).
    """
    dataset = getattr(config, "dataset", None)
    if dataset is None:
        return None
    import boto3

    if owner is None and os.geteuid() == 0:  # as the supervisor: only root hands files to the training user
        try:
            account = pwd.getpwnam(config.training.user)
            owner = (account.pw_uid, account.pw_gid)
        except KeyError:
            owner = None  # local mode runs the trainer as the current user; on AWS the supervisor refuses it

    from spot_training.agent.retry import client_config

    s3 = boto3.client("s3", region_name=config.region, config=client_config())
    return sync_dataset(s3, dataset.uri, Path(config.training.dataset_dir), unpack=dataset.unpack, owner=owner)
