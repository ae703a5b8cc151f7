"""The divergence catalogue: every place where a framework's default differs from the spec, what
this project sets instead, and the measured effect of keeping the default.

Each entry of REGISTRY is one function that measures one number with the framework's own code,
on the CPU, registered by `@divergence(...)` with the static text that says what was measured;
the function's name is the row's key. `write_measurements()` runs them all
(`python -m tools.docs --measure divergences`, or `python -m tools.docs.divergences`) and
writes docs/divergences.json; `catalogue_table()` renders that file as the table in
docs/ROSETTA.md, so no number in the docs is typed in.

How the numbers are taken, unless an entry's "effect" says otherwise:
- the `tiny` preset with seed-0 weights of the "perturbed" scheme (random biases and LayerNorm
  gains, as `rosetta parity` uses) and `rosetta parity`'s default inputs (batch 4, 9 source and
  7 target tokens, ragged, the last source row all padding), eval mode;
- the same framework's model twice, with the default and with what this project sets, so that
  the number is the effect of the default alone (not the framework's distance to the oracle);
- float64 where the point is the formula (rounding then stays ~1e-16 and does not blur the
  effect), float32 or bfloat16 where the point is rounding;
- fixed seeds and inputs: the same number on every run on the same machine and versions.

What a number depends on is part of its record (`depends_on`), and so is the machine that
measured it (`measured_on`). Most rows are formulas or rounding that any CPU reproduces; a few
are facts about a framework on one kind of hardware, not about the framework. TensorFlow's
bfloat16 kernels are the one found so far: they round once on a CPU where TensorFlow uses oneDNN,
and truncate, or sum in bfloat16, where it uses Eigen. Such a row names a `Hardware` with its
classes, a probe that tells which class this process is in, and the environment that selects
each class where one machine can run both. Each class is measured and recorded with its own
machine, and the tests compare what they measure with the record of the class they run in.

Frameworks are imported inside the functions only, so importing this module (for the table)
needs none of them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools.docs.checkout import ROOT
from transformer_rosetta.files.outputs import atomic_write
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.weights.init import init_weights

MEASUREMENTS = ROOT / "docs" / "divergences.json"
MEASURE_COMMAND = "python -m tools.docs --measure divergences"
# The keys of a record, in the order the JSON file lists them: the static text (the first seven),
# then what was measured, where, and, for a row that depends on the hardware, each class's record.
RECORD_KEYS = (
    "key",
    "topic",
    "framework",
    "default",
    "ours",
    "effect",
    "depends_on",
    "value",
    "shown",
    "measured_on",
    "classes",
)
STATIC_KEYS = RECORD_KEYS[:7]
# A hardware class's record, inside a row's "classes".
CLASS_KEYS = ("class", "value", "shown", "measured_on")
FRAMEWORK_NAMES = ("PyTorch", "Keras", "TensorFlow", "JAX", "Flax NNX", "nn.Transformer")
TABLE_COLUMNS = (
    ("topic", "topic"),
    ("framework", "framework"),
    ("default", "default"),
    ("ours", "this project"),
    ("depends_on", "depends on"),
    ("shown", "effect of keeping the default"),
)

# Measured again (the tests), a number may move by this much, relative. float64: a formula's
# effect (>= 1e-8 here) moves by summation order only, ~1e-16 absolute, on another machine; on
# this one every run gives the same bits. Rounding effects (float32, bfloat16): another CPU's
# kernels may block their sums differently, which moves the error itself.
FLOAT64_RTOL = 1e-6
ROUNDING_RTOL = 0.25
# A rounding effect at float32's own level (~1e-6 on the logits) whose digits XLA's CPU kernels
# change with the CPU: measured 1.07e-6 on the AMD EPYC that first recorded it (no oneDNN for
# TensorFlow there: a CPU without AVX512-VNNI/BF16) and 8.0e-7 on one with AVX512-BF16. The row
# states its size, so it is checked to within a factor of 2 (rel_tol 0.5 of the larger).
SIZE_RTOL = 0.5

# What a row's number depends on, beyond the versions in its measured_on (`depends_on`).
FORMULA = "the formula only (float64): the same number on any CPU"
EXACT = "nothing: an exact value on any CPU"
SUMMATION_ORDER = "the CPU's summation order only: within 25% on any x86-64 CPU"
TF32_GPU = (
    "the GPU: NVIDIA Ampere or later rounds float32 products to TF32; emulated here, so the same "
    "number on any CPU"
)

# -- formatting ------------------------------------------------------------------------------------


def scientific(value: float | None) -> str:
    """A measured number for the table: "3.1e-04", "NaN", or "0 (exact)"."""
    if value is None or math.isnan(value):
        return "NaN"
    if value == 0.0:
        return "0 (exact)"
    return f"{value:.1e}"


def _uniform_or_scientific(keys: int) -> Callable[[float | None], str]:
    """Shows a value of exactly 1/keys (a uniform average over `keys` value rows) as such."""

    def show(value: float | None) -> str:
        if value is not None and not math.isnan(value) and abs(value - 1.0 / keys) <= 1e-6:
            return f"uniform 1/{keys} = {1.0 / keys:g}"
        return scientific(value)

    return show


# -- the registry ----------------------------------------------------------------------------------


def machine() -> str:
    """The machine a number is measured on (a record's `measured_on`): the CPU's model, the ISA
    features that change a row (AVX-512F, AVX512-BF16, AMX-BF16) and the versions that compute
    it. Read from /proc/cpuinfo and the installed packages' metadata: no framework is imported."""
    import importlib.metadata

    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
    features = [label for flag, label in _CPU_FEATURES if flag in flags]
    versions = []
    for package in ("numpy", "torch", "tensorflow", "keras", "jax", "flax"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{package} {importlib.metadata.version(package)}")
    cpu = f"{model} ({', '.join([platform.machine(), *features])})"
    return f"{cpu}; {', '.join(versions)}"


# The CPU features a row's number can depend on: (/proc/cpuinfo flag, name shown).
_CPU_FEATURES = (("avx512f", "AVX-512F"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"))


@dataclass(frozen=True)
class Hardware:
    """What a row's number depends on when it is a fact about the hardware, not the framework:
    the classes of machine that give different numbers (name -> what that class does), a probe
    that returns the class this process is in, and, per class, the environment variables that
    put a process in it where the hardware allows (a process whose probe then says otherwise
    cannot measure that class: its record comes from another machine)."""

    depends_on: str
    classes: dict[str, str]
    current: Callable[[], str]
    environments: dict[str, dict[str, str]]


@dataclass(frozen=True)
class Divergence:
    """One row of the catalogue: its key (the measuring function's name), the text (static, so
    that the JSON can be checked against it without any framework) and the function that
    measures its number.

    `needs` names the backend (transformer_rosetta.adapter.backends) whose framework the
    measurement imports, None for numpy only. `cost` is "cheap" (seconds: the tests measure it again) or "slow".
    `rtol` is the relative difference allowed when it is measured again (FLOAT64_RTOL unless
    the entry's point is float32 or bfloat16 rounding, which another CPU's kernels may sum in
    another order: ROUNDING_RTOL). `measure` returns the value, or (value, note), the note
    giving other numbers of the same run, shown in parentheses after the value. `depends_on`
    says what the number depends on; `hardware`, for a row whose number is a fact about a class
    of machine, gives the classes (its `depends_on` is then the row's).
    """

    key: str
    topic: str
    framework: str
    default: str
    ours: str
    effect: str
    measure: Callable[[], float | tuple[float, str]]
    needs: str | None
    show: Callable[[float | None], str] = scientific
    cost: str = "cheap"
    rtol: float = FLOAT64_RTOL
    depends_on: str = FORMULA
    hardware: Hardware | None = None

    def text(self) -> dict[str, str]:
        """The record's static strings: what the JSON must hold for this entry."""
        return {k: getattr(self, k) for k in STATIC_KEYS}

    def measured(self) -> tuple[float | None, str]:
        """Measure: the value (None for NaN, which JSON cannot hold) and the value formatted for
        the table, with the note in parentheses."""
        measured = self.measure()
        value, note = measured if isinstance(measured, tuple) else (measured, "")
        value = float(value)
        shown = self.show(value) + (f" ({note})" if note else "")
        return (None if math.isnan(value) else value), shown

    def class_record(self) -> dict[str, Any]:
        """This process's hardware class, measured: a record of CLASS_KEYS."""
        assert self.hardware is not None, f"{self.key} does not depend on the hardware"
        value, shown = self.measured()
        return {
            "class": self.hardware.current(),
            "value": value,
            "shown": shown,
            "measured_on": machine(),
        }

    def record(self, classes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The row's record. A row that does not depend on the hardware is measured here. A row
        that does is made of its classes' records (`classes`, default: this process's class):
        its value is the largest over them, the bound a user meets on any of those machines."""
        if self.hardware is None:
            value, shown = self.measured()
            return {
                **self.text(),
                "value": value,
                "shown": shown,
                "measured_on": machine(),
                "classes": [],
            }
        classes = [self.class_record()] if classes is None else classes
        order = list(self.hardware.classes)
        classes = sorted(classes, key=lambda c: order.index(c["class"]))
        values = [c["value"] for c in classes]
        value = None if None in values else max(values)
        shown = "; ".join(f"{c['class']}: {c['shown']}" for c in classes)
        where = sorted({c["measured_on"] for c in classes})
        return {
            **self.text(),
            "value": value,
            "shown": shown,
            "measured_on": " | ".join(where),
            "classes": classes,
        }


# Every row, by key, in the order of definition (the table's order): a row's key is the name of
# the function that measures it.
REGISTRY: dict[str, Divergence] = {}


def divergence(
    *,
    topic: str,
    framework: str,
    default: str,
    ours: str,
    effect: str,
    needs: str | None,
    show: Callable[[float | None], str] = scientific,
    cost: str = "cheap",
    rtol: float = FLOAT64_RTOL,
    depends_on: str | None = None,
    hardware: Hardware | None = None,
) -> Callable[[Callable], Callable]:
    """Register the decorated function, which returns the value (or (value, note), the note
    shown in parentheses after it), as the catalogue row named after it (its `__name__` is the
    row's key in docs/divergences.json); rows keep the order of definition. The texts are
    Divergence's fields. `depends_on` defaults to the hardware's text, else to FORMULA for a
    float64 row and to SUMMATION_ORDER for a rounding row (rtol ROUNDING_RTOL)."""
    if depends_on is None:
        if hardware is not None:
            depends_on = hardware.depends_on
        else:
            depends_on = SUMMATION_ORDER if rtol == ROUNDING_RTOL else FORMULA

    def register(measure: Callable) -> Callable:
        key = measure.__name__
        if framework not in FRAMEWORK_NAMES:
            raise ValueError(f"{key}: framework {framework!r} is not one of {FRAMEWORK_NAMES}")
        if key in REGISTRY:
            raise ValueError(f"two catalogue entries are called {key!r}")
        REGISTRY[key] = Divergence(
            key=key,
            topic=topic,
            framework=framework,
            default=default,
            ours=ours,
            effect=effect,
            measure=measure,
            needs=needs,
            show=show,
            cost=cost,
            rtol=rtol,
            depends_on=depends_on,
            hardware=hardware,
        )
        return measure

    return register


# -- shared setup ----------------------------------------------------------------------------------


def _tiny(**changes: Any) -> TransformerConfig:
    config = preset("tiny")
    return config.replace(**changes) if changes else config


def _inputs(config: TransformerConfig) -> tuple[np.ndarray, np.ndarray]:
    """`rosetta parity`'s default inputs: batch 4, 9 source and 7 target tokens, ragged, seed 0."""
    src, tgt_in = ragged_batch(config, batch=4, src_len=9, tgt_len=7, seed=0)
    # Every divergence runs the tiny preset's encoder-decoder (_tiny), which takes both inputs.
    assert src is not None and tgt_in is not None
    return src, tgt_in


def _weights(config: TransformerConfig, dtype: str) -> dict[str, np.ndarray]:
    return init_weights(config, seed=0, scheme="perturbed", dtype=dtype)


def _build(framework: str, config: TransformerConfig, dtype: str) -> Any:
    from transformer_rosetta.adapter.backends import get_backend

    return get_backend(framework).build(config, _weights(config, dtype), dtype=dtype)


def max_abs_diff(a: Any, b: Any) -> float:
    """max |a - b| in float64; NaN if either holds a NaN."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)))


@contextlib.contextmanager
def _attributes(objects: list[Any], name: str, value: Any) -> Iterator[None]:
    """Set attribute `name` of every object to `value` while the block runs."""
    saved = [getattr(o, name) for o in objects]
    for o in objects:
        setattr(o, name, value)
    try:
        yield
    finally:
        for o, old in zip(objects, saved, strict=True):
            setattr(o, name, old)


@contextlib.contextmanager
def _patched(namespace: Any, name: str, value: Any) -> Iterator[None]:
    """namespace[name] (a dict) or namespace.name (a module) replaced while the block runs."""
    if isinstance(namespace, dict):
        saved = namespace[name]
        namespace[name] = value
        try:
            yield
        finally:
            namespace[name] = saved
        return
    saved = getattr(namespace, name)
    setattr(namespace, name, value)
    try:
        yield
    finally:
        setattr(namespace, name, saved)


def _logit_effect(
    framework: str,
    config: TransformerConfig,
    dtype: str,
    default: Callable[[Any], contextlib.AbstractContextManager],
) -> float:
    """max |logits with the default - logits as this project builds them|: one model of
    `framework`, run as built and then inside `default(model)`, which puts the default back."""
    model = _build(framework, config, dtype)
    src, tgt_in = _inputs(config)
    ours = model.forward(src, tgt_in).logits  # the fused attention path, as models run
    with default(model):
        theirs = model.forward(src, tgt_in).logits
    return max_abs_diff(theirs, ours)


def _default_of(callable_: Any, parameter: str) -> Any:
    """A parameter's default in a framework's signature, read from the framework itself."""
    import inspect

    return inspect.signature(callable_).parameters[parameter].default


def _check_default(what: str, found: Any, claimed: Any) -> None:
    """The catalogue states a framework default: refuse to measure if the installed framework
    has another one (the row's text would be wrong, not just its number)."""
    if found != claimed:
        raise RuntimeError(
            f"{what}: the installed framework's default is {found!r}, the catalogue says "
            f"{claimed!r}; update the entry in tools/docs/divergences.py"
        )


# -- 1. LayerNorm epsilon --------------------------------------------------------------------------


def _torch_layer_norms(model: Any) -> list[Any]:
    import torch

    return [m for m in model.module.modules() if isinstance(m, torch.nn.LayerNorm)]


def _keras_layer_norms(model: Any) -> list[Any]:
    import keras

    return [
        layer
        for layer in model.module._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.LayerNormalization)
    ]


def _flax_layer_norms(model: Any) -> list[Any]:
    from flax import nnx

    return [m for _, m in nnx.iter_graph(model.module) if isinstance(m, nnx.LayerNorm)]


@divergence(
    topic="LayerNorm epsilon",
    framework="PyTorch",
    default="`nn.LayerNorm(eps=1e-5)`",
    ours="`eps=config.layer_norm_eps` (1e-6 in the presets), `torch_impl/model.py` `layer_norm`",
    effect="max |Δ logits|, tiny preset, float64: every `nn.LayerNorm`'s `eps` set to the default",
    needs="torch",
)
def layer_norm_eps_torch() -> float:
    import torch

    default = _default_of(torch.nn.LayerNorm, "eps")
    _check_default("nn.LayerNorm eps", default, 1e-5)
    return _logit_effect(
        "torch", _tiny(), "float64", lambda m: _attributes(_torch_layer_norms(m), "eps", default)
    )


@divergence(
    topic="LayerNorm epsilon",
    framework="Keras",
    default="`LayerNormalization(epsilon=1e-3)`",
    ours="`epsilon=config.layer_norm_eps` (1e-6 in the presets), `tf_impl/model.py` `layer_norm`",
    effect=(
        "max |Δ logits|, tiny preset, float64: every `LayerNormalization`'s `epsilon` set to the "
        "default"
    ),
    needs="tf",
)
def layer_norm_eps_keras() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")  # sets KERAS_BACKEND and TensorFlow's logging before keras is imported
    import keras

    default = _default_of(keras.layers.LayerNormalization, "epsilon")
    _check_default("keras.layers.LayerNormalization epsilon", default, 1e-3)
    return _logit_effect(
        "tf", _tiny(), "float64", lambda m: _attributes(_keras_layer_norms(m), "epsilon", default)
    )


@divergence(
    topic="LayerNorm epsilon",
    framework="Flax NNX",
    default="`nnx.LayerNorm(epsilon=1e-6)`",
    ours="`epsilon=config.layer_norm_eps`, `jax_impl/model.py` `layer_norm`",
    effect=(
        "max |Δ logits|, tiny preset with `layer_norm_eps` 1e-5 (as nn.Transformer and Marian "
        "models have), float64: every `nnx.LayerNorm`'s `epsilon` set to the default (on the "
        "presets' own 1e-6 the default happens to agree: 0)"
    ),
    needs="jax",
    cost="slow",
)
def layer_norm_eps_flax() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("jax")
    from flax import nnx

    default = _default_of(nnx.LayerNorm.__init__, "epsilon")
    _check_default("nnx.LayerNorm epsilon", default, 1e-6)
    return _logit_effect(
        "jax",
        _tiny(layer_norm_eps=1e-5),
        "float64",
        lambda m: _attributes(_flax_layer_norms(m), "epsilon", default),
    )


# The draw of parity_tests/impl/test_properties.py that found it: a one-layer pre-norm decoder of
# width 1, whose LayerNorm input equals its own mean, so the normalised value is exactly beta.
WIDTH_ONE = TransformerConfig(
    src_vocab_size=2,
    tgt_vocab_size=2,
    d_model=1,
    num_heads=1,
    d_ff=1,
    num_encoder_layers=0,
    num_decoder_layers=1,
    max_len=1,
    dropout=0.0,
    attention_dropout=0.0,
    norm_position="pre",
    final_norm=False,
    position_kind="learned",
    type_vocab_size=1,
    scale_embeddings=False,
    share_embeddings=False,
    tie_output=False,
    output_bias=False,
    attention_bias=False,
    pad_id=0,
    bos_id=0,
    eos_id=1,
)


@divergence(
    topic="LayerNorm formula",
    framework="Keras",
    default=(
        "`LayerNormalization` (`ops.layer_normalization`): `x * inv + (beta - mean * inv)`, "
        "inv = `gamma * rsqrt(var + eps)`"
    ),
    ours=(
        "`(x - mean) * rsqrt(var + eps) * gamma + beta` on Keras's own weights, "
        "`tf_impl/model.py` `CentredLayerNormalization`"
    ),
    effect=(
        "max |Δ logits|, float32, a one-layer decoder of width `d_model` 1 (its normalised value "
        "is exactly `beta`; a draw of `impl/test_properties.py`): Keras's own "
        "`LayerNormalization.call` put back; in parentheses the same on the tiny preset"
    ),
    needs="tf",
    rtol=ROUNDING_RTOL,
    depends_on=SUMMATION_ORDER,
)
def layer_norm_formula_keras() -> tuple[float, str]:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    import keras

    from transformer_rosetta.tf_impl.model import CentredLayerNormalization

    def keras_formula(_model: Any) -> contextlib.AbstractContextManager:
        return _patched(CentredLayerNormalization, "call", keras.layers.LayerNormalization.call)

    # as the property test builds it: float64 weights, rounded to float32 by the model
    weights = _weights(WIDTH_ONE, "float64")
    model = get_backend("tf").build(WIDTH_ONE, weights, dtype="float32")
    tgt_in = np.zeros((1, 1), np.int64)
    ours = model.forward(None, tgt_in).logits
    with keras_formula(model):
        theirs = model.forward(None, tgt_in).logits
    tiny = _logit_effect("tf", _tiny(), "float32", keras_formula)
    return max_abs_diff(theirs, ours), f"tiny preset: {scientific(tiny)}"


# -- 2. Flax's fast variance -----------------------------------------------------------------------

FAST_VARIANCE_DEFAULT = "`nnx.LayerNorm(use_fast_variance=True)`: var = E[x²] − E[x]²"
FAST_VARIANCE_OURS = "`use_fast_variance=False`: E[(x − mean)²], `jax_impl/model.py` `layer_norm`"


@divergence(
    topic="LayerNorm variance formula",
    framework="Flax NNX",
    default=FAST_VARIANCE_DEFAULT,
    ours=FAST_VARIANCE_OURS,
    effect="max |Δ logits|, tiny preset, float32: every `nnx.LayerNorm` with the default formula",
    needs="jax",
    cost="slow",
    rtol=SIZE_RTOL,
    depends_on="the CPU's summation order (XLA's float32 kernels): its size, within a factor 2",
)
def fast_variance_logits() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("jax")
    from flax import nnx

    _check_default(
        "nnx.LayerNorm use_fast_variance",
        _default_of(nnx.LayerNorm.__init__, "use_fast_variance"),
        True,
    )
    return _logit_effect(
        "jax",
        _tiny(),
        "float32",
        lambda m: _attributes(_flax_layer_norms(m), "use_fast_variance", True),
    )


OFFSET = 1e3  # the common offset of fast_variance_offset's activations


def layer_norm_offset_inputs(dtype: Any = np.float32) -> np.ndarray:
    """4 rows of 16 activations N(OFFSET, 1), seed 0: a large common offset, where E[x²] and
    E[x]² (both ~1e6, a float32 ulp of 0.06) cancel to a variance of ~1."""
    rng = np.random.default_rng(0)
    return (OFFSET + rng.standard_normal((4, 16))).astype(dtype)


@divergence(
    topic="LayerNorm variance formula",
    framework="Flax NNX",
    default=FAST_VARIANCE_DEFAULT,
    ours=FAST_VARIANCE_OURS,
    effect=(
        "max |Δ output| of one `nnx.LayerNorm` (16 features, unit gain, zero bias), float32, on "
        "activations N(1e3, 1), where E[x²] − E[x]² cancels"
    ),
    needs="jax",
    rtol=ROUNDING_RTOL,
)
def fast_variance_offset() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("jax")
    import jax.numpy as jnp
    from flax import nnx

    x = jnp.asarray(layer_norm_offset_inputs())
    outputs = {}
    for fast in (True, False):
        norm = nnx.LayerNorm(
            16,
            epsilon=1e-6,
            use_fast_variance=fast,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            rngs=nnx.Rngs(0),
        )
        outputs[fast] = np.asarray(norm(x))
    return max_abs_diff(outputs[True], outputs[False])


# -- 3. GELU ---------------------------------------------------------------------------------------

GELU_EFFECT = "max |Δ logits|, tiny preset with activation `gelu`, float64"


@divergence(
    topic="GELU form",
    framework="JAX",
    default="`jax.nn.gelu(approximate=True)`: the tanh form",
    ours=(
        '`approximate=False` (the erf form) for activation "gelu", `jax_impl/model.py` '
        "`ACTIVATIONS`"
    ),
    effect=GELU_EFFECT + ": the default `jax.nn.gelu` in every feed-forward layer",
    needs="jax",
    cost="slow",
)
def gelu_approximate_jax() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("jax")
    import jax

    from transformer_rosetta.jax_impl import model as flax_model

    _check_default("jax.nn.gelu approximate", _default_of(jax.nn.gelu, "approximate"), True)
    return _logit_effect(
        "jax",
        _tiny(activation="gelu"),
        "float64",
        lambda m: _patched(flax_model.ACTIVATIONS, "gelu", jax.nn.gelu),
    )


@divergence(
    topic="GELU form",
    framework="Keras",
    default="`keras.ops.gelu(approximate=True)`: the tanh form",
    ours="the erf form written in `keras.ops`, `tf_impl/model.py` `_gelu`",
    effect=GELU_EFFECT + ": the default `keras.ops.gelu` in every feed-forward layer",
    needs="tf",
)
def gelu_approximate_keras() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    import keras

    from transformer_rosetta.tf_impl import model as keras_model

    _check_default("keras.ops.gelu approximate", _default_of(keras.ops.gelu, "approximate"), True)
    return _logit_effect(
        "tf",
        _tiny(activation="gelu"),
        "float64",
        lambda m: _patched(keras_model.ACTIVATIONS, "gelu", keras.ops.gelu),
    )


@divergence(
    topic="GELU constants",
    framework="TensorFlow",
    default=(
        "`keras.ops.gelu(approximate=False)` is `tf.nn.gelu`, whose constants pass through float32"
    ),
    ours="the erf form written in `keras.ops`, `tf_impl/model.py` `_gelu`",
    effect=GELU_EFFECT + ": `keras.ops.gelu(x, approximate=False)` in every feed-forward layer",
    needs="tf",
)
def gelu_float32_constants_tf() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    import keras

    from transformer_rosetta.tf_impl import model as keras_model

    def exact_gelu(x: Any) -> Any:
        return keras.ops.gelu(x, approximate=False)

    return _logit_effect(
        "tf",
        _tiny(activation="gelu"),
        "float64",
        lambda m: _patched(keras_model.ACTIVATIONS, "gelu", exact_gelu),
    )


# -- 4. a query with no allowed key ----------------------------------------------------------------

MASKED_KEYS = 4  # keys of the fully masked row; its values are the identity, so output = weights
MASKED_OURS = "a zero context for a query with no allowed key (the spec)"
MASKED_EFFECT = (
    "max |output| of a query whose 4 keys are all masked (values = the 4 x 4 identity, so the "
    "output row is the attention weights), float32, CPU; the spec gives 0"
)


def masked_row_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q (1, 4), k (4, 4), v (4, 4) = identity) in float32, seed 0."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, MASKED_KEYS)).astype(np.float32)
    k = rng.standard_normal((MASKED_KEYS, MASKED_KEYS)).astype(np.float32)
    return q, k, np.eye(MASKED_KEYS, dtype=np.float32)


@divergence(
    topic="Fully masked attention row",
    framework="PyTorch",
    default=(
        "scores `masked_fill`ed with −inf, then `torch.softmax`: a row with no allowed key is 0/0"
    ),
    ours=(
        "the finite minimum, then the probabilities zeroed where masked, "
        "`torch_impl/model.py` `explicit_attention`; " + MASKED_OURS
    ),
    effect=MASKED_EFFECT,
    needs="torch",
    depends_on=EXACT,
)
def masked_row_softmax_torch() -> float:
    import torch

    q, k, v = (torch.from_numpy(a) for a in masked_row_arrays())
    mask = torch.zeros(1, MASKED_KEYS, dtype=torch.bool)
    scores = (q @ k.T / math.sqrt(MASKED_KEYS)).masked_fill(~mask, float("-inf"))
    return float((torch.softmax(scores, dim=-1) @ v).abs().max())


@divergence(
    topic="Fully masked attention row",
    framework="PyTorch",
    default="`F.scaled_dot_product_attention` with a boolean mask row that is all False",
    ours=(
        "the context masked to 0 afterwards all the same (CUDA kernels may give NaN), "
        "`torch_impl/model.py` `fused_attention`"
    ),
    effect=MASKED_EFFECT,
    needs="torch",
    show=_uniform_or_scientific(MASKED_KEYS),
    depends_on="the device: exact 0 on the CPU; CUDA kernels may give NaN (not measured here)",
)
def masked_row_sdpa_torch() -> float:
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(a)[None, None] for a in masked_row_arrays())  # (1, 1, T, d)
    mask = torch.zeros(1, 1, 1, MASKED_KEYS, dtype=torch.bool)
    return float(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).abs().max())


@divergence(
    topic="Fully masked attention row",
    framework="JAX",
    default=(
        "`jax.nn.dot_product_attention`: a row with no allowed key averages every value uniformly"
    ),
    ours=(
        "rows with no allowed key set to 0 after the kernel, `jax_impl/model.py` `fused_attention`"
    ),
    effect=MASKED_EFFECT,
    needs="jax",
    show=_uniform_or_scientific(MASKED_KEYS),
    depends_on=EXACT,
)
def masked_row_jax() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("jax")
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(a)[None, :, None, :] for a in masked_row_arrays())  # (B, T, N, H)
    mask = jnp.zeros((1, 1, 1, MASKED_KEYS), dtype=bool)
    return float(jnp.max(jnp.abs(jax.nn.dot_product_attention(q, k, v, mask=mask))))


@divergence(
    topic="Fully masked attention row",
    framework="Keras",
    default=(
        "`keras.ops.dot_product_attention`: a row with no allowed key averages every value "
        "uniformly"
    ),
    ours="rows with no allowed key set to 0 after the kernel, `tf_impl/model.py` `fused_attention`",
    effect=MASKED_EFFECT,
    needs="tf",
    show=_uniform_or_scientific(MASKED_KEYS),
    depends_on=EXACT,
)
def masked_row_keras() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    from keras import ops

    q, k, v = (ops.convert_to_tensor(a[None, :, None, :]) for a in masked_row_arrays())
    mask = ops.zeros((1, 1, 1, MASKED_KEYS), dtype="bool")
    out = ops.dot_product_attention(q, k, v, mask=mask)
    return float(np.max(np.abs(ops.convert_to_numpy(out))))


# -- attention kernels in a float64 model ----------------------------------------------------------


@divergence(
    topic="Fused attention in float64",
    framework="JAX",
    default=(
        "`jax.nn.dot_product_attention` computes its softmax in float32 whatever the input dtype"
    ),
    ours=(
        "float64 models take the explicit attention on both paths, `jax_impl/model.py` "
        "`MultiHeadAttention`"
    ),
    effect="max |Δ logits|, tiny preset, float64: every attention through the kernel",
    needs="jax",
    cost="slow",
)
def fused_attention_float64_jax() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("jax")
    from transformer_rosetta.jax_impl import model as flax_model

    def kernel(q: Any, k: Any, v: Any, mask: Any, dropout: Any) -> tuple[Any, None]:
        return flax_model.fused_attention(q, k, v, mask), None

    return _logit_effect(
        "jax",
        _tiny(),
        "float64",
        lambda m: _patched(flax_model, "explicit_attention", kernel),
    )


@divergence(
    topic="Attention scale in float64",
    framework="TensorFlow",
    default=(
        "`keras.ops.dot_product_attention(scale=1/sqrt(d_k))`: a Python float scale becomes a "
        "float32 tensor"
    ),
    ours="q divided by sqrt(d_k) first, then `scale=1.0`, `tf_impl/model.py` `fused_attention`",
    effect=(
        "max |Δ logits|, tiny preset, float64, fused path: the scale passed to the kernel instead"
    ),
    needs="tf",
)
def attention_scale_float32_tf() -> float:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    from keras import ops

    from transformer_rosetta.tf_impl import model as keras_model

    def scale_argument(q: Any, k: Any, v: Any, mask: Any) -> Any:
        # ours with q's pre-scaling undone and the scale handed to the kernel instead: the
        # masked-row handling stays ours, so only the scale's rounding differs.
        context = ops.dot_product_attention(q, k, v, mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))
        has_key = ops.transpose(ops.any(mask, axis=-1), (0, 2, 1))[..., None]
        return ops.where(has_key, context, ops.zeros_like(context))

    return _logit_effect(
        "tf",
        _tiny(),
        "float64",
        lambda m: _patched(keras_model, "fused_attention", scale_argument),
    )


