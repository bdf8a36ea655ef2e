"""A trained model as a CTranslate2 model directory, written through `ctranslate2.specs`.

    export_ct2(model, pieces, tokenizer.files(), "serve/", quantization="int8")
    # serve/ can then be used by decode.py --ct2=serve/ or by plain CTranslate2:
    #   ctranslate2.Translator("serve/").translate_batch([sp.encode(text, out_type=str)])

The directory holds
    model.bin                 the weights (CTranslate2's format, written by its spec API)
    config.json               CTranslate2's: layer_norm_epsilon, special tokens, and
                              add_source_eos (our sources end with EOS, as in training)
    shared_vocabulary.json    the SentencePiece pieces in id order (one vocabulary)
    tokenizer.model           the SentencePiece model (or an OPUS-MT model's source.spm,
                              target.spm and marian_vocab.json: `tokenizer.files()`)
    decoding.json             what our decoder does that CTranslate2 must be told at
                              each call (backends/ct2.py reads it): the default beam,
                              alpha and length penalty, the length rule, the tokens
                              never to generate, the model config, where it came from

What a faithful conversion needs, beyond copying matrices: the sinusoid table is
written out in our interleaved sin/cos order (CTranslate2's built-in table puts
all sines before all cosines); `layer_norm_epsilon` is ours (1e-6; its default
is 1e-5); the decoder starts from <s> (BOS, id 2) and sources end with </s>;
<pad> and <s> are never generated (backends/ct2.py suppresses them).
`ctranslate2` is imported only inside the functions: the module loads without it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import tempfile
from typing import Any

import numpy as np

from attention_jax import Transformer, TransformerConfig
from attention_jax.search.settings import DEFAULTS, EXTRA_DECODE_LEN, SearchSettings
from attention_jax.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

FORMAT_VERSION = 1
DECODING_JSON = "decoding.json"
# Weight types CTranslate2 can store (its `quantization`); float32 = as trained.
QUANTIZATIONS = (
    "float32",
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "float16",
    "bfloat16",
)
DEVICES = ("cpu", "cuda")  # where CTranslate2 translates (decode.py --device)
_log = logging.getLogger(__name__)
INSTALL_HINT = "CTranslate2 is not installed: pip install '.[serve]' (or pip install ctranslate2)"

# Every TransformerConfig field and what the converter does with it: a field added to
# the model later is refused until someone teaches the converter about it.
_CONVERTED_FIELDS = {
    "vocab_size", "d_model", "num_heads", "num_encoder_layers", "num_decoder_layers",
    "d_ff", "activation", "norm", "layer_norm_epsilon", "share_embeddings", "tie_output",
    "max_len", "attention_bias", "logits_bias", "positions", "zero_start",
}  # fmt: skip
# Training-only or how-to-compute fields: no effect on the function the model computes.
_IGNORED_FIELDS = {
    "dropout_rate", "attention_dropout_rate", "dtype", "param_dtype", "attention_impl", "remat",
}  # fmt: skip
_ACTIVATIONS = ("relu", "gelu", "swish")
_NORMS = ("post", "pre")


def int8_saturates(cpuinfo: str | None = None) -> bool:
    """Whether CTranslate2's int8 matrix products lose accuracy on this CPU.

    On an x86-64 CPU without VNNI that is not Intel's, CTranslate2 multiplies int8
    with oneDNN's u8s8 kernels, whose 16-bit intermediate sums (vpmaddubsw) saturate:
    on the 2-core AMD EPYC (AVX2) int8 log-probabilities of a small random model
    strayed far from float32's, and on the Ding test far fewer int8 lines matched
    the JAX decoder's than with MKL's kernels (docs/results.md). Intel CPUs get MKL's;
    CT2_USE_MKL=1 asks for them elsewhere (there at a much lower int8 speed).
    cpuinfo: /proc/cpuinfo's text (read when None).
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if os.environ.get("CT2_USE_MKL", "").lower() in ("1", "true", "on"):
        return False
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    vnni = {"avx512_vnni", "avx_vnni"} & set(flags.split())
    return not vnni and "GenuineIntel" not in cpuinfo


def import_ctranslate2() -> Any:
    """The ctranslate2 module; ImportError with how to install it when it is missing."""
    try:
        import ctranslate2
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return ctranslate2


def unsupported(config: TransformerConfig) -> list[str]:
    """What of `config` a CTranslate2 Transformer cannot express ([] = all of it)."""
    problems = []
    known = _CONVERTED_FIELDS | _IGNORED_FIELDS
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name not in known and value != field.default:  # a switch left off is fine
            problems.append(f"{field.name}={value!r} (unknown to the converter)")
    if config.activation not in _ACTIVATIONS:
        problems.append(f"activation={config.activation!r} (supported: {', '.join(_ACTIVATIONS)})")
    if config.norm not in _NORMS:
        problems.append(f"norm={config.norm!r} (supported: {', '.join(_NORMS)})")
    return problems


