"""Writing files so that a crash never leaves half of one behind: temp file, fsync, rename; and
JSON-lines logs appended one whole line per write."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from felactl.errors import InputError, WriteError

STORAGE_ERRORS = (OSError, InputError)
"""What writing a file raises when the storage fails: OSError (a read-only or full filesystem, no
permission: :func:`atomic_write`'s WriteError is one), or :func:`atomic_write`'s InputError where
it cannot make the file's directory or the path is not a regular file."""


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
    """Call ``write(f)`` on a temp file beside ``path``, fsync it, then rename it over ``path``.

    A ``path`` that exists as anything but a regular file (a device, a FIFO, a socket, a
    directory) is refused, never replaced: ``-o /dev/full`` must not turn a device node into a
    file. A write the filesystem refuses (read-only, full, ``/proc``, no permission) is a
    :class:`WriteError` naming ``path``; nothing is left behind."""
    target = Path(path)
    check_output_file(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise InputError(f"{target}: {target.parent} is not a directory") from None
    except OSError as exc:
        raise WriteError(target, exc) from None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise WriteError(target, exc) from None
    recording = _RecordingFile(os.fdopen(fd, "wb"))
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with recording.file:
            write(recording)
            recording.file.flush()
            os.fsync(recording.file.fileno())
        os.replace(tmp_name, target)
    except BaseException as exc:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        # torch.save reports a failed write as a RuntimeError of its own: the OSError under it says why
        error = exc if isinstance(exc, OSError) else recording.error
        if error is not None and not isinstance(exc, KeyboardInterrupt):
            raise WriteError(target, error) from None
        raise
    _fsync_dir(target.parent)
    return target


NODE_KINDS = {
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFDIR: "directory",
}


def check_output_file(target: Path) -> None:
    """Refuse (InputError) a path to write that exists as anything but a regular file; call it
    before long work whose result goes there, so the user learns at once."""
    try:
        mode = target.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise WriteError(target, exc) from None
    if not stat.S_ISREG(mode):
        kind = NODE_KINDS.get(stat.S_IFMT(mode), "special file")
        hint = "give a file name to write" if kind == "directory" else "felactl writes only regular files"
        raise InputError(f"{target}: is a {kind}, not a regular file; {hint}")


class _RecordingFile:
    """A file whose ``write`` keeps the OSError it raised (a full disk), for when the caller's
    writer (``torch.save``) turns it into an error of its own."""

    def __init__(self, file: IO[bytes]):
        self.file = file
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str):
        return getattr(self.file, name)


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
