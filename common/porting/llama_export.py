"""`rosetta convert --to llama`: a Hugging Face folder (`model.safetensors`, `config.json`,
`generation_config.json`) that `transformers.AutoModelForCausalLM.from_pretrained` loads, the
inverse of the import in common/porting/llama.py, through the same table (its steps inverted by
common/porting/table.py:from_canonical), with no framework imported here.

The architecture written follows the biases (each family's code fixes which it has):
- LlamaForCausalLM (model_type "llama") for every model whose q/k/v and output projections
  have a bias together or not at all (`attention_bias`), and whose three MLP projections do or
  do not (`mlp_bias`): a Mistral without its sliding window is this model too;
- Qwen2ForCausalLM (model_type "qwen2") for q/k/v biases without an output bias and without MLP
  biases, Qwen2's pattern, which LlamaConfig cannot state.
Any other pattern (an output bias alone, q/k/v biases without an output bias but with MLP biases)
is refused rather than padded with zeros, so that a round trip gives back the config it started
from.

Rotary positions in the interleaved layout (Meta's) are written permuted into transformers'
half-split layout: each head's query and key columns (and biases) reordered so that the pair
(2i, 2i+1) becomes (i, i + d_k/2), the `rotary_permute` step of the import. The function is the
same; reading the folder back gives rotary_layout "half_split" with the permuted tensors.

What transformers' Llama cannot compute is refused by field before anything is written:
an encoder, a norm other than a pre-norm RMSNorm with a final norm, positions other than rotary,
an ungated feed-forward, scaled embeddings, an output bias, an embedding norm or segment table,
a residual dropout (Llama has none: set dropout 0), and the bias patterns above.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError
from transformer_rosetta.porting.hf_folder import CONFIG_FILE, SAFETENSORS_FILE, write_hf_folder
from transformer_rosetta.porting.llama import ARCHITECTURES, TABLE
from transformer_rosetta.porting.table import from_canonical
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import dtype_name

GENERATION_FILE = "generation_config.json"
EXPORT_FILES = (SAFETENSORS_FILE, CONFIG_FILE, GENERATION_FILE)
# Ours -> the ACT2FN name that computes it (gelu_pytorch_tanh: the tanh GELU, as Gemma writes it).
EXPORT_ACTIVATIONS = {
    "silu": "silu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
}


def model_type_for(c: TransformerConfig) -> str | None:
    """ "llama" or "qwen2", the family whose code has exactly `c`'s biases; None for neither."""
    qkv, out, mlp = c.attention_bias, c.output_projection_bias, c.feed_forward_bias
    if qkv == out:
        return "llama"
    if qkv and not out and not mlp:
        return "qwen2"
    return None


def export_problems(c: TransformerConfig) -> list[str]:
    """'field: why' for everything of `c` that transformers' Llama (or Qwen2) cannot hold."""
    problems = []
    if c.has_encoder:
        problems.append("num_encoder_layers: a Llama is decoder-only; an encoder cannot be written")
    if not c.has_decoder:
        problems.append("num_decoder_layers: a Llama is a decoder; an encoder-only model has none")
    if c.norm_kind != "rms_norm":
        problems.append(f"norm_kind: a Llama's norms are RMSNorm, not {c.norm_kind!r}")
    if c.norm_position != "pre":
        problems.append("norm_position: a Llama block is pre-norm (x + attn(norm(x)))")
    if not c.final_norm:
        problems.append("final_norm: a Llama ends its stack with a norm (model.norm)")
    if c.position_kind != "rotary":
        problems.append(f"position_kind: a Llama has rotary positions, not {c.position_kind}")
    if not c.gated_feed_forward:
        problems.append("gated_feed_forward: a Llama's MLP is gated, down(act(gate(x)) * up(x))")
    if c.scale_embeddings:
        problems.append("scale_embeddings: a Llama does not scale its token embeddings")
    if c.output_bias:
        problems.append("output_bias: a Llama's lm_head has no bias")
    if c.embedding_norm:
        problems.append("embedding_norm: a Llama has no norm on its embeddings")
    if c.type_vocab_size:
        problems.append("type_vocab_size: a Llama has no segment embeddings")
    if c.dropout:
        problems.append(
            f"dropout: {c.dropout} (on the residuals and embeddings) has no field in LlamaConfig, "
            "whose only dropout is attention_dropout; set it to 0 to export (it changes training "
            "only)"
        )
    if model_type_for(c) is None:
        problems.append(
            f"attention_output_bias: q/k/v biases {c.attention_bias}, output bias "
            f"{c.output_projection_bias} and MLP biases {c.feed_forward_bias}: LlamaConfig has "
            "one switch for q/k/v/o (attention_bias) and one for the MLP (mlp_bias), and Qwen2 "
            "has q/k/v biases only"
        )
    return problems


