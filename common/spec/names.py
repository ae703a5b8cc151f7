"""Canonical tensor names and shapes, derived from the config. The one place that lists them.

Every implementation's weights.py, the validator, the initialiser and docs/FORMAT.md read this
function; nothing else spells out a name. The layout is `y = x @ kernel + bias` throughout:
dense kernels are [in, out], attention kernels keep heads as their own axis.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from transformer_rosetta.files.safe_read import listing
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.results import attention_output_names


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor: its name, shape, and how the paper's initialiser treats it."""

    name: str
    shape: tuple[int, ...]
    role: str  # "embedding", "kernel", "bias", "scale" (LayerNorm gain), "norm_bias"
    fan_in: int = 0  # for xavier-uniform kernels: the matrix this kernel is a view of
    fan_out: int = 0


def attention_specs(prefix: str, c: TransformerConfig) -> list[TensorSpec]:
    """Eq. (4), section 3.2.2: W^Q_i, W^K_i, W^V_i per head and W^O, kept as [d_model, heads, d_k].

    With grouped-query attention (num_kv_heads < num_heads) the key and value kernels have
    num_kv_heads heads. The q/k/v biases follow attention_bias, the output bias
    attention_output_bias (c.output_projection_bias)."""
    d, h, k, g = c.d_model, c.num_heads, c.head_dim, c.kv_heads
    specs = []
    for proj, heads in (("query", h), ("key", g), ("value", g)):
        specs.append(TensorSpec(f"{prefix}.{proj}.kernel", (d, heads, k), "kernel", d, heads * k))
        if c.attention_bias:
            specs.append(TensorSpec(f"{prefix}.{proj}.bias", (heads, k), "bias"))
    specs.append(TensorSpec(f"{prefix}.output.kernel", (h, k, d), "kernel", h * k, d))
    if c.output_projection_bias:
        specs.append(TensorSpec(f"{prefix}.output.bias", (d,), "bias"))
    return specs


def feed_forward_specs(prefix: str, c: TransformerConfig) -> list[TensorSpec]:
    """Eq. (2): FFN(x) = act(x W_1 + b_1) W_2 + b_2, named intermediate (W_1) and output (W_2).
    The gated feed-forward (Shazeer 2020) adds `gate` (W_gate), whose activation multiplies
    x W_1. The biases exist with feed_forward_bias."""
    d, f = c.d_model, c.d_ff
    specs = []
    projections = (("gate", d, f),) if c.gated_feed_forward else ()
    for proj, n_in, n_out in (*projections, ("intermediate", d, f), ("output", f, d)):
        specs.append(TensorSpec(f"{prefix}.{proj}.kernel", (n_in, n_out), "kernel", n_in, n_out))
        if c.feed_forward_bias:
            specs.append(TensorSpec(f"{prefix}.{proj}.bias", (n_out,), "bias"))
    return specs


def norm_specs(prefix: str, c: TransformerConfig) -> list[TensorSpec]:
    """A norm's gain `scale`, and its `bias` unless it is an RMSNorm (which has none)."""
    specs = [TensorSpec(f"{prefix}.scale", (c.d_model,), "scale")]
    if c.norm_kind != "rms_norm":
        specs.append(TensorSpec(f"{prefix}.bias", (c.d_model,), "norm_bias"))
    return specs


def embedding_names(c: TransformerConfig) -> dict[str, str | None]:
    """Which stored tensor each of the three vocabulary matrices reads (section 3.4 sharing).

    Keys: "source", "target" (embeddings, [vocab, d_model]) and "output" (the pre-softmax
    projection, stored as a kernel [d_model, vocab] unless tied, when it is an embedding read
    transposed). A tied tensor is stored once, under the first name here that uses it. A half
    of the family has None for what it lacks: a decoder-only model has no source, an
    encoder-only one no target and no output.
    """
    source = "shared_embedding" if c.share_embeddings else "encoder.embedding"
    target = "shared_embedding" if c.share_embeddings else "decoder.embedding"
    output = target if c.tie_output else "output.kernel"
    return {
        "source": source if c.has_encoder else None,
        "target": target if c.has_decoder else None,
        "output": output if c.has_decoder else None,
    }


def stack_names(c: TransformerConfig) -> list[str]:
    """The stacks a model of config `c` has, in order: "encoder", "decoder" or both."""
    return [s for s, present in (("encoder", c.has_encoder), ("decoder", c.has_decoder)) if present]


def embedding_specs(stack: str, c: TransformerConfig) -> list[TensorSpec]:
    """What one stack adds to its token embedding (sections 3.4, 3.5; BERT's embeddings): the
    learned position table, the segment table and the embedding LayerNorm, when the config has
    them."""
    d = c.d_model
    specs = []
    if c.position_kind == "learned":
        specs.append(TensorSpec(f"{stack}.position_embedding", (c.max_len, d), "embedding"))
    if c.type_vocab_size:
        specs.append(
            TensorSpec(f"{stack}.token_type_embedding", (c.type_vocab_size, d), "embedding")
        )
    if c.embedding_norm:
        specs += norm_specs(f"{stack}.embedding_norm", c)
    return specs


