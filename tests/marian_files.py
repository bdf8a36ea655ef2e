"""Small Marian / OPUS-MT model directories, written as an OPUS-MT release lays them out
(decoder.yml, a .npz with Marian's parameter names and special:model.yml, a joint
vocabulary), for the OPUS-MT tests (test_marian, test_finetune, test_library) and
bench/marian_import.py."""

import json
import os

import numpy as np
import yaml

# Pieces that YAML would read as something else when unquoted, and a few that need quotes.
PIECES = ["</s>", "<unk>", "yes", "null", "123", "~", 'say "hi"', "a: b", "é"]
PIECES += [f"▁w{i}" for i in range(40 - len(PIECES))]


def vocab_yml(pieces) -> str:
    plain = {"yes", "null", "123", "~"} & set(pieces)  # as Marian may write them: unquoted
    return "".join(
        f"{p if p in plain else json.dumps(p, ensure_ascii=False)}: {i}\n"
        for i, p in enumerate(pieces)
    )


def write_marian(
    directory, seed=0, *, d=16, heads=2, ff=32, layers=(2, 2), activation="swish",
    pre_norm=False, tied=True, wpos=False, logit_bias=True, max_len=64, eos=0.0, pieces=PIECES,
) -> str:  # fmt: skip
    """A random Marian model in `directory` (an OPUS-MT release's layout); returns it."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: rng.normal(0, 0.3, shape).astype(np.float32)
    v = len(pieces)
    arrays = {"Wemb": w(v, d)} if tied else {"encoder_Wemb": w(v, d), "decoder_Wemb": w(v, d)}
    if wpos:
        arrays["Wpos"] = w(max_len, d)
    suffix = "_pre" if pre_norm else ""

    def attention(name):
        for p in "qkvo":
            arrays[f"{name}_W{p}"], arrays[f"{name}_b{p}"] = w(d, d), w(1, d)
        arrays[f"{name}_Wo_ln_scale{suffix}"] = 1 + w(1, d)
        arrays[f"{name}_Wo_ln_bias{suffix}"] = w(1, d)

    def ffn(name):
        arrays[f"{name}_W1"], arrays[f"{name}_b1"] = w(d, ff), w(1, ff)
        arrays[f"{name}_W2"], arrays[f"{name}_b2"] = w(ff, d), w(1, d)
        arrays[f"{name}_ffn_ln_scale{suffix}"] = 1 + w(1, d)
        arrays[f"{name}_ffn_ln_bias{suffix}"] = w(1, d)

    for i in range(1, layers[0] + 1):
        attention(f"encoder_l{i}_self")
        ffn(f"encoder_l{i}_ffn")
    for i in range(1, layers[1] + 1):
        attention(f"decoder_l{i}_self")
        attention(f"decoder_l{i}_context")
        ffn(f"decoder_l{i}_ffn")
    if pre_norm:
        for side in ("encoder", "decoder"):
            arrays[f"{side}_top_ln_scale"], arrays[f"{side}_top_ln_bias"] = 1 + w(1, d), w(1, d)
    if not tied:
        arrays["decoder_ff_logit_out_W"] = w(d, v)
    if logit_bias:
        arrays["decoder_ff_logit_out_b"] = w(1, v)
        arrays["decoder_ff_logit_out_b"][0, 0] += eos  # </s>: some translations end early
    options = {
        "type": "transformer", "enc-depth": layers[0], "dec-depth": layers[1],
        "transformer-heads": heads, "dim-emb": d, "transformer-dim-ffn": ff,
        "transformer-ffn-activation": activation, "transformer-decoder-autoreg": "self-attention",
        "transformer-no-projection": False, "transformer-postprocess-emb": "d",
        "transformer-preprocess": "n" if pre_norm else "",
        "transformer-postprocess": "da" if pre_norm else "dan",
        "transformer-postprocess-top": "n" if pre_norm else "",
        "transformer-guided-alignment-layer": "last", "tied-embeddings-all": tied,
    }  # fmt: skip
    text = yaml.safe_dump(options).encode() + b"\0"
    arrays["special:model.yml"] = np.frombuffer(text, np.int8)
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, "opus.npz"), **arrays)
    with open(os.path.join(directory, "opus.vocab.yml"), "w", encoding="utf-8") as f:
        f.write(vocab_yml(pieces))
    with open(os.path.join(directory, "decoder.yml"), "w") as f:
        yaml.safe_dump({"models": ["opus.npz"], "vocabs": ["opus.vocab.yml"] * 2}, f)
    return str(directory)


def write_hugging_face(marian_dir, directory) -> str:
    """The Marian model in `marian_dir` in Hugging Face's MarianMT layout (config.json,
    model.safetensors with PyTorch's [out, in] Linear weights, vocab.json with <pad>
    appended), as transformers' conversion script writes it; returns `directory`."""
    from safetensors.numpy import save_file

    with np.load(os.path.join(marian_dir, "opus.npz")) as f:
        m = {k: f[k] for k in f.files}
    options = yaml.safe_load(m.pop("special:model.yml").tobytes().rstrip(b"\0"))
    with open(os.path.join(marian_dir, "opus.vocab.yml"), encoding="utf-8") as f:
        n = sum(1 for line in f if line.strip())
    d = m["Wemb"].shape[1]
    pad_row = np.zeros((1, d), np.float32)
    out = {"model.shared.weight": np.concatenate([m["Wemb"], pad_row])}
    bias = m.get("decoder_ff_logit_out_b", np.zeros((1, n), np.float32))
    out["final_logits_bias"] = np.concatenate([bias, np.zeros((1, 1), np.float32)], axis=1)
    for side, depth in (("encoder", options["enc-depth"]), ("decoder", options["dec-depth"])):
        for i in range(depth):
            hf, mm = f"model.{side}.layers.{i}", f"{side}_l{i + 1}"
            parts = [("self_attn", "self")]
            parts += [("encoder_attn", "context")] if side == "decoder" else []
            for att, name in parts:
                for p in "qkvo":
                    proj = "out_proj" if p == "o" else f"{p}_proj"
                    out[f"{hf}.{att}.{proj}.weight"] = np.ascontiguousarray(
                        m[f"{mm}_{name}_W{p}"].T
                    )
                    out[f"{hf}.{att}.{proj}.bias"] = m[f"{mm}_{name}_b{p}"].reshape(-1)
                out[f"{hf}.{att}_layer_norm.weight"] = m[f"{mm}_{name}_Wo_ln_scale"].reshape(-1)
                out[f"{hf}.{att}_layer_norm.bias"] = m[f"{mm}_{name}_Wo_ln_bias"].reshape(-1)
            for k in (1, 2):
                out[f"{hf}.fc{k}.weight"] = np.ascontiguousarray(m[f"{mm}_ffn_W{k}"].T)
                out[f"{hf}.fc{k}.bias"] = m[f"{mm}_ffn_b{k}"].reshape(-1)
            out[f"{hf}.final_layer_norm.weight"] = m[f"{mm}_ffn_ffn_ln_scale"].reshape(-1)
            out[f"{hf}.final_layer_norm.bias"] = m[f"{mm}_ffn_ffn_ln_bias"].reshape(-1)
    os.makedirs(directory, exist_ok=True)
    save_file(out, os.path.join(directory, "model.safetensors"))
    config = {
        "model_type": "marian", "d_model": d, "vocab_size": n + 1, "pad_token_id": n,
        "eos_token_id": 0, "decoder_start_token_id": n,
        "encoder_layers": options["enc-depth"], "decoder_layers": options["dec-depth"],
        "encoder_attention_heads": options["transformer-heads"],
        "decoder_attention_heads": options["transformer-heads"],
        "activation_function": options["transformer-ffn-activation"],
        "normalize_before": False, "scale_embedding": True,
    }  # fmt: skip
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(marian_dir, "opus.vocab.yml"), encoding="utf-8") as f:
        text = f.read()
    vocab = {}
    for line in text.splitlines():
        piece, _, i = line.rpartition(":")
        vocab[yaml.safe_load(piece) if piece[:1] in "\"'" else piece] = int(i)
    vocab["<pad>"] = n
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    return str(directory)


def opus_mt_directory(tmp_path, eos: float = 2.0):
    """An OPUS-MT directory with real source.spm / target.spm and a joint vocabulary of
    their pieces; returns (directory, German lines, the two SentencePiece processors)."""
    import sentencepiece as spm

    from attention_jax.data.tokenizer import train_tokenizer
    from tests.digits import digit_pairs

    pairs = digit_pairs(np.random.default_rng(3), 300)
    protos = [train_tokenizer([p[k] for p in pairs], 300) for k in (0, 1)]
    procs = [spm.SentencePieceProcessor(model_proto=p) for p in protos]
    pieces = ["</s>", "<unk>"]
    for sp in procs:
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if not (sp.is_control(i) or sp.is_unknown(i)) and piece not in pieces:
                pieces.append(piece)
    directory = write_marian(tmp_path / "opus", 4, pieces=pieces, eos=eos)
    for name, proto in zip(("source.spm", "target.spm"), protos, strict=True):
        (tmp_path / "opus" / name).write_bytes(proto)
    return directory, [de for de, _ in pairs[:100]], procs
