"""Open paths the training user controls without following their symbolic links.

The agent runs as root; the data volume's contents belong to the training user (``spot_training.agent.ebs``
gives them the mount point), and they follow the volume to every replacement instance. A symlink the
user plants there (``checkpoints`` -> ``/etc``, ``logs/agent.jsonl`` -> ``/etc/shadow``) must never
make root chown, create or write something outside the user's own files.

The rule: a path is walked one component at a time from ``/`` with directory file descriptors
(``openat``). A component is *root-controlled* when every directory above it is, and the directory
holding it is owned by the agent's user and not writable by group or others, or is a sticky directory
(``/tmp``) and the entry itself is the agent's; root-controlled symlinks (local mode's mount point, a
``/home -> /usr/home`` layout) are followed. Every other component is opened with ``O_NOFOLLOW``: a
symlink there raises :class:`UnsafePathError` (exit 78: the volume's contents must be fixed, a retry
will not help). Files are opened with ``O_NOFOLLOW`` relative to their directory's descriptor and must
be regular files with one link.

Why hand-rolled: Linux's ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` is not in Python's
standard library (the agent is standard library + boto3 on Python 3.10), and no library on the node
does this.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import PurePosixPath

from spot_training.agent.errors import AgentError, ExitCode


class UnsafePathError(AgentError):
    """A path the agent would act on as root is a symbolic link (or not a directory / regular file)
    inside a directory the training user controls. Exit 78: the volume's contents need fixing."""

    exit_code = ExitCode.CONFIG


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _root_controlled_dir(st: os.stat_result, me: int) -> bool:
    """Entries of this directory cannot be replaced by anyone but ``me`` (or root)."""
    return st.st_uid in (0, me) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _sticky(st: os.stat_result) -> bool:
    return bool(st.st_mode & stat.S_ISVTX)


