"""Every shipped config loads and maps onto a valid TransformerConfig with the paper's sizes."""

import dataclasses
import importlib
import json

import pytest

from attention_jax import TransformerConfig
from attention_jax.runtime.errors import UserError
from attention_jax.training import load_config, validate


def load(name):
    return importlib.import_module(f"attention_jax.configs.{name}").get_config()


def config_of(c) -> TransformerConfig:
    return TransformerConfig.from_dict({**c.model.to_dict(), "vocab_size": c.vocab_size})


@pytest.mark.parametrize("name", ["tiny", "base", "big"])
def test_config_builds_a_valid_model_config(name):
    c = load(name)
    cfg = config_of(c)
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


@pytest.mark.parametrize("name", ["tiny", "base", "big"])
def test_shipped_configs_pass_validation(name):
    validate(load(name))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        # The one home of every check: each of these used to be checked (or not) by the
        # module that consumes the field.
        ("tokenizer_type", "wordpiece", "tokenizer_type must be one of"),
        ("long_pairs", "keep", "long_pairs must be one of"),
        ("optimizer", "sgd", "optimizer must be one of"),
        ("schedule", "nope", "schedule must be one of"),
        ("nonfinite_policy", "ignore", "nonfinite_policy must be one of"),
        ("label_smoothing", 1.0, r"label_smoothing must be in \[0, 1\)"),
        ("grad_accum_steps", 0, "grad_accum_steps must be > 0"),
        ("grad_clip_norm", -1.0, "grad_clip_norm must be >= 0"),
        ("data_shards", -1, "data_shards must be >= 0"),
        ("loss_logits_dtype", "float16", "loss_logits_dtype must be one of"),
        ("loss_logits_dtype", "bfloat16", "takes effect only with config.loss_chunk_tokens > 0"),
        ("search.beam_size", 0, "bad config.search: beam_size must be >= 1, got 0"),
        ("search.alpha", -0.5, "bad config.search: alpha must be >= 0"),
        ("search.length_penalty", "wu", "bad config.search: length_penalty must be one of"),
        ("search.stop", "never", "bad config.search: stop must be one of"),
        ("max_length", 2000, "exceeds config.model.max_len"),
        ("model.num_heads", 7, "divisible by num_heads"),
    ],
)
def test_validate_names_the_bad_field(field, value, message):
    c = load("tiny")
    node, *path = [c, *field.split(".")]
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    with pytest.raises(UserError, match=message):
        validate(c)


def test_the_model_fields_are_the_dataclass_s_with_its_defaults():
    c = load("default")
    fields = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    assert set(c.model) == set(fields) - {"vocab_size"}
    assert all(c.model[k] == fields[k] for k in c.model)


def test_a_renamed_field_names_its_new_home(tmp_path):
    c = load("tiny")
    with c.unlocked():
        c.eval_beam_size = 3
    with pytest.raises(UserError, match=r"config\.eval_beam_size is now config\.search\.beam_size"):
        validate(c)
    # A workdir's config.json written under the old names loads under the new ones.
    saved = json.loads(load("tiny").to_json_best_effort())
    del saved["search"], saved["state_buffers"]
    saved.update(eval_beam_size=3, eval_alpha=1.0, pack_state=False)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = load_config(str(tmp_path))
    assert (loaded.search.beam_size, loaded.search.alpha) == (3, 1.0)
    assert "eval_beam_size" not in loaded and loaded.search.stop == "bound"
    assert loaded.state_buffers is False and "pack_state" not in loaded
    validate(loaded)
    with c.unlocked():
        del c.eval_beam_size
        c.pack_state = True
    with pytest.raises(UserError, match=r"config\.pack_state is now config\.state_buffers"):
        validate(c)