# -- 5, 6. Keras's Adam ----------------------------------------------------------------------------

ADAM_STEPS, ADAM_WARMUP = 20, 10
ADAM_EFFECT = (
    f"max |Δ loss| over {ADAM_STEPS} steps (warmup {ADAM_WARMUP}), tiny preset, float64, batches "
    "of 3 (6/5 tokens); in parentheses max |Δ weights| after them, `*.key.bias` aside (its true "
    "gradient is 0: docs/PARITY.md)"
)


def adam_batches(config: TransformerConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (src, tgt) batches of parity_tests/impl/test_training.py, seeds 0..ADAM_STEPS-1."""
    batches = []
    for seed in range(ADAM_STEPS):
        src, tgt_in = ragged_batch(config, batch=3, src_len=6, tgt_len=5, seed=seed)
        # The tiny preset's encoder-decoder (as impl/test_training.py's), which takes both inputs.
        assert src is not None and tgt_in is not None
        tgt = np.concatenate([tgt_in[:, 1:], np.full((3, 1), config.pad_id)], axis=1)
        tgt[0, -1] = config.eos_id
        batches.append((src, tgt))
    return batches


@functools.cache
def _keras_training(variant: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(per-step losses, weights after) of ADAM_STEPS steps of Keras on TensorFlow, float64, with
    one optimizer variant:
    - "ours": tf_impl/train.py's Adam (eps on sqrt(v_hat), betas made in float64);
    - "stock": keras.optimizers.Adam with the paper's betas and eps as Python floats;
    - "stock_float64_betas": keras.optimizers.Adam with the betas as float64 tensors, so that
      its only difference from "ours" is where eps sits;
    - "ours_keras_eps": ours with Keras's default epsilon.
    The training step is tf_impl/train.py's `train_step` in a `tf.function` (a graph, not XLA:
    the same for every variant, and faster to trace)."""
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    import keras
    import tensorflow as tf

    from transformer_rosetta.oracle.training import ADAM_BETAS, ADAM_EPS
    from transformer_rosetta.spec.masks import shift_right
    from transformer_rosetta.tf_impl import train
    from transformer_rosetta.tf_impl.weights import (
        export_canonical,
        load_canonical,
        new_model,
        variables_by_name,
    )

    config = _tiny()
    model = new_model(config, "float64")
    load_canonical(model, _weights(config, "float64"))
    rate = train.noam_schedule(config.d_model, ADAM_WARMUP)
    b1, b2 = ADAM_BETAS
    if variant == "ours":
        optimizer = train.Adam(rate)
    elif variant == "ours_keras_eps":
        eps = _default_of(keras.optimizers.Adam, "epsilon")
        _check_default("keras.optimizers.Adam epsilon", eps, 1e-7)
        optimizer = train.Adam(rate, epsilon=eps)
    elif variant == "stock":
        optimizer = keras.optimizers.Adam(rate, beta_1=b1, beta_2=b2, epsilon=ADAM_EPS)
    elif variant == "stock_float64_betas":
        optimizer = keras.optimizers.Adam(
            rate,
            beta_1=tf.constant(b1, tf.float64),
            beta_2=tf.constant(b2, tf.float64),
            epsilon=ADAM_EPS,
        )
    else:
        raise ValueError(f"unknown Adam variant {variant!r}")
    optimizer.build(list(variables_by_name(model).values()))

    @tf.function(autograph=False, reduce_retracing=True)
    def step(src: Any, tgt_in: Any, tgt: Any) -> Any:
        return train.train_step(model, optimizer, src, tgt_in, tgt)

    with tf.device("/CPU:0"):
        losses = [
            step(tf.constant(src), tf.constant(shift_right(tgt, config.bos_id)), tf.constant(tgt))
            for src, tgt in adam_batches(config)
        ]
    return np.array([float(x) for x in losses]), export_canonical(model)


def _adam_effect(a: str, b: str) -> tuple[float, str]:
    (loss_a, weights_a), (loss_b, weights_b) = _keras_training(a), _keras_training(b)
    weights = max(
        max_abs_diff(weights_a[k], weights_b[k]) for k in weights_a if not k.endswith(".key.bias")
    )
    return max_abs_diff(loss_a, loss_b), f"weights: {scientific(weights)}"


@divergence(
    topic="Adam epsilon placement",
    framework="Keras",
    default="`keras.optimizers.Adam`: eps on sqrt(v) before the bias correction",
    ours=(
        "eps on sqrt(v_hat), as torch, optax and `common/oracle/training.py`: `tf_impl/train.py` "
        "`Adam.update_step`"
    ),
    effect=ADAM_EFFECT + "; the stock Adam given float64 betas, so that only the placement differs",
    needs="tf",
    cost="slow",
)
def adam_epsilon_placement_keras() -> tuple[float, str]:
    return _adam_effect("stock_float64_betas", "ours")


@divergence(
    topic="Adam betas in a float64 model",
    framework="TensorFlow",
    default="Keras's Adam `ops.cast(beta_1, 'float64')` goes through float32 (0.8999999761581421)",
    ours="`ops.convert_to_tensor(beta, dtype=...)`, `tf_impl/train.py` `Adam._step_scalars`",
    effect=ADAM_EFFECT + "; the stock Adam with the betas as Python floats vs as float64 tensors",
    needs="tf",
    cost="slow",
)
def adam_float32_betas_tf() -> tuple[float, str]:
    return _adam_effect("stock", "stock_float64_betas")


@divergence(
    topic="Adam epsilon value",
    framework="Keras",
    default="`keras.optimizers.Adam(epsilon=1e-7)`",
    ours="1e-9 (section 5.3), `common/oracle/training.py` `ADAM_EPS`",
    effect=ADAM_EFFECT + "; this project's Adam with eps 1e-7",
    needs="tf",
    cost="slow",
)
def adam_default_epsilon_keras() -> tuple[float, str]:
    return _adam_effect("ours_keras_eps", "ours")


# -- 7. TF32 on GPUs, emulated ---------------------------------------------------------------------


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """Each value rounded to the nearest TF32 value (10 explicit mantissa bits, ties to even),
    kept in float64: what a tensor core reads when TF32 is on. (Exponents stay as they are: the
    model's values are far from TF32's range limits, which are float32's.)"""
    mantissa, exponent = np.frexp(np.asarray(x, np.float64))  # mantissa in [0.5, 1)
    return np.ldexp(np.round(mantissa * 2.0**11) / 2.0**11, exponent)


class _TF32Products(np.ndarray):
    """An ndarray whose matmuls and einsums round their operands to TF32 first (and accumulate
    in float64); every other operation is numpy's. Results stay of this class, so that a whole
    computation started from one such array runs with TF32 products."""

    @staticmethod
    def _plain(x: Any) -> Any:
        if isinstance(x, _TF32Products):
            return x.view(np.ndarray)
        if isinstance(x, (list, tuple)):
            return type(x)(_TF32Products._plain(i) for i in x)
        return x

    @staticmethod
    def _wrap(x: Any) -> Any:
        if isinstance(x, np.ndarray) and not isinstance(x, _TF32Products):
            return x.view(_TF32Products)
        if isinstance(x, tuple):
            return tuple(_TF32Products._wrap(i) for i in x)
        return x

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        args = [self._plain(x) for x in inputs]
        if ufunc is np.matmul and method == "__call__":
            args = [round_to_tf32(a) for a in args]
        kwargs = {k: self._plain(v) for k, v in kwargs.items()}
        return self._wrap(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        args = [self._plain(a) for a in args]
        if func is np.einsum:
            args = [a if isinstance(a, str) else round_to_tf32(a) for a in args]
        kwargs = {k: self._plain(v) for k, v in kwargs.items()}
        return self._wrap(func(*args, **kwargs))


@functools.cache
def tf32_emulated_effect() -> float:
    """max |Δ logits| of the float64 oracle with every matmul and einsum operand rounded to TF32
    against the oracle as it is, on the tiny preset's float32 weights."""
    from transformer_rosetta.oracle import reference

    config = _tiny()
    weights = _weights(config, "float32")
    src, tgt_in = _inputs(config)
    exact = reference.forward(weights, config, src, tgt_in).logits
    embed = reference.embed

    def embed_tf32(*args: Any) -> np.ndarray:
        return embed(*args).view(_TF32Products)  # what follows the embedding: TF32 products

    with _patched(reference, "embed", embed_tf32):
        tf32 = np.asarray(reference.forward(weights, config, src, tgt_in).logits)
    return max_abs_diff(tf32, exact)


TF32_EFFECT = (
    "max |Δ logits|, tiny preset, emulated on CPU: the float64 oracle with every matmul operand "
    "rounded to TF32 (10 mantissa bits) vs without"
)


@divergence(
    topic="TF32 products on GPUs",
    framework="JAX",
    default=(
        "default matmul precision on an NVIDIA GPU (Ampere or later): float32 operands rounded to "
        "TF32"
    ),
    ours=(
        '`jax.default_matmul_precision("highest")` around every call, `jax_impl/precision.py` '
        "`matmul_precision`"
    ),
    effect=TF32_EFFECT,
    needs=None,
    depends_on=TF32_GPU,
)
def tf32_jax() -> float:
    return tf32_emulated_effect()


@divergence(
    topic="TF32 products on GPUs",
    framework="TensorFlow",
    default="`enable_tensor_float_32_execution` on by default (Ampere or later GPUs)",
    ours="off around every call, `tf_impl/precision.py` `matmul_precision`",
    effect=TF32_EFFECT,
    needs=None,
    depends_on=TF32_GPU,
)
def tf32_tf() -> float:
    return tf32_emulated_effect()


# -- 8. bfloat16 statistics and accumulation -------------------------------------------------------

SOFTMAX_ROWS, SOFTMAX_KEYS = 64, 64


def bf16_scores() -> np.ndarray:
    """SOFTMAX_ROWS x SOFTMAX_KEYS attention scores N(0, 3²) in bfloat16 (ml_dtypes), seed 0."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    return (3.0 * rng.standard_normal((SOFTMAX_ROWS, SOFTMAX_KEYS))).astype(ml_dtypes.bfloat16)


def exact_softmax(scores: np.ndarray) -> np.ndarray:
    s = np.asarray(scores, np.float64)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _rounded_once(exact: np.ndarray) -> float:
    """max |error| of the exact values rounded once to bfloat16: the best a bfloat16 output can
    do, and what float32 statistics give."""
    import ml_dtypes

    return max_abs_diff(exact.astype(ml_dtypes.bfloat16), exact)


PRODUCT_SHAPE = (64, 512, 64)  # (m, inner, n): inner = the base model's d_model


def bf16_operands() -> tuple[np.ndarray, np.ndarray]:
    """Two standard-normal bfloat16 matrices (64 x 512, 512 x 64), seed 0."""
    import ml_dtypes

    m, inner, n = PRODUCT_SHAPE
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((m, inner)).astype(ml_dtypes.bfloat16),
        rng.standard_normal((inner, n)).astype(ml_dtypes.bfloat16),
    )


def truncated_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values cut to bfloat16 (their top 16 bits), as float32: truncation, not rounding."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def tf_bf16_kernels() -> str:
    """Which of TF_BF16's classes this process's TensorFlow is in, from what `tf.matmul` does to
    bf16_operands() on the CPU: "Eigen" when the result is the float32 product truncated to
    bfloat16, "oneDNN" when it is within one rounding to nearest of the exact product, and
    "other" for a kernel neither describes (no record can match it: measure it)."""
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    import tensorflow as tf

    a, b = bf16_operands()
    with tf.device("/CPU:0"):
        got = tf.matmul(tf.constant(a), tf.constant(b)).numpy().astype(np.float32)
    if np.array_equal(got, truncated_to_bf16(a.astype(np.float32) @ b.astype(np.float32))):
        return "Eigen"
    exact = a.astype(np.float64) @ b.astype(np.float64)
    # One rounding to nearest of a float32 sum that is itself within 1e-6 relative of the exact
    # product: never more than one bfloat16 rounding of the exact product, plus that 1e-6.
    if max_abs_diff(got, exact) <= _rounded_once(exact) * (1 + 1e-6):
        return "oneDNN"
    return "other"


TF_BF16 = Hardware(
    depends_on=(
        "the CPU: TensorFlow runs bfloat16 through oneDNN where oneDNN is on (its default on x86 "
        "CPUs with AVX512-VNNI, AVX512-BF16 or AMX; `TF_ENABLE_ONEDNN_OPTS`) and the CPU has "
        "AVX-512, else through Eigen"
    ),
    classes={
        "oneDNN": "products accumulate in float32 and round to nearest once; softmax in float32",
        "Eigen": "`tf.matmul` truncates its float32 result, `tf.einsum` sums in bfloat16, "
        "softmax computes in bfloat16",
    },
    current=tf_bf16_kernels,
    environments={
        "oneDNN": {"TF_ENABLE_ONEDNN_OPTS": "1"},
        "Eigen": {"TF_ENABLE_ONEDNN_OPTS": "0"},
    },
)


SOFTMAX_EFFECT = (
    "max |error| of the softmax of 64 x 64 bfloat16 scores N(0, 3²) against the exact softmax "
    "of the same scores; in parentheses one rounding of the exact result, what float32 "
    "statistics give"
)
SOFTMAX_OURS = "scores cast to float32 (`statistics_dtype`), the probabilities rounded once"


@divergence(
    topic="Softmax statistics in bfloat16",
    framework="JAX",
    default="`jax.nn.softmax` on bfloat16 scores computes in bfloat16",
    ours=SOFTMAX_OURS + ", `jax_impl/model.py` `explicit_attention`",
    effect=SOFTMAX_EFFECT,
    rtol=ROUNDING_RTOL,
    needs="jax",
)
def bf16_softmax_jax() -> tuple[float, str]:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("jax")
    import jax
    import jax.numpy as jnp

    scores = bf16_scores()
    exact = exact_softmax(scores)
    got = np.asarray(jax.nn.softmax(jnp.asarray(scores), axis=-1)).astype(np.float64)
    return max_abs_diff(got, exact), f"one rounding: {scientific(_rounded_once(exact))}"


@divergence(
    topic="Softmax statistics in bfloat16",
    framework="Keras",
    default=(
        "`keras.ops.softmax` on bfloat16 scores (TensorFlow, CPU): in bfloat16 with Eigen, in "
        "float32 with oneDNN"
    ),
    ours=SOFTMAX_OURS + ", `tf_impl/model.py` `explicit_attention`",
    effect=SOFTMAX_EFFECT,
    rtol=ROUNDING_RTOL,
    needs="tf",
    hardware=TF_BF16,
)
def bf16_softmax_keras() -> tuple[float, str]:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    from keras import ops

    scores = bf16_scores()
    exact = exact_softmax(scores)
    got = ops.convert_to_numpy(ops.softmax(ops.convert_to_tensor(scores), axis=-1))
    return max_abs_diff(got.astype(np.float64), exact), (
        f"one rounding: {scientific(_rounded_once(exact))}"
    )


def _bf16_product_error(product: Callable[[Any, Any], Any]) -> tuple[float, str]:
    """max |error| of product(a, b) on bf16_operands() against their exact product, and the
    note giving one rounding (to nearest) of the exact product."""
    a, b = bf16_operands()
    exact = a.astype(np.float64) @ b.astype(np.float64)
    got = np.asarray(product(a, b)).astype(np.float64)
    return max_abs_diff(got, exact), f"one rounding: {scientific(_rounded_once(exact))}"


BF16_PRODUCT_EFFECT = (
    "max |error| of a bfloat16 (64 x 512) · (512 x 64) product of N(0, 1) operands against "
    "their exact product; in parentheses one rounding of the exact product (what torch gives)"
)


@divergence(
    topic="bfloat16 products on CPU",
    framework="TensorFlow",
    default=(
        "`tf.matmul` on bfloat16 (CPU), where `keras.ops.einsum` sends the model's products: Eigen "
        "truncates the float32 result to bfloat16, oneDNN rounds it to nearest"
    ),
    ours="kept: within the bfloat16 bound (docs/PARITY.md) on either",
    effect=BF16_PRODUCT_EFFECT + "; through `keras.ops.einsum`",
    rtol=ROUNDING_RTOL,
    needs="tf",
    hardware=TF_BF16,
)
def bf16_matmul_tf() -> tuple[float, str]:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    import tensorflow as tf
    from keras import ops

    def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with tf.device("/CPU:0"):
            return ops.convert_to_numpy(ops.einsum("ij,jk->ik", tf.constant(a), tf.constant(b)))

    return _bf16_product_error(product)


@divergence(
    topic="bfloat16 products on CPU",
    framework="TensorFlow",
    default=(
        "`tf.einsum` on bfloat16 (CPU): Eigen sums the partial products in bfloat16; oneDNN as "
        "its matmul"
    ),
    ours="not used: `keras.ops.einsum` sends the model's products to `tf.matmul`",
    effect=BF16_PRODUCT_EFFECT + "; through `tf.einsum`",
    rtol=ROUNDING_RTOL,
    needs="tf",
    hardware=TF_BF16,
)
def bf16_einsum_tf() -> tuple[float, str]:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    import tensorflow as tf

    def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with tf.device("/CPU:0"):
            return tf.einsum("ij,jk->ik", tf.constant(a), tf.constant(b)).numpy()

    return _bf16_product_error(product)


# -- 9. Keras's bias add ---------------------------------------------------------------------------

# The case the property test found: d_model 2 with 2 heads (d_k = 1), so a per-head bias (h, d_k)
# squeezes to a vector of length h, and sequences of length 2 = h.
BIAS_ADD_CONFIG = dict(d_model=2, num_heads=2, d_ff=4)
BIAS_ADD_ATTENTION = ("encoder_self_attention", "decoder_self_attention", "cross_attention")


@divergence(
    topic="Per-head bias add",
    framework="Keras",
    default=(
        "`layers.EinsumDense` adds its bias with `ops.add`, which Keras 3.15 on TensorFlow turns "
        "into `tf.nn.bias_add` in NCHW layout when the bias's length matches x.shape[1]"
    ),
    ours="`HeadProjection`, an `EinsumDense` that adds its bias with `+`, `tf_impl/model.py`",
    effect=(
        "max |Δ attention probabilities| over every map, tiny preset with d_model 2 and 2 heads "
        "(d_k = 1), batch 2 of 2/2 tokens, float64: stock `EinsumDense` projections vs "
        "`HeadProjection` (in parentheses: max |Δ logits|)"
    ),
    needs="tf",
)
def einsum_dense_bias_keras() -> tuple[float, str]:
    from transformer_rosetta.adapter.backends import get_backend

    get_backend("tf")
    import keras

    from transformer_rosetta.tf_impl import model as keras_model

    config = _tiny(**BIAS_ADD_CONFIG)
    src, tgt_in = ragged_batch(config, batch=2, src_len=2, tgt_len=2, seed=0)
    ours = _build("tf", config, "float64").forward(src, tgt_in, attention=True)
    with _patched(keras_model, "HeadProjection", keras.layers.EinsumDense):
        stock = _build("tf", config, "float64")
    theirs = stock.forward(src, tgt_in, attention=True)
    attention = max(
        max_abs_diff(a, b)
        for key in BIAS_ADD_ATTENTION
        for a, b in zip(getattr(theirs, key), getattr(ours, key), strict=True)
    )
    return attention, f"logits: {scientific(max_abs_diff(theirs.logits, ours.logits))}"


# -- 10. nn.Transformer's fast path ----------------------------------------------------------------


@divergence(
    topic="Padded positions in the encoder",
    framework="nn.Transformer",
    default=(
        "the fast path (eval, no grad, a key padding mask) drops padded positions: they come back "
        "as 0, then the final norm's bias"
    ),
    ours=(
        "every position computed, as the slow path does (`rosetta convert --from nn-transformer`; "
        "tests force the slow path with `torch.backends.mha.set_fastpath_enabled(False)`)"
    ),
    effect=(
        "max |Δ encoder output| at padded positions, fast path vs slow path, "
        "`nn.TransformerEncoder` with the tiny preset's sizes and random weights and biases, "
        "float64, a 4 x 9 batch with padding (in parentheses: at real positions)"
    ),
    needs="torch",
)
def nn_transformer_fast_path() -> tuple[float, str]:
    import warnings

    import torch
    from torch import nn

    config = _tiny()
    src, _ = _inputs(config)
    src[-1, :2] = src[0, :2]  # keep two tokens in the all-pad row: the fast path gives NaN there
    padded = torch.from_numpy(src == config.pad_id)  # True = masked, nn.Transformer's convention
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors' "prototype" warning
        layer = nn.TransformerEncoderLayer(
            config.d_model,
            config.num_heads,
            config.d_ff,
            dropout=0.0,
            layer_norm_eps=config.layer_norm_eps,
            batch_first=True,
        )
        encoder = nn.TransformerEncoder(
            layer,
            config.num_encoder_layers,
            norm=nn.LayerNorm(config.d_model, eps=config.layer_norm_eps),
        )
        encoder = encoder.double().eval()
        with torch.no_grad():
            for name, p in encoder.named_parameters():  # nn's init leaves biases 0 and norms 1
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
                if p.dim() > 1:
                    p.copy_(noise / math.sqrt(p.shape[-1]))
                elif "norm" in name and name.endswith("weight"):
                    p.copy_(1.0 + 0.1 * noise)
                else:
                    p.copy_(0.1 * noise)
        x = torch.randn(*src.shape, config.d_model, generator=generator, dtype=torch.float64)
        before = torch.backends.mha.get_fastpath_enabled()
        outputs = {}
        try:
            for fast in (True, False):
                torch.backends.mha.set_fastpath_enabled(fast)
                with torch.inference_mode():
                    outputs[fast] = encoder(x, src_key_padding_mask=padded).numpy()
        finally:
            torch.backends.mha.set_fastpath_enabled(before)
    pad = padded.numpy()
    at_pads = max_abs_diff(outputs[True][pad], outputs[False][pad])
    at_tokens = max_abs_diff(outputs[True][~pad], outputs[False][~pad])
    return at_pads, f"real positions: {scientific(at_tokens)}"


# -- 11. The loss over data-parallel replicas ------------------------------------------------------

# A worker with two host devices (XLA_FLAGS before jax is imported): the same 20 Adam steps on
# ragged batches, each replica's loss divided by its own token count, then by the global one.
_RAGGED_TRAP_WORKER = """
import json, sys
import numpy as np
from transformer_rosetta.jax_impl.distributed import ragged_trap_train_on_mesh
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.mesh import MeshShape
from transformer_rosetta.weights.init import init_weights

c = preset("tiny")
weights = init_weights(c, seed=0, scheme="perturbed", dtype="float64")
batches = []
for seed in range(20):
    src, tgt = ragged_batch(c, batch=4, src_len=9, tgt_len=7, seed=seed)
    tgt[2:, 3:] = c.pad_id  # the second replica's rows hold fewer target tokens
    batches.append((src, tgt))
losses = {
    way: ragged_trap_train_on_mesh(
        c, weights, batches, MeshShape(2, 1), dtype="float64", warmup=4, denominator=way
    )[0]
    for way in ("local", "global")
}
print(json.dumps(float(np.max(np.abs(np.subtract(losses["local"], losses["global"]))))))
"""


@divergence(
    topic="Loss over data-parallel replicas",
    framework="JAX",
    default=(
        "each replica's mean over its own non-pad tokens, averaged by the engine (`jax.lax.pmean`; "
        "DDP's gradient all-reduce averages the same way)"
    ),
    ours=(
        "each replica's token sum over the GLOBAL token count, `spec/mesh.py` "
        "`replica_loss_scale`; under `jax.jit` over the sharded batch the loss is written "
        "global and no per-replica mean exists"
    ),
    effect=(
        "max |Δ loss| over 20 Adam steps, tiny preset, float64, 2 replicas of a 4-row ragged batch "
        "(the second replica's targets mostly padding): the per-replica mean against the global one"
    ),
    needs="jax",
    cost="slow",
)
def ragged_replica_mean_jax() -> float:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run(
        [sys.executable, "-c", _RAGGED_TRAP_WORKER],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


# -- 12. Today's decoders: rotary layouts and RMSNorm's statistics --------------------------------


def _llama(**changes: Any) -> TransformerConfig:
    config = preset("tiny_llama")
    return config.replace(**changes) if changes else config


def _lm_inputs(config: TransformerConfig) -> np.ndarray:
    """A decoder-only batch: 4 ragged rows of 7 tokens, seed 0 (as _inputs' target side)."""
    _, tgt_in = ragged_batch(config, batch=4, src_len=1, tgt_len=7, seed=0)
    assert tgt_in is not None
    return tgt_in


def _lm_logit_effect(
    config: TransformerConfig,
    dtype: str,
    default: Callable[[Any], contextlib.AbstractContextManager],
) -> float:
    """_logit_effect for a decoder-only model of torch_impl."""
    model = _build("torch", config, dtype)
    tgt_in = _lm_inputs(config)
    ours = model.forward(None, tgt_in).logits
    with default(model):
        theirs = model.forward(None, tgt_in).logits
    return max_abs_diff(theirs, ours)


def _torch_modules(model: Any, kind: type) -> list[Any]:
    return [m for m in model.module.modules() if isinstance(m, kind)]


@divergence(
    topic="Rotary layout",
    framework="PyTorch",
    default=(
        "Hugging Face's `rotate_half` (halves) on a Meta checkpoint, whose q and k rows are "
        "written for interleaved pairs (`consolidated.*.pth`), without the permutation"
    ),
    ours=(
        "`rotary_layout` names the pairs (`half_split` or `interleaved`); `--from meta-llama` "
        "permutes q and k into `half_split` (table step `rotary_permute`), as "
        "`convert_llama_weights_to_hf.py` does"
    ),
    effect=(
        "max |Δ logits|, `tiny_llama` preset, float64, 4 ragged rows of 7 tokens: the same "
        "weights with the other `rotary_layout`"
    ),
    needs="torch",
)
def rotary_layout_mixed_up() -> float:
    from transformer_rosetta.torch_impl.model import MultiHeadAttention

    def other_layout(model: Any) -> contextlib.AbstractContextManager:
        return _attributes(
            _torch_modules(model, MultiHeadAttention), "rotary_layout", "interleaved"
        )

    return _lm_logit_effect(_llama(), "float64", other_layout)


def _rms_norm_without_upcast(self: Any, x: Any) -> Any:
    """RMSNorm with its statistics in the input dtype: no float32 upcast anywhere."""
    import torch

    return self.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps))


RMS_ROWS, RMS_WIDTH = 64, 512  # the base model's d_model


@divergence(
    topic="RMSNorm statistics dtype",
    framework="PyTorch",
    default=(
        "an RMSNorm written without an upcast: `x * rsqrt(x.pow(2).mean(-1) + eps)` in the "
        "input's bfloat16"
    ),
    ours=(
        "float32 statistics, the normalised x rounded to bfloat16 once before the gain "
        "(`torch_impl/model.py` `RMSNorm`, Hugging Face's `LlamaRMSNorm`)"
    ),
    effect=(
        "max |error| of RMSNorm over 64 x 512 bfloat16 inputs N(0, 1) with gains 1 + N(0, 0.1²) "
        "against the exact float64 norm of the same bfloat16 values: statistics in bfloat16; in "
        "parentheses with float32 statistics"
    ),
    needs="torch",
    rtol=ROUNDING_RTOL,
)
def rms_norm_statistics_bf16() -> tuple[float, str]:
    import torch

    from transformer_rosetta.torch_impl.model import RMSNorm

    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((RMS_ROWS, RMS_WIDTH))).to(torch.bfloat16)
    norm = RMSNorm(RMS_WIDTH, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(1.0 + 0.1 * rng.standard_normal(RMS_WIDTH)))
        x64, w64 = x.double(), norm.weight.double()
        exact = w64 * x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
        ours = norm(x).double()
        theirs = _rms_norm_without_upcast(norm, x).double()
    return max_abs_diff(theirs, exact), f"float32 statistics: {max_abs_diff(ours, exact):.2g}"