def layer_specs(stack: str, i: int, c: TransformerConfig) -> list[TensorSpec]:
    """The tensors of layer i of `stack` ("encoder" or "decoder"): its self-attention, the
    decoder's cross-attention when the model has an encoder, the feed-forward, and their norms.
    Every layer of a stack has the same shapes; only the index in the names differs."""
    p = f"{stack}.layers.{i}"
    specs = attention_specs(f"{p}.self_attention", c)
    specs += norm_specs(f"{p}.self_attention_norm", c)
    if stack == "decoder" and c.has_encoder:
        specs += attention_specs(f"{p}.cross_attention", c)
        specs += norm_specs(f"{p}.cross_attention_norm", c)
    specs += feed_forward_specs(f"{p}.feed_forward", c)
    specs += norm_specs(f"{p}.feed_forward_norm", c)
    return specs


def canonical_specs(c: TransformerConfig) -> list[TensorSpec]:
    """Every tensor of a model with config `c`, in a fixed order (embeddings, encoder, decoder,
    output): the order of docs/FORMAT.md's table and of what load_weights returns. A file's
    own order is safetensors' (by name; docs/FORMAT.md, "Order inside the file").

    The halves drop what they lack: a decoder-only model every encoder.* tensor and the
    cross-attention of each decoder layer; an encoder-only one every decoder.* and output.*
    tensor.

    The list grows with the layer counts: a reader of an outside file compares those with the
    file's keys first (layer_count_problems), and a lister that must not grow with them takes
    iter_canonical_specs and tensor_count."""
    return list(iter_canonical_specs(c))


def iter_canonical_specs(c: TransformerConfig) -> Iterator[TensorSpec]:
    """canonical_specs one at a time, so that a caller that shows the first few of a config
    with 10^9 layers (rosetta inspect --config) costs what it shows, not what the config
    claims."""
    d = c.d_model
    emb = embedding_names(c)
    if emb["source"] is not None:
        yield TensorSpec(emb["source"], (c.src_vocab_size, d), "embedding")
    if emb["target"] is not None and emb["target"] != emb["source"]:
        yield TensorSpec(emb["target"], (c.tgt_vocab_size, d), "embedding")
    for stack in stack_names(c):
        yield from embedding_specs(stack, c)

    for i in range(c.num_encoder_layers):
        yield from layer_specs("encoder", i, c)
    if c.final_norm and c.has_encoder:
        yield from norm_specs("encoder.final_norm", c)

    for i in range(c.num_decoder_layers):
        yield from layer_specs("decoder", i, c)
    if c.final_norm and c.has_decoder:
        yield from norm_specs("decoder.final_norm", c)

    if c.has_decoder and not c.tie_output:
        v = c.tgt_vocab_size
        yield TensorSpec("output.kernel", (d, v), "kernel", d, v)
    if c.output_bias:
        yield TensorSpec("output.bias", (c.tgt_vocab_size,), "bias")


def _one_layer_shell(c: TransformerConfig) -> TransformerConfig:
    """`c` with at most one layer a stack: every tensor outside the layers, and one layer's,
    for the counts that multiply one layer by the layer count (every layer has the same
    shapes). dataclasses.replace keeps a half a half (0 layers stay 0)."""
    shell = dataclasses.replace(c, num_encoder_layers=min(c.num_encoder_layers, 1))
    return dataclasses.replace(shell, num_decoder_layers=min(c.num_decoder_layers, 1))


def tensor_count(c: TransformerConfig) -> int:
    """len(canonical_specs(c)), counted from one layer a stack times the layer counts."""
    total = len(canonical_specs(_one_layer_shell(c)))
    for stack, n in (("encoder", c.num_encoder_layers), ("decoder", c.num_decoder_layers)):
        if n:
            total += (n - 1) * len(layer_specs(stack, 0, c))
    return total


# -- a config's layer counts against a file's keys ------------------------------------------------

# The canonical names' stem of a stack's layers; a torch state_dict and a Flax checkpoint name
# their layers the same way. Keras's .weights.h5 has its own (tf_impl/weights.py).
CANONICAL_LAYER_STEMS = {"encoder": "encoder.layers.{i}", "decoder": "decoder.layers.{i}"}
LAYER_COUNT_FIELDS = {"encoder": "num_encoder_layers", "decoder": "num_decoder_layers"}
_INDEX = r"0|[1-9]\d{0,17}"  # a layer index as a name writes it: no leading zeros, int64


def _stem_pattern(stem: str) -> re.Pattern[str]:
    """A key of one layer of `stem`: "{i}" the index, or Keras's "{_i}" ("" for layer 0, "_k"
    for layer k), followed by "." or "/" and the rest of the key."""
    text = re.escape(stem)
    text = text.replace(re.escape("{i}"), rf"(?P<i>{_INDEX})")
    text = text.replace(re.escape("{_i}"), rf"(?:_(?P<i>{_INDEX}))?")
    return re.compile(rf"{text}[./]")


