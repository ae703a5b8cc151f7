"""Import a torch.nn.Transformer model (its state_dict plus the user's embeddings and output layer).

nn.Transformer is the encoder-decoder of "Attention Is All You Need" (section 3.1) without the
parts around it: it has no embeddings, no positions and no output projection. A user's model wraps
it, and this importer reads the state_dict of such a wrapper, as numpy arrays (the CLI reads the
.pt with the torch backend's `read_tensors`, weights_only), with no framework imported here.

Which keys, exactly (the rule):
- nn.Transformer's own keys (`encoder.layers.{i}.self_attn.in_proj_weight`, ..., `encoder.norm.*`,
  `decoder.norm.*`) either all under the prefix `transformer.` (the state_dict of a module whose
  nn.Transformer attribute is `transformer`) or all bare (an nn.Transformer's own state_dict).
  If any key starts with `transformer.`, the prefixed form is expected, and a bare
  `encoder.*`/`decoder.*` key is then reported as unexpected.
- The user's modules, never prefixed: `src_embedding.weight` and `tgt_embedding.weight`
  (nn.Embedding, [vocab, d_model]), `output.weight` (nn.Linear, [tgt_vocab, d_model]) and
  `output.bias` when the config has `output_bias`; with learned positions also
  `src_position_embedding.weight` and `tgt_position_embedding.weight` ([max_len, d_model]).
- Sharing and tying are what the config says, never guessed from the values. With
  `share_embeddings`, `tgt_embedding.weight` may be absent (stored once) or must equal
  `src_embedding.weight`; with `tie_output`, `output.weight` may be absent or must equal the
  target embedding. (A module that assigns one Parameter to two attributes saves it under both
  keys, so the file holds identical arrays.) Identical arrays under a config that does not share
  or tie are imported as separate tensors.

What the state_dict cannot tell, the config must (`--config`): num_heads, activation, norm
position (norm_first), layer_norm_eps, and what the user's pipeline does around nn.Transformer:
the position kind and sinusoid layout, scale_embeddings, pad_id (its padding masks). The PyTorch
tutorial pipeline (embedding * sqrt(d_model) + PositionalEncoding with sin at even and cos at odd
dims) is our default: scale_embeddings=true, position_kind="sinusoidal", sinusoid_layout=
"interleaved". nn.Transformer always has a final encoder and decoder LayerNorm, even in post-LN
(norm_first=False), so the config needs final_norm=true.

Layouts: nn.Linear stores [out, in] for y = x W^T + b; canonical kernels are [in, out]. The
packed `in_proj_weight` [3 d_model, d_model] stacks W^Q, W^K, W^V (rows, in that order, heads
major within each, as nn.MultiheadAttention views them); each is transposed and split into heads,
[d_model, h, d_k]. `out_proj.weight` [d_model, h d_k] becomes [h, d_k, d_model] (Eq. (4), W^O).

The importer is TABLE, data for the engine of common/porting/table.py; `nn_transformer_rules`
is also what the PyTorch tutorial's table (common/porting/tutorials.py) builds on.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from transformer_rosetta.errors import ConfigError
from transformer_rosetta.porting.table import (
    Rule,
    Table,
    file_sizes,
    fixed_problems,
    rows,
    to_canonical,
)
from transformer_rosetta.spec.config import TransformerConfig

PREFIX = "transformer."
SOURCE_EMBEDDING = "src_embedding.weight"
TARGET_EMBEDDING = "tgt_embedding.weight"
OUTPUT_WEIGHT = "output.weight"
OUTPUT_BIAS = "output.bias"

# Canonical sublayer -> nn.Transformer submodule. norm1/norm2/norm3 are numbered by sublayer, so
# the feed-forward norm is norm2 in an encoder layer but norm3 in a decoder layer.
SUBMODULES = {
    "encoder": {
        "self_attention": "self_attn",
        "self_attention_norm": "norm1",
        "feed_forward.intermediate": "linear1",
        "feed_forward.output": "linear2",
        "feed_forward_norm": "norm2",
    },
    "decoder": {
        "self_attention": "self_attn",
        "self_attention_norm": "norm1",
        "cross_attention": "multihead_attn",
        "cross_attention_norm": "norm2",
        "feed_forward.intermediate": "linear1",
        "feed_forward.output": "linear2",
        "feed_forward_norm": "norm3",
    },
}
_QKV = ("query", "key", "value")  # the row blocks of in_proj_weight / in_proj_bias, in order


def nn_transformer_rules(core: str = "{prefix}") -> list[Rule]:
    """The rules for nn.Transformer's own keys, under `core` (a literal prefix, or "{prefix}"
    for the optional one): attention, norms and feed-forward of every layer, and the final
    norms."""
    out = []
    for stack, submodules in SUBMODULES.items():
        layer = f"{stack}.layers.{{i}}"
        source = f"{core}{layer}"
        for sublayer, module in submodules.items():
            here, there = f"{layer}.{sublayer}", f"{source}.{module}"
            if sublayer.endswith("_attention"):
                for part, proj in enumerate(_QKV):
                    split = f"split:{part}/3"
                    out.append(
                        Rule(
                            f"{here}.{proj}.kernel",
                            f"{there}.in_proj_weight",
                            (split, "transpose", "heads"),
                        )
                    )
                    out.append(
                        Rule(f"{here}.{proj}.bias", f"{there}.in_proj_bias", (split, "heads"))
                    )
                out.append(
                    Rule(
                        f"{here}.output.kernel", f"{there}.out_proj.weight", ("transpose", "heads")
                    )
                )
                out.append(Rule(f"{here}.output.bias", f"{there}.out_proj.bias"))
            elif sublayer.endswith("_norm"):
                out.append(Rule(f"{here}.scale", f"{there}.weight"))
                out.append(Rule(f"{here}.bias", f"{there}.bias"))
            else:  # the two linears of the feed-forward network
                out.append(Rule(f"{here}.kernel", f"{there}.weight", ("transpose",)))
                out.append(Rule(f"{here}.bias", f"{there}.bias"))
        out.append(Rule(f"{stack}.final_norm.scale", f"{core}{stack}.norm.weight"))
        out.append(Rule(f"{stack}.final_norm.bias", f"{core}{stack}.norm.bias"))
    return out


def embedding_rules(source: str, target: str, output: str) -> list[Rule]:
    """Token embeddings and the output layer, shared and tied as the config says (never guessed
    from the values): a key that the config ties to another may be absent, or must equal it."""
    tied_output = (output,)
    return [
        Rule(
            "shared_embedding",
            source,
            copies=(target, *tied_output),
            when=(("share_embeddings", True), ("tie_output", True)),
        ),
        Rule(
            "shared_embedding",
            source,
            copies=(target,),
            when=(("share_embeddings", True), ("tie_output", False)),
        ),
        Rule("encoder.embedding", source, when=(("share_embeddings", False),)),
        Rule(
            "decoder.embedding",
            target,
            copies=tied_output,
            when=(("share_embeddings", False), ("tie_output", True)),
        ),
        Rule(
            "decoder.embedding",
            target,
            when=(("share_embeddings", False), ("tie_output", False)),
        ),
        Rule("output.kernel", output, ("transpose",)),
    ]


TABLE = Table(
    kind="nn-transformer",
    model="an nn.Transformer pipeline",
    rules=(
        *embedding_rules(SOURCE_EMBEDDING, TARGET_EMBEDDING, OUTPUT_WEIGHT),
        Rule("output.bias", OUTPUT_BIAS),
        Rule("encoder.position_embedding", "src_position_embedding.weight"),
        Rule("decoder.position_embedding", "tgt_position_embedding.weight"),
        *nn_transformer_rules(),
    ),
    fixed={"final_norm": True, "attention_bias": True},
    why={
        "final_norm": "nn.Transformer always has a final encoder and decoder LayerNorm "
        "(encoder.norm, decoder.norm), even in post-LN; set final_norm to true",
        "attention_bias": "nn.Transformer(bias=False) also drops the feed-forward and LayerNorm "
        "biases, which this format keeps; only bias=True models can be imported",
    },
    sizes={
        "src_vocab_size": (SOURCE_EMBEDDING, 0),
        "d_model": (SOURCE_EMBEDDING, 1),
        "d_ff": ("{prefix}encoder.layers.0.linear1.weight", 0),
        "max_len": ("src_position_embedding.weight", 0),
    },
    layer_counts={
        "num_encoder_layers": "{prefix}encoder.layers.{i}.",
        "num_decoder_layers": "{prefix}decoder.layers.{i}.",
    },
    optional_prefix=PREFIX,
    hints={OUTPUT_BIAS: f"{OUTPUT_BIAS}: the file has an output bias; set output_bias to true"},
    tie_reason="the config ties them (share_embeddings or tie_output is true); set it to false "
    "to import them separately",
)


def check_config(config: TransformerConfig) -> None:
    """Refuse a config that no nn.Transformer pipeline has (ConfigError naming each field).

    Everything about positions and embeddings is the user's pipeline, so any position kind,
    sinusoid layout, scaling, sharing and tying is accepted: the config must say what the
    pipeline does. Every activation is possible (gelu_tanh is a callable activation).
    """
    problems = fixed_problems(TABLE, config)
    if problems:
        raise ConfigError(problems)


def nn_transformer_to_canonical(
    tensors: Mapping[str, np.ndarray],
    config: TransformerConfig,
    source: str = "<state_dict>",
) -> dict[str, np.ndarray]:
    """Canonical tensors, in canonical order and in each tensor's own dtype, from the state_dict
    of an nn.Transformer wrapper (the key rule is in the module docstring).

    Checks the config first (check_config), then reports every missing, unexpected, wrong-shaped
    and wrong-dtype tensor and every broken tie at once in one WeightFileError labelled `source`.
    """
    return to_canonical(TABLE, tensors, config, source)


def mapping_table(config: TransformerConfig, prefix: str = PREFIX) -> list[tuple[str, str, str]]:
    """(source key, canonical name(s), steps) for every tensor of the file, in canonical order;
    a packed source lists its canonical names joined by ', '. For docs/PORTING.md."""
    return rows(TABLE, config, prefix)


def infer_sizes(tensors: Mapping[str, np.ndarray]) -> dict[str, int | bool]:
    """The config fields that the file itself tells: vocabulary sizes, d_model, d_ff, layer
    counts, output_bias and (with learned positions) max_len. Heads, activation, norm position,
    epsilon and the pipeline around nn.Transformer must come from the user's config."""
    shapes = {k: np.shape(v) for k, v in tensors.items()}
    sizes: dict[str, int | bool] = dict(file_sizes(TABLE, shapes))
    for key in (TARGET_EMBEDDING, OUTPUT_WEIGHT, SOURCE_EMBEDDING):  # a shared one is the source
        if len(shapes.get(key, ())) == 2:
            sizes["tgt_vocab_size"] = shapes[key][0]
            break
    sizes["output_bias"] = OUTPUT_BIAS in shapes
    return sizes
