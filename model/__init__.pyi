# The names `attention_jax` offers, for type checkers: __init__.py loads each on first use.
from attention_jax.config import TransformerConfig as TransformerConfig
from attention_jax.decode_cache import DecodeCache as DecodeCache
from attention_jax.ensemble import Ensemble as Ensemble
from attention_jax.inference.text import ScoreResult as ScoreResult
from attention_jax.inference.text import TranslationResult as TranslationResult
from attention_jax.inference.text import Translator as Translator
from attention_jax.layers import DecoderLayer as DecoderLayer
from attention_jax.layers import Embed as Embed
from attention_jax.layers import EncoderLayer as EncoderLayer
from attention_jax.layers import FeedForward as FeedForward
from attention_jax.layers import KVCache as KVCache
from attention_jax.layers import LayerNorm as LayerNorm
from attention_jax.layers import MultiHeadAttention as MultiHeadAttention
from attention_jax.search.beam import beam_search as beam_search
from attention_jax.search.sampling import greedy_search as greedy_search
from attention_jax.search.sampling import sample as sample
from attention_jax.search.settings import SearchSettings as SearchSettings
from attention_jax.tokens import BOS_ID as BOS_ID
from attention_jax.tokens import EOS_ID as EOS_ID
from attention_jax.tokens import PAD_ID as PAD_ID
from attention_jax.tokens import UNK_ID as UNK_ID
from attention_jax.training.loss import label_smoothed_loss as label_smoothed_loss
from attention_jax.transformer import Transformer as Transformer
from attention_jax.transformer import shift_right as shift_right

__all__: list[str]
