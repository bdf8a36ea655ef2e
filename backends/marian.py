"""OPUS-MT / Marian Transformer models in our model: options, vocabulary and weights.

    model, pieces = load_marian("opus-mt-de-en/")   # a Transformer and its V tokens

A Marian model is a `.npz` of named arrays whose `special:model.yml` holds the
options it was trained with; an OPUS-MT release adds decoder.yml (which names the
.npz and the vocabularies), one joint vocabulary (`*.vocab.yml`) and
source.spm / target.spm. The directory is untrusted input: arrays are read
without unpickling, YAML with `safe_load`, and nothing in it is run.

Ids. Marian numbers `</s>` 0 and `<unk>` 1 and has no padding or BOS token (its
decoder starts from a zero vector); ours are PAD 0, EOS 1, BOS 2, UNK 3
(model/tokens.py). Marian's token i >= 2 becomes our i + 2, and the two rows
ours adds (PAD, BOS) are zeros with a logit bias of `_ABSENT`, so that their
probability is ~e^-30 and the distribution over Marian's tokens is its own.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from attention_jax import Transformer, TransformerConfig
from attention_jax.data import MarianTokenizer, read_sentencepiece_models
from attention_jax.runtime.errors import UserError
from attention_jax.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

MARIAN_EOS, MARIAN_UNK = 0, 1
_ABSENT = -30.0  # the logit bias of PAD and BOS, tokens a Marian model does not have
_ACTIVATIONS = {"relu": "relu", "swish": "swish"}


def our_ids(num_marian: int) -> np.ndarray:
    """[V_marian] -> our id of each Marian id (V = V_marian + 2)."""
    ids = np.arange(num_marian) + 2
    ids[MARIAN_EOS], ids[MARIAN_UNK] = EOS_ID, UNK_ID
    return ids


def _rows(table: np.ndarray, fill: float = 0.0) -> np.ndarray:
    """Marian's rows (axis 0) in our id order, with PAD's and BOS's rows set to `fill`."""
    out = np.full((table.shape[0] + 2, *table.shape[1:]), fill, table.dtype)
    out[our_ids(table.shape[0])] = table
    out[[PAD_ID, BOS_ID]] = fill
    return out


def _piece(text: str) -> str:
    """A vocabulary key as written: a quoted YAML scalar unquoted; a plain one as it
    stands (YAML would read `yes`, `null` or `1` as a boolean, None, a number)."""
    text = text.strip()
    if len(text) < 2 or text[0] != text[-1] or text[0] not in "\"'":
        return text
    inner = text[1:-1]
    # Most keys quote printable text without escapes, which YAML reads as it stands ('' is
    # one ' in single quotes): read so here, since YAML's parser, one key at a time, was
    # most of an OPUS-MT import. Escapes and other characters (YAML folds some line
    # separators, refuses some controls) go through YAML itself.
    if inner.isprintable():
        if text[0] == '"' and '"' not in inner and "\\" not in inner:
            return inner
        if text[0] == "'" and "'" not in inner.replace("''", ""):
            return inner.replace("''", "'")
    import yaml

    return str(yaml.safe_load(text))


def read_vocab(path: str) -> list[str]:
    """A Marian vocabulary (`piece: id` lines, or `? piece` then `: id`) -> its pieces in
    id order."""
    found: dict[int, str] = {}
    key = None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            if line.startswith("? "):  # a complex key; its id is on the next line
                key = _piece(line[2:])
                continue
            piece, _, value = (None, ":", line[1:]) if key is not None else line.rpartition(":")
            try:
                found[int(value)] = key if key is not None else _piece(piece)
            except ValueError:
                raise UserError(f"{path}:{n}: not a Marian vocabulary line ('piece: id')") from None
            key = None
    if sorted(found) != list(range(len(found))):
        raise UserError(f"{path}: the ids are not 0..{len(found) - 1}, each once")
    return [found[i] for i in range(len(found))]


