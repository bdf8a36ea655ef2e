"""Special token ids: the model's padding, EOS and BOS, and the tokenizer's (data/tokenizer.py).

The one place they are defined. This module imports nothing, and `model/__init__`
loads its other names lazily, so data/ (whose cache worker processes run without
JAX) can import the ids without starting JAX.
"""

PAD_ID = 0  # padding everywhere: masked out of attention and the loss
EOS_ID = 1  # ends every source and target
BOS_ID = 2  # starts the decoder input (the target shifted right)
UNK_ID = 3  # a piece the tokenizer does not know (SentencePiece's <unk>)


def visible(ids) -> list[int]:
    """The ids a tokenizer turns into text: those before the first EOS, without pad and BOS."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i not in (PAD_ID, BOS_ID):
            out.append(i)
    return out