def vocabulary(pieces: list[str], vocab_size: int) -> list[str]:
    """The model's V tokens: the tokenizer's pieces in id order, then placeholders for ids
    the tokenizer lacks (a corpus that supported fewer pieces; never generated)."""
    if len(pieces) > vocab_size:
        raise ValueError(f"the tokenizer has {len(pieces)} pieces, the model only {vocab_size}")
    taken = set(pieces)
    if len(taken) != len(pieces):
        raise ValueError("the tokenizer has duplicate pieces; CTranslate2 maps tokens by name")
    extra, i = [], 0
    while len(pieces) + len(extra) < vocab_size:
        name = f"<unused_{i}>"
        if name not in taken:
            extra.append(name)
        i += 1
    return pieces + extra


# --- weights -> spec ----------------------------------------------------------------------


def _f32(param: Any) -> np.ndarray:
    """A parameter as a new float32 array (the spec quantizes its arrays in place)."""
    return np.array(param[...], np.float32)


def _t(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w.T)


def _in_out(w: Any) -> np.ndarray:
    """A projection D -> N*H stored [D, N, H] (ours) -> CTranslate2's [N*H, D] (out, in)."""
    w = _f32(w)
    return _t(w.reshape(w.shape[0], -1))


def _out_in(w: Any) -> np.ndarray:
    """The output projection stored [N, H, D] -> CTranslate2's [D, N*H]."""
    w = _f32(w)
    return _t(w.reshape(-1, w.shape[-1]))


def _norm(spec: Any, norm: Any) -> None:
    spec.gamma, spec.beta = _f32(norm.scale), _f32(norm.bias)


def _attention(spec: Any, mha: Any, norm: Any, *, self_attention: bool) -> None:
    """One attention sub-layer: fused QKV (self) or Q and fused KV (cross), then W^O.

    CTranslate2 splits a fused projection into equal parts and each part into heads
    of consecutive columns, which is our [D, N, H] flattened to [D, N*H].
    """
    q, k, v = _in_out(mha.query), _in_out(mha.key), _in_out(mha.value)  # [N*H, D] each
    if self_attention:
        spec.linear[0].weight = np.concatenate([q, k, v])  # [3*N*H, D]
    else:
        spec.linear[0].weight = q
        spec.linear[1].weight = np.concatenate([k, v])  # [2*N*H, D]
    spec.linear[-1].weight = _out_in(mha.out)  # [D, N*H]
    if mha.query_bias is not None:  # [N, H] each -> [N*H], fused as the weights
        qb, kb, vb = (_f32(b).reshape(-1) for b in (mha.query_bias, mha.key_bias, mha.value_bias))
        if self_attention:
            spec.linear[0].bias = np.concatenate([qb, kb, vb])
        else:
            spec.linear[0].bias, spec.linear[1].bias = qb, np.concatenate([kb, vb])
        spec.linear[-1].bias = _f32(mha.out_bias)
    _norm(spec.layer_norm, norm)


def _ffn(spec: Any, ffn: Any, norm: Any) -> None:
    spec.linear_0.weight, spec.linear_0.bias = _t(_f32(ffn.wi)), _f32(ffn.bi)  # [F, D], [F]
    spec.linear_1.weight, spec.linear_1.bias = _t(_f32(ffn.wo)), _f32(ffn.bo)  # [D, F], [D]
    _norm(spec.layer_norm, norm)


def transformer_spec(model: Transformer, vocab: list[str]) -> Any:
    """Our Transformer as a `ctranslate2.specs.TransformerSpec` (weights, vocabulary, config).

    In CTranslate2 each sub-layer owns its LayerNorm and residual: post-LN computes
    LN(x + f(x)) and pre-LN x + f(LN(x)), as our `_Residual` does; pre-LN also has a
    final LayerNorm on each stack.
    """
    import_ctranslate2()
    from ctranslate2.specs import common_spec
    from ctranslate2.specs import transformer_spec as ts

    cfg = model.config
    problems = unsupported(cfg)
    if problems:
        raise ValueError(f"CTranslate2 cannot express this model: {'; '.join(problems)}")
    act = {  # jax.nn.gelu is the tanh approximation by default
        "relu": common_spec.Activation.RELU,
        "gelu": common_spec.Activation.GELUTanh,
        "swish": common_spec.Activation.SWISH,
    }[cfg.activation]
    pre = cfg.norm == "pre"
    layers = (cfg.num_encoder_layers, cfg.num_decoder_layers)
    encoder = ts.TransformerEncoderSpec(layers[0], cfg.num_heads, pre_norm=pre, activation=act)
    decoder = ts.TransformerDecoderSpec(layers[1], cfg.num_heads, pre_norm=pre, activation=act)
    spec = ts.TransformerSpec(encoder, decoder)

    table = np.asarray(model.position_table_values(), np.float32)  # [max_len, D]
    encoder.embeddings[0].weight = _f32(model.src_embed.embedding)  # [V, D]
    decoder.embeddings.weight = _f32(model.tgt_embed.embedding)
    encoder.position_encodings.encodings = table
    decoder.position_encodings.encodings = table
    decoder.start_from_zero_embedding = cfg.zero_start
    decoder.projection.weight = np.array(model.output_matrix(), np.float32)  # [V, D]
    if model.output_bias() is not None:
        decoder.projection.bias = np.array(model.output_bias(), np.float32)  # [V]
    for layer, ours in zip(encoder.layer, model.encoder_layers, strict=True):
        _attention(layer.self_attention, ours.self_attn, ours.attn_res.norm, self_attention=True)
        _ffn(layer.ffn, ours.ffn, ours.ffn_res.norm)
    for layer, ours in zip(decoder.layer, model.decoder_layers, strict=True):
        _attention(layer.self_attention, ours.self_attn, ours.self_res.norm, self_attention=True)
        _attention(layer.attention, ours.cross_attn, ours.cross_res.norm, self_attention=False)
        _ffn(layer.ffn, ours.ffn, ours.ffn_res.norm)
    if pre:
        _norm(encoder.layer_norm, model.encoder_norm)
        _norm(decoder.layer_norm, model.decoder_norm)

    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    config = spec.config
    config.layer_norm_epsilon = cfg.layer_norm_epsilon
    config.unk_token, config.bos_token, config.eos_token = (
        vocab[UNK_ID],
        vocab[BOS_ID],
        vocab[EOS_ID],
    )
    config.decoder_start_token = vocab[BOS_ID]
    config.add_source_eos = True  # our sources end with EOS, as in training
    config.add_source_bos = False
    return spec