def read_npz(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(the arrays by name, the options of special:model.yml) of a Marian .npz."""
    import yaml

    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {name: f[name] for name in f.files}
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable .npz of arrays ({e})") from e
    if "special:model.yml" not in arrays:
        raise UserError(f"{path}: no 'special:model.yml' (is this a Marian model?)")
    raw = arrays.pop("special:model.yml").tobytes().rstrip(b"\0")
    options = yaml.safe_load(raw.decode("utf-8"))
    if not isinstance(options, dict):
        raise UserError(f"{path}: special:model.yml is not a mapping of options")
    return arrays, options


def _refuse(options: dict[str, Any], weights: dict[str, np.ndarray]) -> list[str]:
    """The options of a model we cannot run as it was trained, each in a few words."""
    problems = []
    want = {
        "type": "transformer",
        "transformer-decoder-autoreg": "self-attention",
        "transformer-no-projection": False,
        "right-left": False,
    }
    for name, value in want.items():
        if options.get(name, value) != value:
            problems.append(f"--{name} {options[name]!r} (only {value!r} is supported)")
    activation = options.get("transformer-ffn-activation", "relu")
    if activation not in _ACTIVATIONS:
        problems.append(f"--transformer-ffn-activation {activation!r} (relu or swish only)")
    if "n" in str(options.get("transformer-postprocess-emb", "d")):
        problems.append("--transformer-postprocess-emb with 'n' (a LayerNorm on embeddings)")
    layout = (
        options.get("transformer-preprocess", ""),
        options.get("transformer-postprocess", "dan"),
        options.get("transformer-postprocess-top", ""),
    )
    if layout not in (("", "dan", ""), ("n", "da", "n")):
        problems.append(
            "--transformer-preprocess/-postprocess/-postprocess-top "
            f"{layout!r} (only post-norm '', 'dan', '' or pre-norm 'n', 'da', 'n')"
        )
    if any(k.endswith("_lemma_W") or "factor" in k for k in weights):
        problems.append("factored vocabularies")
    return problems


def transformer_config(
    options: dict[str, Any], weights: dict[str, np.ndarray], path: str
) -> TransformerConfig:
    """Our TransformerConfig of a Marian model (UserError naming what we cannot honour)."""
    problems = _refuse(options, weights)
    if problems:
        raise UserError(f"{path}: this Marian model cannot be imported: {'; '.join(problems)}")
    shared = "Wemb" in weights
    emb = weights["Wemb"] if shared else weights.get("decoder_Wemb")
    w1 = weights.get("encoder_l1_ffn_W1")
    if emb is None or w1 is None:
        raise UserError(f"{path}: no embedding or first encoder layer (Wemb, encoder_l1_ffn_W1)")
    missing = [k for k in ("transformer-heads", "enc-depth", "dec-depth") if k not in options]
    if missing:
        raise UserError(f"{path}: special:model.yml lacks {', '.join(missing)}")
    untied = any(f"decoder_ff_logit_out_{w}" in weights for w in ("W", "Wt"))
    wpos = weights.get("Wpos")
    return TransformerConfig(
        vocab_size=emb.shape[0] + 2,
        d_model=emb.shape[1],
        num_heads=int(options["transformer-heads"]),
        num_encoder_layers=int(options["enc-depth"]),
        num_decoder_layers=int(options["dec-depth"]),
        d_ff=w1.shape[1],
        dropout_rate=0.0,
        activation=_ACTIVATIONS[options.get("transformer-ffn-activation", "relu")],
        norm="pre" if options.get("transformer-preprocess", "") == "n" else "post",
        share_embeddings=shared,
        tie_output=not untied,
        max_len=wpos.shape[0] if wpos is not None else 1024,
        attention_bias=True,
        logits_bias=True,
        positions="table" if wpos is not None else "sinusoid_halves",
        zero_start=True,
    )


def _get(weights: dict[str, np.ndarray], name: str, path: str) -> np.ndarray:
    if name not in weights:
        raise UserError(f"{path}: the model has no array {name!r}")
    return weights[name].astype(np.float32)


def _norm(get, ours: Any, name: str, pre: bool) -> None:
    suffix = "_pre" if pre else ""
    ours.scale[...] = get(f"{name}_ln_scale{suffix}").reshape(-1)
    ours.bias[...] = get(f"{name}_ln_bias{suffix}").reshape(-1)


def _attention(get, mha: Any, name: str, heads: int) -> None:
    """x W (+ b) with Marian's W [D, N*H] (heads as consecutive columns) -> [D, N, H]."""
    for ours, bias, part in (
        (mha.query, mha.query_bias, "q"),
        (mha.key, mha.key_bias, "k"),
        (mha.value, mha.value_bias, "v"),
    ):
        w = get(f"{name}_W{part}")
        ours[...] = w.reshape(w.shape[0], heads, -1)
        bias[...] = get(f"{name}_b{part}").reshape(heads, -1)
    w = get(f"{name}_Wo")
    mha.out[...] = w.reshape(heads, -1, w.shape[1])
    mha.out_bias[...] = get(f"{name}_bo").reshape(-1)


def _ffn(get, ffn: Any, name: str) -> None:
    ffn.wi[...], ffn.bi[...] = get(f"{name}_W1"), get(f"{name}_b1").reshape(-1)
    ffn.wo[...], ffn.bo[...] = get(f"{name}_W2"), get(f"{name}_b2").reshape(-1)


def set_weights(model: Transformer, weights: dict[str, np.ndarray], path: str) -> None:
    """Copy a Marian model's arrays into `model` (built with `transformer_config`)."""
    cfg, pre = model.config, model.config.norm == "pre"
    get = lambda name: _get(weights, name, path)
    n = cfg.num_heads
    if cfg.share_embeddings:
        model.src_embed.embedding[...] = _rows(get("Wemb"))
    else:
        model.src_embed.embedding[...] = _rows(get("encoder_Wemb"))
        model.tgt_embed.embedding[...] = _rows(get("decoder_Wemb"))
    if model.position_table is not None:
        model.position_table[...] = get("Wpos")
    for i, layer in enumerate(model.encoder_layers, start=1):
        _attention(get, layer.self_attn, f"encoder_l{i}_self", n)
        _norm(get, layer.attn_res.norm, f"encoder_l{i}_self_Wo", pre)
        _ffn(get, layer.ffn, f"encoder_l{i}_ffn")
        _norm(get, layer.ffn_res.norm, f"encoder_l{i}_ffn_ffn", pre)
    for i, layer in enumerate(model.decoder_layers, start=1):
        _attention(get, layer.self_attn, f"decoder_l{i}_self", n)
        _norm(get, layer.self_res.norm, f"decoder_l{i}_self_Wo", pre)
        _attention(get, layer.cross_attn, f"decoder_l{i}_context", n)
        _norm(get, layer.cross_res.norm, f"decoder_l{i}_context_Wo", pre)
        _ffn(get, layer.ffn, f"decoder_l{i}_ffn")
        _norm(get, layer.ffn_res.norm, f"decoder_l{i}_ffn_ffn", pre)
    if pre:
        _norm(get, model.encoder_norm, "encoder_top", False)
        _norm(get, model.decoder_norm, "decoder_top", False)
    if model.unembed is not None:
        if "decoder_ff_logit_out_W" in weights:
            w = get("decoder_ff_logit_out_W")  # [D, V]
        else:
            w = get("decoder_ff_logit_out_Wt").T
        model.unembed.kernel[...] = _rows(w.T).T
    bias = weights.get("decoder_ff_logit_out_b")
    bias = np.zeros(cfg.vocab_size - 2, np.float32) if bias is None else bias.reshape(-1)
    model.logits_bias[...] = _rows(bias.astype(np.float32), _ABSENT)


def find_files(directory: str) -> tuple[str, list[str]]:
    """(the .npz, the vocabularies [source, target]) of an OPUS-MT directory."""
    import yaml

    if not os.path.isdir(directory):
        raise UserError(f"{directory}: not a directory (of an OPUS-MT / Marian model)")
    names = os.listdir(directory)
    if "pytorch_model.bin" in names and "model.safetensors" not in names:
        raise UserError(
            f"{directory}: pytorch_model.bin is a pickle, which is never loaded: "
            "use the model's model.safetensors"
        )
    decoder = os.path.join(directory, "decoder.yml")
    if os.path.isfile(decoder):
        with open(decoder, encoding="utf-8") as f:
            conf = yaml.safe_load(f) or {}
        models, vocabs = conf.get("models") or [], conf.get("vocabs") or []
        if not models or not vocabs:
            raise UserError(f"{decoder}: it names no models or no vocabs")
        return os.path.join(directory, models[0]), [os.path.join(directory, v) for v in vocabs]
    npz = sorted(n for n in names if n.endswith(".npz"))
    vocab = sorted(n for n in names if re.search(r"vocab\.ya?ml$", n))
    if len(npz) != 1 or not vocab:
        raise UserError(
            f"{directory}: expected decoder.yml, or one .npz and a *.vocab.yml "
            f"(found {len(npz)} .npz, {len(vocab)} vocabularies)"
        )
    return os.path.join(directory, npz[0]), [os.path.join(directory, vocab[0])]


def _is_hugging_face(directory: str) -> bool:
    names = ("model.safetensors", "config.json")
    return all(os.path.isfile(os.path.join(directory, n)) for n in names)


def _hugging_face_vocabulary(directory: str) -> tuple[dict[str, Any], list[int], list[str]]:
    """(config.json, the ids Marian has: all but <pad>, their pieces) of a MarianMT directory."""
    import json

    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        conf = json.load(f)
    with open(os.path.join(directory, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    pad = conf.get("pad_token_id")
    by_id = {int(i): str(p) for p, i in vocab.items()}
    if by_id.get(conf.get("eos_token_id")) != "</s>" or sorted(by_id) != list(range(len(by_id))):
        raise UserError(f"{directory}: vocab.json is not a Marian vocabulary ('</s>' 0, no gaps)")
    keep = [i for i in range(len(by_id)) if i != pad]  # Marian has no padding token
    if by_id.get(0) != "</s>" or by_id.get(1) != "<unk>":
        raise UserError(f"{directory}: vocab.json must number '</s>' 0 and '<unk>' 1")
    return conf, keep, [by_id[i] for i in keep]


def read_pieces(directory: str) -> list[str]:
    """The V tokens of a Marian / OPUS-MT directory (either layout) in our id order:
    '<pad>', '</s>', '<s>', '<unk>', then Marian's from id 2 on."""
    if _is_hugging_face(directory):
        marian = _hugging_face_vocabulary(directory)[2]
    else:
        _, vocabs = find_files(directory)
        if len(set(vocabs)) > 1 and read_vocab(vocabs[0]) != read_vocab(vocabs[-1]):
            raise UserError(
                f"{directory}: separate source and target vocabularies are not supported"
            )
        marian = read_vocab(vocabs[0])
    return ["<pad>", "</s>", "<s>", "<unk>", *marian[2:]]


def from_hugging_face(directory: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A Hugging Face MarianMT directory (config.json, model.safetensors, vocab.json) as
    Marian's (arrays by Marian's names, its options): the same model."""
    from safetensors.numpy import load_file

    conf, keep, _ = _hugging_face_vocabulary(directory)
    try:
        arrays = load_file(os.path.join(directory, "model.safetensors"))
    except Exception as e:  # the file's own format errors
        raise UserError(f"{directory}/model.safetensors: not readable ({e})") from e
    a = lambda name: np.asarray(arrays[name], np.float32)
    out = {"Wemb": a("model.shared.weight")[keep]}
    for side in ("encoder", "decoder"):
        for i in range(conf[f"{side}_layers"]):
            hf, ours = f"model.{side}.layers.{i}", f"{side}_l{i + 1}"
            parts = [("self_attn", "self")] + (
                [("encoder_attn", "context")] if side == "decoder" else []
            )
            for att, name in parts:
                for p in "qkv":
                    out[f"{ours}_{name}_W{p}"] = a(f"{hf}.{att}.{p}_proj.weight").T
                    out[f"{ours}_{name}_b{p}"] = a(f"{hf}.{att}.{p}_proj.bias")[None]
                out[f"{ours}_{name}_Wo"] = a(f"{hf}.{att}.out_proj.weight").T
                out[f"{ours}_{name}_bo"] = a(f"{hf}.{att}.out_proj.bias")[None]
                norm = f"{ours}_{name}_Wo_ln"
                out[f"{norm}_scale"] = a(f"{hf}.{att}_layer_norm.weight")[None]
                out[f"{norm}_bias"] = a(f"{hf}.{att}_layer_norm.bias")[None]
            for k in (1, 2):
                out[f"{ours}_ffn_W{k}"] = a(f"{hf}.fc{k}.weight").T
                out[f"{ours}_ffn_b{k}"] = a(f"{hf}.fc{k}.bias")[None]
            out[f"{ours}_ffn_ffn_ln_scale"] = a(f"{hf}.final_layer_norm.weight")[None]
            out[f"{ours}_ffn_ffn_ln_bias"] = a(f"{hf}.final_layer_norm.bias")[None]
    if "final_logits_bias" in arrays:
        out["decoder_ff_logit_out_b"] = a("final_logits_bias").reshape(1, -1)[:, keep]
    if "lm_head.weight" in arrays and not conf.get("tie_word_embeddings", True):
        out["decoder_ff_logit_out_Wt"] = a("lm_head.weight")[keep]
    options = {
        "type": "transformer",
        "enc-depth": conf["encoder_layers"],
        "dec-depth": conf["decoder_layers"],
        "transformer-heads": conf["encoder_attention_heads"],
        "transformer-ffn-activation": conf.get("activation_function", "swish"),
    }
    if conf.get("normalize_before") or not conf.get("scale_embedding", True):
        raise UserError(f"{directory}: normalize_before / no scale_embedding: not OPUS-MT's")
    return out, options


def load_marian(directory: str) -> tuple[Transformer, list[str]]:
    """A Marian / OPUS-MT directory (OPUS-MT's layout, or Hugging Face's MarianMT one) ->
    (our Transformer holding its weights, its V tokens in our id order: `read_pieces`)."""
    from flax import nnx

    pieces = read_pieces(directory)
    if _is_hugging_face(directory):
        path = os.path.join(directory, "model.safetensors")
        weights, options = from_hugging_face(directory)
    else:
        path = find_files(directory)[0]
        weights, options = read_npz(path)
    config = transformer_config(options, weights, path)
    if config.vocab_size != len(pieces):
        raise UserError(
            f"{directory}: the vocabulary has {len(pieces) - 2} tokens, the embedding "
            f"{config.vocab_size - 2} rows"
        )
    model = Transformer(config, rngs=nnx.Rngs(0))
    set_weights(model, weights, path)
    return model, pieces


def opus_tokenizer(directory: str) -> MarianTokenizer:
    """The tokenizer of an OPUS-MT directory: source.spm, target.spm and its vocabulary
    (data/tokenizer.py `load_tokenizer` reads the one a workdir or an export holds)."""
    pieces = read_pieces(directory)
    return MarianTokenizer(*read_sentencepiece_models(directory), pieces, directory)


def load_directory(directory: str, sharding: Any = None) -> tuple[Transformer, MarianTokenizer]:
    """decode.py --marian: the model (its parameters placed by `sharding`, if given) and
    the tokenizer of an OPUS-MT directory."""
    import jax
    from flax import nnx

    model, pieces = load_marian(directory)
    tokenizer = MarianTokenizer(*read_sentencepiece_models(directory), pieces, directory)
    if sharding is not None:
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, jax.device_put(state, sharding))
    return model, tokenizer
