"""An importer is a table: source-name pattern -> canonical name, plus the steps between them.

Every outside model that `rosetta convert` reads (torch.nn.Transformer pipelines, Hugging Face
Marian, the Annotated Transformer, the PyTorch and TensorFlow tutorials, the Keras pre-norm
model) is one `Table` of data, read by the one engine below, with the one set of steps in STEPS.
A user's own model is the same table written as JSON (`rosetta convert --map MAP.json`,
common/porting/user_map.py; docs/PORTING.md has a worked example).

A table says:
- `rules`: for each canonical tensor (a pattern over transformer_rosetta.spec.names, `{i}` for the layer
  index), the source key it is read from (the same `{i}`, or `{_i}` for Keras's per-class layer
  names "", "_1", "_2"; and `{prefix}` for an optional prefix),
  and the steps that turn the source array into the canonical one. A rule may carry `copies`
  (keys that, when present, must hold the same array: a tied matrix saved under several names),
  `fallbacks` (read only when the key is absent), a `when` (config fields it applies under) and
  `absent_zeros` (a missing tensor is zeros, as transformers treats Marian's final_logits_bias).
  A source with `{h}` is one key per head (h = 0 .. num_heads - 1: a model with one Linear per
  head), concatenated along axis 0 into one packed array before the steps. A rule may instead be
  `computed` from the config (a position table that the model's code computes and never stores).
- `buffers`: stored constants that are not weights (a sinusoid table). Each is checked against
  the sinusoid of the layout the table claims, within a derived bound (`sinusoid_bound`), and
  then dropped; or, when the user asks (`learned_positions`), imported as learned positions.
  A buffer is never silently replaced.
- `constants`: stored arrays that are not weights either (a causal-mask buffer), checked to hold
  what the model's code puts there, then dropped.
- the config: `fixed` fields (what the model's code fixes, each with why), `defaults` (what its
  text uses, overridable), `needs` (what the file cannot tell and the user must give), and the
  sizes the file tells (`sizes`, `layer_counts`, and `flags`: a field that is true when a key is
  present). `assemble_config` merges them with the user's fields and refuses every contradiction
  by name. `head_sizes` are the shapes that tell a head count times d_k (a packed q or k
  projection).
- the counts of a config that comes with the file (a config.json, a params.json, --config) are
  checked against its keys and shapes by `check_counts` before anything proportional to them is
  built: the layers of each stack (the distinct layer indices of the keys), the heads of a
  per-head layout, the `sizes` and `head_sizes`, and the position table that the models compute
  for a max_len no tensor tells (its memory). to_canonical runs it first; an importer with work
  of its own before that runs it first itself, on the file's header shapes.

Nothing here imports a framework: sources arrive as {name: numpy array}.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError, WeightFileError
from transformer_rosetta.files.memory import fits_problem
from transformer_rosetta.files.safe_read import brief, listing
from transformer_rosetta.oracle.reference import sinusoidal_positions
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import TensorSpec, canonical_specs, position_buffer_count
from transformer_rosetta.weights.format import dtype_problems

# -- the steps: one shared set of transforms -----------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One transform from a source array towards the canonical one. `native_shape` maps the shape
    after the step back to the shape before it (so a wrong source shape is named before anything
    runs); `apply` does the step. Both see the canonical spec and the config."""

    text: str  # as written in a table, e.g. "split:1/3"
    describe: str
    native_shape: Callable[[tuple[int, ...], TensorSpec], tuple[int, ...]]
    apply: Callable[[np.ndarray, TensorSpec, TransformerConfig], np.ndarray]
    # The way out (export, from_canonical): the array before the step from the array after it.
    # A split's block is returned as it is; from_canonical stacks the blocks of one key.
    invert: Callable[[np.ndarray, TensorSpec], np.ndarray] = lambda a, spec: a
    block: tuple[int, int] | None = None  # (K, N) of a split
    block_axis: int = 0  # the axis the blocks of a split are stacked along


def _merged_heads(shape: tuple[int, ...], spec: TensorSpec) -> tuple[int, ...]:
    """The canonical attention shape with its two head axes merged: [d, h, d_k] -> [d, h*d_k],
    [h, d_k, d] -> [h*d_k, d] (a kernel is a view of its [fan_in, fan_out] matrix) and
    [h, d_k] -> [h*d_k]."""
    if spec.role == "kernel":
        return (spec.fan_in, spec.fan_out)
    return (math.prod(shape),)


def _split(text: str, part: int, parts: int, axis: int = 0) -> Step:
    """Block `part` of `parts` along `axis`: rows of a packed [3 out, in] Linear (axis 0), or
    columns of a packed [in, 3 out] matrix (axis 1, as GPT-2's Conv1D stores c_attn)."""
    what = "rows" if axis == 0 else "columns"

    def native(shape: tuple[int, ...], spec: TensorSpec) -> tuple[int, ...]:
        if axis >= len(shape):  # columns of a vector: no source shape fits, the file's is named
            return shape
        return (*shape[:axis], shape[axis] * parts, *shape[axis + 1 :])

    def apply(a: np.ndarray, spec: TensorSpec, c: TransformerConfig) -> np.ndarray:
        size = a.shape[axis] // parts
        return np.take(a, range(part * size, (part + 1) * size), axis=axis)

    return Step(
        text,
        f"{what} {part + 1} of {parts} (a packed q/k/v)",
        native,
        apply,
        block=(part, parts),
        block_axis=axis,
    )


