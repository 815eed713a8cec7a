"""Atomic, verified, keep-N checkpoint store shared by every framework adapter.

Standard library only: no TensorFlow, MXNet or boto3 import here (docs/architecture.md, "Layers").

Layout of a checkpoint directory::

    <directory>/
      ckpt-000000000050/          one checkpoint: the framework's files + manifest.json
      ckpt-000000000100/
      LATEST                      JSON pointer to the newest committed checkpoint (replaced atomically)
      COMPLETED                   JSON written once training reached its last step (docs/contracts.md)
      .tmp-ckpt-...               a write in progress (or left by a killed writer; removed on next start)

Why not just ``tf.train.CheckpointManager`` or Keras ``BackupAndRestore``: neither fsyncs, neither
checksums what it wrote, and neither falls back past a torn or corrupt newest checkpoint; MXNet has no
manager at all. The frameworks still write their own files (``write(tmp_dir)``); this store only makes
the directory that holds them atomic, verified and pruned, in the order ``CheckpointManager`` uses
(record the new state before deleting old checkpoints).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from spot_training import contract

__all__ = [
    "BackgroundSaver",
    "Checkpoint",
    "CheckpointError",
    "CheckpointPathError",
    "CheckpointStore",
    "CorruptCheckpointError",
    "FrameworkMismatchError",
    "ShapeMismatchError",
    "write_file",
    "MANIFEST_NAME",
    "LATEST_NAME",
    "COMPLETED_NAME",
]

MANIFEST_NAME = "manifest.json"
LATEST_NAME = contract.LATEST_FILE
COMPLETED_NAME = contract.COMPLETED_FILE
CHECKPOINT_PREFIX = "ckpt-"
TMP_PREFIX = ".tmp-"
#: A temporary entry whose owner cannot be checked (another host, or no owner in its name) is left
#: alone until nothing in it changed for this long (seconds): a checkpoint directory on EFS is shared
#: by every node of a cluster, and a live writer elsewhere must not lose its temporary directory.
STALE_TEMP_AGE_S = 900.0


def _host_token() -> str:
    """This host's name as it appears in temporary names (no ``-``, so names parse from the right)."""
    return (socket.gethostname() or "host").replace("-", "_")[:63]


def _temp_suffix() -> str:
    """``<host>-<pid>-<8 hex>``: who made a temporary entry, so another process can tell whether its
    owner is still alive (same host) before removing it."""
    return f"{_host_token()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _newest_mtime(path: Path) -> float:
    try:
        newest = path.lstat().st_mtime
        if path.is_dir() and not path.is_symlink():
            for child in path.rglob("*"):
                try:
                    newest = max(newest, child.lstat().st_mtime)
                except OSError:
                    continue
        return newest
    except OSError:
        return 0.0


def is_stale_temp(path: Path, *, now: float | None = None) -> bool:
    """Whether the temporary entry ``path`` (``.tmp-...``) was left by a writer that is gone.

    Gone: made on this host by a process that no longer exists, or, when that cannot be told (another
    host sharing the directory, an older name without an owner), unchanged for :data:`STALE_TEMP_AGE_S`
    seconds.

    Args:
        path: the temporary file or directory in a checkpoint directory.
        now: the current time, seconds since the epoch (default ``time.time()``).

    Returns:
        True when the entry may be removed.
    """
    parts = path.name.rsplit("-", 3)
    if len(parts) == 4 and parts[1] == _host_token() and parts[2].isdigit():
        pid = int(parts[2])
        if pid != os.getpid() and not contract.pid_alive(pid):
            return True
    # A live owner (its pid may also have been reused), another host, or no owner in the name.
    now = time.time() if now is None else now
    return now - _newest_mtime(path) >= STALE_TEMP_AGE_S
FORMAT = "spot-training-checkpoint"
FORMAT_VERSION = 1
FRAMEWORKS = ("tensorflow", "mxnet", "pytorch", "numpy")
#: The fewest checkpoints a store keeps: a corrupt newest one always has an older one to fall back to.
MIN_KEEP = 2
_HASH_CHUNK = 4 * 1024 * 1024