@divergence(
    topic="RMSNorm statistics dtype",
    framework="PyTorch",
    default="no upcast: every RMSNorm's statistics in bfloat16 (the row above)",
    ours="Hugging Face's float32 upcast of the variance (`torch_impl/model.py` `RMSNorm`)",
    effect=(
        "max |Δ logits|, `tiny_llama` preset, bfloat16, 4 ragged rows of 7 tokens: every RMSNorm "
        "without the upcast"
    ),
    needs="torch",
    rtol=ROUNDING_RTOL,
)
def rms_norm_upcast_logits() -> float:
    from transformer_rosetta.torch_impl.model import RMSNorm

    def no_upcast(_model: Any) -> contextlib.AbstractContextManager:
        return _patched(RMSNorm, "forward", _rms_norm_without_upcast)

    return _lm_logit_effect(_llama(), "bfloat16", no_upcast)


def _torch_rms_norm(self: Any, x: Any) -> Any:
    """What torch's own nn.RMSNorm computes (F.rms_norm), on RMSNorm's weight and eps."""
    import torch.nn.functional as F

    return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


@divergence(
    topic="RMSNorm gain order",
    framework="PyTorch",
    default=(
        "`nn.RMSNorm` (`F.rms_norm`): the gain multiplies the float32 normalised x, rounded to "
        "bfloat16 once at the end"
    ),
    ours=(
        "the normalised x rounded to bfloat16 first, then times the gain, as Hugging Face's "
        "`LlamaRMSNorm` (`weight * hidden.to(input_dtype)`): `torch_impl/model.py` `RMSNorm`"
    ),
    effect=(
        "max |Δ logits|, `tiny_llama` preset, bfloat16, 4 ragged rows of 7 tokens: every RMSNorm "
        "computed as `nn.RMSNorm` does"
    ),
    needs="torch",
    rtol=ROUNDING_RTOL,
)
def rms_norm_gain_order_torch() -> float:
    from transformer_rosetta.torch_impl.model import RMSNorm

    def torch_order(_model: Any) -> contextlib.AbstractContextManager:
        return _patched(RMSNorm, "forward", _torch_rms_norm)

    return _lm_logit_effect(_llama(), "bfloat16", torch_order)