def _squeeze(text: str, axis: int) -> Step:
    return Step(
        text,
        f"axis {axis} of size 1 dropped",
        lambda shape, spec: (*shape[:axis], 1, *shape[axis:]),
        lambda a, spec, c: np.squeeze(a, axis=axis),
        lambda a, spec: np.expand_dims(a, axis),
    )


def _scale(text: str, factor: float) -> Step:
    return Step(
        text,
        f"multiplied by {factor:g}",
        lambda shape, spec: shape,
        lambda a, spec, c: (a * np.asarray(factor, a.dtype)).astype(a.dtype),
        lambda a, spec: (a / np.asarray(factor, a.dtype)).astype(a.dtype),
    )


def _zero_pad_row(a: np.ndarray, spec: TensorSpec, c: TransformerConfig) -> np.ndarray:
    out = np.array(a, copy=True)
    out[c.pad_id] = 0
    return out


def _rotary_pairs(a: np.ndarray, spec: TensorSpec, split: bool) -> np.ndarray:
    """Axis 0 of a query's or key's [heads * d_k, ...] source (an [out, in] weight or a bias),
    reordered within each head between Meta's interleaved rotary pairs (2i, 2i + 1) and the
    half-split ones (i, i + d_k/2) of Hugging Face's rotate_half; the heads and d_k are the
    canonical spec's last two axes ([d, heads, d_k] or [heads, d_k]). `split` is Hugging Face's
    convert_llama_weights_to_hf.py permute(w, n_heads, dim1, dim2) = w.view(n_heads,
    dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2); not `split`, its inverse."""
    heads, d_k = spec.shape[-2:]
    pairs = (heads, d_k // 2, 2) if split else (heads, 2, d_k // 2)
    return a.reshape(*pairs, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


STEPS: dict[str, Step] = {
    "transpose": Step(
        "transpose",
        "transposed ([out, in] -> [in, out])",
        lambda shape, spec: tuple(reversed(shape)),
        lambda a, spec, c: a.T,
        lambda a, spec: a.T,
    ),
    "heads": Step(
        "heads",
        "split into heads",
        _merged_heads,
        lambda a, spec, c: a.reshape(spec.shape),
        lambda a, spec: a.reshape(_merged_heads(spec.shape, spec)),
    ),
    "zero_pad_row": Step(
        "zero_pad_row",
        "row pad_id set to zero",
        lambda shape, spec: shape,
        _zero_pad_row,
    ),
    # Meta's Llama rotates interleaved pairs; the same rows reordered per head rotate the same
    # pairs in the half-split layout (common/porting/meta_llama.py). Query and key only.
    "rotary_permute": Step(
        "rotary_permute",
        "rows permuted per head from interleaved rotary pairs (2i, 2i+1) to half-split ones "
        "(i, i + d_k/2) (Hugging Face's permute)",
        lambda shape, spec: shape,
        lambda a, spec, c: _rotary_pairs(a, spec, split=True),
        lambda a, spec: _rotary_pairs(a, spec, split=False),
    ),
}
# Steps with an argument: "split:K/N" (block K of N along axis 0), "columns:K/N" (along axis 1),
# "squeeze:A", "scale:F".
_ARGUMENT_STEPS = {
    "split": (re.compile(r"(\d+)/(\d+)"), "split:K/N (block K of N along axis 0, K from 0)"),
    "columns": (
        re.compile(r"(\d+)/(\d+)"),
        "columns:K/N (block K of N along axis 1, K from 0)",
    ),
    "squeeze": (re.compile(r"(\d+)"), "squeeze:A (drop axis A, of size 1)"),
    "scale": (re.compile(r"([-+0-9.eE]+)"), "scale:F (multiply by the number F)"),
}
STEP_HELP = [*STEPS, *(help for _, help in _ARGUMENT_STEPS.values())]


def parse_step(text: Any) -> Step:
    """The Step a table writes as `text`; ValueError with what is allowed when it is none."""
    if isinstance(text, str) and text in STEPS:
        return STEPS[text]
    name, _, argument = text.partition(":") if isinstance(text, str) else ("", "", "")
    if name in _ARGUMENT_STEPS:
        pattern, usage = _ARGUMENT_STEPS[name]
        match = pattern.fullmatch(argument)
        if match and name in ("split", "columns") and int(match[1]) < int(match[2]):
            return _split(text, int(match[1]), int(match[2]), 0 if name == "split" else 1)
        if match and name == "squeeze":
            return _squeeze(text, int(match[1]))
        if match and name == "scale":
            try:
                return _scale(text, float(match[1]))
            except ValueError:
                pass
        raise ValueError(f"step {brief(text)}: expected {usage}")
    raise ValueError(f"unknown step {brief(text)}; allowed: {', '.join(STEP_HELP)}")


def describe_steps(steps: Sequence[Step]) -> str:
    """'as is', or the steps' descriptions joined, for the PORTING.md tables."""
    return ", then ".join(s.describe for s in steps) if steps else "as is"


# -- the table ----------------------------------------------------------------------------------

HEADS = "{h}"  # in a source key: one key per head, concatenated along axis 0


@dataclass(frozen=True)
class Computed:
    """A canonical tensor that the model's code computes rather than stores (a position table):
    `compute(spec, config)` gives it in float64, rounded once to the file's dtype on import."""

    describe: str  # the formula, for messages and docs/PORTING.md
    compute: Callable[[TensorSpec, TransformerConfig], np.ndarray]


@dataclass(frozen=True)
class Constant:
    """A stored array that is no weight (a causal-mask buffer): each key matching `source` (`{i}`
    for any layer index) must pass `check`, then is dropped."""

    source: str
    holds: str  # what the model's code stores there, for messages: "the causal mask ..."
    check: Callable[[np.ndarray], bool]


def is_causal_mask(a: np.ndarray) -> bool:
    """A lower-triangular matrix of ones ([..., L, L], every leading axis of size 1; bool or
    numbers): the mask `torch.tril(torch.ones(L, L))` that GPT code registers as a buffer."""
    a = np.asarray(a)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or math.prod(a.shape[:-2]) != 1:
        return False
    if a.dtype.kind not in "biuf":
        return False
    m = a.reshape(a.shape[-2:])
    return bool(np.all((m == 0) | (m == 1)) and np.array_equal(m != 0, np.tri(len(m), dtype=bool)))


@dataclass(frozen=True)
class Rule:
    """Where the canonical tensors matching `canonical` come from."""

    canonical: str  # e.g. "encoder.layers.{i}.self_attention.query.kernel"
    source: str  # e.g. "{prefix}encoder.layers.{i}.self_attn.in_proj_weight"
    steps: tuple[str, ...] = ()
    copies: tuple[str, ...] = ()  # present -> must equal the array read
    fallbacks: tuple[str, ...] = ()  # read only when `source` and the copies are absent
    when: tuple[tuple[str, Any], ...] = ()  # (config field, value) pairs that must all hold
    absent_zeros: bool = False  # a missing tensor is zeros rather than a problem
    computed: Computed | None = None  # no source: computed from the config (source "")

    def applies(self, c: TransformerConfig) -> bool:
        return all(getattr(c, name) == value for name, value in self.when)


@dataclass(frozen=True)
class Buffer:
    """A stored sinusoid table: checked, then dropped, or imported as learned positions."""

    source: str
    layout: str  # the layout the model's code computes: "interleaved" or "concatenated"
    steps: tuple[str, ...] = ()  # to [length, d_model]
    # "float64": computed in float64 and rounded once to the stored dtype (transformers, numpy);
    # "stored": computed in the stored dtype itself (torch's default dtype), see sinusoid_bound.
    computed_in: str = "stored"
    learned: tuple[str, ...] = ()  # canonical names it becomes with learned positions


@dataclass(frozen=True)
class Table:
    """One importer, as data (the module docstring says what each part means)."""

    kind: str  # the --from name
    model: str  # for messages: "the Annotated Transformer"
    rules: tuple[Rule, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    why: Mapping[str, str] = field(default_factory=dict)  # fixed field -> the reason, for messages
    defaults: Mapping[str, Any] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    sizes: Mapping[str, tuple[str, int]] = field(default_factory=dict)  # field -> (key, axis)
    layer_counts: Mapping[str, str] = field(default_factory=dict)  # field -> key with {i}
    flags: Mapping[str, str] = field(default_factory=dict)  # field -> key: True iff present
    # field (num_heads, num_kv_heads) -> (key, axis) that holds that many heads of d_k
    head_sizes: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    buffers: tuple[Buffer, ...] = ()
    constants: tuple[Constant, ...] = ()
    optional_prefix: str = ""  # {prefix}: this when any key starts with it, else ""
    # An unexpected or wrong-shaped key -> one more line, said first (another kind's file). A key
    # with "*" is a pattern (fnmatch) that any unexpected key may match: a whole naming scheme.
    hints: Mapping[str, str] = field(default_factory=dict)
    tie_reason: str = "the table ties them"


@dataclass(frozen=True)
class Resolved:
    """One canonical tensor and where it is read from, in this config and this file."""

    spec: TensorSpec
    rule: Rule
    key: str
    copies: tuple[str, ...]
    fallbacks: tuple[str, ...]
    steps: tuple[Step, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *self.copies, *self.fallbacks)


def _pattern(canonical: str) -> re.Pattern[str]:
    return re.compile(re.escape(canonical).replace(re.escape("{i}"), r"(?P<i>\d+)"))


def _fill(pattern: str, index: str | None, prefix: str) -> str:
    """A source pattern with its placeholders filled: {prefix}, {i} (the layer index) and {_i},
    Keras's name for the i-th layer of one class in a list: "" for the first, then "_1", "_2"
    (keras.saving numbers a container's layers per class name, so the path is reproducible)."""
    text = pattern.replace("{prefix}", prefix)
    if index is None or index == "{i}":  # "{i}": the pattern itself, for the docs' tables
        return text
    return text.replace("{i}", index).replace("{_i}", "" if index == "0" else f"_{index}")


def prefix_of(table: Table, names: Sequence[str]) -> str:
    """The table's optional prefix when any source key starts with it, else ''."""
    p = table.optional_prefix
    return p if p and any(n.startswith(p) for n in names) else ""


def resolve(
    table: Table, c: TransformerConfig, prefix: str = "", patterns: bool = False
) -> list[Resolved]:
    """Each canonical tensor of `c` with its source, in canonical order. A tensor that no rule or
    two rules name is a fault of the table: ConfigError naming it (a user's map gets this).
    `patterns` keeps the layer placeholders in the source keys (for the docs' tables)."""
    rules = [(r, _pattern(r.canonical)) for r in table.rules if r.applies(c)]
    if c.position_kind == "learned":  # a stored sinusoid table imported as learned positions
        for buffer in table.buffers:
            for name in buffer.learned:
                rules.append((Rule(name, buffer.source, buffer.steps), _pattern(name)))
    out, problems = [], []
    for spec in canonical_specs(c):
        hits = [(r, m) for r, p in rules if (m := p.fullmatch(spec.name))]
        if len(hits) != 1:
            what = "no rule" if not hits else f"{len(hits)} rules"
            problems.append(f"{spec.name}: {what} in the table of {table.model} names it")
            continue
        rule, match = hits[0]
        index = "{i}" if patterns and match.groupdict().get("i") else match.groupdict().get("i")
        try:
            steps = tuple(parse_step(s) for s in rule.steps)
        except ValueError as exc:
            problems.append(f"{rule.canonical}: {exc}")
            continue
        out.append(
            Resolved(
                spec,
                rule,
                _fill(rule.source, index, prefix),
                tuple(_fill(k, index, prefix) for k in rule.copies),
                tuple(_fill(k, index, prefix) for k in rule.fallbacks),
                steps,
            )
        )
    if problems:
        raise ConfigError(problems)
    return out


def native_shape(r: Resolved) -> tuple[int, ...]:
    """The source shape that the steps turn into the canonical shape (the steps run backwards)."""
    shape = r.spec.shape
    for step in reversed(r.steps):
        shape = tuple(step.native_shape(shape, r.spec))
    return shape


# -- the config ----------------------------------------------------------------------------------


def fixed_problems(table: Table, c: TransformerConfig) -> list[str]:
    """'field: why' for every fixed field that `c` contradicts."""
    problems = []
    learned = c.position_kind == "learned" and any(b.learned for b in table.buffers)
    for name, value in table.fixed.items():
        if learned and name in ("position_kind", "sinusoid_layout"):
            continue  # the stored table imported as learned positions, as the user asked
        if getattr(c, name) != value:
            why = table.why.get(name, f"{table.model} has {value!r}")
            problems.append(f"{name}: {why}")
    return problems


def file_sizes(table: Table, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int | bool]:
    """The config fields that the file's shapes tell (`sizes`, `layer_counts`), and those its
    keys tell (`flags`: true when the key is present)."""
    prefix = prefix_of(table, list(shapes))
    found: dict[str, int | bool] = {
        name: _fill(key, None, prefix) in shapes for name, key in table.flags.items()
    }
    for name, (key, axis) in table.sizes.items():
        shape = shapes.get(_fill(key, None, prefix))
        if name not in found and shape is not None and len(shape) > axis:
            found[name] = int(shape[axis])
    for name, key in table.layer_counts.items():
        pattern = (
            re.escape(_fill(key, None, prefix))
            .replace(re.escape("{i}"), r"(\d{1,9})")
            .replace(re.escape("{_i}"), r"(?:_(\d{1,9}))?")
        )
        indices = {int(m[1] or 0) for n in shapes if (m := re.match(pattern, n))}
        if indices:
            found[name] = max(indices) + 1
    return found


def assemble_config(
    table: Table,
    shapes: Mapping[str, tuple[int, ...]],
    given: Mapping[str, Any] | None = None,
    *,
    learned_positions: bool = False,
) -> TransformerConfig:
    """The config of the model in the file: the table's fixed fields and defaults, the sizes the
    file tells, and the user's `given` fields (from --config). Every contradiction between them
    and every field that nobody gives is refused by name, all at once."""
    given = dict(given or {})
    problems: list[str] = []
    fields_: dict[str, Any] = {**table.defaults, **table.fixed}
    if learned_positions:
        buffer = _learned_buffer(table, problems)
        if buffer is not None:
            fields_["position_kind"] = "learned"
            shape = shapes.get(_fill(buffer.source, None, prefix_of(table, list(shapes))))
            if shape is not None:
                squeezed = [d for i, d in enumerate(shape) if not _squeezed_axis(buffer, i)]
                fields_["max_len"] = int(squeezed[0])
    told = file_sizes(table, shapes)
    for name, value in given.items():
        if name in table.fixed and value != fields_[name]:
            why = table.why.get(name, f"{table.model} has {table.fixed[name]!r}")
            problems.append(f"{name}: --config says {brief(value)}, but {why}")
        elif name in told and value != told[name]:
            what = "tensors" if name in table.flags else "shapes"
            problems.append(
                f"{name}: --config says {brief(value)}, but the file's {what} say {told[name]}"
            )
    fields_.update(told)
    fields_.update({k: v for k, v in given.items() if k not in table.fixed})
    if (
        fields_.get("num_encoder_layers") == 0
        and "tgt_vocab_size" in fields_
        and "pad_id" not in fields_
        and "pad_id" not in table.needs
    ):
        # A decoder-only model whose pad nobody names has none: the virtual pad, an id that names
        # no token (TransformerConfig.virtual_pad), so that no token is masked.
        fields_["pad_id"] = fields_["tgt_vocab_size"]
    missing = [n for n in table.needs if n not in fields_]
    for name in missing:
        problems.append(f"{name}: the file cannot tell it; give it in --config FILE.json")
    if problems:
        raise ConfigError(problems)
    if fields_.get("key_dim") is not None and "d_model" in fields_ and "num_heads" in fields_:
        d, h = fields_["d_model"], fields_["num_heads"]
        if isinstance(d, int) and isinstance(h, int) and h > 0 and d == h * fields_["key_dim"]:
            fields_["key_dim"] = None  # d_model / h: the paper's case, stated as such
    return TransformerConfig.from_dict(fields_)


def _learned_buffer(table: Table, problems: list[str]) -> Buffer | None:
    candidates = [b for b in table.buffers if b.learned]
    if not candidates:
        problems.append(
            f"--learned-positions: {table.model} stores no position table to import as learned"
        )
        return None
    return candidates[0]


def _squeezed_axis(buffer: Buffer, axis: int) -> bool:
    return any(s == f"squeeze:{axis}" for s in buffer.steps)


# -- the counts of a config, against the file ------------------------------------------------------

_INDEX = r"\d{1,9}"  # a layer or head index in a key (as file_sizes reads them)
_STACK_LAYERS = (("encoder", "num_encoder_layers"), ("decoder", "num_decoder_layers"))


def _source_regex(source: str, prefix: str) -> re.Pattern[str]:
    """A source key as a pattern: group `i` the layer index ({i}, or Keras's {_i}: absent for
    layer 0), group `h` the head index ({h})."""
    text = re.escape(source.replace("{prefix}", prefix))
    for placeholder, first, again in (
        ("{i}", rf"(?P<i>{_INDEX})", "(?P=i)"),
        ("{_i}", rf"(?:_(?P<i>{_INDEX}))?", "(?:_(?P=i))?"),
        (HEADS, rf"(?P<h>{_INDEX})", "(?P=h)"),
    ):
        escaped = re.escape(placeholder)
        head, sep, rest = text.partition(escaped)
        if sep:
            text = head + first + rest.replace(escaped, again)
    return re.compile(text)


def _indices(patterns: Sequence[re.Pattern[str]], keys: Sequence[str], group: str) -> set[int]:
    found = set()
    for key in keys:
        for pattern in patterns:
            if m := pattern.fullmatch(key):
                found.add(int(m[group] or 0))
                break
    return found


def _held(stem: str, name: str, letter: str, held: Sequence[int]) -> str:
    """'2 layers (model.layers.{i} for i = 0 .. 1)': what the file holds, in a message."""
    if not held:
        return f"no {stem}"
    if held == list(range(len(held))):
        which = f"{held[0]}" if len(held) == 1 else f"0 .. {held[-1]}"
    else:
        which = listing([str(i) for i in held])
    plural = "" if len(held) == 1 else "s"
    return f"{len(held)} {name}{plural} ({stem} for {letter} = {which})"


def _stem(source: str, placeholder: str, prefix: str) -> str:
    """The source key up to its placeholder: 'model.layers.{i}'."""
    head, sep, _ = source.replace("{prefix}", prefix).partition(placeholder)
    return head + sep


def _whole(held: Sequence[int], want: int) -> bool:
    """`held` (sorted, distinct) is 0 .. want - 1, compared without building that range."""
    return len(held) == want and (not held or (held[0] == 0 and held[-1] == want - 1))


def count_problems(
    table: Table, c: TransformerConfig, shapes: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """'field: ...' for every count of `c` that the file's keys or shapes contradict, or that
    asks for more memory than this machine has where no tensor tells it (module docstring).

    Its work is proportional to the file's keys and the table's rules, never to a count of `c`,
    so that it can run before anything that is: resolve names every layer `c` claims, a `{h}`
    source every head, a computed position table every position."""
    keys = list(shapes)
    prefix = prefix_of(table, keys)
    problems = []
    for stack, name in _STACK_LAYERS:
        sources = [
            k
            for r in table.rules
            if r.computed is None and r.canonical.startswith(f"{stack}.layers.{{i}}.")
            for k in (r.source, *r.copies, *r.fallbacks)
            if "{i}" in k or "{_i}" in k
        ]
        if not sources:
            continue
        held = sorted(_indices([_source_regex(k, prefix) for k in sources], keys, "i"))
        want = getattr(c, name)
        if not _whole(held, want):
            placeholder = "{i}" if "{i}" in sources[0] else "{_i}"
            what = _held(_stem(sources[0], placeholder, prefix), "layer", "i", held)
            problems.append(f"{name}: {brief(want)}, but the file holds {what}")
    for source in dict.fromkeys(r.source for r in table.rules if HEADS in r.source):
        proj = next(r.canonical for r in table.rules if r.source == source).split(".")[-2]
        name, want = (
            ("num_kv_heads", c.kv_heads) if proj in ("key", "value") else ("num_heads", c.num_heads)
        )
        held = sorted(_indices([_source_regex(source, prefix)], keys, "h"))
        if held and not _whole(held, want):
            what = _held(_stem(source, HEADS, prefix), "head", "h", held)
            problems.append(f"{name}: {brief(want)}, but the file holds {what}")
    said = set()  # (key, axis, value): two fields read from one axis are one problem
    for name, (key, axis) in table.sizes.items():
        want = c.head_dim if name == "key_dim" else getattr(c, name)
        shape = shapes.get(_fill(key, None, prefix))
        if (key, axis, want) in said:
            continue
        if shape is not None and len(shape) > axis and shape[axis] != want:
            said.add((key, axis, want))
            problems.append(
                f"{name}: {brief(want)}, but the file's {_fill(key, None, prefix)} is "
                f"{list(shape)} (axis {axis})"
            )
    for name, (key, axis) in table.head_sizes.items():
        heads = c.kv_heads if name == "num_kv_heads" else c.num_heads
        shape = shapes.get(_fill(key, None, prefix))
        if shape is not None and len(shape) > axis and shape[axis] != heads * c.head_dim:
            problems.append(
                f"{name}: {brief(heads)} heads of head_dim {c.head_dim} need "
                f"{heads * c.head_dim} on axis {axis}, but the file's {_fill(key, None, prefix)} "
                f"is {list(shape)}"
            )
    if not problems and position_buffer_count(c):  # a max_len that no tensor tells
        problem = fits_problem(
            8 * position_buffer_count(c),
            f"the {c.position_kind} position table of {c.max_len} positions that each "
            "framework's model computes",
        )
        if problem:
            problems.append(f"max_len: {problem}")
    return problems


def check_counts(
    table: Table,
    c: TransformerConfig,
    shapes: Mapping[str, tuple[int, ...]],
    name_keys: Callable[[list[str]], list[str]] | None = None,
) -> None:
    """ConfigError with every count_problems, each named by `name_keys` (the outside key behind
    our field: HfModel.name_keys), before any work proportional to a count."""
    problems = count_problems(table, c, shapes)
    if problems:
        named = name_keys(problems) if name_keys else problems
        raise ConfigError([*_key_hints(table, list(shapes)), *named])


def _key_hints(table: Table, keys: Sequence[str]) -> list[str]:
    """The table's hints for the keys that no rule, buffer or constant names (another kind's
    file often shows in its counts first), found from the keys alone, as to_canonical finds them
    among its unexpected tensors: said before the counts, since one says what the file is."""
    prefix = prefix_of(table, keys)
    sources = [k for r in table.rules for k in (r.source, *r.copies, *r.fallbacks) if k]
    sources += [b.source for b in table.buffers] + [k.source for k in table.constants]
    patterns = [_source_regex(k, prefix) for k in dict.fromkeys(sources)]
    unknown = [k for k in keys if not any(p.fullmatch(k) for p in patterns)]
    return [
        hint
        for key, hint in table.hints.items()
        if key in unknown or ("*" in key and any(fnmatch.fnmatchcase(k, key) for k in unknown))
    ]


# -- buffers --------------------------------------------------------------------------------------


def sinusoid_bound(length: int, dtype: np.dtype, computed_in: str) -> np.ndarray:
    """The largest difference a correct sinusoid table may have from the float64 one, per row.

    "float64": computed in float64 and rounded once to the stored dtype: eps of that dtype (the
    values lie in [-1, 1], where one rounding is at most eps/2).
    "stored": computed in the stored dtype itself, as torch's default-dtype code does
    (`div = exp(arange(0, d, 2) * -(ln 10000 / d))`, `angle = pos * div`). With u = eps/2: the
    exponent carries at most 2u relative error on |x| <= ln 10000 = 9.21, so 18.4u absolute; exp
    adds 2u relative; the product pos * div adds u. The angle is then off by at most
    pos * 21.4u (div <= 1), and sin or cos, 1-Lipschitz, passes that on and adds its own 2u:
    (21.4 pos + 2) u = (10.7 pos + 1) eps. Rounded up to (11 pos + 1) eps. A wrong layout or a
    learned table differs by O(1) already at position 1.
    """
    eps = float(np.finfo(dtype).eps)
    if computed_in == "float64":
        return np.full((length, 1), eps)
    return ((11.0 * np.arange(length) + 1.0) * eps)[:, None]


def buffer_problems(
    table: Table, arrays: Mapping[str, np.ndarray], c: TransformerConfig, prefix: str = ""
) -> list[str]:
    """A stored position table must be the sinusoid of the layout the table claims, within
    sinusoid_bound. Each one that is not is named, with how to import it as learned positions."""
    problems = []
    for buffer in table.buffers:
        key = _fill(buffer.source, None, prefix)
        if key not in arrays:
            continue
        table_, problem = _buffer_table(buffer, key, arrays[key], c)
        if problem:
            problems.append(problem)
            continue
        if c.position_kind == "learned" and buffer.learned:
            continue  # imported as the learned table, as the user asked
        want = sinusoidal_positions(table_.shape[0], c.d_model, buffer.layout)
        gaps = np.abs(table_.astype(np.float64) - want)
        bound = sinusoid_bound(table_.shape[0], table_.dtype, buffer.computed_in)
        bad = np.flatnonzero((gaps > bound).any(axis=1))
        if bad.size:
            worst = int(bad[0])  # the first position off
            hint = (
                "; pass --learned-positions to import it as learned positions"
                if buffer.learned
                else "; learned or other positions cannot be imported"
            )
            problems.append(
                f"{key} is not the {buffer.layout} sinusoid table (position {worst} differs by "
                f"{gaps[worst].max():.3g} > {bound[worst, 0]:.3g}){hint}"
            )
    return problems


def _buffer_table(
    buffer: Buffer, key: str, array: np.ndarray, c: TransformerConfig
) -> tuple[np.ndarray, str | None]:
    a = np.asarray(array)
    if a.dtype.kind != "f":
        return a, f"wrong dtype for {key}: {a.dtype.name}; a position table holds floats"
    for text in buffer.steps:
        step = parse_step(text)
        try:
            a = step.apply(a, None, c)  # type: ignore[arg-type]  # squeeze needs no spec
        except ValueError:
            return a, f"wrong shape for {key}: {list(np.shape(array))} ({step.describe} fails)"
    if a.ndim != 2 or a.shape[1] != c.d_model:
        return a, (
            f"wrong shape for {key}: file has {list(np.shape(array))}, a table of "
            f"[length, {c.d_model}] is needed"
        )
    return a, None


# -- the tensors ----------------------------------------------------------------------------------


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _first_present(r: Resolved, arrays: Mapping[str, np.ndarray]) -> str | None:
    return next((k for k in r.keys if k in arrays), None)


def to_canonical(
    table: Table,
    tensors: Mapping[str, np.ndarray],
    c: TransformerConfig,
    source: str = "<weights>",
    extra_problems: Callable[[Mapping[str, np.ndarray]], list[str]] | None = None,
) -> dict[str, np.ndarray]:
    """Canonical tensors, in canonical order and in the file's dtype, from the source arrays.

    Checks the fixed config fields first (ConfigError naming each), then reports every missing,
    unexpected, wrong-shaped and wrong-dtype tensor, every broken tie and every position table
    that is not the claimed sinusoid, at once, in one WeightFileError labelled `source`."""
    problems = fixed_problems(table, c)
    if problems:
        raise ConfigError(problems)
    arrays = {k: np.asarray(v) for k, v in tensors.items()}
    # Before resolve, which names every layer of `c`: a count the file cannot hold is refused
    # after work proportional to the file, never to the count.
    check_counts(table, c, {k: a.shape for k, a in arrays.items()})
    prefix = prefix_of(table, list(arrays))
    resolved = resolve(table, c, prefix)
    # A computed tensor (a position table of max_len rows) has no stored shape to bound it.
    for r in resolved:
        if r.rule.computed is not None:
            what = f"{r.spec.name} {list(r.spec.shape)}, computed from the config,"
            problem = fits_problem(8 * math.prod(r.spec.shape), what)
            if problem:
                raise ConfigError([problem])
    buffer_keys = {_fill(b.source, None, prefix) for b in table.buffers}
    constant_keys, constant_problems = _constants(table, arrays, prefix)
    missing: list[str] = []
    arrays = _gather_heads(resolved, arrays, c, missing, problems)

    used: dict[str, str] = {}  # canonical name -> key read
    for r in resolved:
        if r.rule.computed is not None:
            continue
        key = _first_present(r, arrays)
        if key is None:
            if not r.rule.absent_zeros and r.key not in missing:
                missing.append(r.key)
            continue
        used[r.spec.name] = key
    known = {k for r in resolved for k in r.keys} | buffer_keys | constant_keys
    unexpected = sorted(k for k in arrays if k not in known)
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listing(unexpected)}")
    misshaped: set[str] = set()  # a packed source is named once, not once per block
    for r in resolved:
        key = used.get(r.spec.name)
        if key is None:
            continue
        want = native_shape(r)
        if arrays[key].shape != want and key not in misshaped:
            misshaped.add(key)
            problems.append(
                f"wrong shape for {key}: file has {list(arrays[key].shape)}, config needs "
                f"{list(want)}"
            )
        for copy in r.copies:
            if copy != key and copy in arrays and not _same(arrays[copy], arrays[key]):
                problems.append(f"{copy} differs from {key}, but {table.tie_reason}")
    # The hints first: one often says what the whole file is (another kind's), and the lists
    # may be long enough for the message's length cap to cut.
    problems[:0] = [
        h
        for key, h in table.hints.items()
        if key in unexpected
        or key in misshaped
        or ("*" in key and any(fnmatch.fnmatchcase(k, key) for k in unexpected))
    ]
    if extra_problems is not None:
        problems += extra_problems(arrays)
    problems += buffer_problems(table, arrays, c, prefix)
    problems += constant_problems
    read = sorted(set(used.values()))
    problems += dtype_problems({k: (arrays[k].dtype.name, arrays[k].shape) for k in read})
    if problems:
        raise WeightFileError(source, problems)

    out: dict[str, np.ndarray] = {}
    dtype = arrays[read[0]].dtype if read else np.dtype(np.float32)
    for r in resolved:
        if r.rule.computed is not None:
            value = r.rule.computed.compute(r.spec, c).astype(dtype)
        elif r.spec.name in used:
            value = arrays[used[r.spec.name]]
            for step in r.steps:
                value = step.apply(value, r.spec, c)
        else:  # absent_zeros
            value = np.zeros(r.spec.shape, dtype=dtype)
        assert value.shape == r.spec.shape, f"{r.spec.name}: {value.shape} != {r.spec.shape}"
        out[r.spec.name] = np.ascontiguousarray(value)
    return out


def _head_keys(key: str, c: TransformerConfig) -> list[str]:
    return [key.replace(HEADS, str(h)) for h in range(c.num_heads)]


def _gather_heads(
    resolved: Sequence[Resolved],
    arrays: dict[str, np.ndarray],
    c: TransformerConfig,
    missing: list[str],
    problems: list[str],
) -> dict[str, np.ndarray]:
    """`arrays` with each `{h}` source's per-head keys replaced by one array under the key with
    `{h}`: the heads concatenated along axis 0, in head order (the order in which a model that
    concatenates its heads' outputs lays them out). Absent heads go to `missing`; heads whose
    shapes or dtypes differ to `problems`. A head at or beyond num_heads stays, as unexpected."""
    out = dict(arrays)
    for key in dict.fromkeys(r.key for r in resolved if HEADS in r.key):
        parts = _head_keys(key, c)
        present = [p for p in parts if p in out]
        if not present:
            continue  # the key with {h} is reported missing, once for all heads
        if len(present) < len(parts):
            missing += [p for p in parts if p not in out]
        elif len({(out[p].shape, out[p].dtype) for p in parts}) > 1:
            kinds = ", ".join(f"{list(out[p].shape)} {out[p].dtype}" for p in parts)
            problems.append(f"{key}: the heads differ in shape or dtype ({kinds})")
        elif out[parts[0]].ndim == 0:
            problems.append(f"{key}: a head's tensor has no axis to concatenate along")
        else:
            out[key] = np.concatenate([out.pop(p) for p in parts], axis=0)
    return out


def _constants(
    table: Table, arrays: Mapping[str, np.ndarray], prefix: str
) -> tuple[set[str], list[str]]:
    """(the keys that are the table's constants, a problem for each constant that does not hold
    what the model's code stores there)."""
    keys: set[str] = set()
    problems = []
    for constant in table.constants:
        pattern = re.escape(_fill(constant.source, None, prefix)).replace(
            re.escape("{i}"), r"\d{1,9}"
        )
        found = sorted(k for k in arrays if re.fullmatch(pattern, k))
        keys.update(found)
        bad = [k for k in found if not constant.check(arrays[k])]
        if bad:
            problems.append(
                f"not {constant.holds}, as {table.model} stores there ({len(bad)}): {listing(bad)}"
            )
    return keys, problems


def from_canonical(
    table: Table, tensors: Mapping[str, np.ndarray], c: TransformerConfig
) -> dict[str, np.ndarray]:
    """The way out: {source key: array} for the model in `tensors` (canonical names), each rule's
    steps inverted in reverse order. Only each rule's own key is written (not its copies or
    fallbacks: a tied matrix once, as its framework saves it), the blocks of a packed key are
    stacked in order, and buffers are left out (the reader computes them). The table's fixed
    fields are checked first (ConfigError naming each). Computed tensors are not written (the
    model computes them), and a `{h}` key is written once per head."""
    problems = fixed_problems(table, c)
    if problems:
        raise ConfigError(problems)
    out: dict[str, np.ndarray] = {}
    blocks: dict[str, dict[int, np.ndarray]] = {}
    for r in resolve(table, c):
        if r.rule.computed is not None:
            continue
        value = np.asarray(tensors[r.spec.name])
        # Inverted back to the split (a block); the steps before the split in the table's order
        # (a squeeze, a transpose) act on the whole packed array: undone once the blocks are
        # stacked, not on each block.
        block, axis = None, 0
        before: tuple[Step, ...] = ()
        for n in range(len(r.steps) - 1, -1, -1):
            step = r.steps[n]
            if step.block is not None:
                block, axis, before = step.block, step.block_axis, r.steps[:n]
                break
            value = step.invert(value, r.spec)
        if block is not None:
            blocks.setdefault(r.key, {})[block[0]] = value
            if len(blocks[r.key]) < block[1]:
                continue
            parts = blocks.pop(r.key)
            value = np.concatenate([parts[k] for k in sorted(parts)], axis=axis)
            for step in reversed(before):
                value = step.invert(value, r.spec)
        if HEADS in r.key:
            for key, head in zip(_head_keys(r.key, c), np.split(value, c.num_heads), strict=True):
                out[key] = np.ascontiguousarray(head)
        else:
            out[r.key] = np.ascontiguousarray(value)
    assert not blocks, f"packed keys with missing blocks: {sorted(blocks)}"
    return out


def rows(
    table: Table, c: TransformerConfig, prefix: str = "", patterns: bool = False
) -> list[tuple[str, str, str]]:
    """(source key, canonical name(s), steps) for every tensor of the file, in canonical order; a
    packed source lists its canonical names joined by ', '. Then the copies, fallbacks and
    buffers. For docs/PORTING.md, which shows them with `patterns` ({i}, {_i} left in)."""
    grouped: dict[str, tuple[list[str], str]] = {}
    extra: list[tuple[str, str, str]] = []
    for r in resolve(table, c, prefix, patterns):
        how = describe_steps(r.steps)
        if r.rule.absent_zeros:
            how += "; zeros when absent"
        if HEADS in r.key:
            how = f"one per head ({HEADS} = 0 .. h-1), concatenated along axis 0, then {how}"
        if r.rule.computed is not None:
            grouped["(none: computed)"] = ([r.spec.name], r.rule.computed.describe)
            continue
        names, _ = grouped.setdefault(r.key, ([], how))
        names.append(r.spec.name)
        for copy in r.copies:
            extra.append((copy, r.spec.name, f"optional; must equal {r.key} (tied)"))
        for fallback in r.fallbacks:
            extra.append((fallback, r.spec.name, f"read only when {r.key} is absent"))
    out = [(key, ", ".join(names), how) for key, (names, how) in grouped.items()]
    for buffer in table.buffers:
        how = f"checked against the {buffer.layout} sinusoid table, then dropped"
        out_steps = [parse_step(s) for s in buffer.steps]
        if out_steps:
            how = describe_steps(out_steps) + ", " + how
        if buffer.learned:
            how += "; with --learned-positions, imported as " + ", ".join(buffer.learned)
        extra.append((_fill(buffer.source, None, prefix), "(none: computed)", "optional; " + how))
    for constant in table.constants:
        how = f"optional; checked to be {constant.holds}, then dropped"
        extra.append((_fill(constant.source, None, prefix), "(none: not a weight)", how))
    return out + _unique(extra)


def _unique(items: Sequence[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    seen, out = set(), []
    for item in items:
        if item[0] not in seen:
            seen.add(item[0])
            out.append(item)
    return out
