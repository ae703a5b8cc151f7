"""Check your own implementation against the float64 oracle, output by output and layer by layer.

numpy.testing and torch.testing compare two arrays. A port of a Transformer is a chain of
arrays: the embedding, then each layer's attention maps and output, then the logits. When a port
is wrong, the logits are wrong too, but they do not say where. This module compares every
output under its canonical name (docs/PARITY.md, `ForwardOutput.named()`), in the order the
forward pass computes them, each within the derived bound for the port's dtype and matmul
precision (common/spec/tolerances.py), and names the first one that diverges:

    from transformer_rosetta.testing import assert_matches_reference, reference_outputs

    want = reference_outputs("model.safetensors", src, tgt, dtype="float32")
    assert_matches_reference(my_outputs, want, dtype="float32")

docs/TESTING_YOUR_PORT.md walks through a port written from docs/FORMAT.md alone. The pytest
plugin (transformer_rosetta.pytest_plugin) gives the reference as a fixture.

Why the first divergence: every output after it depends on it, so it is the only one that
points at the bug; the rest are listed for completeness.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.app.parity import compare
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.files.safe_read import listing
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import numpy_dtype
from transformer_rosetta.spec.inputs import check_inputs
from transformer_rosetta.spec.precision import DEFAULT_PRECISION, check_precision
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import WeightFile, check_tensors, load_weights

__all__ = [
    "MatchReport",
    "ReferenceInputError",
    "ReferenceOutputs",
    "Row",
    "assert_matches_reference",
    "compare_to_reference",
    "describe",
    "forward_order",
    "reference_outputs",
]

WeightsLike = str | os.PathLike | Mapping[str, Any] | WeightFile


class ReferenceInputError(RosettaError, ValueError):
    """A call of this module that cannot be answered: weights without their config, an unknown
    dtype, names the model does not output. One line, naming the argument."""


class ReferenceOutputs(dict):
    """reference_outputs' answer: a plain {canonical name: float64 array} dict, in forward order,
    that also keeps the model's config and the dtype its weights were rounded to. The config is
    what assert_matches_reference needs to derive the bound (float32's depends on the model's
    size), so a reference from here needs nothing more."""

    def __init__(
        self, arrays: Mapping[str, np.ndarray], config: TransformerConfig | None, dtype: str | None
    ) -> None:
        super().__init__(arrays)
        self.config = config
        self.dtype = dtype  # the weights were rounded to it first; None: used as stored


# -- forward order and plain-language names ---------------------------------------------------

_LAYER_MAP = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.(self_attention|cross_attention)$")
_HIDDEN = re.compile(r"(encoder|decoder)\.hidden_states\.(\d+)$")
_STACKS = {"encoder": 0, "decoder": 1}
# The whole-sequence outputs, after their stack's layers: the memory, then its pooled vector
# (encoder-only), then the logits.
_AFTER_LAYERS = {"encoder_output": (0, 0), "pooled_output": (0, 1), "logits": (1, 0)}
_SUBLAYER = {"self_attention": 0, "cross_attention": 1}


def _position(name: str) -> tuple[float, ...]:
    """Where the forward pass computes `name`: (stack, layer step, rank inside the step).

    Step 0 is the embedding (hidden state 0); step i + 1 is layer i, whose self-attention comes
    before its cross-attention, and whose output (hidden state i + 1) comes last. Names this
    module does not know go after everything, in the order given (the sort is stable)."""
    if m := _HIDDEN.match(name):
        return (_STACKS[m[1]], int(m[2]), 2)
    if m := _LAYER_MAP.match(name):
        return (_STACKS[m[1]], int(m[2]) + 1, _SUBLAYER[m[3]])
    if name in _AFTER_LAYERS:
        stack, rank = _AFTER_LAYERS[name]
        return (stack, math.inf, rank)
    return (2, 0, 0)


def forward_order(names: Iterable[str]) -> list[str]:
    """`names` in the order the forward pass computes them: the encoder's embedding, each encoder
    layer's self-attention and output, the encoder output and pooled vector, then the decoder's
    embedding, each decoder layer's self-attention, cross-attention and output, and the logits."""
    return sorted(names, key=_position)


