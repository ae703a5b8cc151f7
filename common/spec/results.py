"""What every model returns through the adapter, as numpy arrays: the forward pass's outputs
under their canonical names (docs/PARITY.md) and a training step's loss and gradients. The oracle
and the frameworks' backends build these; the parity report and the tests read them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformer_rosetta.spec.config import TransformerConfig

# The attention maps in output order: (canonical name pattern, ForwardOutput field, the config
# field that counts its layers). ForwardOutput.named(), the ONNX graphs' outputs and their readers
# all follow it.
ATTENTION_OUTPUTS = (
    ("encoder.layers.{}.self_attention", "encoder_self_attention", "num_encoder_layers"),
    ("decoder.layers.{}.self_attention", "decoder_self_attention", "num_decoder_layers"),
    ("decoder.layers.{}.cross_attention", "cross_attention", "num_decoder_layers"),
)


def attention_layers(c: TransformerConfig, field: str) -> int:
    """How many maps one ATTENTION_OUTPUTS group has: a decoder-only model's decoder layers have
    no cross-attention."""
    if field == "cross_attention" and not c.has_encoder:
        return 0
    layers = next(count for _, f, count in ATTENTION_OUTPUTS if f == field)
    return getattr(c, layers)


def attention_output_names(c: TransformerConfig) -> list[str]:
    """Every attention map's canonical output name for config `c`, in output order."""
    return [
        pattern.format(i)
        for pattern, field, _ in ATTENTION_OUTPUTS
        for i in range(attention_layers(c, field))
    ]


@dataclass
class ForwardOutput:
    """What a forward pass returns, as numpy arrays (float64 for the oracle, else the model dtype
    converted to float32/float64 so that numpy can compare it).

    Attentions are post-softmax, pre-dropout probabilities [B, h, query, key], one per layer;
    None when they were not requested. Hidden states are the embedding output followed by every
    layer's output (before any final norm), [B, L, d_model] each.

    The halves (docs/FORMAT.md, "The three kinds"): a decoder-only model has no encoder_output
    (None) and empty encoder and cross-attention lists; an encoder-only one has no logits (None),
    empty decoder lists, and pooled_output when its config pools.
    """

    logits: np.ndarray | None  # (B, T, V)
    encoder_output: np.ndarray | None  # (B, S, d), after the final norm if the config has one
    encoder_self_attention: list[np.ndarray] | None = None
    decoder_self_attention: list[np.ndarray] | None = None
    cross_attention: list[np.ndarray] | None = None
    encoder_hidden_states: list[np.ndarray] | None = None
    decoder_hidden_states: list[np.ndarray] | None = None
    pooled_output: np.ndarray | None = None  # (B, d): encoder-only, config.pooling

    @classmethod
    def from_model(
        cls,
        out: Mapping[str, Any],
        to_numpy: Callable[[Any], np.ndarray],
        *,
        attention: bool,
        hidden_states: bool,
    ) -> ForwardOutput:
        """What every backend returns from its model's outputs: `out` maps each field's name to a
        tensor, a list of tensors, or None (what the model's kind lacks), in the framework's own
        arrays, and `to_numpy` converts one of them. The attention maps are kept only when asked
        for (`attention`: the explicit path computed them), the hidden states only when asked for
        (`hidden_states`); whatever is kept is converted, nothing else is."""
        wanted = {
            "encoder_self_attention": attention,
            "decoder_self_attention": attention,
            "cross_attention": attention,
            "encoder_hidden_states": hidden_states,
            "decoder_hidden_states": hidden_states,
        }
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = out.get(f.name)
            if value is None or not wanted.get(f.name, True):
                values[f.name] = None
            elif f.name in wanted:
                values[f.name] = [to_numpy(a) for a in value]
            else:
                values[f.name] = to_numpy(value)
        return cls(**values)

    def named(self) -> dict[str, np.ndarray]:
        """Every array under its canonical output name (see docs/PARITY.md); what the model's
        kind lacks is left out."""
        whole = {
            "logits": self.logits,
            "encoder_output": self.encoder_output,
            "pooled_output": self.pooled_output,
        }
        out = {name: a for name, a in whole.items() if a is not None}
        groups = [
            *((pattern, getattr(self, field)) for pattern, field, _ in ATTENTION_OUTPUTS),
            ("encoder.hidden_states.{}", self.encoder_hidden_states),
            ("decoder.hidden_states.{}", self.decoder_hidden_states),
        ]
        for pattern, arrays in groups:
            for i, a in enumerate(arrays or []):
                out[pattern.format(i)] = a
        return out


@dataclass
class LossOutput:
    """What `loss_and_grads` returns: the mean label-smoothed loss over non-pad target tokens,
    token accuracy, the number of such tokens, and d loss / d weight for every canonical tensor
    (canonical names and layouts; a tied tensor's gradient is the sum over its uses)."""

    loss: float
    accuracy: float
    tokens: int
    grads: dict[str, np.ndarray]
