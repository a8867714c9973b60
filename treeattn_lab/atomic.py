"""Atomic file writes: a reader sees the old file or the new one, never a part of either.

:func:`atomic_writer` opens a temporary file beside the target (same folder, so the same file system),
hands it to the caller, and only when the caller's block finishes without an error flushes it to disk and
renames it over the target with :func:`os.replace`, which is atomic on POSIX and Windows. Any error on
the way (a full disk, a file-size limit, an exception in the caller's serializer) removes the temporary
file and leaves the target as it was. This module sits at the bottom of the package: it imports nothing
from it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, *, binary: bool = False) -> Iterator[IO]:
    """Yield a file to write; on success it replaces ``path`` whole, on an error ``path`` is untouched.

    Text files are UTF-8. The temporary file is created with the process's usual permissions (exclusive
    creation under a random name, never a predictable one) and removed on any error.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb" if binary else "x", **({} if binary else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_writer`)."""
    with atomic_writer(path) as f:
        f.write(text)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_writer`)."""
    with atomic_writer(path, binary=True) as f:
        f.write(data)
