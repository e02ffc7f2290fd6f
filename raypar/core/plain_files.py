"""Files a user or another local account may have planted: read only regular files, write only beside them.

A FIFO where a file is expected blocks its reader forever (`open` waits for a writer), a symlink makes a
reader copy whatever it points at (into checkpoints, manifests, exports) and a writer write through it into
a victim file. So such inputs are opened without following a final symlink and without blocking
(O_NOFOLLOW | O_NONBLOCK), then refused unless fstat says a regular file; outputs are written to a hidden
file beside the target and renamed over it (`os.replace` replaces a symlink, never writes through it).
"""

from __future__ import annotations

import errno
import io
import os
import stat
import uuid
from pathlib import Path
from typing import Any

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegularFile(ValueError):
    """A path that must be a regular file is a symlink, a FIFO, a socket, a device or a directory."""


def kind(mode: int) -> str:
    """What a file of st_mode `mode` is, in words."""
    for test, name in (
        (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    ):  # fmt: skip
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def refuse_unless_regular(path: str | os.PathLike[str], what: str, follow_symlinks: bool = False) -> None:
    """NotRegularFile naming `path` and `what` it should be, unless it is absent or a regular file (a
    symlink is refused, unless `follow_symlinks`: then what it points at must be one)."""
    try:
        mode = os.stat(path, follow_symlinks=follow_symlinks).st_mode
    except (FileNotFoundError, NotADirectoryError):  # absent, also below a file: the caller's open says so
        return
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"{path}: is {kind(mode)}, not a regular file ({what} must be one); refused")


def read_regular(path: str | os.PathLike[str], what: str, follow_symlinks: bool = False) -> bytes:
    """The bytes of `path`, a regular file (not a symlink to one, unless `follow_symlinks`); NotRegularFile
    otherwise, at once (a FIFO is opened without waiting for a writer). FileNotFoundError and other
    OSErrors pass through."""
    try:
        fd = os.open(path, _READ_FLAGS & ~(os.O_NOFOLLOW if follow_symlinks else 0))
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW on a symlink
            raise NotRegularFile(
                f"{path}: is a symlink, not a regular file ({what} must be one); refused"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{path}: is {kind(mode)}, not a regular file ({what} must be one); refused")
        os.set_blocking(fd, True)
        return f.read()


def write_figure(figure: Any, path: str | os.PathLike[str]) -> None:
    """A matplotlib figure saved as `write_aside` writes (its format from the suffix)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png")
    write_aside(path, buffer.getvalue())


def write_aside(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` through a hidden file beside it renamed over it: a symlink or FIFO planted at
    `path` is replaced, never written through, and a reader never sees half a file. Mode: the umask's."""
    path = Path(path)
    part = path.with_name(f".{path.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(part, "xb") as out:  # x: never an existing file (nor a symlink) at the hidden name
            out.write(data)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
