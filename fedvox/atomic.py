"""Atomic file writes: a result or checkpoint is either the old file or the whole new one.

Every write that matters (checkpoints, metrics tables, reports, caches) goes through here.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def atomic_write(
    path: str | Path, writer: Callable[[IO[bytes]], None], mode: int | None = None
) -> Path:
    """Write via `writer(fileobj)` into a temp file beside `path`, fsync, then rename over it;
    `mode` (e.g. 0o600 for a private key) holds from the first byte written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes 0600; results are ordinary files unless a mode is asked for
        os.fchmod(fd, 0o666 & ~_UMASK if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> Path:
    """Atomically replace `path` with `data` (file mode `mode` if given)."""
    return atomic_write(path, lambda f: f.write(data), mode)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Atomically replace `path` with UTF-8 `text`."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes (checkpoint integrity)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
