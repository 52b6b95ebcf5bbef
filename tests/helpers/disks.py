"""Real small disks for the write-error tests: tmpfs mounts (root only; CI is root), made
read-only or filled on demand. The ``tmpfs`` fixture (tests/conftest.py) mounts them and always
unmounts them."""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

_MS_RDONLY, _MS_REMOUNT, _MNT_DETACH = 1, 32, 2
_LIBC = ctypes.CDLL(None, use_errno=True)


def mount(target: Path, options: str, flags: int = 0) -> None:
    """A tmpfs on ``target`` (mount's ``options``: ``size=4m,mode=0755``), or OSError."""
    if _LIBC.mount(b"tmpfs", os.fsencode(target), b"tmpfs", flags, options.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def unmount(target: Path) -> None:
    _LIBC.umount2(os.fsencode(target), _MNT_DETACH)


def read_only(disk: Path) -> None:
    mount(disk, "", _MS_REMOUNT | _MS_RDONLY)


def fill(disk: Path, leave: int = 0) -> None:
    """Takes the disk's free space but ``leave`` bytes (0: until a write is refused)."""
    stat = os.statvfs(disk)
    room = stat.f_bavail * stat.f_frsize - leave
    with open(disk / "filler", "wb", buffering=0) as handle:
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):
            while room > 0:
                room -= handle.write(chunk[: min(len(chunk), room)])
            if leave == 0:
                while True:
                    handle.write(b"\0" * 4096)
