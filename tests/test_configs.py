"""Every shipped config loads and maps onto a valid TransformerConfig with the paper's sizes."""

import importlib

import pytest

from model import TransformerConfig


def load(name):
    return importlib.import_module(f"configs.{name}").get_config()


def model_config(c) -> TransformerConfig:
    return TransformerConfig.from_dict({**c.model.to_dict(), "vocab_size": c.vocab_size})


@pytest.mark.parametrize("name", ["tiny", "base", "big"])
def test_config_builds_a_valid_model_config(name):
    c = load(name)
    cfg = model_config(c)
    assert cfg.vocab_size == c.vocab_size
    for field in (
        "dataset",
        "eval_dataset",
        "source_lang",
        "target_lang",
        "vocab_size",
        "max_length",
        "batch_tokens",
        "num_train_steps",
        "eval_every_steps",
        "checkpoint_every_steps",
        "seed",
    ):
        assert field in c, field


def test_paper_hyperparameters():
    base, big = load("base"), load("big")
    assert (base.model.d_model, base.model.num_heads, base.model.d_ff) == (512, 8, 2048)
    assert (big.model.d_model, big.model.num_heads, big.model.d_ff) == (1024, 16, 4096)
    assert base.model.num_encoder_layers == base.model.num_decoder_layers == 6
    assert big.model.num_encoder_layers == big.model.num_decoder_layers == 6
    assert base.model.dropout_rate == 0.1 and big.model.dropout_rate == 0.3
    for c in (base, big):
        assert (c.adam_b1, c.adam_b2, c.adam_eps) == (0.9, 0.98, 1e-9)
        assert c.label_smoothing == 0.1 and c.warmup_steps == 4000 and c.schedule == "rsqrt"
        assert 32000 <= c.vocab_size <= 40000