class CheckpointError(Exception):
    """Base class of every checkpoint problem; the message names the path and the problem."""


class CheckpointPathError(CheckpointError, ValueError):
    """The checkpoint directory cannot be used (e.g. it is a file, or a parent is a file)."""


class FrameworkMismatchError(CheckpointError, ValueError):
    """The checkpoint was written by another framework than the one restoring it."""


class ShapeMismatchError(CheckpointError, ValueError):
    """A variable in the checkpoint has another shape than the model's (raised by the adapters).

    The message names the checkpoint path, the variable, the expected and the actual shape.
    """


class CorruptCheckpointError(CheckpointError):
    """One checkpoint failed verification (missing manifest, missing file, checksum mismatch)."""


@dataclass(frozen=True)
class Checkpoint:
    """One committed checkpoint.

    path: the ``ckpt-<step:012d>`` directory. step: optimizer steps completed when it was taken.
    epoch: the epoch the next step belongs to (0-based). framework: ``tensorflow`` or ``mxnet``.
    manifest: the parsed ``manifest.json`` (also holds ``framework_version``, ``wall_time``
    (seconds since the epoch), ``checksum``, ``files`` and the caller's ``metadata``).
    """

    path: Path
    step: int
    epoch: int
    framework: str
    manifest: dict = field(repr=False, compare=False)

    @property
    def metadata(self) -> dict:
        """The caller's ``metadata`` dict given to :meth:`CheckpointStore.save` (``{}`` if none)."""
        return dict(self.manifest.get("metadata") or {})