def open_directory(path: str | os.PathLike[str], *, create: bool = False,
                   owner: tuple[int, int] | None = None) -> int:
    """Open the directory ``path`` (absolute) without following user-controlled symlinks.

    Args:
        path: absolute path of a directory.
        create: create missing components (mode 0755) instead of raising FileNotFoundError.
        owner: ``(uid, gid)`` to give the directories created here and the final directory to
            (``fchown`` on the opened descriptor, so it is the directory that was checked). None:
            leave ownership alone.

    Returns:
        an ``O_DIRECTORY`` file descriptor (close-on-exec); the caller closes it.

    Raises:
        UnsafePathError: a user-controlled component is a symlink or not a directory.
        FileNotFoundError: missing and ``create`` is False.
        OSError: as the file system raises it.
    """
    pure = PurePosixPath(os.fspath(path))
    if not pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"expected an absolute path without '..', got {str(pure)!r}")
    me = os.geteuid()
    fd = os.open("/", _DIR_FLAGS)
    trusted = True
    walked = PurePosixPath("/")
    try:
        for name in pure.parts[1:]:
            parent_st = os.fstat(fd)
            walked = walked / name
            created = False
            try:
                entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                    created = True
                except FileExistsError:
                    pass  # made by someone else meanwhile: checked below like any existing entry
                entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
            trusted = trusted and (_root_controlled_dir(parent_st, me)
                                   or (_sticky(parent_st) and entry.st_uid in (0, me)))
            flags = _DIR_FLAGS if trusted else _DIR_FLAGS | os.O_NOFOLLOW
            try:
                child = os.open(name, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    kind = "a symbolic link" if stat.S_ISLNK(entry.st_mode) else "not a directory"
                    raise UnsafePathError(
                        f"{str(walked)!r} is {kind} in a directory the training user controls; the agent runs as "
                        f"root and does not follow it (it could point at any file of the system). Replace it "
                        f"with a real directory (for example: rm {walked} && mkdir {walked}) and boot again"
                    ) from None
                raise
            os.close(fd)
            fd = child
            if created and owner is not None:
                os.fchown(fd, *owner)
        if owner is not None:
            os.fchown(fd, *owner)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_file(path: str | os.PathLike[str], flags: int, *, mode: int = 0o644, create_parents: bool = False,
              owner: tuple[int, int] | None = None) -> int:
    """Open the file ``path`` relative to its directory without following a link the user planted.

    The directory is opened by :func:`open_directory`; ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`` is added
    to ``flags``. The result must be a regular file with a single link (no FIFO or device planted to
    block or redirect the agent, no hard link to a root file).

    Args:
        path: absolute path of the file.
        flags: ``os.open`` flags (``os.O_RDONLY``, ``os.O_WRONLY | os.O_APPEND | os.O_CREAT``...).
        mode: permission bits of a created file (default 0o644).
        create_parents: create missing directories (default False).
        owner: ``(uid, gid)`` to ``fchown`` the opened file to; None: unchanged.

    Returns:
        the open descriptor (blocking); the caller closes it.

    Raises:
        UnsafePathError: the file or a user-controlled directory component is a symlink, or the file is
            not a regular file with a single link.
        OSError: as ``os.open`` raises it (``FileNotFoundError`` for a missing file).
    """
    pure = PurePosixPath(os.fspath(path))
    dir_fd = open_directory(pure.parent, create=create_parents)
    try:
        try:
            fd = os.open(pure.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(
                    f"{str(pure)!r} is a symbolic link in a directory the training user controls; the agent runs as "
                    f"root and does not write through it. Remove it (rm {pure}) and boot again") from None
            raise
        st = os.fstat(fd)
        # nlink 0: a writer renamed a new file over this one after we opened it (write_bytes_atomic);
        # what we hold is the old, complete file. Only a second link (a hard link to another file) is refused.
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            raise UnsafePathError(f"{str(pure)!r} is not a regular file with a single link; the agent runs as root "
                                  f"and does not write to it. Remove it (rm {pure}) and boot again")
        os.set_blocking(fd, True)
        if owner is not None:
            os.fchown(fd, *owner)
        return fd
    finally:
        os.close(dir_fd)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, owner: tuple[int, int] | None = None) -> None:
    """Write ``data`` to ``path`` so that a reader on another node sees the old file or the new one and
    the new one survives a power cut (the contract's ``write_json_atomic`` semantics: a temporary file
    beside it, fsync, rename, fsync of the directory), without following a link the user planted: the
    directory is opened by :func:`open_directory`, the temporary file (a fresh random name) is created
    ``O_EXCL | O_NOFOLLOW`` and renamed relative to the directory's descriptor (rename(2) replaces a
    link at the target, never follows it). Several writers of one path may run at once.

    Args:
        path: absolute path of the file.
        data: the bytes to write.
        owner: ``(uid, gid)`` to give the file; None: the agent's.

    Raises:
        UnsafePathError: a user-controlled component of the directory is a symlink.
        OSError: the write failed (the temporary file is removed).
    """
    pure = PurePosixPath(os.fspath(path))
    dir_fd = open_directory(pure.parent)
    try:
        tmp = f".tmp-{pure.name}-{os.getpid()}-{os.urandom(6).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        try:
            try:
                if owner is not None:
                    os.fchown(fd, *owner)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, pure.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            raise
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_bytes(path: str | os.PathLike[str], *, limit: int) -> bytes | None:
    """The content of the regular file ``path`` (at most ``limit`` bytes), read without following a
    link the user planted and without blocking on a FIFO (:func:`open_file`); None when it is missing.

    Args:
        path: absolute path of the file.
        limit: the most bytes the file may hold.

    Returns:
        the file's bytes, or None when it does not exist.

    Raises:
        UnsafePathError: a symlink, a hard link, a FIFO or a device is there, or the file holds more
            than ``limit`` bytes.
        OSError: reading failed.
    """
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UnsafePathError(f"{os.fspath(path)!r} holds more than {limit} bytes; expected a small state file")
    return data


def list_directory(path: str | os.PathLike[str]) -> list[str]:
    """The entry names of the directory ``path`` (opened by :func:`open_directory`); [] when missing."""
    try:
        dir_fd = open_directory(path)
    except FileNotFoundError:
        return []
    try:
        return os.listdir(dir_fd)
    finally:
        os.close(dir_fd)


def unlink(path: str | os.PathLike[str]) -> None:
    """Remove the entry ``path`` (a link is removed itself, never its target) relative to its directory
    opened by :func:`open_directory`; missing is fine.

    Raises:
        UnsafePathError: a user-controlled component of the directory is a symlink.
        OSError: as the file system raises it.
    """
    pure = PurePosixPath(os.fspath(path))
    try:
        dir_fd = open_directory(pure.parent)
    except FileNotFoundError:
        return
    try:
        os.unlink(pure.name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dir_fd)