# --- the directory ------------------------------------------------------------------------


def decoding_settings(
    config: TransformerConfig, vocab: list[str], num_pieces: int, *, alpha: float, beam_size: int
) -> dict[str, Any]:
    """decoding.json: how our decoder behaves, for backends/ct2.py (and a reader)."""
    never = [vocab[PAD_ID], vocab[BOS_ID], *vocab[num_pieces:]]
    return {
        "format_version": FORMAT_VERSION,
        "beam_size": beam_size,
        "alpha": alpha,
        # CTranslate2 ranks by log P / len^alpha, len the tokens with EOS.
        "length_penalty": "average",
        "max_len": config.max_len,
        "extra_decode_len": EXTRA_DECODE_LEN,
        "length_rule": (
            "a source of n tokens (EOS included) gets at most min(n + extra_decode_len, "
            "max_len) output tokens, EOS included"
        ),
        "source_eos": "appended by CTranslate2 (config.json add_source_eos); pass pieces only",
        "decoder_start": vocab[BOS_ID],
        "never_generate": never,
        "vocab_limit": num_pieces if num_pieces < config.vocab_size else None,
        "model": config.to_dict(),
    }


def export_ct2(
    model: Transformer,
    pieces: list[str],
    tokenizer_files: dict[str, bytes],
    directory: str,
    *,
    quantization: str = "float32",
    search: SearchSettings = DEFAULTS,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write `model` as a CTranslate2 model into `directory`; returns decoding.json's dict.

    Args:
      model: the Transformer (any supported config; see `unsupported`).
      pieces: the tokenizer's pieces in id order; tokenizer_files: its files
        ({name: contents}, `tokenizer.files()`).
      directory: created, or replaced if it holds an earlier export (never another
        non-empty directory); the new one appears only once complete.
      quantization: one of QUANTIZATIONS (CTranslate2's weight types).
      search: its beam_size and alpha are the defaults decode.py --ct2 uses.
      source: where the weights came from (workdir, step, averaged steps), recorded.
    Raises:
      ImportError without ctranslate2; ValueError for what cannot be converted.
    """
    ct2 = import_ctranslate2()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    _check_target(directory)
    vocab = vocabulary(list(pieces), model.config.vocab_size)
    spec = transformer_spec(model, vocab)
    spec.validate()
    spec.optimize(quantization=quantization)
    settings = decoding_settings(
        model.config, vocab, len(pieces), alpha=search.alpha, beam_size=search.beam_size
    )
    settings.update(
        quantization=quantization, ctranslate2_version=ct2.__version__, source=source or {}
    )
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".ct2-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's is owner-only; a model directory is not secret
    try:
        spec.save(tmp)
        for name, data in tokenizer_files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        with open(os.path.join(tmp, DECODING_JSON), "w") as f:
            json.dump(settings, f, indent=2)
        _replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return settings


def _check_target(directory: str) -> None:
    """Refuse to replace a non-empty directory that is not an earlier export."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{directory} exists and is not a directory")
    earlier = os.path.isfile(os.path.join(directory, DECODING_JSON))
    if os.path.isdir(directory) and os.listdir(directory) and not earlier:
        raise ValueError(
            f"{directory} is not empty and holds no earlier CTranslate2 export; "
            "choose a new or empty directory"
        )


def _replace(tmp: str, directory: str) -> None:
    """Move the finished export into place (an earlier one is removed only then)."""
    old = None
    if os.path.isdir(directory):
        old = directory.rstrip("/") + ".old-" + os.path.basename(tmp)
        os.rename(directory, old)
    os.rename(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
