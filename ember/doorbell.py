"""Wake-up calls between processes on the same host: one UDP datagram on 127.0.0.1.

Both directions are purely an optimisation over polling the store, which stays the only record:
a lost datagram (or a process on another host) only means the news is found by the next poll.

* API -> engine: engines poll the store for work, backing off to a few tens of milliseconds when
  idle. After the API queues a request it rings the engine's doorbell, so an idle engine starts at
  once instead of at its next poll.
* Engine -> API: after an engine commits results it sends the finished request ids (``ring_ids``)
  to every API process on the host that registered a result doorbell (``Store.listen_results``);
  their long-polls (``ember.server.waiter``) answer at once instead of at the next poll.
"""

from __future__ import annotations

import select
import socket


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