def check_int(name: str, value, minimum: int) -> int:
    """The one integer check of the checkpoint code (the store, the driver, the front-ends).

    Args:
        name: the argument's name, for the message.
        value: the value to check; ``bool`` is refused although it is an ``int`` subclass
            (``save(step=True)`` is a bug, not step 1).
        minimum: the smallest value allowed.

    Returns:
        ``value``.

    Raises:
        ValueError: ``<name> must be an integer >= <minimum>. Received: <name>=<value>``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}. Received: {name}={value!r}")
    return value


def _fsync(path: Path) -> None:
    """fsync a file or a directory (a directory's entry list: a rename in it is durable after this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_file(path: str | os.PathLike, chunks) -> dict:
    """Write ``chunks`` to a new file ``path``, hashing each chunk as it is written, then fsync it.

    Hand the returned entries (keyed by the path relative to the checkpoint's temporary directory) back
    from the ``write`` callback of :meth:`CheckpointStore.save`: the store then neither re-reads nor
    re-fsyncs those files, which halves the writer thread's CPU and memory traffic for a large
    checkpoint. Why by hand: no library hashes while it writes. Large chunks keep the GIL free:
    ``file.write`` of a big buffer goes straight to ``write(2)`` and ``hashlib`` releases the GIL for
    buffers over 2 KiB, so a background writer does not stall the training thread's Python.

    Args:
        path: the file to create (must not exist: a checkpoint file is written once).
        chunks: an iterable of bytes-like objects (bytes, memoryview, a contiguous numpy ``uint8`` view).

    Returns:
        the manifest entry ``{"size": bytes, "sha256": hex}`` of exactly the bytes written.

    Raises:
        FileExistsError: ``path`` exists.
        OSError: as the file system raises it (full disk, permissions).
    """
    digest = hashlib.sha256()
    size = 0
    with open(path, "xb") as f:
        for chunk in chunks:
            view = memoryview(chunk)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")  # len() in bytes, whatever the item type
            f.write(view)
            digest.update(view)
            size += len(view)
        f.flush()
        os.fsync(f.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def _content_files(directory: Path) -> list[Path]:
    """All regular files under ``directory`` except the manifest, sorted by relative path."""
    files = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in names:
            p = Path(root) / name
            if p.parent == directory and name == MANIFEST_NAME:
                continue
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(directory).as_posix())


def _combined_checksum(files: dict[str, dict]) -> str:
    digest = hashlib.sha256()
    for rel in sorted(files):
        entry = files[rel]
        digest.update(f"{rel}\0{entry['size']}\0{entry['sha256']}\n".encode())
    return digest.hexdigest()


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write ``payload`` as JSON to ``path`` atomically (:func:`contract.write_json_atomic`).

    The temporary file's name carries ``TMP_PREFIX`` and the owner's ``<host>-<pid>-<random>``, so a
    store opened elsewhere can tell whether its writer is gone (:func:`is_stale_temp`).

    Args:
        path: the file to write, in the checkpoint directory.
        payload: a JSON-serializable dict.

    Raises:
        OSError: the file cannot be written or synced (the temporary file is removed).
    """
    contract.write_json_atomic(path, payload, tmp_prefix=TMP_PREFIX, tmp_suffix=_temp_suffix())


class CheckpointStore:
    """Atomic keep-N checkpoints in one directory, with checksums and fallback past corrupt ones.

    Only one process may write to a directory at a time (on a cluster, rank 0 saves); temporary
    directories left by killed writers are removed when a store is created.

    Args:
        directory: where checkpoints live (created if missing).
        framework: one of :data:`FRAMEWORKS` (``"tensorflow"``, ``"mxnet"``, ``"pytorch"``, ``"numpy"``);
            recorded in every manifest and checked on restore.
        framework_version: recorded in every manifest (default ``""``).
        keep: how many checkpoints to keep, >= 2 (default 3) so that a corrupt newest one always has a
            predecessor.
        logger: default ``logging.getLogger("spot_training.training.store")``.

    Raises:
        CheckpointPathError: ``directory`` (or a parent) is an existing non-directory.
        ValueError: a bad ``framework`` or ``keep``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        framework: str,
        framework_version: str = "",
        keep: int = 3,
        logger: logging.Logger | None = None,
    ) -> None:
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {FRAMEWORKS}. Received: framework={framework!r}")
        self.keep = check_int("keep", keep, MIN_KEEP)
        self.framework = framework
        self.framework_version = str(framework_version)
        self.log = logger or logging.getLogger("spot_training.training.store")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointPathError(
                f"checkpoint directory {str(self.directory)!r} exists and is not a directory; "
                "pass a directory path (it is created if missing) or move the file away"
            )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as err:
            raise CheckpointPathError(
                f"cannot create checkpoint directory {str(self.directory)!r}: a parent path is a file ({err})"
            ) from err
        self._remove_stale_temps()

    # ------------------------------------------------------------------ writing
    def save(
        self,
        write: Callable[[Path], None],
        *,
        step: int,
        epoch: int,
        metadata: dict | None = None,
    ) -> Checkpoint:
        """Write one checkpoint atomically and return it.

        The store fsyncs every file ``write`` did not report, records a sha256 per file and one over all
        of them in ``manifest.json``, renames the directory to ``ckpt-<step:012d>``, replaces ``LATEST``
        atomically, fsyncs the directory and only then prunes to the newest ``keep``. Saving a step that
        already has a verified checkpoint returns that checkpoint unchanged.

        Args:
            write: ``write(tmp_dir)`` puts the framework's files into ``tmp_dir`` (an empty directory beside
                the target). It may return ``{relative path: {"size", "sha256"}}`` for files it wrote with
                :func:`write_file` (already hashed and fsynced); any other return value is ignored.
            step: optimizer steps completed, >= 0.
            epoch: the epoch the next step belongs to, >= 0.
            metadata: a JSON-serialisable dict stored in the manifest (e.g. the data position).

        Returns:
            the committed checkpoint.

        Raises:
            ValueError: a bad ``step``, ``epoch`` or ``metadata``.
            Exception: any exception of ``write`` propagates after the temporary directory is removed (the
                previous checkpoints stay as they were).
        """
        check_int("step", step, 0)
        check_int("epoch", epoch, 0)
        try:
            json.dumps(dict(metadata or {}))
        except (TypeError, ValueError) as err:
            raise ValueError(f"metadata must be JSON-serialisable. Received: metadata={metadata!r} ({err})") from err
        tmp = self.begin(step)
        try:
            written = write(tmp)
        except BaseException:
            self.abort(tmp)
            raise
        return self.commit(tmp, step=step, epoch=epoch, metadata=metadata,
                           written=written if isinstance(written, dict) else None)

    def begin(self, step: int) -> Path:
        """First half of a two-phase save: create and return an empty temporary directory beside the
        target for ``step``. Fill it, then call :meth:`commit` (or :meth:`abort`). Used when the
        framework writes asynchronously (``tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)``)."""
        check_int("step", step, 0)
        tmp = self.directory / f"{TMP_PREFIX}{CHECKPOINT_PREFIX}{step:012d}-{_temp_suffix()}"
        tmp.mkdir()
        return tmp

    def abort(self, tmp: str | os.PathLike) -> None:
        """Remove a temporary directory from :meth:`begin` (the committed checkpoints stay)."""
        shutil.rmtree(tmp, ignore_errors=True)

    def commit(self, tmp: str | os.PathLike, *, step: int, epoch: int, metadata: dict | None = None,
               written: dict | None = None) -> Checkpoint:
        """Second half of a two-phase save: checksum, manifest, rename to ``ckpt-<step:012d>``, ``LATEST``, prune.

        Every file in ``tmp`` is covered by the manifest; see :meth:`save`.

        Args:
            tmp: the temporary directory from :meth:`begin`, filled.
            step: optimizer steps completed, >= 0.
            epoch: the epoch the next step belongs to, >= 0.
            metadata: a JSON-serialisable dict stored in the manifest.
            written: ``{relative path: {"size", "sha256"}}`` from :func:`write_file` for files already hashed
                and fsynced (their size is checked against the file; a file not listed, or listed with another
                size, is fsynced and hashed here).

        Returns:
            the committed checkpoint (an existing verified one at ``step`` is kept and returned).

        Raises:
            ValueError: a bad ``step``, ``epoch`` or ``metadata``.
            OSError: as the file system raises it. On any error ``tmp`` is removed and the previous
                checkpoints stay as they were.
        """
        tmp = Path(tmp)
        try:
            check_int("step", step, 0)
            check_int("epoch", epoch, 0)
            metadata = dict(metadata or {})
            try:
                json.dumps(metadata)
            except (TypeError, ValueError) as err:
                raise ValueError(f"metadata must be JSON-serialisable. Received: metadata={metadata!r} ({err})") from err
            name = f"{CHECKPOINT_PREFIX}{step:012d}"
            target = self.directory / name
            files = {}
            written = dict(written or {})
            for p in _content_files(tmp):
                rel = p.relative_to(tmp).as_posix()
                size = p.stat().st_size
                entry = written.get(rel)
                if isinstance(entry, dict) and entry.get("size") == size and isinstance(entry.get("sha256"), str):
                    files[rel] = {"size": size, "sha256": entry["sha256"]}
                    continue
                _fsync(p)
                files[rel] = {"size": size, "sha256": _file_sha256(p)}
            for root, _dirs, _names in os.walk(tmp):
                _fsync(Path(root))
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "step": step,
                "epoch": epoch,
                "framework": self.framework,
                "framework_version": self.framework_version,
                "wall_time": time.time(),
                "files": files,
                "checksum": _combined_checksum(files),
                "metadata": metadata,
            }
            write_json_atomic(tmp / MANIFEST_NAME, manifest)
            if target.exists():
                existing = self._verify(target)
                if existing is not None:
                    self.log.info("checkpoint %s already exists and verifies; keeping it", target)
                    shutil.rmtree(tmp, ignore_errors=True)
                    return existing
                # A corrupt checkpoint at this step: set it aside (not deleted) until the new one is committed.
                aside = self.directory / f"{TMP_PREFIX}corrupt-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                os.replace(target, aside)
                self.log.warning("checkpoint %s failed verification; replacing it with a new save", target)
            os.replace(tmp, target)
            _fsync(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        ckpt = Checkpoint(path=target, step=step, epoch=epoch, framework=self.framework, manifest=manifest)
        write_json_atomic(
            self.directory / LATEST_NAME,
            {"checkpoint": name, "step": step, "epoch": epoch, "framework": self.framework,
             "wall_time": manifest["wall_time"], "checksum": manifest["checksum"]},
        )
        self._prune()
        return ckpt

    def mark_complete(self, *, step: int, epoch: int) -> None:
        """Write ``<directory>/COMPLETED`` atomically: JSON ``{"step", "epoch", "wall_time"}``
        (docs/contracts.md). Call it after the final checkpoint.

        Args:
            step: the final step, >= 0.
            epoch: its epoch, >= 0.

        Raises:
            ValueError: a negative or non-integer ``step`` or ``epoch``.
        """
        check_int("step", step, 0)
        check_int("epoch", epoch, 0)
        write_json_atomic(self.directory / COMPLETED_NAME, {"step": step, "epoch": epoch, "wall_time": time.time()})

    def is_complete(self) -> bool:
        """True when ``COMPLETED`` exists (training reached its last step)."""
        return (self.directory / COMPLETED_NAME).is_file()

    # ------------------------------------------------------------------ reading
    def checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint directory with a readable manifest, newest (highest step) first.

        Not verified against checksums (see :meth:`latest`). Directories whose manifest is missing
        or unreadable are left out.
        """
        found = []
        for p in self.directory.glob(f"{CHECKPOINT_PREFIX}*"):
            if not p.is_dir():
                continue
            try:
                found.append(self._from_manifest(p, self._read_manifest(p)))
            except CorruptCheckpointError:
                continue
        # Order by the manifest's step, never by parsing directory names.
        return sorted(found, key=lambda c: (c.step, c.manifest.get("wall_time", 0.0)), reverse=True)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies (manifest readable, every file present, sizes and
        sha256 match), or None when there is none. Torn or corrupt newer ones are skipped and
        logged with the reason at WARNING; nothing is deleted."""
        candidates = []
        for p in self.directory.glob(f"{CHECKPOINT_PREFIX}*"):
            if p.is_dir():
                candidates.append(p)
        scored = []
        for p in candidates:
            try:
                m = self._read_manifest(p)
                scored.append(((m["step"], m.get("wall_time", 0.0)), p))
            except (CorruptCheckpointError, KeyError, TypeError) as err:
                self.log.warning("skipping checkpoint %s: %s", p, err)
        for _key, p in sorted(scored, key=lambda x: x[0], reverse=True):
            try:
                return self._verify_or_raise(p)
            except CorruptCheckpointError as err:
                self.log.warning("skipping checkpoint %s: %s; falling back to the previous one", p, err)
        return None

    def restore(self, read: Callable[[Checkpoint], None]) -> Checkpoint | None:
        """Find :meth:`latest`, check its framework, call ``read(ckpt)`` and return it (None when
        there is no checkpoint, and ``read`` is not called).

        Raises:
            FrameworkMismatchError: the newest verified checkpoint was written by another framework.
            Exception: whatever ``read`` raises (adapters raise ShapeMismatchError) propagates. Nothing
                is deleted in any case.
        """
        ckpt = self.latest()
        if ckpt is None:
            return None
        if ckpt.framework != self.framework:
            raise FrameworkMismatchError(
                f"checkpoint {str(ckpt.path)!r} was written by framework {ckpt.framework!r} "
                f"(version {ckpt.manifest.get('framework_version', '')!r}) but this run uses "
                f"{self.framework!r}; point the run at another checkpoint directory or use the "
                f"{ckpt.framework} adapter"
            )
        read(ckpt)
        return ckpt

    def verify(self, path: str | os.PathLike) -> Checkpoint:
        """Verify one checkpoint directory; return it or raise CorruptCheckpointError saying why."""
        return self._verify_or_raise(Path(path))

    # ------------------------------------------------------------------ internals
    def _read_manifest(self, path: Path) -> dict:
        mpath = path / MANIFEST_NAME
        try:
            with open(mpath, encoding="utf-8") as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{mpath} is missing (torn write)") from None
        except (OSError, ValueError) as err:
            raise CorruptCheckpointError(f"{mpath} is unreadable: {err}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{mpath} is not a {FORMAT} manifest")
        for key in ("step", "epoch", "framework", "files", "checksum"):
            if key not in manifest:
                raise CorruptCheckpointError(f"{mpath} lacks {key!r}")
        return manifest

    @staticmethod
    def _from_manifest(path: Path, manifest: dict) -> Checkpoint:
        return Checkpoint(path=path, step=int(manifest["step"]), epoch=int(manifest["epoch"]),
                          framework=str(manifest["framework"]), manifest=manifest)

    def _verify_or_raise(self, path: Path) -> Checkpoint:
        manifest = self._read_manifest(path)
        files = manifest["files"]
        if _combined_checksum(files) != manifest["checksum"]:
            raise CorruptCheckpointError(f"{path / MANIFEST_NAME} checksum does not match its file list")
        present = {p.relative_to(path).as_posix() for p in _content_files(path)}
        missing = sorted(set(files) - present)
        if missing:
            raise CorruptCheckpointError(f"{path} is missing file(s) {missing}")
        for rel, entry in files.items():
            p = path / rel
            size = p.stat().st_size
            if size != entry["size"]:
                raise CorruptCheckpointError(f"{p} has {size} bytes, manifest says {entry['size']}")
            if _file_sha256(p) != entry["sha256"]:
                raise CorruptCheckpointError(f"{p} sha256 does not match the manifest")
        return self._from_manifest(path, manifest)

    def _verify(self, path: Path) -> Checkpoint | None:
        try:
            return self._verify_or_raise(path)
        except CorruptCheckpointError:
            return None

    def _prune(self) -> None:
        # Called only after LATEST names the new checkpoint (CheckpointManager's order).
        # Keep the newest `keep` checkpoints that pass a structural check (manifest readable, every
        # file present with its recorded size): a torn one does not count towards `keep`, so an older
        # good one is never deleted in its favour. The full sha256 check runs on restore only: hashing
        # every kept checkpoint on every save would cost more than the save itself.
        good = 0
        for ckpt in self.checkpoints():
            if good < self.keep:
                if self._structurally_sound(ckpt):
                    good += 1
                continue
            self.log.debug("pruning checkpoint %s (keep=%d)", ckpt.path, self.keep)
            shutil.rmtree(ckpt.path, ignore_errors=True)
        for p in self.directory.glob(f"{TMP_PREFIX}corrupt-*"):
            shutil.rmtree(p, ignore_errors=True)
        _fsync(self.directory)

    @staticmethod
    def _structurally_sound(ckpt: Checkpoint) -> bool:
        for rel, entry in ckpt.manifest["files"].items():
            try:
                if (ckpt.path / rel).stat().st_size != entry["size"]:
                    return False
            except OSError:
                return False
        return _combined_checksum(ckpt.manifest["files"]) == ckpt.manifest["checksum"]

    def _remove_stale_temps(self) -> None:
        # Only what a writer that is gone left: the directory may be shared (EFS) with live writers.
        for p in self.directory.glob(f"{TMP_PREFIX}*"):
            if p.name.startswith(f"{TMP_PREFIX}corrupt-"):
                continue  # set aside, not ours to drop until a new checkpoint at that step commits
            if not is_stale_temp(p):
                continue
            self.log.info("removing %s left by an interrupted write", p)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


class BackgroundSaver:
    """Runs :meth:`CheckpointStore.save` on one background thread, never two writes at once.

    The caller copies its state to host memory first (e.g. numpy arrays) and passes a ``write``
    closure over that copy, so training can go on while the copy is written. :meth:`submit` blocks
    while a previous write is still running (so at most one copy waits in memory). An exception
    of a background write is re-raised by the next ``submit``, ``wait`` or ``close``.
    A process killed mid-write leaves the previous checkpoint valid (the store's atomic rename).

    Args:
        store: the store the thread writes to.
        writer_nice: nice value of the writer thread on Linux, 0..19 (default 10; None: unchanged), so
            that on a small node its CPU work uses idle cores and yields to training.

    Raises:
        ValueError: ``writer_nice`` is not an integer 0..19 or None.
    """

    def __init__(self, store: CheckpointStore, *, writer_nice: int | None = 10) -> None:
        if writer_nice is not None and (isinstance(writer_nice, bool) or not isinstance(writer_nice, int)
                                        or not 0 <= writer_nice <= 19):
            raise ValueError(f"writer_nice must be an integer 0..19 or None. Received: writer_nice={writer_nice!r}")
        self.store = store
        self.writer_nice = writer_nice
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._last: Checkpoint | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, write: Callable[[Path], None], *, step: int, epoch: int, metadata: dict | None = None) -> None:
        """Queue one save; waits for the previous one to finish first.

        Args:
            write, step, epoch, metadata: as for :meth:`CheckpointStore.save`.

        Raises:
            RuntimeError: called after :meth:`close`.
            Exception: the previous background write's error.
        """
        self._enqueue("submit", (write, step, epoch, metadata))

    def submit_prepared(self, tmp: Path, finish: Callable[[], None], *, step: int, epoch: int,
                        metadata: dict | None = None) -> None:
        """Queue a two-phase save's commit: the writer thread calls ``finish()``, then :meth:`CheckpointStore.commit`.

        ``finish`` is e.g. TF's ``Checkpoint.sync()``, which waits for its own asynchronous write into
        ``tmp``; a dict it returns is passed as ``written``. Call :meth:`wait` before starting the
        framework's write so that writes never overlap.

        Args:
            tmp: the temporary directory from :meth:`CheckpointStore.begin`.
            finish: called on the writer thread before the commit.
            step, epoch, metadata: as for :meth:`CheckpointStore.commit`.

        Raises:
            RuntimeError: called after :meth:`close`.
            Exception: the previous background write's error.
        """
        self._enqueue("submit_prepared", (("prepared", Path(tmp), finish), step, epoch, metadata))

    def _enqueue(self, method: str, item: tuple) -> None:
        """Wait for the previous save, re-raise its error, then queue ``item`` for the writer thread."""
        if self._closed:
            raise RuntimeError(f"BackgroundSaver.{method}() called after close()")
        self._idle.wait()
        self._raise_pending()
        self._idle.clear()
        self._queue.put(item)

    def wait(self) -> Checkpoint | None:
        """Block until no write is running; return the last checkpoint written (None if none)."""
        self._idle.wait()
        self._raise_pending()
        return self._last

    def close(self) -> Checkpoint | None:
        """Finish the pending write, stop the thread and return the last checkpoint."""
        if not self._closed:
            self._closed = True
            self._idle.wait()
            self._queue.put(None)
            self._thread.join()
        self._raise_pending()
        return self._last

    def __enter__(self) -> "BackgroundSaver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _lower_priority(self) -> None:
        # The writer's CPU work (zip, sha256, copies) must not slow the training thread: on Linux a
        # thread is a task with its own nice value, so raise only this thread's (always permitted).
        # Elsewhere, or if the kernel refuses, the writer keeps the process's priority.
        if self.writer_nice is None or not hasattr(os, "setpriority"):
            return
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), self.writer_nice))
        except OSError as err:
            self.store.log.debug("could not lower the checkpoint writer's priority: %s", err)

    def _run(self) -> None:
        self._lower_priority()
        while True:
            item = self._queue.get()
            if item is None:
                return
            write, step, epoch, metadata = item
            try:
                if isinstance(write, tuple):
                    _kind, tmp, finish = write
                    try:
                        written = finish()
                    except BaseException:
                        self.store.abort(tmp)
                        raise
                    self._last = self.store.commit(tmp, step=step, epoch=epoch, metadata=metadata,
                                                   written=written if isinstance(written, dict) else None)
                else:
                    self._last = self.store.save(write, step=step, epoch=epoch, metadata=metadata)
            except BaseException as err:  # handed to the training thread, not swallowed
                self._error = err
            finally:
                self._idle.set()
