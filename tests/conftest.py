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


def small_train_config(**overrides):
    """configs/tiny.py shrunk for tests (d_model 32, one layer each side, no periodic eval)."""
    from configs import tiny

    c = tiny.get_config()
    c.vocab_size = 300
    c.max_length = 16
    c.batch_tokens = 256
    c.model.d_model = 32
    c.model.num_heads = 2
    c.model.num_encoder_layers = 1
    c.model.num_decoder_layers = 1
    c.model.d_ff = 64
    c.model.max_len = 64
    c.warmup_steps = 10
    c.num_train_steps = 30
    c.log_every_steps = 5
    c.eval_every_steps = 0
    c.checkpoint_every_steps = 10
    c.final_eval_max_examples = 8
    c.eval_beam_size = 2
    c.num_examples_to_print = 1
    for k, v in overrides.items():
        node = c
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    return c