# -- running, writing, reading, rendering ----------------------------------------------------------


def measure_all(
    progress: Callable[[str], None] | None = None, previous: list[dict] | None = None
) -> list[dict]:
    """Every entry's record, in REGISTRY order. `progress` is told which one runs.

    A row that depends on the hardware is measured in this process's class and, in a child
    process per other class, under that class's environment. A class that this machine cannot
    reach keeps its record from `previous` (the catalogue as it was), with the machine that
    measured it."""
    say = progress or (lambda line: None)
    elsewhere = _measure_other_classes(say)
    earlier = {row["key"]: row for row in previous or []}
    records = []
    for i, entry in enumerate(REGISTRY.values(), 1):
        say(f"[{i}/{len(REGISTRY)}] {entry.key}")
        hardware = entry.hardware
        if hardware is None:
            records.append(entry.record())
            continue
        here = entry.class_record()
        if here["class"] not in hardware.classes:
            raise RuntimeError(
                f"{entry.key}: this machine is in class {here['class']!r}, which the "
                f"catalogue does not describe (it knows {', '.join(hardware.classes)})"
            )
        classes = {here["class"]: here}
        for name in hardware.classes:
            if name in classes:
                continue
            kept = [c for c in earlier.get(entry.key, {}).get("classes", []) if c["class"] == name]
            found = elsewhere.get((entry.key, name)) or (kept[0] if kept else None)
            if found is None:
                say(f"  {entry.key}: class {name} cannot be measured here and has no record")
            else:
                classes[name] = found
        records.append(entry.record(list(classes.values())))
    return records


