"""``free_port``: ports for servers a test starts beside other tests' servers and clients."""

from __future__ import annotations

import socket

from agl.testing import free_port
from agl.testing.net import _ephemeral_low


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # one section of the README asks for three at once: never the same twice
    assert all(p < _ephemeral_low() for p in ports)  # no outgoing connection is given one of these
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
