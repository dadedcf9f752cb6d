"""A wake-up call for engines on the same host: one UDP datagram on 127.0.0.1.

Engines poll the store for work, backing off to a few tens of milliseconds when idle. After the
API queues a request it rings the engine's doorbell, so an idle engine starts at once instead of at
its next poll. Purely an optimisation: a lost datagram (or an engine on another host) only means
the work is found by polling.
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


def ring(port: int | None) -> None:
    """Ring the doorbell at ``port`` (no error if nobody listens)."""
    if port:
        try:
            _sender.sendto(b"!", ("127.0.0.1", port))
        except OSError:
            pass