def describe(name: str) -> str:
    """`name` in words, for a report: "encoder layer 1, self-attention probabilities"."""
    if m := _HIDDEN.match(name):
        step = int(m[2])
        if step == 0:
            return f"{m[1]} embedding output (before layer 0)"
        return f"{m[1]} layer {step - 1}, its output"
    if m := _LAYER_MAP.match(name):
        kind = m[3].replace("_attention", "-attention")
        return f"{m[1]} layer {m[2]}, {kind} probabilities"
    whole = {
        "encoder_output": "the encoder's output (after its final norm, if any)",
        "pooled_output": "the pooled vector",
        "logits": "the logits",
    }
    return whole.get(name, name)


# -- arrays from any framework ----------------------------------------------------------------


def host_array(x: Any) -> np.ndarray:
    """`x` as a numpy array. torch tensors leave autograd and come to the host first (np.asarray
    refuses a tensor that requires grad or lives on a GPU), and a torch bfloat16, which has no
    numpy twin, is widened to float32 (exactly); jax and TensorFlow arrays convert as they are."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


def _ids(x: Any) -> np.ndarray | None:
    return None if x is None else host_array(x)


# -- the reference ----------------------------------------------------------------------------


def _fail(message: str) -> ReferenceInputError:
    return ReferenceInputError(message)


def resolve_weights(
    weights: WeightsLike, config: TransformerConfig | None
) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """(config, canonical tensors) of a weight file's path, a loaded WeightFile, or a mapping
    of canonical names to arrays with its `config`. A file is validated by load_weights, a
    mapping by check_tensors: every problem in one WeightFileError line."""
    if isinstance(weights, WeightFile):
        if config is not None and config != weights.config:
            raise _fail("config: differs from the WeightFile's own config; pass one of them")
        return weights.config, dict(weights.tensors)
    if isinstance(weights, (str, os.PathLike)):
        loaded = load_weights(Path(weights), config)
        return loaded.config, dict(loaded.tensors)
    if isinstance(weights, Mapping):
        if config is None:
            raise _fail(
                "config: a mapping of tensors carries no config; pass config= "
                "(or the weight file's path, whose metadata holds it)"
            )
        tensors = {str(name): host_array(t) for name, t in weights.items()}
        check_tensors("weights", config, tensors)
        return config, tensors
    raise _fail(
        "weights: expected a weight file's path, a WeightFile or a mapping of canonical names "
        f"to arrays, got {type(weights).__name__}"
    )


def rounded(tensors: Mapping[str, np.ndarray], dtype: str | None) -> dict[str, np.ndarray]:
    """The weights as a model computing in `dtype` holds them, widened back to float64, so that
    the oracle measures the computation and not the rounding of the weights (docs/PARITY.md);
    None leaves them as stored."""
    if dtype is None:
        return dict(tensors)
    try:
        target = numpy_dtype(dtype)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    return {k: np.asarray(v).astype(target).astype(np.float64) for k, v in tensors.items()}


def reference_outputs(
    weights: WeightsLike,
    src: Any = None,
    tgt: Any = None,
    *,
    config: TransformerConfig | None = None,
    dtype: str | None = None,
    hidden_states: bool = True,
) -> ReferenceOutputs:
    """The float64 oracle's outputs for `weights` on these inputs, under canonical names, in
    forward order: logits, encoder_output and pooled_output where the kind has them, every
    attention map ([B, h, query, key]) and, with hidden_states, every hidden state (the
    embedding output, then each layer's output before any final norm).

    weights: a weight file's path (its metadata holds the config), a WeightFile, or a mapping
    of canonical names to arrays with `config`. src [B, S] and tgt [B, T] are token ids (numpy,
    torch, jax, tf or lists); tgt is the decoder's input, already shifted right behind BOS. A
    model takes the inputs of its kind only: a decoder-only model tgt alone, an encoder-only one
    src alone. dtype: round the weights to the dtype your port computes in first, as parity
    does ("float32", "bfloat16"); None uses them as stored. Bad arguments raise one-line
    RosettaErrors (WeightFileError, InputError, ReferenceInputError).
    """
    config, tensors = resolve_weights(weights, config)
    src_ids, tgt_ids = check_inputs(config, _ids(src), _ids(tgt))
    out = reference.forward(
        rounded(tensors, dtype), config, src_ids, tgt_ids, hidden_states=hidden_states
    )
    named = out.named()
    return ReferenceOutputs({n: named[n] for n in forward_order(named)}, config, dtype)


# -- the comparison ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One compared output: max |yours - oracle|, that over max |oracle| (the reference's scale,
    so that the exact zeros of attention maps do not blow it up), the bound and the verdict.
    `problem` says why an output could not be compared: missing, the wrong shape, not an array
    (max_abs and max_rel are then inf); NaN or inf values count as an error of inf."""

    name: str
    max_abs: float
    max_rel: float
    bound: float
    ok: bool
    problem: str | None = None

    @property
    def where(self) -> str:
        return describe(self.name)


@dataclass
class MatchReport:
    """Every compared output in forward order. `str(report)` is a headline and a table; `passed`
    is the verdict, and `first_failure` the output to look at first."""

    rows: list[Row]
    dtype: str
    precision: str = DEFAULT_PRECISION
    ignored: list[str] = field(default_factory=list)  # your outputs the reference does not have

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    @property
    def first_failure(self) -> Row | None:
        return next((r for r in self.rows if not r.ok), None)

    @property
    def setting(self) -> str:
        """ "float32, highest products", or the dtype alone where precision does not apply."""
        return f"{self.dtype}, {self.precision} products" if self.dtype == "float32" else self.dtype

    def headline(self) -> str:
        """One line: PASS with the largest error, or FAIL naming the first divergence."""
        first = self.first_failure
        if first is None:
            worst = max(self.rows, key=lambda r: r.max_abs, default=None)
            if worst is None:
                return "PASS: nothing compared"
            return (
                f"PASS: {len(self.rows)} outputs match the float64 oracle within "
                f"{worst.bound:.0e} ({self.setting}); largest error {worst.max_abs:.1e}"
            )
        return (
            f"FAIL: {len(self.failures)} of {len(self.rows)} outputs diverge ({self.setting}); "
            f"the first, in forward order, is {first.name} ({first.where}): "
            f"{_verdict(first)}"
        )

    def message(self) -> str:
        """What assert_matches_reference raises: the headline, the outputs that fail after the
        first, then the table."""
        lines = [self.headline()]
        rest = self.failures[1:]
        if rest:
            lines.append(f"diverging after it ({len(rest)}): {', '.join(r.name for r in rest)}")
        return "\n".join([*lines, "", self.table()])

    def table(self) -> str:
        width = max([len("output"), *(len(r.name) for r in self.rows)])
        first = self.first_failure
        lines = [f"{'output':<{width}}  {'max abs':>8}  {'max rel':>8}  {'bound':>6}  result"]
        for r in self.rows:
            if r.problem not in (None, _NAN):  # nothing was compared
                numbers = f"{'-':>8}  {'-':>8}"
            else:
                numbers = f"{r.max_abs:8.1e}  {r.max_rel:8.1e}"
            result = "ok" if r.ok else "FAIL" + (f" ({r.problem})" if r.problem else "")
            if r is first:
                result += "  <- first"
            lines.append(f"{r.name:<{width}}  {numbers}  {r.bound:6.0e}  {result}")
        if self.ignored:
            lines.append(
                f"not compared (the reference has no such output): {listing(self.ignored)}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"{self.headline()}\n{self.table()}"


_NAN = "NaN or inf"


def _verdict(r: Row) -> str:
    if r.problem is not None and r.problem != _NAN:
        return r.problem
    return f"max abs {r.max_abs:.2e} > bound {r.bound:.0e} (max rel {r.max_rel:.2e})" + (
        f", {r.problem}" if r.problem else ""
    )


def bound_for(dtype: str, precision: str, config: TransformerConfig | None) -> float:
    """The derived bound (common/spec/tolerances.py, docs/PARITY.md) for a port computing in
    `dtype` with float32 products at `precision`. float32's depends on the model's size (2e-5
    past the tiny sizes), so it needs the config."""
    try:
        check_precision(precision)
        if dtype == "float32" and config is None:
            raise _fail(
                "config: the float32 bound depends on the model's size (1e-5 tiny, 2e-5 larger); "
                "pass config=, weights=, or a reference from reference_outputs"
            )
        return atol_for(dtype, config, precision)
    except ReferenceInputError:
        raise
    except ValueError as exc:
        raise _fail(str(exc)) from None


def _row(name: str, outputs: Mapping[str, Any], want: np.ndarray, bound: float) -> Row:
    if name not in outputs:
        return Row(name, math.inf, math.inf, bound, False, "missing")
    try:
        got = host_array(outputs[name]).astype(np.float64)
    except (TypeError, ValueError) as exc:
        what = f"not an array ({type(outputs[name]).__name__}: {exc})"
        return Row(name, math.inf, math.inf, bound, False, what)
    if got.shape != want.shape:
        shape = f"shape {list(got.shape)}, the reference's {list(want.shape)}"
        return Row(name, math.inf, math.inf, bound, False, shape)
    c = compare(name, "yours", "oracle", got, want, bound)
    problem = None if math.isfinite(c.max_abs) else _NAN
    return Row(name, c.max_abs, c.max_rel, bound, c.passed, problem)


def _named(outputs: Any) -> Mapping[str, Any]:
    """A mapping of your outputs; a ForwardOutput (this project's models) gives its named()."""
    if hasattr(outputs, "named") and callable(outputs.named):
        return outputs.named()
    if not isinstance(outputs, Mapping):
        raise _fail(
            f"outputs: expected a mapping of canonical names to arrays, got {type(outputs).__name__}"
        )
    return outputs


def _reference_for(
    ref: Mapping[str, Any] | None,
    weights: WeightsLike | None,
    src: Any,
    tgt: Any,
    config: TransformerConfig | None,
    dtype: str,
) -> ReferenceOutputs:
    """The reference given, or the oracle's on `weights` rounded to `dtype` (one of the two)."""
    if (ref is None) == (weights is None):
        raise _fail(
            "reference: give either a reference (reference_outputs) or weights=, one of them"
        )
    if weights is not None:
        return reference_outputs(weights, src, tgt, config=config, dtype=dtype)
    assert ref is not None  # one of the two, checked above
    if src is not None or tgt is not None:
        raise _fail("src, tgt: only with weights=; a reference is already computed on its inputs")
    if isinstance(ref, ReferenceOutputs):
        return ref
    if not isinstance(ref, Mapping):
        raise _fail(f"reference: expected a mapping of names to arrays, got {type(ref).__name__}")
    arrays = {str(k): host_array(v).astype(np.float64) for k, v in ref.items()}
    return ReferenceOutputs(arrays, config, None)


def compare_to_reference(
    outputs: Mapping[str, Any],
    reference: Mapping[str, Any] | None = None,
    *,
    weights: WeightsLike | None = None,
    src: Any = None,
    tgt: Any = None,
    config: TransformerConfig | None = None,
    dtype: str = "float32",
    precision: str = DEFAULT_PRECISION,
    names: Iterable[str] | None = None,
) -> MatchReport:
    """assert_matches_reference without the assertion: the MatchReport, passed or not."""
    want = _reference_for(reference, weights, src, tgt, config, dtype)
    bound = bound_for(dtype, precision, want.config if want.config is not None else config)
    got = _named(outputs)
    if names is None:
        chosen = forward_order(want)
    else:
        chosen = forward_order(dict.fromkeys([names] if isinstance(names, str) else names))
        unknown = [n for n in chosen if n not in want]
        if unknown:
            raise _fail(
                f"names: not outputs of this model: {listing(unknown)}; it has {listing(want)}"
            )
    rows = [_row(name, got, want[name], bound) for name in chosen]
    ignored = forward_order(n for n in got if n not in want)
    return MatchReport(rows, dtype, precision, ignored)


def assert_matches_reference(
    outputs: Mapping[str, Any],
    reference: Mapping[str, Any] | None = None,
    *,
    weights: WeightsLike | None = None,
    src: Any = None,
    tgt: Any = None,
    config: TransformerConfig | None = None,
    dtype: str = "float32",
    precision: str = DEFAULT_PRECISION,
    names: Iterable[str] | None = None,
) -> MatchReport:
    """Assert that your port's `outputs` ({canonical name: array}, numpy, torch, jax or tf)
    match the float64 oracle, each within the derived bound for `dtype` and `precision`
    (common/spec/tolerances.py; the table of docs/PARITY.md).

    The reference is `reference` (from reference_outputs, or any mapping of canonical names to
    arrays, then with config= for a float32 bound), or the oracle run here on `weights` (a path,
    a WeightFile or a mapping with config=) and src / tgt, with the weights rounded to `dtype`.
    `names` restricts the comparison (default: every output the reference has; what your port
    lacks is reported as missing). Outputs are compared in forward order, and the
    AssertionError names the first that diverges (its layer, max abs and max rel error, the
    bound), then lists the rest, then the whole table. Returns the MatchReport when all pass.
    """
    report = compare_to_reference(
        outputs,
        reference,
        weights=weights,
        src=src,
        tgt=tgt,
        config=config,
        dtype=dtype,
        precision=precision,
        names=names,
    )
    if not report.passed:
        raise AssertionError(report.message())
    return report
