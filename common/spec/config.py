"""The spec: one frozen dataclass that every implementation, the oracle and the weight file share.

The defaults are the paper's base model (Vaswani et al. 2017, Table 3, row "base"). Every knob that
the paper leaves open, or that outside models set differently, is a field here, so that porting a
model means writing a config rather than editing code.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from transformer_rosetta.errors import ConfigError
from transformer_rosetta.files.safe_read import (
    MAX_CONFIG_BYTES,
    MAX_LISTED,
    MAX_QUOTED_CHARS,
    FileProblem,
    MissingFile,
    brief,
    parse_json,
    read_json,
    shown,
)
from transformer_rosetta.spec.arguments import check_path

NORM_POSITIONS = ("post", "pre")
NORM_KINDS = ("layer_norm", "std_plus_eps", "rms_norm")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
POSITION_KINDS = ("sinusoidal", "learned", "rotary")
ROTARY_LAYOUTS = ("half_split", "interleaved")
POOLINGS = ("none", "mean", "first")
MODEL_KINDS = ("encoder_decoder", "decoder_only", "encoder_only")
SINUSOID_LAYOUTS = ("interleaved", "concatenated")


@dataclass(frozen=True)
class TransformerConfig:
    """Every size and switch of the model. Frozen: a config is a value.

    The family (docs/FORMAT.md, "The three kinds"): both stacks is the paper's encoder-decoder;
    num_encoder_layers 0 is a decoder-only language model (GPT: causal self-attention, no
    cross-attention); num_decoder_layers 0 is an encoder-only model (BERT: bidirectional
    self-attention, hidden states and an optional pooled vector, no logits).
    """

    # Sizes. The paper's base model shares one ~37000-token BPE vocabulary between EN and DE.
    src_vocab_size: int = 37000
    tgt_vocab_size: int = 37000
    d_model: int = 512
    num_heads: int = 8  # h in the paper; d_k = d_v = d_model / h
    # d_k = d_v per head when it is not d_model / h (Keras MultiHeadAttention's key_dim; the
    # TensorFlow tutorial passes key_dim=d_model). null: d_model / h, as in section 3.2.2.
    key_dim: int | None = None
    # Grouped-query attention (Ainslie et al. 2023): the keys and values have num_kv_heads heads,
    # each shared by num_heads / num_kv_heads query heads; 1 is multi-query attention (Shazeer
    # 2019). null: num_heads, the paper's multi-head attention. docs/FORMAT.md, step 4.
    num_kv_heads: int | None = None
    d_ff: int = 2048
    # 0 encoder layers: decoder-only; 0 decoder layers: encoder-only (see `kind`).
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    # Longest sequence for learned positions. Sinusoidal positions extrapolate past it (section 3.5).
    max_len: int = 512

    # Section 5.4: dropout 0.1 on every sublayer output and on the embedding sums. The paper does not
    # use dropout on the attention probabilities; tensor2tensor later did, so it is a separate knob.
    dropout: float = 0.1
    attention_dropout: float = 0.0

    # Normalisation. The paper is post-norm: LayerNorm(x + Sublayer(x)) (section 3.1).
    norm_position: str = "post"
    # A LayerNorm after the last encoder and decoder layer. Pre-norm models need it; torch's
    # nn.Transformer has it even in post-norm, so it is its own switch.
    final_norm: bool = False
    # The paper does not give epsilon. 1e-6 is tensor2tensor's; torch uses 1e-5, Keras 1e-3.
    layer_norm_eps: float = 1e-6
    # "layer_norm": Ba et al. 2016, (x - mean) / sqrt(var + eps) with the population variance.
    # "std_plus_eps": the Annotated Transformer's (x - mean) / (std + eps), with the unbiased
    # (n - 1) standard deviation and eps outside the square root. "rms_norm": Zhang & Sennrich
    # 2019, x / sqrt(mean(x^2) + eps) * scale, no mean and no bias (Llama). docs/FORMAT.md, step 3.
    norm_kind: str = "layer_norm"

    activation: str = "relu"  # Eq. (2) uses max(0, x); GELU and SiLU variants for ported models.
    # The gated feed-forward of Shazeer 2020: (act(x W_gate) * (x W_1)) W_2, SwiGLU with "silu"
    # (Llama, Mistral, Qwen2), GeGLU with "gelu" or "gelu_tanh". docs/FORMAT.md, step 5.
    gated_feed_forward: bool = False
    feed_forward_bias: bool = True  # biases on the feed-forward projections (Llama has none)

    position_kind: str = "sinusoidal"
    # "interleaved" is Eq. (5) as written: sin at even dims, cos at odd dims. "concatenated" puts
    # every sin first, then every cos (tensor2tensor, Marian), with the same frequencies.
    sinusoid_layout: str = "interleaved"
    # Rotary positions (Su et al. 2021, RoFormer), position_kind "rotary": no position table is
    # added; every self-attention rotates its queries and keys by angle pos * rope_theta^(-2i/d_k).
    # "half_split" rotates dimension i with i + d_k/2 (Hugging Face's rotate_half); "interleaved"
    # rotates 2i with 2i + 1 (Meta's original Llama, RoFormer). docs/FORMAT.md, step 4a.
    rotary_layout: str = "half_split"
    rope_theta: float = 10000.0
    # BERT's segment (token type) embeddings: a [type_vocab_size, d_model] table per stack, whose
    # row 0 is added to every token. 0 = none. The models take no segment ids: every token is of
    # type 0, single-segment input (what sentence embedding feeds BERT).
    type_vocab_size: int = 0
    # A LayerNorm over the summed embeddings, before dropout (BERT's embeddings.LayerNorm).
    embedding_norm: bool = False

    # Section 3.4: embeddings are multiplied by sqrt(d_model), the two embedding layers share one
    # matrix, and the pre-softmax projection is that matrix transposed.
    scale_embeddings: bool = True
    share_embeddings: bool = True
    tie_output: bool = True
    output_bias: bool = False  # Marian's final_logits_bias; the paper has none.
    attention_bias: bool = True  # biases on the q/k/v/output projections of every attention
    # The output projection's bias alone, when it differs from attention_bias (Qwen2 has q/k/v
    # biases and none on the output). null: attention_bias.
    attention_output_bias: bool | None = None

    # Encoder-only: one pooled vector per sequence from the encoder output. "mean" averages the
    # non-pad positions (sentence-transformers' mean pooling); "first" takes position 0 ([CLS]).
    pooling: str = "none"
    pooled_l2_norm: bool = False  # then divide it by its L2 norm (sentence-transformers' Normalize)

    pad_id: int = 0
    bos_id: int = 1  # may equal pad_id (Marian starts decoding from the pad token)
    eos_id: int = 2

    # Section 5.4: label smoothing eps_ls = 0.1 in the training loss.
    label_smoothing: float = 0.1

    def __post_init__(self) -> None:
        problems = validation_problems(self)
        if problems:
            raise ConfigError(problems)

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """ "encoder_decoder", "decoder_only" (no encoder layers) or "encoder_only" (no decoder)."""
        if self.num_encoder_layers == 0:
            return "decoder_only"
        if self.num_decoder_layers == 0:
            return "encoder_only"
        return "encoder_decoder"

    @property
    def kind_name(self) -> str:
        """The kind as messages write it: "encoder-decoder", "decoder-only", "encoder-only"."""
        return self.kind.replace("_", "-")

    @property
    def a_model_of_its_kind(self) -> str:
        """ "an encoder-decoder model", "a decoder-only model", "an encoder-only model"."""
        return f"{'an' if self.kind_name.startswith('e') else 'a'} {self.kind_name} model"

    @property
    def has_encoder(self) -> bool:
        return self.num_encoder_layers > 0

    @property
    def has_decoder(self) -> bool:
        return self.num_decoder_layers > 0

    @property
    def kv_heads(self) -> int:
        """The key/value heads: num_kv_heads, or num_heads when it is null (multi-head)."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def output_projection_bias(self) -> bool:
        """Whether each attention's output projection has a bias: attention_output_bias, or
        attention_bias when it is null."""
        if self.attention_output_bias is None:
            return self.attention_bias
        return self.attention_output_bias

    @property
    def head_dim(self) -> int:
        """d_k = d_v: d_model / h (section 3.2.2), or key_dim when the config sets it."""
        return self.key_dim if self.key_dim is not None else self.d_model // self.num_heads

    @property
    def virtual_pad(self) -> bool:
        """Whether the model has no pad token: a decoder-only model whose pad_id is
        tgt_vocab_size, one past its vocabulary (docs/FORMAT.md, "Special ids"). That id names no
        token, so no real token is ever masked, as transformers masks none by id; where it pads a
        batch it embeds as the zero vector. A static switch: a model with a real pad pays nothing.
        """
        return self.kind == "decoder_only" and self.pad_id == self.tgt_vocab_size

    # -- JSON round trip -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Build from a dict. Unknown keys are an error naming each, with the nearest real field;
        each field's type and range is checked by validation_problems."""
        if not isinstance(data, dict):
            raise ConfigError([f"a config must be a JSON object, got {type(data).__name__}"])
        known = [f.name for f in fields(cls)]
        unknown = [k for k in data if k not in known]
        if unknown:
            problems = []
            for key in unknown[:MAX_LISTED]:
                # A long key is no near miss; difflib would also spend quadratic time on it.
                near = difflib.get_close_matches(str(key), known, n=1) if len(str(key)) < 64 else []
                hint = f" (did you mean '{near[0]}'?)" if near else ""
                problems.append(f"{shown(str(key))[:MAX_QUOTED_CHARS]}: unknown config field{hint}")
            if len(unknown) > MAX_LISTED:
                problems.append(f"and {len(unknown) - MAX_LISTED} more unknown config fields")
            raise ConfigError(problems)
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> TransformerConfig:
        """Parse JSON text (at most MAX_CONFIG_BYTES, nested at most MAX_JSON_DEPTH deep)."""
        if isinstance(text, str) and len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(
                [f"the JSON text is {len(text)} characters, over the limit of {MAX_CONFIG_BYTES}"]
            )
        try:
            data = parse_json(text)
        except FileProblem as exc:
            raise ConfigError([exc.problem]) from None
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | Path) -> TransformerConfig:
        """Read a JSON config file: a regular file of at most MAX_CONFIG_BYTES, in UTF-8 (or,
        as --config takes it, the JSON itself when the value starts with `{`)."""
        return cls.from_dict(read_config_fields(path))

    def replace(self, **changes: Any) -> TransformerConfig:
        """A copy with some fields changed (validated again)."""
        unknown = [k for k in changes if k not in {f.name for f in fields(self)}]
        if unknown:
            return TransformerConfig.from_dict({**self.to_dict(), **changes})  # raises, names them
        return dataclasses.replace(self, **changes)


