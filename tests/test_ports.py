"""Rendezvous ports are chosen outside the kernel's ephemeral range, where no outgoing connection
can take them between the choice and the store's bind (the cause of EADDRINUSE under load)."""
import socket

from megastrategy import ports


def test_the_port_is_free_and_below_the_ephemeral_range():
    start = ports._ephemeral_start()
    for _ in range(20):
        port = ports.free_port()
        assert port < start or start <= ports._LOWEST
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


def test_a_port_in_use_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: taken + 1)
        monkeypatch.setattr(ports, "_LOWEST", taken)  # the only candidate below the range is taken
        port = ports.free_port()
        assert port != taken
