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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from common.errors import ConfigError, WeightFileError
from common.files.safe_read import listing
from common.spec.config import TransformerConfig
from common.spec.names import TensorSpec, canonical_specs, embedding_names
from common.weights.format import dtype_problems

PREFIX = "transformer."
SOURCE_EMBEDDING = "src_embedding.weight"
TARGET_EMBEDDING = "tgt_embedding.weight"
OUTPUT_WEIGHT = "output.weight"
OUTPUT_BIAS = "output.bias"
POSITION_EMBEDDINGS = {
    "encoder.position_embedding": "src_position_embedding.weight",
    "decoder.position_embedding": "tgt_position_embedding.weight",
}

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


@dataclass(frozen=True)
class Transform:
    """How one native tensor becomes canonical tensor(s): the native shape it must have, the
    conversion (native array, canonical spec, index in a packed tensor) and its description."""

    describe: str
    native_shape: Callable[[TransformerConfig, TensorSpec], tuple[int, ...]]
    apply: Callable[[np.ndarray, TensorSpec, int], np.ndarray]


def _packed_rows(a: np.ndarray, part: int) -> np.ndarray:
    rows = a.shape[0] // 3  # in_proj_* stacks [W^Q; W^K; W^V] along its first axis
    return a[part * rows : (part + 1) * rows]


TRANSFORMS: dict[str, Transform] = {
    "in_proj_kernel": Transform(
        "rows split in 3 (q, k, v), each transposed and reshaped to [d_model, h, d_k]",
        lambda c, s: (3 * c.d_model, c.d_model),
        lambda a, s, p: _packed_rows(a, p).T.reshape(s.shape),  # (h*d_k, d) -> (d, h, d_k)
    ),
    "in_proj_bias": Transform(
        "split in 3 (q, k, v), each reshaped to [h, d_k]",
        lambda c, s: (3 * c.d_model,),
        lambda a, s, p: _packed_rows(a, p).reshape(s.shape),  # (h*d_k,) -> (h, d_k)
    ),
    "out_proj_kernel": Transform(
        "transposed and reshaped to [h, d_k, d_model]",
        lambda c, s: (s.fan_out, s.fan_in),
        lambda a, s, p: a.T.reshape(s.shape),  # (d, h*d_k) -> (h*d_k, d) -> (h, d_k, d)
    ),
    "transpose": Transform(
        "transposed ([out, in] -> [in, out])",
        lambda c, s: (s.fan_out, s.fan_in),
        lambda a, s, p: a.T,
    ),
    "copy": Transform("as is", lambda c, s: s.shape, lambda a, s, p: a),
    "scale": Transform(
        "as is (LayerNorm weight -> scale)", lambda c, s: s.shape, lambda a, s, p: a
    ),
}


@dataclass(frozen=True)
class Source:
    """Where one canonical tensor comes from: a native key (without the prefix, for the
    nn.Transformer keys), the transform, and its block in a packed tensor."""

    key: str
    transform: str
    part: int = 0
    in_transformer: bool = True  # False for the user's embeddings and output layer


def _layer_source(stack: str, rest: str) -> Source:
    """`rest` is the canonical name inside one layer, e.g. 'self_attention.query.kernel'."""
    for sublayer, module in SUBMODULES[stack].items():
        if not rest.startswith(sublayer + "."):
            continue
        leaf = rest[len(sublayer) + 1 :]
        if sublayer.endswith("_attention"):
            proj, _, kind = leaf.partition(".")
            if proj in _QKV and kind == "kernel":
                return Source(f"{module}.in_proj_weight", "in_proj_kernel", _QKV.index(proj))
            if proj in _QKV:
                return Source(f"{module}.in_proj_bias", "in_proj_bias", _QKV.index(proj))
            if kind == "kernel":
                return Source(f"{module}.out_proj.weight", "out_proj_kernel")
            return Source(f"{module}.out_proj.bias", "copy")
        if sublayer.endswith("_norm"):
            return Source(f"{module}.{'weight' if leaf == 'scale' else 'bias'}", _leaf_kind(leaf))
        if leaf == "kernel":  # the two linears of the feed-forward network
            return Source(f"{module}.weight", "transpose")
        return Source(f"{module}.bias", "copy")
    raise AssertionError(f"no nn.Transformer submodule for {stack} layer tensor {rest!r}")


