"""Batching set-up of the data tests (test_data_pipeline, test_data_buckets): a word
tokenizer (TOK, one id per word) and the config their batches are planned with."""

from attention_jax.configs import default


class WordTokenizer:
    """Deterministic stand-in for SentencePiece: one id per word (>= 4)."""

    vocab_size = 1000

    def encode(self, text):
        return [4 + int(w) for w in text.split()]

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    encode_target_batch = encode_batch  # one model for both sides


TOK = WordTokenizer()


def config(**kw):
    """configs/default.py for batching tests: max_length 32, long pairs dropped, 512-token
    batches, no packing; `kw` overrides."""
    c = default.get_config()
    c.update(dict(max_length=32, long_pairs="drop", batch_tokens=512, packing=False))
    c.update(kw)
    return c
