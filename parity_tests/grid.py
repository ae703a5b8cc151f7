"""The config variants and inputs that every implementation is checked on against the oracle."""

from __future__ import annotations

import itertools

import numpy as np

from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import ragged_batch

# Small, but with d_k (=6) not a power of two, src vocab != tgt vocab where untied, and
# encoder depth != decoder depth, so that a transposed or swapped axis cannot pass by symmetry.
TINY = dict(
    src_vocab_size=23,
    tgt_vocab_size=29,
    d_model=12,
    num_heads=2,
    d_ff=20,
    num_encoder_layers=2,
    num_decoder_layers=1,
    max_len=16,
    dropout=0.0,
    layer_norm_eps=1e-5,
)

# (share_embeddings, tie_output): separate untied; separate with the output tied to the target
# embedding; one shared embedding that is also the output (the paper).
EMBEDDINGS = {"untied": (False, False), "tied": (False, True), "shared": (True, True)}
POSITIONS = {
    "sin-interleaved": ("sinusoidal", "interleaved"),
    "sin-concatenated": ("sinusoidal", "concatenated"),
    "learned": ("learned", "interleaved"),
}
# post/pre x activations x position kinds x sharing/tying x attention bias: 108 configs.
FACTORS = (
    ("post", "pre"),
    ("relu", "gelu", "gelu_tanh"),
    tuple(POSITIONS),
    tuple(EMBEDDINGS),
    (True, False),
)
# Special ids that are neither 0 nor the defaults (pad 0, BOS 1, EOS 2), for the GELU third of
# the grid: a literal 0 (or 1, 2) written where the config's id belongs shows there, and 0 is an
# ordinary token that must not be masked.
OTHER_IDS = {"pad_id": 3, "bos_id": 4, "eos_id": 5}


# d_k = 5 while d_model / h = 6: the projections are not square (h d_k = 10 != d_model = 12), so
# a d_model written where h * d_k belongs shows. Rides along on a third of the grid.
OTHER_KEY_DIM = 5


def _levels(norm: str, act: str, pos: str, emb: str, bias: bool) -> list[int]:
    """Each factor's level as its index in FACTORS."""
    return [FACTORS[i].index(v) for i, v in enumerate((norm, act, pos, emb, bias))]


def variant(norm: str, act: str, pos: str, emb: str, bias: bool) -> TransformerConfig:
    share, tie = EMBEDDINGS[emb]
    kind, layout = POSITIONS[pos]
    levels = _levels(norm, act, pos, emb, bias)
    vocab = {"tgt_vocab_size": TINY["src_vocab_size"]} if share else {}
    return TransformerConfig(
        **{
            **TINY,
            **vocab,
            "norm_position": norm,
            "activation": act,
            "position_kind": kind,
            "sinusoid_layout": layout,
            "share_embeddings": share,
            "tie_output": tie,
            "attention_bias": bias,
            # The switches that ride along, chosen so that each is on for half of the grid.
            "final_norm": norm == "pre" or emb == "tied",
            "output_bias": not bias,
            "scale_embeddings": act != "gelu",
            # And the special ids, for a third of it (every level of the other factors).
            **(OTHER_IDS if act == "gelu" else {}),
            # The Annotated Transformer's norm where the levels' indices sum to an odd number:
            # half of the grid, with every level of every factor on both sides.
            "norm_kind": "std_plus_eps" if sum(levels) % 2 else "layer_norm",
            # A key_dim that is not d_model / h where position and embedding levels agree (a
            # third of the grid, every level of every factor).
            "key_dim": OTHER_KEY_DIM if levels[2] == levels[3] else None,
        }
    )


def _id(norm: str, act: str, pos: str, emb: str, bias: bool) -> str:
    return f"{norm}-{act}-{pos}-{emb}-{'bias' if bias else 'nobias'}"


FULL_GRID: dict[str, TransformerConfig] = {
    _id(*key): variant(*key) for key in itertools.product(*FACTORS)
}

# A covering subset in which every pair of factor levels appears at least once, for the slower
# paths (compiled modes): 9 configs instead of 108.
PAIRWISE_KEYS = [
    ("post", "relu", "sin-interleaved", "untied", True),
    ("pre", "gelu", "sin-interleaved", "tied", False),
    ("post", "gelu_tanh", "sin-interleaved", "shared", False),
    ("pre", "relu", "sin-concatenated", "shared", False),
    ("post", "gelu", "sin-concatenated", "untied", True),
    ("pre", "gelu_tanh", "sin-concatenated", "tied", True),
    ("post", "relu", "learned", "tied", False),
    ("pre", "gelu", "learned", "shared", True),
    ("pre", "gelu_tanh", "learned", "untied", False),
]
PAIRWISE_GRID: dict[str, TransformerConfig] = {_id(*key): variant(*key) for key in PAIRWISE_KEYS}

# The two halves of the family (docs/FORMAT.md, "The three kinds"), each over the pairwise keys,
# so every pair of factor levels appears in each kind. BERT's embedding additions and the
# pooling ride along, each level on a part of each kind's nine configs (an encoder-only model
# pools "none", "mean" or "first" in turn, with the L2 norm on every other).
KINDS = ("decoder_only", "encoder_only")
POOLINGS = ("none", "mean", "first")


