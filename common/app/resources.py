"""Memory estimates, checked before anything big is allocated, so that a request this machine
cannot hold is refused in one line saying what it would need, instead of dying in the allocator
(or being killed by the kernel) minutes into the work.

The estimates are upper bounds of the right order, not exact accounting: they count the arrays
that scale with the request (weights, ids, logits, attention maps, activations) at the width the
oracle computes in (float64), times the number of models that hold them at once.
"""

from __future__ import annotations

from transformer_rosetta.files.memory import GIB as GIB
from transformer_rosetta.files.memory import USABLE_FRACTION as USABLE_FRACTION
from transformer_rosetta.files.memory import ResourceError as ResourceError
from transformer_rosetta.files.memory import check_fits as check_fits
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import parameter_count, position_buffer_count


def weights_bytes(config: TransformerConfig, itemsize: int = 8) -> int:
    """The weights of `config` at `itemsize` bytes a number, with the position tables that every
    framework's model computes when it is built (max_len rows, whatever the request's lengths):
    a max_len no tensor bounds would otherwise be allocated unchecked."""
    return (parameter_count(config) + position_buffer_count(config)) * itemsize


def forward_bytes(config: TransformerConfig, batch: int, src_len: int, tgt_len: int) -> int:
    """One float64 forward pass with every attention map kept: the ids, the logits, each layer's
    attention probabilities and its widest activation (the FFN's d_ff)."""
    c = config
    ids = batch * (src_len + tgt_len) * 8
    logits = batch * tgt_len * c.tgt_vocab_size
    attention = (
        batch
        * c.num_heads
        * (
            c.num_encoder_layers * src_len * src_len
            + c.num_decoder_layers * (tgt_len * tgt_len + tgt_len * src_len)
        )
    )
    activations = batch * (src_len + tgt_len) * max(c.d_ff, c.d_model) * 4
    return ids + 8 * (logits + attention + activations)


def check_forward_fits(
    config: TransformerConfig, batch: int, src_len: int, tgt_len: int, models: int, what: str
) -> None:
    """Refuse a forward request (weights plus outputs, for `models` models held at once) that
    cannot fit, before the weights or inputs are made."""
    per_model = weights_bytes(config) + forward_bytes(config, batch, src_len, tgt_len)
    check_fits(models * per_model, what)


def decode_bytes(config: TransformerConfig, rows: int, src_len: int, beam: int, steps: int) -> int:
    """A cached decode of `rows` inputs with `beam` hypotheses each: the repeated encoder output,
    every decoder layer's cross-attention keys and values over the source and its self-attention
    buffers of `steps` positions, and one step's logits, in float64."""
    c = config
    hypotheses = rows * beam
    per_layer = 2 * (src_len + steps) * c.d_model  # keys and values, cross and self
    numbers = hypotheses * (
        src_len * c.d_model + c.num_decoder_layers * per_layer + c.tgt_vocab_size
    )
    return 8 * numbers
