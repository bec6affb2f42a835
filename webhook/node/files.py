"""Reading files that a container controls, from the agent.

The agent reads files that tenants can replace: each container's region file in its state dir
and each mount namespace's ``/etc/ld.so.preload`` (through ``/proc/<pid>/root``). Such a path
may be a FIFO (opening it would wait for a writer), a device node (opening one can act: a
watchdog, a terminal), a symbolic link, or a huge or endless file (``/dev/zero``). Here the path
is first opened with ``O_PATH``, which opens nothing, its type checked on that descriptor, and
only a plain file is then opened for reading, through ``/proc/self/fd`` (the same inode: a
rename in between changes nothing), and read up to a limit.
"""

from __future__ import annotations

import os
import stat


class NotPlainFile(OSError):
    """The path names something other than a plain file (a FIFO, device, socket, directory or,
    where links are not followed, a symbolic link)."""


def read_plain_file(path: str | os.PathLike[str], limit: int, *, follow: bool = True) -> bytes:
    """At most ``limit`` bytes from the start of the plain file at ``path``.

    Raises :class:`NotPlainFile` for anything else, and the ``OSError`` of the open otherwise
    (``FileNotFoundError`` and so on). With ``follow=False`` a final symbolic link is not
    followed (it is not a plain file)."""
    flags = os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    ref = os.open(path, flags)
    try:
        mode = os.fstat(ref).st_mode
        if not stat.S_ISREG(mode):
            raise NotPlainFile(f"{os.fspath(path)!r} is not a plain file "
                               f"({_kind(mode)})")
        fd = os.open(f"/proc/self/fd/{ref}",
                     os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(ref)
    try:
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"