def half_variant(
    kind: str, norm: str, act: str, pos: str, emb: str, bias: bool
) -> TransformerConfig:
    """The pairwise variant made a half: decoder-only keeps its output tying (a "shared" level is
    tied, the one sharing a half can do), encoder-only has no output at all."""
    c = variant(norm, act, pos, emb, bias)
    n = PAIRWISE_KEYS.index((norm, act, pos, emb, bias))
    common = {
        "share_embeddings": False,
        "type_vocab_size": 3 if n % 2 else 0,
        "embedding_norm": n % 3 != 1,
    }
    if kind == "decoder_only":
        return c.replace(num_encoder_layers=0, num_decoder_layers=2, **common)
    return c.replace(
        num_decoder_layers=0,
        tie_output=False,
        output_bias=False,
        pooling=POOLINGS[n % 3],
        pooled_l2_norm=n % 3 != 0 and n % 2 == 0,
        **common,
    )


FAMILY_GRID: dict[str, TransformerConfig] = {
    f"{kind}-{_id(*key)}": half_variant(kind, *key) for kind in KINDS for key in PAIRWISE_KEYS
}


def input_cases(c: TransformerConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Ragged padding with src length != tgt length, a pad mid-sequence and a fully padded
    source row; and length 1."""
    src, tgt_in = ragged_batch(c, batch=4, src_len=7, tgt_len=5, seed=1)
    # Row 0 is full length. A pad between real tokens is a masked key that right padding never
    # shows (a mask built from lengths would miss it); and where 0 is not a special id it is an
    # ordinary token next to it, which a mask built with a literal 0 would hide. (A half of the
    # family has None for the input it does not take.)
    for ids in (a for a in (src, tgt_in) if a is not None):
        ids[0, 3] = c.pad_id
        if 0 not in (c.pad_id, c.bos_id, c.eos_id):
            ids[0, 2] = 0
    return {
        "ragged": (src, tgt_in),
        "length1": ragged_batch(c, batch=2, src_len=1, tgt_len=1, seed=2),
    }


# Today's decoders (docs/FORMAT.md, steps 3, 4a, 4 and 5): rotary positions, RMSNorm, the gated
# feed-forward, grouped-query attention and bias-free projections, over an orthogonal array L9(3^4)
# of four three-level factors, so that every pair of levels of any two factors appears once:
# the feed-forward, the key/value heads (of 4 query heads), the biases, and the (rotary layout,
# norm) pair. d_k = 6 is not a power of two, and rope_theta and the output tying ride along.
TODAY_FACTORS = (
    ("swiglu", "geglu", "silu"),
    (1, 2, 4),
    ("none", "qkv", "all"),
    (("half_split", "rms_norm"), ("interleaved", "rms_norm"), ("half_split", "layer_norm")),
)
L9 = ((0, 0, 0, 0), (0, 1, 1, 1), (0, 2, 2, 2), (1, 0, 1, 2), (1, 1, 2, 0), (1, 2, 0, 1))
L9 += ((2, 0, 2, 1), (2, 1, 0, 2), (2, 2, 1, 0))
FEED_FORWARDS = {
    "swiglu": dict(gated_feed_forward=True, activation="silu"),
    "geglu": dict(gated_feed_forward=True, activation="gelu_tanh"),
    "silu": dict(gated_feed_forward=False, activation="silu"),
}
BIASES = {  # (q/k/v, output, feed-forward): Llama, Qwen2, the paper
    "none": dict(attention_bias=False, attention_output_bias=None, feed_forward_bias=False),
    "qkv": dict(attention_bias=True, attention_output_bias=False, feed_forward_bias=False),
    "all": dict(attention_bias=True, attention_output_bias=None, feed_forward_bias=True),
}


def today_variant(ff: str, kv_heads: int, bias: str, layout_norm: tuple[str, str], n: int):
    """A decoder-only model of today's kind; `n` (its row of L9) picks the ride-alongs."""
    layout, norm = layout_norm
    return TransformerConfig(
        **{
            **TINY,
            "tgt_vocab_size": 29,
            "d_model": 24,
            "num_heads": 4,
            "d_ff": 20,
            "num_encoder_layers": 0,
            "num_decoder_layers": 2,
            "norm_position": "pre",
            "final_norm": True,
            "position_kind": "rotary",
            "rotary_layout": layout,
            "norm_kind": norm,
            "num_kv_heads": kv_heads,
            "rope_theta": 500000.0 if n % 2 else 10000.0,
            "scale_embeddings": False,
            "share_embeddings": False,
            "tie_output": n % 3 == 1,
            "output_bias": False,
            **FEED_FORWARDS[ff],
            **BIASES[bias],
        }
    )


def _today_id(ff: str, kv_heads: int, bias: str, layout_norm: tuple[str, str]) -> str:
    return f"{ff}-kv{kv_heads}-{bias}bias-{layout_norm[0]}-{layout_norm[1]}"


TODAY_GRID: dict[str, TransformerConfig] = {}
for _n, _row in enumerate(L9):
    _key = [TODAY_FACTORS[i][level] for i, level in enumerate(_row)]
    TODAY_GRID[_today_id(*_key)] = today_variant(*_key, _n)
# The same parts in the other two kinds: an encoder-decoder whose cross-attention is grouped too
# (rotary only in the self-attentions), and an encoder-only model with rotary positions.
_ENC_DEC_BASE, _ENC_BASE = list(TODAY_GRID)[4], list(TODAY_GRID)[3]
TODAY_GRID[f"encoder_decoder-{_ENC_DEC_BASE}"] = TODAY_GRID[_ENC_DEC_BASE].replace(
    num_encoder_layers=2, num_decoder_layers=1, src_vocab_size=23
)
TODAY_GRID[f"encoder_only-{_ENC_BASE}"] = TODAY_GRID[_ENC_BASE].replace(
    num_encoder_layers=2, num_decoder_layers=0, src_vocab_size=23, tie_output=False
)
