"""`rosetta convert --to marian`: a Hugging Face MarianMTModel folder from our weights, the inverse
of the import in common/porting/marian.py (`model.safetensors`, `config.json` and
`generation_config.json`), with no framework imported here.

A config that MarianMTModel cannot compute is refused before anything is written, naming each
field (export_problems). A bias our config does not have is written as zeros, which computes
the same function: Marian always has them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError
from transformer_rosetta.porting.hf_folder import CONFIG_FILE, SAFETENSORS_FILE, write_hf_folder
from transformer_rosetta.porting.marian import LAYER_NORM_EPS, TABLE
from transformer_rosetta.porting.table import from_canonical
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import canonical_specs

# Ours -> transformers' ACT2FN name that computes it (gelu_new is the tanh form).
EXPORT_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}
GENERATION_FILE = "generation_config.json"
EXPORT_FILES = (SAFETENSORS_FILE, CONFIG_FILE, GENERATION_FILE)


def export_problems(c: TransformerConfig) -> list[str]:
    """'field: why' for everything of `c` that a MarianMTModel cannot hold. A missing bias is not
    among them: it is written as zeros, the same function."""
    problems = []
    if c.norm_position != "post":
        problems.append("norm_position: MarianMTModel is post-norm (LayerNorm after each residual)")
    if c.final_norm:
        problems.append("final_norm: MarianMTModel has no final encoder or decoder LayerNorm")
    if c.norm_kind != "layer_norm":
        problems.append(f"norm_kind: MarianMTModel's norms are nn.LayerNorm, not {c.norm_kind!r}")
    if c.layer_norm_eps != LAYER_NORM_EPS:
        problems.append(
            f"layer_norm_eps: MarianMTModel's LayerNorms use torch's default {LAYER_NORM_EPS:g}, "
            f"and its config has no field for {c.layer_norm_eps:g}"
        )
    if c.position_kind != "sinusoidal":
        problems.append("position_kind: MarianMTModel has fixed sinusoidal positions only")
    elif c.sinusoid_layout != "concatenated":
        problems.append(
            "sinusoid_layout: MarianMTModel's sinusoids are concatenated (every sin, then every "
            f"cos), not {c.sinusoid_layout!r}"
        )
    if c.key_dim is not None and c.key_dim * c.num_heads != c.d_model:
        problems.append(f"key_dim: MarianMTModel's heads are d_model / heads wide, not {c.key_dim}")
    if c.activation not in EXPORT_ACTIVATIONS:
        problems.append(
            f"activation: MarianMTModel's activation_function has no {c.activation!r}; allowed: "
            + ", ".join(EXPORT_ACTIVATIONS)
        )
    if c.gated_feed_forward:
        problems.append("gated_feed_forward: MarianMTModel's feed-forward has no gate (fc1, fc2)")
    if c.kv_heads != c.num_heads:
        problems.append(
            f"num_kv_heads: MarianMTModel's attention has as many key/value heads as query heads "
            f"({c.num_heads}), not {c.kv_heads}"
        )
    if c.share_embeddings and not c.tie_output:
        problems.append(
            "share_embeddings: transformers 5 shares Marian's embedding only together with "
            "tie_word_embeddings; a shared embedding with an untied output is three separate "
            "matrices there: set share_embeddings to false"
        )
    return problems


def hf_config_for(c: TransformerConfig) -> dict[str, Any]:
    """config.json for `c`, the inverse of marian_config (export_problems must be empty)."""
    return {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "vocab_size": c.src_vocab_size,
        "decoder_vocab_size": c.tgt_vocab_size,
        "share_encoder_decoder_embeddings": c.share_embeddings,
        "tie_word_embeddings": c.tie_output,
        "d_model": c.d_model,
        "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers,
        "encoder_attention_heads": c.num_heads,
        "decoder_attention_heads": c.num_heads,
        "encoder_ffn_dim": c.d_ff,
        "decoder_ffn_dim": c.d_ff,
        "max_position_embeddings": c.max_len,
        "dropout": c.dropout,
        "attention_dropout": c.attention_dropout,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "activation_function": EXPORT_ACTIVATIONS[c.activation],
        "scale_embedding": c.scale_embeddings,
        "pad_token_id": c.pad_id,
        "eos_token_id": c.eos_id,
        "decoder_start_token_id": c.bos_id,
        "forced_eos_token_id": None,
    }


def generation_config_for(c: TransformerConfig) -> dict[str, Any]:
    """generation_config.json: decoding starts where ours does (bos_id) and stops at eos_id,
    with nothing forced, as common/decoding/search.py decodes."""
    return {
        "decoder_start_token_id": c.bos_id,
        "eos_token_id": c.eos_id,
        "pad_token_id": c.pad_id,
        "forced_eos_token_id": None,
    }


def canonical_to_marian(
    tensors: Mapping[str, np.ndarray], c: TransformerConfig
) -> dict[str, np.ndarray]:
    """MarianMTModel's state dict (the names save_pretrained writes) from canonical tensors. A
    bias the config does not have is written as zeros: q/k/v/output biases without
    attention_bias (or attention_output_bias), fc1/fc2 biases without feed_forward_bias,
    final_logits_bias without output_bias."""
    problems = export_problems(c)
    if problems:
        raise ConfigError(problems)
    # Marian always has the biases: take the config that has them, with zeros where ours has none.
    held = c.replace(
        attention_bias=True, attention_output_bias=None, output_bias=True, feed_forward_bias=True
    )
    full = dict(tensors)
    dtype = np.asarray(next(iter(tensors.values()))).dtype
    for spec in canonical_specs(held):
        if spec.name not in full:
            full[spec.name] = np.zeros(spec.shape, dtype=dtype)
    return from_canonical(TABLE, full, held)


def write_marian_dir(
    folder: str | Path, c: TransformerConfig, tensors: Mapping[str, np.ndarray]
) -> None:
    """Write a MarianMTModel folder: model.safetensors, config.json, generation_config.json.

    Everything is computed before the first byte is written (a config Marian cannot hold is a
    ConfigError naming each field); each file is written atomically, the weights first, and if a
    later file fails the files this call wrote are removed again (and the folder, if it made it)."""
    state = canonical_to_marian(tensors, c)
    texts = {
        CONFIG_FILE: json.dumps(hf_config_for(c), indent=2) + "\n",
        GENERATION_FILE: json.dumps(generation_config_for(c), indent=2) + "\n",
    }
    write_hf_folder(folder, state, texts)
