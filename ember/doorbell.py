"""Wake-up calls between processes on the same host: one UDP datagram on 127.0.0.1.

Both directions are purely an optimisation over polling the store, which stays the only record:
a lost datagram (or a process on another host) only means the news is found by the next poll.

* API -> engine: engines poll the store for work, backing off to a few tens of milliseconds when
  idle. After the API queues a request it rings the engine's doorbell, so an idle engine starts at
  once instead of at its next poll.
* Engine -> API: after an engine commits results it sends the finished request ids (``ring_ids``)
  to every API process on the host that registered a result doorbell (``Store.listen_results``);
  their long-polls (``ember.server.waiter``) answer at once instead of at the next poll. Results
  small enough travel in the datagram too (``result_datagrams``), authenticated with HMAC-SHA256
  under a key both sides read from the store (``RESULT_KEY_SETTING``), so the API answers without
  reading the row back; they are copies of what the engine has just committed (the store stays
  the record), and a datagram that fails the check is only a "look now".
"""

from __future__ import annotations

import hashlib
import hmac
import select
import socket
import struct
from typing import NamedTuple


class Doorbell:
    """The engine's end: ``wait(timeout)`` returns early when rung."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True if rung (all pending rings are consumed)."""
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        rung = False
        while ready:
            try:
                self.sock.recv(64)
                rung = True
            except BlockingIOError:
                break
        return rung


_sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def ring(port: int | None, data: bytes = b"!") -> None:
    """Ring the doorbell at ``port`` (no error if nobody listens)."""
    if port:
        try:
            _sender.sendto(data, ("127.0.0.1", port))
        except OSError:
            pass


MAX_DATAGRAM = 1200  # bytes of ids per datagram (well under any loopback MTU)


def id_datagrams(ids: list[str]) -> list[bytes]:
    """``ids`` as newline-separated datagrams of at most ``MAX_DATAGRAM`` bytes."""
    out: list[bytes] = []
    chunk: list[bytes] = []
    size = 0
    for rid in ids:
        b = rid.encode()
        if chunk and size + len(b) + 1 > MAX_DATAGRAM:
            out.append(b"\n".join(chunk))
            chunk, size = [], 0
        chunk.append(b)
        size += len(b) + 1
    if chunk:
        out.append(b"\n".join(chunk))
    return out


def ring_ids(port: int | None, ids: list[str]) -> None:
    """Tell the listener at ``port`` that the requests ``ids`` finished."""
    for data in id_datagrams(ids):
        ring(port, data)


RESULT_KEY_SETTING = "result_doorbell_key"  # the ``settings`` row with the HMAC key (hex)
MAX_RESULT_DATAGRAM = 8192  # bytes of a datagram carrying results (loopback takes far more)
_RESULTS = b"\x01"  # first byte of a results datagram (an id never starts with it)
_MAC = 32
_HEAD = struct.Struct("<HcIHH")  # id length, state (d/f), result/error length, category length, 0


class Outcome(NamedTuple):
    """A finished request as the engine committed it (``state``: ``done`` or ``failed``)."""

    state: str
    result: bytes | None
    error: str | None
    category: str | None


def _record(rid: str, result: bytes | None, error: str | None, category: str | None) -> bytes:
    rid_b = rid.encode()
    if error is None:
        body = result or b""
        return _HEAD.pack(len(rid_b), b"d", len(body), 0, 0) + rid_b + body
    err = error.encode()
    cat = (category or "server").encode()
    return _HEAD.pack(len(rid_b), b"f", len(err), len(cat), 0) + rid_b + err + cat


def result_datagrams(
    key: bytes, outcomes: list[tuple[str, bytes | None, str | None, str | None]]
) -> tuple[list[bytes], list[str]]:
    """``outcomes`` (``(id, result, error, category)``, as ``Store.finish`` takes them) as
    authenticated datagrams of at most ``MAX_RESULT_DATAGRAM`` bytes, and the ids whose result is
    too large for one (to send with ``ring_ids``)."""
    out: list[bytes] = []
    too_big: list[str] = []
    chunk: list[bytes] = []
    size = 0
    room = MAX_RESULT_DATAGRAM - 1 - _MAC

    def flush() -> None:
        body = b"".join(chunk)
        out.append(_RESULTS + hmac.new(key, body, hashlib.sha256).digest() + body)

    for rid, result, error, category in outcomes:
        rec = _record(rid, result, error, category)
        if len(rec) > room:
            too_big.append(rid)
            continue
        if chunk and size + len(rec) > room:
            flush()
            chunk, size = [], 0
        chunk.append(rec)
        size += len(rec)
    if chunk:
        flush()
    return out, too_big


def parse_results(key: bytes | None, data: bytes) -> dict[str, Outcome] | None:
    """The outcomes of a ``result_datagrams`` datagram; ``None`` if ``data`` is not one, or fails
    the HMAC check (or there is no ``key``)."""
    if key is None or data[:1] != _RESULTS or len(data) < 1 + _MAC:
        return None
    mac, body = data[1 : 1 + _MAC], data[1 + _MAC :]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        return None
    found: dict[str, Outcome] = {}
    at = 0
    try:
        while at < len(body):
            n_id, state, n_val, n_cat, _ = _HEAD.unpack_from(body, at)
            at += _HEAD.size
            rid = body[at : at + n_id].decode()
            at += n_id
            value = body[at : at + n_val]
            at += n_val
            if state == b"d":
                found[rid] = Outcome("done", value, None, None)
            else:
                found[rid] = Outcome("failed", None, value.decode(), body[at : at + n_cat].decode())
                at += n_cat
            if at > len(body):
                return None
    except (struct.error, UnicodeDecodeError):
        return None
    return found


def ring_results(
    port: int | None, key: bytes | None, outcomes: list[tuple[str, bytes | None, str | None, str | None]]
) -> None:
    """Tell the listener at ``port`` that ``outcomes`` were committed: with their results when
    there is a ``key`` and they fit in a datagram, else by id."""
    if not port:
        return
    if key is None:
        ring_ids(port, [o[0] for o in outcomes])
        return
    grams, too_big = result_datagrams(key, outcomes)
    for data in grams:
        ring(port, data)
    if too_big:
        ring_ids(port, too_big)
