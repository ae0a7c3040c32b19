"""Signed documents: an HMAC-SHA256 under the job secret, bound to the job, the key, the
generation and a sequence number.

A sealed document on the store is one JSON object::

    {"v": 1, "job": "<run id>#<session>", "key": "elastic/gen/3", "generation": 3, "seq": 17…,
     "kind": "generation", "body": {...}, "mac": "<hex>"}

``mac`` is ``HMAC(secret, canonical JSON of everything else)``. :meth:`Seal.open` refuses
(:class:`Forged`, naming what is wrong) a value that is not such an object, whose MAC is wrong
(altered, or made without the secret), whose job is another (another job, or an earlier launch of
the same run: every launch has a fresh session), whose key is not the one it was read from
(moved), whose generation is not the one the reader expects, or whose sequence number is below
one the reader has already accepted for that key (replayed). Sequence numbers are nanoseconds
of the writer's clock, kept increasing by each writer, so a restarted writer still counts up.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from felactl.errors import ControlPlaneError

D = TypeVar("D")

VERSION = 1


class Forged(Exception):
    """A value on the store that is not a document this job's secret sealed for that key."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


def mac(secret: str, message: bytes) -> str:
    """HMAC-SHA256 of ``message`` under the hex job secret, hex."""
    return hmac.new(bytes.fromhex(secret), message, hashlib.sha256).hexdigest()


def _canonical(fields: dict) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class Opened:
    body: dict
    generation: int
    seq: int
    kind: str


