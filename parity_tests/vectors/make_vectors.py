"""Regenerate the shared test vectors: `python -m parity_tests.vectors.make_vectors`.

For each config below it writes NAME.safetensors (float64 weights in the shared format, config in
the metadata) and NAME.npz (inputs `src`, `tgt_in` and the oracle's float64 outputs under their
canonical output names: logits, encoder_output, encoder.layers.{i}.self_attention, ...). A half
of the family stores only the input it takes and the outputs it has (docs/FORMAT.md, "The three
kinds").
An implementation in any framework can check itself against these files alone: load the weights,
run the inputs, compare (docs/PARITY.md). The npz holds no objects: load it with allow_pickle=False.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import TransformerConfig
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
}


def vector_inputs(c: TransformerConfig) -> tuple[np.ndarray | None, np.ndarray | None]:
    return ragged_batch(c, batch=3, src_len=7, tgt_len=6, seed=11)


def write_vectors(folder: Path = HERE) -> list[Path]:
    written = []
    for name, config in VECTOR_CONFIGS.items():
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
    for path in write_vectors():
        print(f"wrote {path} ({path.stat().st_size} bytes)")
