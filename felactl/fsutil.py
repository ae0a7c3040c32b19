"""Writing files so that a crash never leaves half of one behind: temp file, fsync, rename; and
JSON-lines logs appended one whole line per write."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from felactl.errors import InputError

STORAGE_ERRORS = (OSError, InputError)
"""What writing a file raises when the storage fails: OSError (a read-only or full filesystem, no
permission), or :func:`atomic_write`'s InputError where it cannot make the file's directory."""


def check_directory(what: str, path: str | os.PathLike) -> None:
    """Refuse a directory to write in that exists as something else, or lies under a file (where
    ``mkdir`` would fail half-way through a command); a path not there yet is fine."""
    wanted = Path(path)
    for part in (wanted, *wanted.parents):
        if part.exists():
            if not part.is_dir():
                raise InputError(f"{what} {wanted}: {part} is not a directory")
            return


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None], mode: int | None = None) -> Path:
    """Call ``write(f)`` on a temp file beside ``path``, fsync it, then rename it over ``path``."""
    target = Path(path)
    if target.is_dir():
        raise InputError(f"{target}: is a directory; give a file name to write")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise InputError(f"{target}: {target.parent} is not a directory") from None
    except PermissionError:
        raise InputError(f"{target}: no permission to create {target.parent}") from None
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(target.parent)
    return target


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")), mode=mode)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write(2) on an O_APPEND file, so concurrent writers
    (several workers) never interleave within a line and a crash leaves whole lines only."""
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: Path, *, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """Every complete record; a torn last line (a crash mid-write: no newline after it) is
    skipped, not an error. Any other line that is not a JSON object is: records are appended
    whole, so one is a damaged file, and reading past it would report a wrong run.
    ``tail_bytes``: only the records in the file's last that many bytes (a long run's metrics
    need not be read whole to see its recent steps)."""
    try:
        with open(path, "rb") as f:
            if tail_bytes is not None and os.fstat(f.fileno()).st_size > tail_bytes:
                f.seek(-tail_bytes, os.SEEK_END)
                f.readline()  # the rest of a line cut in the middle
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a JSON-lines file") from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines[:-1], start=1):  # the last piece has no newline: torn or empty
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: line {number} is not valid JSON ({exc.msg}): the file is damaged") from None
        if not isinstance(record, dict):
            raise InputError(f"{path}: line {number} is not a JSON object: the file is damaged")
        records.append(record)
    return records


class JsonlTail:
    """Reads the records appended to a JSON-lines file since the last call (whole lines only)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]
