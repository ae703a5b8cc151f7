"""Canonical weights <-> the torch model's state_dict.

Every name comes from common.names; this file says only what is special to torch. nn.Linear
computes y = x W^T + b with W stored [out, in], while the canonical layout is y = x @ kernel + b:

    canonical                          shape            state_dict               shape
    *.{query,key,value}.kernel         [d, h, d_k]      *.weight (merge, T)      [h*d_k, d]
    *.{query,key,value}.bias           [h, d_k]         *.bias (merge)           [h*d_k]
    *_attention.output.kernel          [h, d_k, d]      *.weight (merge, T)      [d, h*d_k]
    feed_forward.*.kernel              [in, out]        *.weight (T)             [out, in]
    output.kernel (untied)             [d, V]           output.weight (T)        [V, d]
    *.scale (LayerNorm)                [d]              *.weight                 [d]
    embeddings                         [vocab, d]       *.weight                 [vocab, d]

Tied tensors are one Parameter under several state_dict keys: a shared embedding is
encoder.embedding.weight and decoder.embedding.weight, a tied output is also output.weight.
Every shape is asserted before a copy (nanoGPT's from_pretrained).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from common.config import TransformerConfig
from common.names import TensorSpec, canonical_specs, embedding_names


def native_name_map(config: TransformerConfig) -> dict[str, str]:
    """{canonical name: state_dict key}, in canonical order (for docs and converters). A tied
    tensor maps to its first key; native_aliases lists them all."""
    emb = embedding_names(config)
    # Token embeddings live in the stacks; a shared one is the encoder's (assigned last, wins).
    modules = {emb["target"]: "decoder.embedding", emb["source"]: "encoder.embedding"}
    names = {}
    for spec in canonical_specs(config):
        if spec.name in modules:
            names[spec.name] = f"{modules[spec.name]}.weight"
        elif spec.role == "embedding":  # learned positions: an nn.Embedding under the same path
            names[spec.name] = f"{spec.name}.weight"
        else:  # kernel and LayerNorm scale -> weight; bias -> bias
            stem, _, leaf = spec.name.rpartition(".")
            names[spec.name] = f"{stem}.{'bias' if leaf == 'bias' else 'weight'}"
    return names


def native_aliases(config: TransformerConfig) -> dict[str, list[str]]:
    """{canonical name: every state_dict key that holds it}; more than one only when tied."""
    aliases = {name: [key] for name, key in native_name_map(config).items()}
    emb = embedding_names(config)
    if config.share_embeddings:
        aliases[emb["target"]].append("decoder.embedding.weight")
    if config.tie_output:
        aliases[emb["output"]].append("output.weight")
    return aliases


def native_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The shape of canonical tensor `spec` in the state_dict."""
    if spec.role == "kernel":
        return (spec.fan_out, spec.fan_in)
    if spec.role == "bias":
        return (math.prod(spec.shape),)
    return spec.shape


def to_native(spec: TensorSpec, t: Tensor) -> Tensor:
    """Canonical layout -> nn.Linear / nn.LayerNorm / nn.Embedding layout (exact: no arithmetic).

    A kernel, of any rank, is a view of the matrix (fan_in, fan_out) that nn.Linear stores
    transposed: attention kernels merge their head axes first, (d, h, d_k) -> (d, h*d_k).
    """
    assert tuple(t.shape) == spec.shape, f"{spec.name}: {tuple(t.shape)} != {spec.shape}"
    if spec.role == "kernel":
        return t.reshape(spec.fan_in, spec.fan_out).T.contiguous()  # (out, in)
    return t.reshape(native_shape(spec))  # attention biases (h, d_k) -> (h*d_k,)


def to_canonical(spec: TensorSpec, t: Tensor) -> Tensor:
    """Inverse of to_native."""
    want = native_shape(spec)
    assert tuple(t.shape) == want, f"{spec.name}: state_dict has {tuple(t.shape)}, needs {want}"
    out = t.T if spec.role == "kernel" else t  # (out, in) -> (in, out), then split the heads
    return out.reshape(spec.shape).contiguous()


def state_dict_from_canonical(
    config: TransformerConfig, weights: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """A state_dict for Transformer(config) (every alias of a tied tensor included)."""
    aliases = native_aliases(config)
    state = {}
    for spec in canonical_specs(config):
        native = to_native(spec, weights[spec.name])
        for key in aliases[spec.name]:
            state[key] = native
    return state


def canonical_from_state_dict(
    config: TransformerConfig, state: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Canonical tensors, in canonical order, from a Transformer(config) state_dict."""
    keys = native_name_map(config)
    return {
        spec.name: to_canonical(spec, state[keys[spec.name]]) for spec in canonical_specs(config)
    }


@torch.no_grad()
def load_canonical(model: nn.Module, weights: Mapping[str, Tensor]) -> None:
    """Copy canonical tensors (any float dtype) into `model`, casting to each parameter's dtype
    and device. Every tensor is shape-checked twice: canonical, then native."""
    config = model.config
    params = model.state_dict(keep_vars=True)
    expected = {s.name for s in canonical_specs(config)}
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ValueError(
            f"canonical weights: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    keys = native_name_map(config)
    for spec in canonical_specs(config):
        native, key = to_native(spec, weights[spec.name]), keys[spec.name]
        assert native.shape == params[key].shape, f"{key}: {native.shape} != {params[key].shape}"
        params[key].copy_(native)  # a tied Parameter is copied once, through its first key


def export_canonical(model: nn.Module) -> dict[str, Tensor]:
    """Every canonical tensor of `model`, in canonical order, in the model's dtype."""
    return canonical_from_state_dict(model.config, model.state_dict())