def hf_config_for(c: TransformerConfig, dtype: str) -> dict[str, Any]:
    """config.json for `c` in transformers 5's layout (what its save_pretrained writes), with
    rope_theta also at the top level, where transformers 4 reads it (5 reads rope_parameters
    first). export_problems must be empty."""
    model_type = model_type_for(c)
    assert model_type is not None
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": c.tgt_vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.num_decoder_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": EXPORT_ACTIVATIONS[c.activation],
        "max_position_embeddings": c.max_len,
        "rms_norm_eps": c.layer_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rope_theta": c.rope_theta,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": c.tie_output,
        "bos_token_id": c.bos_id,
        "eos_token_id": c.eos_id,
        "pad_token_id": pad_token_id(c),
        "dtype": dtype,
        "use_cache": True,
    }
    if model_type == "llama":
        out |= {"attention_bias": c.attention_bias, "mlp_bias": c.feed_forward_bias}
    else:  # Qwen2: every layer full attention
        out |= {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": c.num_decoder_layers,
            "layer_types": ["full_attention"] * c.num_decoder_layers,
        }
    return out


def pad_token_id(c: TransformerConfig) -> int | None:
    """config.json's pad_token_id: our pad_id, or null for a model without a pad token (the
    virtual pad, TransformerConfig.virtual_pad: an id past the vocabulary, which no tokenizer
    gives and transformers' generate would feed). Read back, a folder's pad_token_id is never
    masked (common/porting/llama.py): a real pad_id comes back only when --config names it."""
    return None if c.virtual_pad else c.pad_id


def generation_config_for(c: TransformerConfig) -> dict[str, Any]:
    """generation_config.json, as save_pretrained writes it: the special ids."""
    return {"bos_token_id": c.bos_id, "eos_token_id": c.eos_id, "pad_token_id": pad_token_id(c)}


def half_split(tensors: Mapping[str, np.ndarray], c: TransformerConfig) -> dict[str, np.ndarray]:
    """The canonical tensors of an interleaved-rotary model rewritten for the half-split layout:
    every self-attention's query and key kernels [d, heads, d_k] and biases [heads, d_k] with
    each head's dimensions 0, 2, 4, ... first and 1, 3, 5, ... after them. A pair (2i, 2i+1) then
    sits at (i, i + d_k/2), where rotate_half pairs it: the same rotation, the same scores
    (the table's rotary_permute step, seen from the canonical side)."""
    out = dict(tensors)
    for name, value in tensors.items():
        if ".self_attention.query." in name or ".self_attention.key." in name:
            a = np.asarray(value)
            out[name] = np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)
    return out


def canonical_to_llama(
    tensors: Mapping[str, np.ndarray], c: TransformerConfig
) -> dict[str, np.ndarray]:
    """LlamaForCausalLM's (or Qwen2ForCausalLM's) state dict, as save_pretrained names it, from
    canonical tensors; ConfigError naming each field it cannot hold."""
    problems = export_problems(c)
    if problems:
        raise ConfigError(problems)
    if c.rotary_layout == "interleaved":
        tensors, c = half_split(tensors, c), c.replace(rotary_layout="half_split")
    return from_canonical(TABLE, tensors, c)


def write_llama_dir(
    folder: str | Path, c: TransformerConfig, tensors: Mapping[str, np.ndarray]
) -> None:
    """Write a Llama folder: model.safetensors, config.json, generation_config.json.

    Everything is computed before the first byte is written (a config Llama cannot hold is a
    ConfigError naming each field); each file is written atomically, the weights first, and if a
    later file fails the files this call wrote are removed again (and the folder, if it made it)."""
    state = canonical_to_llama(tensors, c)
    dtype = dtype_name(next(iter(state.values())).dtype)
    texts = {
        CONFIG_FILE: json.dumps(hf_config_for(c, dtype), indent=2) + "\n",
        GENERATION_FILE: json.dumps(generation_config_for(c), indent=2) + "\n",
    }
    write_hf_folder(folder, state, texts)
