"""Shared test setup: CPU only, no network."""

import os
import socket

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Tests never reach the network: outbound connections fail loudly."""

    def guard(*args, **kwargs):
        raise RuntimeError("tests must not use the network")

    monkeypatch.setattr(socket.socket, "connect", guard)
    monkeypatch.setattr(socket, "create_connection", guard)