def held_layers(keys: Iterable[str], stem: str) -> list[int]:
    """The distinct layer indices of `stem` among `keys`, sorted: the layers a file holds."""
    pattern = _stem_pattern(stem)
    return sorted({int(m["i"] or 0) for k in keys if (m := pattern.match(k))})


def _holds(stem: str, held: list[int]) -> str:
    """'2 layers (decoder.layers.{i} for i = 0 .. 1)': what a file holds, in a message."""
    if not held:
        return f"no layers ({stem})"
    if held == list(range(len(held))):
        which = f"{held[0]}" if len(held) == 1 else f"0 .. {held[-1]}"
    else:
        which = listing([str(i) for i in held])
    return f"{len(held)} layer{'' if len(held) == 1 else 's'} ({stem} for i = {which})"


def layer_count_problems(
    c: TransformerConfig, keys: Iterable[str], stems: Mapping[str, str] | None = None
) -> list[str]:
    """'num_decoder_layers: 1000000000, but the file holds 2 layers (decoder.layers.{i} for
    i = 0 .. 1)' for each stack whose layer count in `c` is not the layers the file's `keys`
    hold (`stems`: how the file names a stack's layers, the canonical names by default).

    Its work is one pass over the keys, never proportional to a count of `c`: a reader runs it
    before anything that names every layer `c` claims (canonical_specs), so that a config that
    says 10^9 layers over a file of 2 is refused in milliseconds (docs/RELIABILITY.md, "Counts
    of an outside config")."""
    keys = list(keys)
    problems = []
    for stack, stem in (stems or CANONICAL_LAYER_STEMS).items():
        field = LAYER_COUNT_FIELDS[stack]
        want = getattr(c, field)
        held = held_layers(keys, stem)
        # held is sorted and distinct: it is 0 .. want - 1 when its length and ends are.
        if not (len(held) == want and (not held or (held[0] == 0 and held[-1] == want - 1))):
            problems.append(f"{field}: {want}, but the file holds {_holds(stem, held)}")
    return problems


def canonical_shapes(c: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} for every canonical tensor, in canonical order."""
    return {s.name: s.shape for s in canonical_specs(c)}


def _numbers(specs: list[TensorSpec]) -> int:
    total = 0
    for s in specs:
        n = 1
        for dim in s.shape:
            n *= dim
        total += n
    return total


def parameter_count(c: TransformerConfig) -> int:
    """Number of trainable scalars; a tied matrix counts once.

    Counted from one layer of each stack times its layer count (every layer has the same
    shapes), so the count costs the same for 2 layers as for 10^9: the memory estimates that
    refuse an impossible config (common/app/resources.py) must not themselves build a name per
    layer."""
    layers = (("encoder", c.num_encoder_layers), ("decoder", c.num_decoder_layers))
    # the embeddings, the final norms, the output, and one layer of each stack
    total = _numbers(canonical_specs(_one_layer_shell(c)))
    for stack, n in layers:
        if n:
            total += (n - 1) * _numbers(layer_specs(stack, 0, c))
    return total


def position_buffer_count(c: TransformerConfig) -> int:
    """The numbers of the position tables that each framework's model computes when it is built
    and keeps beside its parameters (torch_impl/model.py, Stack): one per stack, of max_len rows
    of d_model (sinusoidal) or of d_k (rotary: the cosines and the sines, d_k / 2 each). Learned
    positions are parameters (parameter_count). A max_len that no tensor tells (an outside
    config's max_position_embeddings for rotary or sinusoidal positions) enters memory here."""
    width = {"sinusoidal": c.d_model, "rotary": c.head_dim}.get(c.position_kind, 0)
    stacks = int(c.has_encoder) + int(c.has_decoder)
    return stacks * c.max_len * width


# -- the ONNX graphs' inputs and outputs (torch_impl/onnx_export.py; docs/PORTING.md, "ONNX") ----

ONNX_GRAPHS = ("forward", "encoder", "decoder_step")
ONNX_CACHE_FIELDS = ("self_key", "self_value", "cross_key", "cross_value")


def onnx_cache_names(c: TransformerConfig, prefix: str) -> list[str]:
    """The decoding cache as graph inputs (prefix "past") or outputs ("present"), in order: each
    decoder layer's four buffers, then the memory mask, key_valid and index."""
    layers = [
        f"{prefix}.layers.{i}.{field}"
        for i in range(c.num_decoder_layers)
        for field in ONNX_CACHE_FIELDS
    ]
    return [*layers, f"{prefix}.memory_mask", f"{prefix}.key_valid", f"{prefix}.index"]


def onnx_io_names(c: TransformerConfig, graph: str, attention: bool = False) -> tuple[list, list]:
    """(inputs, outputs) of one ONNX graph, in order."""
    if graph == "forward":
        outputs = ["logits", "encoder_output"]
        return ["src", "tgt_in"], outputs + (attention_output_names(c) if attention else [])
    if graph == "encoder":
        return ["src"], onnx_cache_names(c, "present")
    if graph == "decoder_step":
        return ["tokens", *onnx_cache_names(c, "past")], ["logits", *onnx_cache_names(c, "present")]
    raise ValueError(f"graph: unknown {graph!r}; allowed: {', '.join(ONNX_GRAPHS)}")