def _leaf_kind(leaf: str) -> str:
    return "scale" if leaf == "scale" else "copy"


def source_of(spec: TensorSpec, c: TransformerConfig) -> Source:
    """The native tensor behind canonical tensor `spec` (the one table of this importer)."""
    emb = embedding_names(c)
    name = spec.name
    if name == emb["source"]:
        return Source(SOURCE_EMBEDDING, "copy", in_transformer=False)
    if name == emb["target"]:
        return Source(TARGET_EMBEDDING, "copy", in_transformer=False)
    if name in POSITION_EMBEDDINGS:
        return Source(POSITION_EMBEDDINGS[name], "copy", in_transformer=False)
    if name == "output.kernel":
        return Source(OUTPUT_WEIGHT, "transpose", in_transformer=False)
    if name == "output.bias":
        return Source(OUTPUT_BIAS, "copy", in_transformer=False)
    stack, _, rest = name.partition(".")
    if rest.startswith("final_norm."):
        leaf = rest.rpartition(".")[2]
        return Source(f"{stack}.norm.{'weight' if leaf == 'scale' else 'bias'}", _leaf_kind(leaf))
    _, index, inner = rest.split(".", 2)  # "layers", i, rest of the name
    source = _layer_source(stack, inner)
    return Source(f"{stack}.layers.{index}.{source.key}", source.transform, source.part)


def tied_aliases(c: TransformerConfig) -> dict[str, str]:
    """{native key: native key it must equal} for the keys that the config ties to another and
    that may therefore be absent: the target embedding when shared, the output when tied."""
    aliases = {}
    if c.share_embeddings:
        aliases[TARGET_EMBEDDING] = SOURCE_EMBEDDING
    if c.tie_output:
        aliases[OUTPUT_WEIGHT] = aliases.get(TARGET_EMBEDDING, TARGET_EMBEDDING)
    return aliases


def check_config(config: TransformerConfig) -> None:
    """Refuse a config that no nn.Transformer pipeline has (ConfigError naming each field).

    Everything about positions and embeddings is the user's pipeline, so any position kind,
    sinusoid layout, scaling, sharing and tying is accepted: the config must say what the
    pipeline does. Every activation is possible (gelu_tanh is a callable activation).
    """
    problems = []
    if not config.final_norm:
        problems.append(
            "final_norm: nn.Transformer always has a final encoder and decoder LayerNorm "
            "(encoder.norm, decoder.norm), even in post-LN; set final_norm to true"
        )
    if not config.attention_bias:
        problems.append(
            "attention_bias: nn.Transformer(bias=False) also drops the feed-forward and LayerNorm "
            "biases, which this format keeps; only bias=True models can be imported"
        )
    if problems:
        raise ConfigError(problems)


def _sources(c: TransformerConfig) -> Iterator[tuple[TensorSpec, Source]]:
    for spec in canonical_specs(c):
        yield spec, source_of(spec, c)


def _prefix_of(tensors: Mapping[str, np.ndarray]) -> str:
    """The rule: any key under `transformer.` means nn.Transformer's keys all are."""
    return PREFIX if any(k.startswith(PREFIX) for k in tensors) else ""


