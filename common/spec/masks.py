"""Attention masks as small pure numpy functions. Boolean, True = may attend.

That is the convention of Keras, Flax, ONNX and torch's scaled_dot_product_attention.
(nn.MultiheadAttention / nn.Transformer take the inverse; invert only at that boundary.)
Every mask is shaped to broadcast against scores [batch, heads, query, key].
"""

from __future__ import annotations

import numpy as np


def key_padding_mask(ids: np.ndarray, pad_id: int) -> np.ndarray:
    """[B, 1, 1, K]: a key may be attended iff it is not padding."""
    return (ids != pad_id)[:, None, None, :]


def decoder_key_padding_mask(ids: np.ndarray, pad_id: int) -> np.ndarray:
    """[B, 1, 1, T] for decoder inputs: as key_padding_mask, but position 0 is always allowed.

    Position 0 holds the start token by construction (shift_right), and some models (Marian) use
    the pad id as that start token; it must stay visible.
    """
    mask = ids != pad_id
    mask[:, 0] = True
    return mask[:, None, None, :]


def causal_mask(length: int) -> np.ndarray:
    """[1, 1, T, T]: query i may attend key j iff j <= i (section 3.2.3, "prevent leftward
    information flow")."""
    return np.tril(np.ones((length, length), dtype=bool))[None, None]


def decoder_self_mask(tgt_in: np.ndarray, pad_id: int) -> np.ndarray:
    """[B, 1, T, T]: decoder self-attention is causal and skips padding."""
    return decoder_key_padding_mask(tgt_in, pad_id) & causal_mask(tgt_in.shape[1])


def shift_right(tgt: np.ndarray, bos_id: int) -> np.ndarray:
    """Decoder input: the target shifted one step right behind BOS (teacher forcing)."""
    tgt = np.asarray(tgt)
    start = np.full((tgt.shape[0], 1), bos_id, dtype=tgt.dtype)
    return np.concatenate([start, tgt[:, :-1]], axis=1)
