"""Regenerate the shared test vectors: `python -m parity_tests.vectors.make_vectors`.

For each config below it writes NAME.safetensors (float64 weights in the shared format, config in
the metadata) and NAME.npz (inputs `src`, `tgt_in` and the oracle's float64 outputs under their
canonical output names: logits, encoder_output, encoder.layers.{i}.self_attention, ...). A half
of the family stores only the input it takes and the outputs it has (docs/FORMAT.md, "The three
kinds").
`python -m parity_tests.vectors.make_vectors NAME ...` writes only the vectors named, leaving the
others' files (and bytes) as they are.
An implementation in any framework can check itself against these files alone: load the weights,
run the inputs, compare (docs/PARITY.md). The npz holds no objects: load it with allow_pickle=False.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.weights.format import atomic_write, save_weights
from transformer_rosetta.weights.init import init_weights

HERE = Path(__file__).parent
_TINY = dict(
    src_vocab_size=31,
    tgt_vocab_size=31,
    d_model=12,
    num_heads=3,
    d_ff=20,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=16,
    dropout=0.0,
)

VECTOR_CONFIGS: dict[str, TransformerConfig] = {
    # The paper's model in miniature: post-norm, relu, interleaved sinusoids, one shared embedding.
    "post_ln_shared": TransformerConfig(**_TINY),
    # Pre-norm with final norms, GELU, learned positions, separate vocabularies, untied output
    # with a bias, eps 1e-5 (torch's), like many ported models.
    "pre_ln_untied": TransformerConfig(
        **{
            **_TINY,
            "tgt_vocab_size": 37,
            "norm_position": "pre",
            "final_norm": True,
            "activation": "gelu",
            "position_kind": "learned",
            "share_embeddings": False,
            "tie_output": False,
            "output_bias": True,
            "layer_norm_eps": 1e-5,
        }
    ),
    # Marian-like: concatenated sinusoids, output tied to a separate target embedding, tanh GELU,
    # no attention biases, no embedding scale, decoding starts from the pad id.
    "post_ln_tied_concat": TransformerConfig(
        **{
            **_TINY,
            "tgt_vocab_size": 29,
            "sinusoid_layout": "concatenated",
            "share_embeddings": False,
            "activation": "gelu_tanh",
            "attention_bias": False,
            "scale_embeddings": False,
            "bos_id": 0,
        }
    ),
    # The Annotated Transformer's norm (std plus eps, unbiased) in pre-norm with final norms, and
    # heads 5 wide where d_model / h is 4 (key_dim): untied output with a bias.
    "pre_std_plus_eps_key_dim": TransformerConfig(
        **{
            **_TINY,
            "tgt_vocab_size": 33,
            "norm_position": "pre",
            "final_norm": True,
            "norm_kind": "std_plus_eps",
            "key_dim": 5,
            "share_embeddings": False,
            "tie_output": False,
            "output_bias": True,
        }
    ),
    # The two halves (docs/FORMAT.md, "The three kinds"). A GPT: decoder-only, pre-norm with a
    # final norm, tanh GELU, learned positions, the output tied to its embedding, eps 1e-5.
    "gpt_decoder_only": TransformerConfig(
        **{
            **_TINY,
            "num_encoder_layers": 0,
            "norm_position": "pre",
            "final_norm": True,
            "activation": "gelu_tanh",
            "position_kind": "learned",
            "scale_embeddings": False,
            "share_embeddings": False,
            "layer_norm_eps": 1e-5,
        }
    ),
    # A BERT: encoder-only, post-norm, exact GELU, learned positions, segment embeddings and the
    # embedding LayerNorm, eps 1e-12, mean pooling with the L2 norm (all-MiniLM-L6-v2's head).
    "bert_encoder_only": TransformerConfig(
        **{
            **_TINY,
            "num_decoder_layers": 0,
            "activation": "gelu",
            "position_kind": "learned",
            "type_vocab_size": 2,
            "embedding_norm": True,
            "layer_norm_eps": 1e-12,
            "scale_embeddings": False,
            "share_embeddings": False,
            "tie_output": False,
            "pooling": "mean",
            "pooled_l2_norm": True,
        }
    ),
    # Today's decoders (docs/FORMAT.md steps 3, 4, 4a and 5). The preset tiny_llama as it is: a
    # Llama, decoder-only, pre-norm RMSNorm with a final norm, rotary positions in the half-split
    # layout (rope_theta 10000), SwiGLU, grouped-query attention (4 query heads, 2 key/value
    # heads), no bias anywhere, unscaled embeddings, an untied output. d_model 32, d_k 8.
    "llama_decoder_only": preset("tiny_llama"),
    # The other choices of today's parts, in an encoder-decoder so that the encoder's
    # (bidirectional) self-attention is rotated too and the cross-attention, never rotated, is
    # covered: rotary in the interleaved layout with rope_theta 1e6 (Qwen2's), multi-query
    # attention (one key/value head for 3 query heads), q/k/v biases without the output bias
    # (attention_output_bias false, Qwen2's), a GeGLU (gelu_tanh, Gemma's) gated feed-forward
    # with biases, pre-norm RMSNorm with final norms, eps 1e-5, one shared embedding that is also
    # the output. Heads are key_dim 8 wide where d_model / h is 4 (Gemma's head_dim), so the
    # rotary frequencies run over d_k = 8. The fully padded source row makes every encoder and
    # cross-attention query of that row empty: its sublayer output is zero, having no output
    # bias.
    "qwen_interleaved_mqa": TransformerConfig(
        **{
            **_TINY,
            "key_dim": 8,
            "num_kv_heads": 1,
            "norm_position": "pre",
            "final_norm": True,
            "norm_kind": "rms_norm",
            "layer_norm_eps": 1e-5,
            "activation": "gelu_tanh",
            "gated_feed_forward": True,
            "position_kind": "rotary",
            "rotary_layout": "interleaved",
            "rope_theta": 1e6,
            "attention_output_bias": False,
            "scale_embeddings": False,
        }
    ),
}


def vector_inputs(c: TransformerConfig) -> tuple[np.ndarray | None, np.ndarray | None]:
    return ragged_batch(c, batch=3, src_len=7, tgt_len=6, seed=11)


def write_vectors(folder: Path = HERE, names: Iterable[str] | None = None) -> list[Path]:
    """Write the vectors `names` (all of VECTOR_CONFIGS when None) into `folder`."""
    chosen = list(VECTOR_CONFIGS) if names is None else list(names)
    unknown = [n for n in chosen if n not in VECTOR_CONFIGS]
    if unknown:
        raise ValueError(f"unknown vectors {unknown}; known: {', '.join(VECTOR_CONFIGS)}")
    written = []
    for name in chosen:
        config = VECTOR_CONFIGS[name]
        weights = init_weights(config, seed=2017, scheme="perturbed", dtype="float64")
        src, tgt_in = vector_inputs(config)
        out = reference.forward(weights, config, src, tgt_in)
        save_weights(folder / f"{name}.safetensors", weights, config, producer="common.reference")
        inputs = {k: a for k, a in (("src", src), ("tgt_in", tgt_in)) if a is not None}
        arrays = {**inputs, **out.named()}
        atomic_write(folder / f"{name}.npz", lambda tmp, a=arrays: _savez(tmp, a))
        written += [folder / f"{name}.safetensors", folder / f"{name}.npz"]
    return written


def _savez(path: str, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)


if __name__ == "__main__":
    for path in write_vectors(names=sys.argv[1:] or None):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