def _file_key(source: Source, prefix: str) -> str:
    return prefix + source.key if source.in_transformer else source.key


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
    check_config(config)
    prefix = _prefix_of(tensors)
    arrays = {k: np.asarray(v) for k, v in tensors.items()}
    sources = list(_sources(config))
    aliases = tied_aliases(config)

    needed: dict[str, tuple[int, ...]] = {}  # file key -> native shape, in canonical order
    for spec, src in sources:
        needed.setdefault(
            _file_key(src, prefix), TRANSFORMS[src.transform].native_shape(config, spec)
        )

    problems = []
    missing = [k for k in needed if k not in arrays]
    unexpected = sorted(k for k in arrays if k not in needed and k not in aliases)
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listing(unexpected)}")
        if OUTPUT_BIAS in unexpected:
            problems.append(f"{OUTPUT_BIAS}: the file has an output bias; set output_bias to true")
    for key, shape in needed.items():
        if key in arrays and arrays[key].shape != shape:
            problems.append(
                f"wrong shape for {key}: file has {list(arrays[key].shape)}, config needs {list(shape)}"
            )
    for key, target in aliases.items():
        if key in arrays and target in arrays and not _same(arrays[key], arrays[target]):
            flag = "share_embeddings" if key == TARGET_EMBEDDING else "tie_output"
            problems.append(
                f"{key} differs from {target}, but the config ties them ({flag} is true); "
                f"set {flag} to false to import them separately"
            )
    known = {k: (a.dtype.name, a.shape) for k, a in arrays.items() if k in needed or k in aliases}
    problems += dtype_problems(known)
    if problems:
        raise WeightFileError(source, problems)

    out = {}
    for spec, src in sources:
        transform = TRANSFORMS[src.transform]
        value = transform.apply(arrays[_file_key(src, prefix)], spec, src.part)
        assert value.shape == spec.shape, f"{spec.name}: {value.shape} != {spec.shape}"
        out[spec.name] = np.ascontiguousarray(value)
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def mapping_table(config: TransformerConfig, prefix: str = PREFIX) -> list[tuple[str, str, str]]:
    """(source key, canonical name(s), transform) for every tensor of the file, in canonical
    order; a packed source lists its canonical names joined by ', '. For docs/PORTING.md."""
    grouped: dict[str, tuple[list[str], str]] = {}
    for spec, src in _sources(config):
        key = _file_key(src, prefix)
        names, _ = grouped.setdefault(key, ([], TRANSFORMS[src.transform].describe))
        names.append(spec.name)
    rows = [(key, ", ".join(names), how) for key, (names, how) in grouped.items()]
    emb = embedding_names(config)
    for key, target in tied_aliases(config).items():
        canonical = emb["target"] if key == TARGET_EMBEDDING else emb["output"]
        rows.append((key, canonical, f"optional; must equal {target} (tied by the config)"))
    return rows


def infer_sizes(tensors: Mapping[str, np.ndarray]) -> dict[str, int | bool]:
    """The config fields that the file itself tells: vocabulary sizes, d_model, d_ff, layer
    counts, output_bias and (with learned positions) max_len. Heads, activation, norm position,
    epsilon and the pipeline around nn.Transformer must come from the user's config."""
    prefix = _prefix_of(tensors)
    shapes = {k: np.shape(v) for k, v in tensors.items()}
    sizes: dict[str, int | bool] = {}
    # Only matrices tell sizes: one of another rank is named by nn_transformer_to_canonical.
    matrices = {k: s for k, s in shapes.items() if len(s) == 2}
    if SOURCE_EMBEDDING in matrices:
        sizes["src_vocab_size"], sizes["d_model"] = matrices[SOURCE_EMBEDDING]
    for key in (TARGET_EMBEDDING, OUTPUT_WEIGHT, SOURCE_EMBEDDING):  # a shared one is the source
        if key in matrices:
            sizes["tgt_vocab_size"] = matrices[key][0]
            break
    ff = f"{prefix}encoder.layers.0.linear1.weight"
    if ff in matrices:
        sizes["d_ff"] = matrices[ff][0]
    for stack in ("encoder", "decoder"):
        start = f"{prefix}{stack}.layers."
        parts = (k[len(start) :].split(".")[0] for k in shapes if k.startswith(start))
        indices = {int(p) for p in parts if p.isascii() and p.isdecimal() and len(p) < 10}
        if indices:
            sizes[f"num_{stack}_layers"] = max(indices) + 1
    sizes["output_bias"] = OUTPUT_BIAS in shapes
    if POSITION_EMBEDDINGS["encoder.position_embedding"] in matrices:
        sizes["max_len"] = matrices[POSITION_EMBEDDINGS["encoder.position_embedding"]][0]
    return sizes
