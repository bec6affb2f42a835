"""Reading files that a container controls, from the agent.

The agent reads files that tenants can replace: each container's region file in its state dir
and each mount namespace's ``/etc/ld.so.preload`` (through ``/proc/<pid>/root``). Such a path
may be a FIFO (opening it would wait for a writer), a device node (opening one can act: a
watchdog, a terminal), a symbolic link, or a huge or endless file (``/dev/zero``). Here the path
is first opened with ``O_PATH``, which opens nothing, its type checked on that descriptor, and
only a plain file is then opened for reading, through ``/proc/self/fd`` (the same inode: a
rename in between changes nothing), and read up to a limit. A path inside a container's root
(``/proc/<pid>/root``) is resolved as the container sees it (:func:`read_plain_file_in_root`):
its links never lead out of it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct


class NotPlainFile(OSError):
    """The path names something other than a plain file (a FIFO, device, socket, directory or,
    where links are not followed, a symbolic link)."""


def read_plain_file(path: str | os.PathLike[str], limit: int, *, follow: bool = True) -> bytes:
    """At most ``limit`` bytes from the start of the plain file at ``path``.

    Raises :class:`NotPlainFile` for anything else, and the ``OSError`` of the open otherwise
    (``FileNotFoundError`` and so on). With ``follow=False`` a final symbolic link is not
    followed (it is not a plain file)."""
    return _read_and_close(open_plain_file(path, follow=follow), limit)


def open_plain_file(path: str | os.PathLike[str], *, follow: bool = True) -> int:
    """A read-only descriptor of the plain file at ``path`` (the caller closes it), checked as
    :func:`read_plain_file` checks it: for reading, and for queries on the open file that a
    read alone cannot make (the region's liveness tokens:
    :func:`webhook.node.region.read_region`)."""
    flags = os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    return _open_ref(os.open(path, flags), path)


def read_plain_file_in_root(root: str | os.PathLike[str], path: str, limit: int) -> bytes:
    """As :func:`read_plain_file`, for ``path`` as a process whose root directory is ``root``
    (``/proc/<pid>/root``) sees it: every symbolic link on the way is resolved inside ``root``
    (an absolute one from ``root``, ``..`` stops there, no ``/proc`` magic link), as the
    process's own ``ld.so`` resolves it. Followed from the agent, an absolute link (``/etc`` or
    the file itself, made by the container, or by any process of it that chroots) named a file
    of the agent's own view: with hostPID, ``/proc/1/root/...`` is any file of the host.

    Through ``openat2(RESOLVE_IN_ROOT)`` (Linux 5.6); where the kernel (or a seccomp profile)
    has none, the same resolution one component at a time (:func:`_open_in_root`)."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            ref = _openat2(root_fd, path, os.O_PATH | os.O_CLOEXEC,
                           _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            ref = _open_in_root(root_fd, path)
    finally:
        os.close(root_fd)
    return _read_and_close(_open_ref(ref, os.path.join(os.fspath(root), path.lstrip("/"))), limit)


_MAX_LINKS = 40
"""Symbolic links one resolution follows before ELOOP (the kernel's limit)."""


def _open_in_root(root_fd: int, path: str) -> int:
    """An ``O_PATH`` descriptor of ``path`` resolved inside the directory ``root_fd`` as
    ``RESOLVE_IN_ROOT`` resolves it, for kernels without ``openat2``: each component is opened
    with ``O_NOFOLLOW`` below the one before, a symbolic link met on the way (a ``/proc`` magic
    link included) is read and its target resolved in its place, from ``root_fd`` when
    absolute, and ``..`` never climbs above ``root_fd``. An ``os.open`` of the whole path
    follows the links above the last component from the agent's root: a container's ``/etc``
    made a link to ``/proc/1/root/etc`` read the host's file."""
    dirs = [os.dup(root_fd)]  # root_fd, then each directory below it on the way
    todo = [c for c in reversed(path.split("/")) if c]
    links = 0
    try:
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            if name == "..":
                if len(dirs) > 1:
                    os.close(dirs.pop())
                continue
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirs[-1])
            dirs.append(fd)  # (closed with the others, whatever happens)
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                target = os.readlink("", dir_fd=fd)  # the link opened, not one put there since
                os.close(dirs.pop())
                if target.startswith("/"):
                    while len(dirs) > 1:
                        os.close(dirs.pop())
                todo.extend(c for c in reversed(target.split("/")) if c)
            elif todo and not stat.S_ISDIR(mode):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        return dirs.pop()
    finally:
        for fd in dirs:
            os.close(fd)


_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_SYS_OPENAT2 = 437
"""openat2's number, on x86_64 and in the generic table (aarch64) alike."""
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    how = struct.pack("=QQQ", flags, 0, resolve)  # struct open_how {flags, mode, resolve}
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd),
                       ctypes.c_char_p(os.fsencode(path)), ctypes.c_char_p(how),
                       ctypes.c_size_t(len(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def _open_ref(ref: int, path: str | os.PathLike[str]) -> int:
    """Open for reading the plain file that the ``O_PATH`` descriptor ``ref`` (closed here)
    refers to."""
    try:
        mode = os.fstat(ref).st_mode
        if not stat.S_ISREG(mode):
            raise NotPlainFile(f"{os.fspath(path)!r} is not a plain file "
                               f"({_kind(mode)})")
        return os.open(f"/proc/self/fd/{ref}",
                       os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(ref)


def read_fd(fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes from ``fd``'s offset on, in file order, until its end."""
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_and_close(fd: int, limit: int) -> bytes:
    try:
        return read_fd(fd, limit)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"