def is_inline_json(value: object) -> bool:
    """Whether a --config value (or the API's config=) is the JSON itself rather than a file's
    name: it starts with `{`, as no config file's name does (write ./{name}.json for one)."""
    return isinstance(value, str) and value.lstrip().startswith("{")


def read_config_fields(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config, not yet a config: a regular UTF-8 file of at most
    MAX_CONFIG_BYTES, or the JSON itself when the value starts with `{`
    (`--config '{"pad_id": 5}'`, docs/PORTING.md), held to the same limits as a file's: its
    size, its nesting depth, the digits of an integer, a key given twice (parse_json). An
    importer table takes some fields from it and the rest from the model
    (common/porting/table.py). ConfigError names the file, or quotes the JSON, for anything
    unreadable; InputTypeError names `path` when it is neither text nor a pathlib.Path."""
    if is_inline_json(path):
        text = str(path)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                [f"config JSON: {size:,} bytes, over the limit of {MAX_CONFIG_BYTES:,}"]
            )
        try:
            data = parse_json(text)
        except FileProblem as exc:
            raise ConfigError([f"config JSON {brief(text)}: {exc.problem}"]) from None
    else:
        check_path(path, "path")
        try:
            data = read_json(path, "a config file", MAX_CONFIG_BYTES)
        except MissingFile:
            raise ConfigError([f"no such config file {shown(path)}"]) from None
        except FileProblem as exc:
            raise ConfigError([str(exc)]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"a config must be a JSON object, got {type(data).__name__}"])
    return data


_INT_FIELDS = (
    "src_vocab_size",
    "tgt_vocab_size",
    "d_model",
    "num_heads",
    "d_ff",
    "max_len",
)
_COUNT_FIELDS = ("num_encoder_layers", "num_decoder_layers", "type_vocab_size")  # 0 allowed
_ID_FIELDS = ("pad_id", "bos_id", "eos_id")
_BOOL_FIELDS = (
    "final_norm",
    "scale_embeddings",
    "share_embeddings",
    "tie_output",
    "output_bias",
    "attention_bias",
    "embedding_norm",
    "pooled_l2_norm",
    "gated_feed_forward",
    "feed_forward_bias",
)
_PROBABILITY_FIELDS = ("dropout", "attention_dropout", "label_smoothing")
_CHOICES = {
    "norm_position": NORM_POSITIONS,
    "norm_kind": NORM_KINDS,
    "activation": ACTIVATIONS,
    "position_kind": POSITION_KINDS,
    "sinusoid_layout": SINUSOID_LAYOUTS,
    "rotary_layout": ROTARY_LAYOUTS,
    "pooling": POOLINGS,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validation_problems(c: TransformerConfig) -> list[str]:
    """Every way `c` breaks the spec, as 'field: what is wrong; what is allowed'. Empty when valid."""
    problems: list[str] = []
    for name in _INT_FIELDS:
        value = getattr(c, name)
        if not _is_int(value):
            problems.append(f"{name}: must be an integer >= 1, got {brief(value)}")
        elif value < 1:
            problems.append(f"{name}: must be >= 1, got {value}")
    for name in _COUNT_FIELDS:
        value = getattr(c, name)
        if not _is_int(value) or value < 0:
            problems.append(f"{name}: must be an integer >= 0, got {brief(value)}")
    for name in _ID_FIELDS:
        value = getattr(c, name)
        if not _is_int(value) or value < 0:
            problems.append(f"{name}: must be an integer >= 0, got {brief(value)}")
    for name in _BOOL_FIELDS:
        value = getattr(c, name)
        if not isinstance(value, bool):
            problems.append(f"{name}: must be true or false, got {brief(value)}")
    for name in _PROBABILITY_FIELDS:
        value = getattr(c, name)
        if not _is_number(value) or not 0.0 <= value < 1.0:
            problems.append(f"{name}: must be a number in [0, 1), got {brief(value)}")
    if c.key_dim is not None and (not _is_int(c.key_dim) or c.key_dim < 1):
        problems.append(f"key_dim: must be an integer >= 1 or null, got {brief(c.key_dim)}")
    if c.num_kv_heads is not None and (not _is_int(c.num_kv_heads) or c.num_kv_heads < 1):
        problems.append(
            f"num_kv_heads: must be an integer >= 1 or null, got {brief(c.num_kv_heads)}"
        )
    if c.attention_output_bias is not None and not isinstance(c.attention_output_bias, bool):
        problems.append(
            f"attention_output_bias: must be true, false or null, got {brief(c.attention_output_bias)}"
        )
    theta = c.rope_theta
    if not _is_number(theta) or not 1.0 < theta < 1e12:
        problems.append(f"rope_theta: must be a number in (1, 1e12), got {brief(theta)}")
    eps = c.layer_norm_eps
    if not _is_number(eps) or not 0.0 < eps < 1.0:
        problems.append(f"layer_norm_eps: must be a number in (0, 1), got {brief(eps)}")
    for name, allowed in _CHOICES.items():
        value = getattr(c, name)
        if value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            problems.append(f"{name}: unknown value {brief(value)}; allowed: {choices}")
    if problems:  # the cross-field rules below assume well-typed fields
        return problems

    problems += family_problems(c)
    if c.key_dim is None and c.d_model % c.num_heads:
        problems.append(
            f"d_model: {c.d_model} is not divisible by num_heads={c.num_heads}; "
            "d_model must be a multiple of num_heads (d_k = d_model / h), or set key_dim"
        )
    if c.num_kv_heads is not None and c.num_heads % c.num_kv_heads:
        problems.append(
            f"num_kv_heads: {c.num_kv_heads} does not divide num_heads={c.num_heads}; each "
            "key/value head serves num_heads / num_kv_heads query heads"
        )
    if c.position_kind == "rotary" and c.head_dim % 2:
        problems.append(
            f"position_kind: rotary positions rotate pairs of dimensions, so the head size "
            f"(d_k) must be even, got {c.head_dim}"
        )
    if c.norm_kind == "std_plus_eps" and c.d_model < 2:
        problems.append(
            "norm_kind: 'std_plus_eps' divides by d_model - 1 (the unbiased standard deviation), "
            f"so d_model must be >= 2, got {c.d_model}"
        )
    if c.position_kind == "sinusoidal" and c.d_model % 2:
        problems.append(
            f"d_model: sinusoidal positions pair a sin and a cos per frequency, so d_model must "
            f"be even, got {c.d_model}"
        )
    if c.share_embeddings and c.src_vocab_size != c.tgt_vocab_size:
        problems.append(
            f"share_embeddings: one shared embedding needs src_vocab_size == tgt_vocab_size, got "
            f"{c.src_vocab_size} and {c.tgt_vocab_size}; set share_embeddings to false"
        )
        if c.tie_output:
            problems.append(
                "tie_output: the output projection would be tied to the shared embedding, whose "
                f"vocabulary ({c.src_vocab_size}) differs from the target vocabulary "
                f"({c.tgt_vocab_size}); untie it or use one vocabulary"
            )
    for name in _ID_FIELDS:
        value = getattr(c, name)
        if name == "pad_id" and c.virtual_pad:
            continue  # one past the vocabulary: a decoder-only model without a pad token
        for stack, size in special_id_vocabularies(c, name):
            if value >= size:
                problems.append(
                    f"{name}: {value} is outside the {stack} vocabulary (size {size})"
                    + (
                        "; pad_id = tgt_vocab_size (no pad token) is for a decoder-only model "
                        f"only, and {c.a_model_of_its_kind} masks its padding by pad_id"
                        if name == "pad_id" and stack == "target" and value == size
                        else ""
                    )
                )
    if c.eos_id == c.pad_id:
        problems.append(f"eos_id: must differ from pad_id (both {c.eos_id})")
    # GPT-2's <|endoftext|> both starts and ends a text: a decoder-only model, which decodes from
    # its prompt rather than from BOS, may use one id for both.
    if c.eos_id == c.bos_id and c.has_encoder:
        problems.append(f"eos_id: must differ from bos_id (both {c.eos_id})")
    return problems


def special_id_vocabularies(c: TransformerConfig, name: str) -> list[tuple[str, int]]:
    """(stack, vocabulary size) for each vocabulary that special id `name` must index
    (docs/FORMAT.md, "Special ids"). bos_id and eos_id are the decoder's: the first input of
    decoding and the token that ends it, so they index the target vocabulary only, whatever the
    source's own markers are (TensorFlow's older tutorial numbers them vocab_size and
    vocab_size + 1 of each language's tokenizer, so the target's end id may lie outside a smaller
    source vocabulary). An encoder-only model keeps them there too, unused. pad_id is read by
    every stack that the model has: each of those vocabularies."""
    if name in ("bos_id", "eos_id"):
        return [("target", c.tgt_vocab_size)]
    stacks = (
        ("source", c.src_vocab_size, c.has_encoder),
        ("target", c.tgt_vocab_size, c.has_decoder),
    )
    return [(stack, size) for stack, size, present in stacks if present] or [
        ("source", c.src_vocab_size),
        ("target", c.tgt_vocab_size),
    ]


def family_problems(c: TransformerConfig) -> list[str]:
    """The rules of the two halves (docs/FORMAT.md, "The three kinds"): what a stack that is
    absent would have shared, tied or pooled."""
    problems: list[str] = []
    if not c.has_encoder and not c.has_decoder:
        return [
            "num_encoder_layers: both stacks have 0 layers; set num_encoder_layers 0 for a "
            "decoder-only model or num_decoder_layers 0 for an encoder-only one, not both"
        ]
    if c.kind != "encoder_decoder" and c.share_embeddings:
        problems.append(
            f"share_embeddings: {c.a_model_of_its_kind} has one embedding, nothing to "
            "share it with; set share_embeddings to false"
        )
    if c.kind == "encoder_only":
        for name in ("tie_output", "output_bias"):
            if getattr(c, name):
                problems.append(
                    f"{name}: an encoder-only model has no output projection (it returns hidden "
                    f"states); set {name} to false"
                )
    elif c.pooling != "none":
        problems.append(
            f"pooling: only an encoder-only model (num_decoder_layers 0) pools, got "
            f"{c.pooling!r} on {c.a_model_of_its_kind}; set pooling to 'none'"
        )
    if c.pooled_l2_norm and c.pooling == "none":
        problems.append("pooled_l2_norm: there is no pooled vector to normalise (pooling 'none')")
    return problems


# Small enough that the oracle grid runs in seconds; odd sizes would hide nothing here, the
# property tests of the parity issue draw those.
_TINY = TransformerConfig(
    src_vocab_size=48,
    tgt_vocab_size=48,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=32,
    dropout=0.0,
)
PRESETS: dict[str, TransformerConfig] = {
    "tiny": _TINY,
    # The two halves at the tiny sizes: a GPT-style decoder-only LM (pre-norm, learned positions,
    # tanh GELU, a final norm, tied output) and a BERT-style encoder (post-norm, learned positions,
    # segment embeddings, an embedding LayerNorm, exact GELU, mean pooling with L2 norm).
    "tiny_decoder_only": _TINY.replace(
        num_encoder_layers=0,
        norm_position="pre",
        final_norm=True,
        activation="gelu_tanh",
        position_kind="learned",
        scale_embeddings=False,
        share_embeddings=False,
    ),
    "tiny_encoder_only": _TINY.replace(
        num_decoder_layers=0,
        activation="gelu",
        position_kind="learned",
        type_vocab_size=2,
        embedding_norm=True,
        layer_norm_eps=1e-12,
        scale_embeddings=False,
        share_embeddings=False,
        tie_output=False,
        pooling="mean",
        pooled_l2_norm=True,
    ),
    # Today's decoders at the tiny sizes: a Llama (pre-norm RMSNorm with a final norm, rotary
    # positions in Hugging Face's half-split layout, SwiGLU, grouped-query attention with two
    # query heads per key/value head, no biases, an untied output, unscaled embeddings).
    "tiny_llama": _TINY.replace(
        num_encoder_layers=0,
        d_model=32,
        num_heads=4,
        num_kv_heads=2,
        d_ff=64,
        norm_position="pre",
        final_norm=True,
        norm_kind="rms_norm",
        activation="silu",
        gated_feed_forward=True,
        position_kind="rotary",
        attention_bias=False,
        feed_forward_bias=False,
        scale_embeddings=False,
        share_embeddings=False,
        tie_output=False,
    ),
    "base": TransformerConfig(),
    # Table 3, "big": d_model 1024, d_ff 4096, h 16, P_drop 0.3 (0.1 for EN-FR).
    "big": TransformerConfig(d_model=1024, num_heads=16, d_ff=4096, dropout=0.3),
}


def preset(name: str) -> TransformerConfig:
    """One of PRESETS by name, with an error listing the names when it is unknown."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):  # TypeError: a list or a dict is no name (unhashable)
        raise ConfigError(
            [f"preset: unknown preset {name!r}; allowed: {', '.join(PRESETS)}"]
        ) from None