def measure_classes(keys: list[str], environment: dict[str, str]) -> list[dict]:
    """The class records of the hardware-dependent entries `keys`, measured in a child process
    whose environment adds `environment` (`python -m tools.docs.divergences --classes`): a
    framework reads such switches once, when it is imported. The records say which class the
    child was in, which need not be the one asked for."""
    child = subprocess.run(
        [sys.executable, "-m", "tools.docs.divergences", "--classes", ",".join(keys)],
        env={**os.environ, **environment},
        cwd=ROOT,  # where `tools` is importable
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode != 0:
        raise RuntimeError(
            f"measuring {', '.join(keys)} under {environment} failed:\n{child.stderr}"
        )
    return json.loads(child.stdout)


def _measure_other_classes(say: Callable[[str], None]) -> dict[tuple[str, str], dict]:
    """(key, class) -> class record, for every hardware class that a child process under the
    class's environment turns out to be in."""
    found: dict[tuple[str, str], dict] = {}
    hardware = {id(d.hardware): d.hardware for d in REGISTRY.values() if d.hardware is not None}
    for kind in hardware.values():
        keys = [d.key for d in REGISTRY.values() if d.hardware is kind]
        for name, environment in kind.environments.items():
            say(
                f"  class {name} ({' '.join(f'{k}={v}' for k, v in environment.items())}): {', '.join(keys)}"
            )
            for record in measure_classes(keys, environment):
                if record["class"] == name:
                    found[(record["key"], name)] = {k: record[k] for k in CLASS_KEYS}
    return found


def write_measurements(
    path: Path = MEASUREMENTS, progress: Callable[[str], None] | None = None
) -> Path:
    """Measure every entry and write the records to `path` (docs/divergences.json), atomically."""
    records = measure_all(progress, previous=load_catalogue(path))
    text = json.dumps(records, indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path


def load_catalogue(path: Path = MEASUREMENTS) -> list[dict]:
    """The records written by write_measurements; [] when nothing was measured yet."""
    if not path.exists():
        return []
    return json.loads(path.read_text(encoding="utf-8"))


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def catalogue_table(rows: list[dict] | None = None) -> str:
    """The catalogue as a markdown table, from `rows` (default: docs/divergences.json). The last
    column is the measured number (per hardware class where it depends on one), then what it
    measures. Below the table: what each hardware class does, and the machines that measured."""
    rows = load_catalogue() if rows is None else rows
    lines = [
        "| " + " | ".join(heading for _, heading in TABLE_COLUMNS) + " |",
        "|---" * len(TABLE_COLUMNS) + "|",
    ]
    if not rows:
        return "\n".join([*lines, f"| nothing measured yet: run `{MEASURE_COMMAND}` ||||||"])
    for row in rows:
        cells = [_cell(row[key]) for key, _ in TABLE_COLUMNS[:-1]]
        cells.append(f"**{_cell(row['shown'])}**: {_cell(row['effect'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *_table_notes(rows)])


def _table_notes(rows: list[dict]) -> list[str]:
    """The lines under the table: each hardware class that a row depends on, and each machine
    that measured a number, with the rows it measured."""
    notes = []
    for kind in {
        id(d.hardware): d.hardware for d in REGISTRY.values() if d.hardware is not None
    }.values():
        for name, does in kind.classes.items():
            notes.append(f"- **{name}**: {does}.")
    machines: dict[str, list[str]] = {}
    for row in rows:
        for where in [c["measured_on"] for c in row["classes"]] or [row["measured_on"]]:
            machines.setdefault(where, [])
            if row["key"] not in machines[where]:
                machines[where].append(row["key"])
    for where, keys in machines.items():
        which = "every row" if len(keys) == len(rows) else f"{len(keys)} rows"
        notes.append(f"- Measured on {_cell(where)}: {which}.")
    return notes


def _main(argv: list[str]) -> int:
    """No argument: measure every entry and write docs/divergences.json. `--classes K1,K2`:
    print the class records of those hardware-dependent entries, measured in this process, as
    JSON (what measure_classes runs in a child process)."""
    import time

    if argv[:1] == ["--classes"] and len(argv) == 2:
        print(json.dumps([{"key": k, **REGISTRY[k].class_record()} for k in argv[1].split(",")]))
        return 0
    start = time.perf_counter()
    path = write_measurements(progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