class Seal:
    """Seals and opens the documents of one job (``job``: the run id and the launch's session)."""

    def __init__(self, secret: str, job: str):
        bytes.fromhex(secret)  # a malformed secret fails here, not at the first document
        self.secret, self.job = secret, job
        self._last_seq = 0
        self._lock = threading.Lock()

    def next_seq(self) -> int:
        with self._lock:
            self._last_seq = max(self._last_seq + 1, time.time_ns())
            return self._last_seq

    def seal(self, key: str, kind: str, body: dict, *, generation: int = 0, seq: int | None = None) -> str:
        fields = {
            "v": VERSION,
            "job": self.job,
            "key": key,
            "generation": int(generation),
            "seq": self.next_seq() if seq is None else int(seq),
            "kind": kind,
            "body": body,
        }
        return json.dumps({**fields, "mac": mac(self.secret, _canonical(fields))})

    def open(
        self, key: str, raw: bytes | str, kind: str, *, generation: int | None = None, after_seq: int | None = None
    ) -> Opened:
        """The document sealed at ``key``; :class:`Forged` naming what is wrong otherwise."""
        try:
            envelope = json.loads(raw)
            fields = {name: envelope[name] for name in ("v", "job", "key", "generation", "seq", "kind", "body")}
            signature = str(envelope["mac"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise Forged(key, "not a signed document") from None
        if not hmac.compare_digest(mac(self.secret, _canonical(fields)), signature):
            raise Forged(key, "wrong signature (altered, or not signed with this job's secret)")
        if fields["job"] != self.job:
            raise Forged(key, f"signed for another job or launch ({str(fields['job'])[:80]!r})")
        if fields["key"] != key:
            raise Forged(key, f"a document of {str(fields['key'])[:80]!r} moved here")
        if fields["kind"] != kind:
            raise Forged(key, f"a {str(fields['kind'])[:40]!r} document where a {kind!r} one belongs")
        if (
            not isinstance(fields["body"], dict)
            or not isinstance(fields["generation"], int)
            or not isinstance(fields["seq"], int)
        ):
            raise Forged(key, "malformed document")
        if generation is not None and fields["generation"] != generation:
            raise Forged(key, f"signed for generation {fields['generation']}, expected {generation}")
        if after_seq is not None and fields["seq"] < after_seq:
            raise Forged(key, f"replayed (sequence {fields['seq']} is older than {after_seq})")
        return Opened(fields["body"], fields["generation"], fields["seq"], fields["kind"])


ABSENT = "\x00felactl:absent\x00"
ABSENT_BYTES = ABSENT.encode()


class Reader:
    """Reads sealed documents from a store, keeps each key's newest accepted sequence number
    (replays are refused) and reports each distinct forgery once through ``on_refused(key, reason)``.

    ``store`` is a TCPStore (or PrefixStore) and ``prefix`` what to put before a key's name to
    find it there."""

    def __init__(
        self, seal: Seal, store, prefix: str = "", on_refused: Callable[[str, str], None] = lambda key, reason: None
    ):
        self.seal, self.store, self.prefix, self.on_refused = seal, store, prefix, on_refused
        self.seqs: dict[str, int] = {}
        self.refused: dict[str, bytes] = {}
        """Key -> the forged value last reported for it (reported once, however often it is read)."""

    def raw(self, key: str) -> bytes | None:
        """The value at ``key``, None when there is none; never waits for the key (a ``get`` of a key
        deleted after a ``check`` would block for the store's timeout: a compare-and-set whose
        expected and desired value are one that is never written reads it atomically)."""
        value = self.store.compare_set(self.prefix + key, ABSENT, ABSENT)
        return None if value == ABSENT_BYTES else value

    def open(self, key: str, raw: bytes, kind: str, *, generation: int | None = None) -> Opened | None:
        """``raw`` opened, or None (reported once) when it is a forgery."""
        try:
            opened = self.seal.open(key, raw, kind, generation=generation, after_seq=self.seqs.get(key))
        except Forged as exc:
            if self.refused.get(key) != raw:
                self.refused[key] = raw
                self.on_refused(key, exc.reason)
            return None
        self.seqs[key] = opened.seq
        return opened

    def read(self, key: str, kind: str, *, generation: int | None = None) -> Opened | None:
        """The valid document at ``key``; None when there is none or it is a forgery."""
        raw = self.raw(key)
        return None if raw is None else self.open(key, raw, kind, generation=generation)

    def read_doc(self, key: str, doc_type: type[D], *, generation: int | None = None) -> D | None:
        """The valid document at ``key`` as a ``doc_type`` (a :class:`~felactl.control.documents.Document`);
        None when there is none, it is a forgery, or its body is malformed (reported once, like a forgery)."""
        raw = self.raw(key)
        opened = None if raw is None else self.open(key, raw, doc_type.KIND.value, generation=generation)
        if opened is None:
            return None
        try:
            return doc_type.from_body(opened.body)
        except ValueError as exc:
            if self.refused.get(key) != raw:
                self.refused[key] = raw
                self.on_refused(key, f"malformed ({exc})")
            return None

    def write(self, key: str, kind: str, body: dict, *, generation: int = 0) -> str:
        value = self.seal.seal(key, kind, body, generation=generation)
        self.store.set(self.prefix + key, value)
        return value

    def agree(self, key: str, kind: str, body: dict, *, generation: int = 0) -> dict:
        """Compare-and-set a sealed proposal: the first valid one at ``key`` wins for everyone; a
        forgery sitting there is replaced by ours (compare-and-set on the forged bytes). Someone
        who keeps writing forgeries faster than that: ControlPlaneError naming the key."""
        proposal = self.seal.seal(key, kind, body, generation=generation)
        expected = ""
        for _ in range(8):
            current = self.store.compare_set(self.prefix + key, expected, proposal)
            opened = self.open(key, current, kind, generation=generation)
            if opened is not None:
                return opened.body
            expected = current  # a forgery: replace exactly it
        raise ControlPlaneError(f"{key}: kept being overwritten by forgeries; no agreement could be reached")


def job_binding(run: str, session: str) -> str:
    """What a signature binds as the job: the run and its launch's session."""
    return f"{run}#{session}"


def parse_int(raw: Any) -> int | None:
    """A counter's or hint's value, None when it is not an integer (tampered with)."""
    try:
        text = raw.decode("ascii") if isinstance(raw, bytes) else str(raw)
        return int(text)
    except (ValueError, UnicodeDecodeError):
        return None
