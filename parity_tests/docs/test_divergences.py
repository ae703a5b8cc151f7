"""The divergence catalogue (tools/docs/divergences.py, docs/divergences.json, the table in
docs/ROSETTA.md).

- Every registry entry has its record in docs/divergences.json, with the same text, so an entry
  changed without measuring again fails here.
- The cheap entries (seconds each) are measured again and must give the recorded number (within
  the entry's rtol). The slow ones (Flax's eager float64 forwards, ~9 s the first; Keras training
  runs, ~5 s each) are `slow`.
- A row whose number depends on the hardware (TensorFlow's bfloat16 kernels: oneDNN or Eigen)
  records each class with the machine that measured it. The tests find the class they run in
  and compare with that class's record, so they pass on any CPU; every class this machine can
  reach (TF_ENABLE_ONEDNN_OPTS) is measured again in a child process.
- Facts the catalogue states are derived here independently: from the frameworks' signatures,
  from the float64 oracle, or from small cases worked out by hand. No expected number is taken
  from the code under test; the catalogue's numbers are measurements, not assertions.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from parity_tests.conftest import SHARED_CORES, backend_or_skip
from tools.docs import divergences
from tools.docs.divergences import (
    CLASS_KEYS,
    FRAMEWORK_NAMES,
    MEASURE_COMMAND,
    RECORD_KEYS,
    REGISTRY,
    catalogue_table,
    load_catalogue,
)
from transformer_rosetta.adapter.backends import unavailable_reason
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.init import init_weights

STALE = f"run {MEASURE_COMMAND}"
ENTRIES = list(REGISTRY.values())
# The static texts of a made-up entry, for the registry's own tests.
TEXT = {"topic": "t", "default": "d", "ours": "o", "effect": "e"}


def recorded() -> dict[str, dict]:
    return {row["key"]: row for row in load_catalogue()}


def value_of(key: str, hardware_class: str | None = None) -> float:
    """The recorded value of entry `key` (NaN for a recorded NaN); for a row that depends on the
    hardware, the value of `hardware_class` (default: the largest over the classes)."""
    row = recorded()[key]
    if hardware_class is not None:
        row = class_record(key, hardware_class)
    value = row["value"]
    return math.nan if value is None else value


def class_record(key: str, hardware_class: str) -> dict:
    found = [c for c in recorded()[key]["classes"] if c["class"] == hardware_class]
    assert found, f"{key}: no record for hardware class {hardware_class!r}: {STALE}"
    return found[0]


def tf_class() -> str:
    """The TF_BF16 class this process is in, from TensorFlow's own flag and the CPU's features,
    not from the catalogue's probe: TensorFlow sends bfloat16 to oneDNN only where oneDNN is on
    (IsMklEnabled) and the CPU has AVX-512F (tensorflow/core/util/util.cc,
    IsDataTypeSupportedByOneDNNOnThisCPU), else to Eigen."""
    backend_or_skip("tf")
    from pathlib import Path

    from tensorflow.python.util import _pywrap_util_port

    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    return "oneDNN" if _pywrap_util_port.IsMklEnabled() and "avx512f" in flags else "Eigen"


def framework_or_skip(name: str | None) -> None:
    reason = None if name is None else unavailable_reason(name)
    if reason is not None:
        pytest.skip(f"backend {name}: {reason}")


# -- the JSON matches the registry -----------------------------------------------------------------


def test_every_entry_has_its_record_with_the_same_text():
    rows = load_catalogue()
    assert rows, f"{divergences.MEASUREMENTS} is missing or empty: {STALE}"
    assert [r["key"] for r in rows] == list(REGISTRY), (
        f"docs/divergences.json lists other entries than the registry: {STALE}"
    )
    for row, divergence in zip(rows, ENTRIES, strict=True):
        assert tuple(row) == RECORD_KEYS, f"{row['key']}: keys {tuple(row)}: {STALE}"
        for field, text in divergence.text().items():
            assert row[field] == text, f"{row['key']}: {field} changed: {STALE}"
        assert row["measured_on"], row["key"]
        hardware = divergence.hardware
        # A row that depends on the hardware holds one record per class, in the classes' order;
        # its value is the largest of theirs and its text shows each, named.
        classes = row["classes"]
        if hardware is None:
            assert classes == [], row["key"]
            records = [row]
        else:
            assert [c["class"] for c in classes] == list(hardware.classes), (
                f"{row['key']}: classes {[c['class'] for c in classes]}: {STALE}"
            )
            assert all(tuple(c) == CLASS_KEYS and c["measured_on"] for c in classes)
            assert row["value"] == max(c["value"] for c in classes)
            assert row["shown"] == "; ".join(f"{c['class']}: {c['shown']}" for c in classes)
            records = classes
        for record in records:
            value = record["value"]
            assert value is None or (isinstance(value, float) and math.isfinite(value))
            # The shown text starts with the value as the entry formats it (then a note).
            shown = divergence.show(math.nan if value is None else value)
            assert record["shown"].startswith(shown), f"{row['key']}: {record['shown']!r}: {STALE}"


def test_rows_that_depend_on_the_hardware_say_so():
    """TensorFlow's bfloat16 rows say that they depend on the CPU, in the JSON and in the table;
    the other rows say what they depend on too."""
    rows = recorded()
    for key in ("bf16_softmax_keras", "bf16_matmul_tf", "bf16_einsum_tf"):
        assert REGISTRY[key].hardware is divergences.TF_BF16, key
        assert rows[key]["depends_on"].startswith("the CPU: TensorFlow runs bfloat16 through")
    assert all(row["depends_on"] for row in rows.values())
    assert rows["tf32_jax"]["depends_on"].startswith("the GPU")
    table = catalogue_table()
    assert "- **oneDNN**: products accumulate in float32" in table
    assert "- **Eigen**: `tf.matmul` truncates" in table
    assert "| the CPU: TensorFlow runs bfloat16 through oneDNN" in table


def test_registry_entries_are_well_formed():
    for key, d in REGISTRY.items():
        assert d.key == key == d.measure.__name__  # a row's key is its function's name
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", d.key), d.key
        assert d.framework in FRAMEWORK_NAMES, d.key
        assert d.cost in ("cheap", "slow"), d.key
        assert d.needs in (None, "torch", "tf", "jax"), d.key
        assert all(d.text().values()), f"{d.key}: an empty text"

    def x() -> float:
        return 0.0

    with pytest.raises(ValueError, match="x: framework 'Torch' is not one of"):
        divergences.divergence(**TEXT, framework="Torch", needs=None)(x)
    with pytest.raises(ValueError, match="two catalogue entries are called 'layer_norm_eps_torch'"):
        divergences.divergence(**TEXT, framework="PyTorch", needs=None)(
            divergences.layer_norm_eps_torch
        )


def test_the_table_has_one_row_per_record_and_is_deterministic():
    rows = load_catalogue()
    table = catalogue_table()
    assert table == catalogue_table(rows) == catalogue_table()
    lines = table.splitlines()
    assert lines[0] == (
        "| topic | framework | default | this project | depends on "
        "| effect of keeping the default |"
    )
    assert lines[2 + len(rows)] == ""  # the table ends; the classes and machines follow
    for line, row in zip(lines[2 : 2 + len(rows)], rows, strict=True):
        cells = re.split(r"(?<!\\)\|", line)[1:-1]  # pipes inside a cell are escaped
        assert len(cells) == 6, line
        assert cells[-1].replace("\\|", "|").strip().startswith(f"**{row['shown']}**")
    machines = {c["measured_on"] for r in rows for c in r["classes"] or [r]}
    for where in machines:
        assert f"- Measured on {where}: " in table


def test_the_table_without_measurements_says_how_to_measure(tmp_path):
    assert load_catalogue(tmp_path / "none.json") == []
    assert MEASURE_COMMAND in catalogue_table([])


def test_write_measurements_writes_json_with_nan_as_null(tmp_path, monkeypatch):
    monkeypatch.setattr(divergences, "REGISTRY", {})

    @divergences.divergence(**TEXT, framework="PyTorch", needs=None)
    def a_nan() -> float:
        return math.nan

    @divergences.divergence(**TEXT, framework="JAX", needs=None)
    def a_note() -> tuple[float, str]:
        return 0.0, "x: 1"

    @divergences.divergence(
        **TEXT, framework="Keras", needs=None, show=divergences._uniform_or_scientific(4)
    )
    def a_value() -> float:
        return 0.25

    seen = []
    path = divergences.write_measurements(tmp_path / "d.json", progress=seen.append)
    assert seen == ["[1/3] a_nan", "[2/3] a_note", "[3/3] a_value"]
    rows = json.loads(path.read_text())
    assert [r["value"] for r in rows] == [None, 0.0, 0.25]
    assert [r["shown"] for r in rows] == ["NaN", "0 (exact) (x: 1)", "uniform 1/4 = 0.25"]
    assert [p.name for p in tmp_path.iterdir()] == ["d.json"]  # no temp folder left
    assert divergences.scientific(3.14159e-4) == "3.1e-04"


# -- measured again --------------------------------------------------------------------------------


def _params(cost: str) -> list:
    marks = [pytest.mark.slow] if cost == "slow" else []
    return [pytest.param(d, id=d.key, marks=marks) for d in ENTRIES if d.cost == cost]


def _measure_again(divergence: divergences.Divergence) -> None:
    framework_or_skip(divergence.needs)
    if divergence.needs is not None:
        backend_or_skip(divergence.needs)
    row = recorded().get(divergence.key)
    assert row is not None, f"{divergence.key} is not in docs/divergences.json: {STALE}"
    if divergence.hardware is None:
        value, _ = divergence.measured()
    else:
        # The class this process is in, then that class's record; the probe must agree with
        # the framework's own account (test_the_probe_names_the_class_tensorflow_is_in).
        measured = divergence.class_record()
        row = class_record(divergence.key, measured["class"])
        value = measured["value"]
    _agrees(divergence, value, row)


def _agrees(divergence: divergences.Divergence, got: float | None, row: dict) -> None:
    want = row["value"]
    if want is None:
        assert got is None, f"{divergence.key}: NaN recorded, measured {got}"
        return
    assert got is not None and math.isclose(got, want, rel_tol=divergence.rtol, abs_tol=0.0), (
        f"{divergence.key}: measured {got!r}, recorded {want!r} (rtol {divergence.rtol}, "
        f"recorded on {row['measured_on']}): {STALE}"
    )


@pytest.mark.parametrize("divergence", _params("cheap"))
def test_cheap_entries_measure_what_is_recorded(divergence):
    _measure_again(divergence)


@pytest.mark.parametrize("divergence", _params("slow"))
def test_slow_entries_measure_what_is_recorded(divergence):
    """slow: a Flax model's first eager float64 forward compiles every op (~9 s on 2 cores), and
    each Keras training run traces a step and takes 20 of them (~5 s)."""
    _measure_again(divergence)


@pytest.mark.parametrize("hardware_class", list(divergences.TF_BF16.classes))
def test_each_class_this_machine_can_reach_measures_what_is_recorded(hardware_class, monkeypatch):
    """Every TF_BF16 class measured again in a child process under its environment
    (TF_ENABLE_ONEDNN_OPTS), ~5 s each: on a CPU with AVX-512 both classes, so that the record
    of the class the suite does not run in is checked too. A child that lands in another class
    (oneDNN asked for on a CPU without AVX-512) cannot measure this one: skipped, saying so."""
    backend_or_skip("tf")
    # The child measures with TF's own thread pools, as the record was made: Eigen's bfloat16
    # sums are split by thread, so conftest's per-worker pools (SHARED_CORES) would move them.
    for name in SHARED_CORES:
        monkeypatch.delenv(name, raising=False)
    kind = divergences.TF_BF16
    keys = [d.key for d in ENTRIES if d.hardware is kind]
    records = divergences.measure_classes(keys, kind.environments[hardware_class])
    landed = {r["class"] for r in records}
    if landed != {hardware_class}:
        pytest.skip(f"asked for {hardware_class}, this machine gives {', '.join(sorted(landed))}")
    for record in records:
        _agrees(
            REGISTRY[record["key"]], record["value"], class_record(record["key"], hardware_class)
        )


def test_the_probe_names_the_class_tensorflow_is_in():
    """divergences.tf_bf16_kernels (the behaviour of tf.matmul) names the class that
    TensorFlow's own flag and the CPU's features give (tf_class, above)."""
    assert divergences.tf_bf16_kernels() == tf_class()


# -- facts the catalogue states, derived independently ---------------------------------------------


def test_the_frameworks_defaults_are_the_ones_the_catalogue_names():
    import inspect

    def default(f, name):
        return inspect.signature(f).parameters[name].default

    if unavailable_reason("torch") is None:
        import torch

        assert default(torch.nn.LayerNorm, "eps") == 1e-5
        assert "1e-5" in REGISTRY["layer_norm_eps_torch"].default
    if unavailable_reason("tf") is None:
        backend_or_skip("tf")
        import keras

        assert default(keras.layers.LayerNormalization, "epsilon") == 1e-3
        assert default(keras.ops.gelu, "approximate") is True
        assert default(keras.optimizers.Adam, "epsilon") == 1e-7
        assert "1e-3" in REGISTRY["layer_norm_eps_keras"].default
        assert "1e-7" in REGISTRY["adam_default_epsilon_keras"].default
    if unavailable_reason("jax") is None:
        backend_or_skip("jax")
        import jax
        from flax import nnx

        assert default(nnx.LayerNorm.__init__, "epsilon") == 1e-6
        assert default(nnx.LayerNorm.__init__, "use_fast_variance") is True
        assert default(jax.nn.gelu, "approximate") is True


def _oracle_logit_effect(**default_vs_ours: tuple) -> float:
    """max |Δ logits| of the float64 oracle between two configs, on the catalogue's inputs
    (tiny preset, perturbed seed-0 weights, rosetta parity's batch)."""
    ((field, (theirs, ours)),) = default_vs_ours.items()
    configs = [preset("tiny").replace(**{field: v}) for v in (theirs, ours)]
    weights = init_weights(configs[0], seed=0, scheme="perturbed", dtype="float64")
    src, tgt_in = ragged_batch(configs[0], batch=4, src_len=9, tgt_len=7, seed=0)
    a, b = (reference.forward(weights, c, src, tgt_in).logits for c in configs)
    return float(np.max(np.abs(a - b)))


def test_the_layer_norm_rows_are_the_formulas_effect_and_grow_with_epsilon():
    """The oracle with eps changed gives the same numbers as the frameworks' models: each row is
    the epsilon's effect and nothing else. Torch's (1e-5 for 1e-6) and Flax's (1e-6 for 1e-5)
    rows swap the same two values, so they must agree; Keras's 1e-3 moves the logits more."""
    torch_row = value_of("layer_norm_eps_torch")
    keras_row = value_of("layer_norm_eps_keras")
    assert keras_row > torch_row > 0
    assert math.isclose(value_of("layer_norm_eps_flax"), torch_row, rel_tol=1e-9)
    assert math.isclose(_oracle_logit_effect(layer_norm_eps=(1e-5, 1e-6)), torch_row, rel_tol=1e-9)
    assert math.isclose(_oracle_logit_effect(layer_norm_eps=(1e-3, 1e-6)), keras_row, rel_tol=1e-9)


def test_the_gelu_rows_are_the_tanh_forms_effect():
    """The oracle's own tanh form (exact constants) against its erf form gives the JAX row; the
    Keras row is the same up to Keras's constants passing through float32 (the TF row's size)."""
    oracle = _oracle_logit_effect(activation=("gelu_tanh", "gelu"))
    assert math.isclose(value_of("gelu_approximate_jax"), oracle, rel_tol=1e-9)
    keras_row = value_of("gelu_approximate_keras")
    assert abs(keras_row - oracle) <= 10 * value_of("gelu_float32_constants_tf")
    assert 0 < value_of("gelu_float32_constants_tf") < atol_for("float32")


def test_a_minus_infinity_row_softmaxes_to_nan_in_torch():
    backend_or_skip("torch")
    import torch

    row = torch.full((5,), float("-inf"))
    assert torch.isnan(torch.softmax(row, dim=-1)).all()
    assert math.isnan(value_of("masked_row_softmax_torch"))


@pytest.mark.parametrize("keys", [3, 5])
def test_fused_kernels_average_a_fully_masked_row_uniformly(keys):
    """jax.nn.dot_product_attention and keras.ops.dot_product_attention give a query with no
    allowed key 1/n of every value (values = identity, so each output is its key's weight); the
    catalogue measures n = 4."""
    v = np.eye(keys, dtype=np.float32)[None, :, None, :]  # (B, T, N, H)
    q = np.ones((1, 1, 1, keys), np.float32)
    k = np.arange(keys * keys, dtype=np.float32).reshape(1, keys, 1, keys)  # unequal scores
    mask = np.zeros((1, 1, 1, keys), bool)
    outputs = {}
    if unavailable_reason("jax") is None:
        backend_or_skip("jax")
        import jax

        outputs["jax"] = np.asarray(jax.nn.dot_product_attention(q, k, v, mask=mask))
    if unavailable_reason("tf") is None:
        backend_or_skip("tf")
        from keras import ops

        outputs["keras"] = ops.convert_to_numpy(ops.dot_product_attention(q, k, v, mask=mask))
    if not outputs:
        pytest.skip("neither jax nor tf is installed")
    for name, out in outputs.items():
        np.testing.assert_allclose(out, np.full_like(out, 1.0 / keys), rtol=1e-6, err_msg=name)
    for key in ("masked_row_jax", "masked_row_keras"):
        assert recorded()[key]["shown"] == "uniform 1/4 = 0.25"


def test_keras_stock_adam_puts_epsilon_before_the_bias_correction():
    """One step of keras.optimizers.Adam on one weight is, by hand,
    w - lr sqrt(1 - b2) / (1 - b1) * m / (sqrt(v) + eps), m = (1 - b1) g, v = (1 - b2) g^2;
    ours (tf_impl/train.py) is the oracle's adam_step. With g = 1e-9 ~ eps they differ by a
    large fraction of a step, which is the catalogue's nonzero placement effect."""
    backend_or_skip("tf")
    import keras
    import tensorflow as tf

    from transformer_rosetta.oracle.training import ADAM_EPS, adam_step, noam_learning_rate
    from transformer_rosetta.tf_impl.train import Adam, noam_schedule

    # The rate as a float64 schedule, as in training (a Python float would be a float32 variable).
    d_model, warmup = 16, 10
    lr = noam_learning_rate(1, d_model, warmup)
    (b1, b2), g, w0 = (0.9, 0.98), 1e-9, 0.5
    steps = {}
    for name, optimizer in (
        ("stock", keras.optimizers.Adam(noam_schedule(d_model, warmup), b1, b2, ADAM_EPS)),
        ("ours", Adam(noam_schedule(d_model, warmup))),
    ):
        w = keras.Variable(np.array([w0]), dtype="float64")
        optimizer.apply([tf.constant([g], tf.float64)], [w])
        steps[name] = float(keras.ops.convert_to_numpy(w)[0])
    m, v = (1 - b1) * g, (1 - b2) * g * g
    by_hand = w0 - lr * math.sqrt(1 - b2) / (1 - b1) * m / (math.sqrt(v) + ADAM_EPS)
    assert math.isclose(steps["stock"], by_hand, rel_tol=1e-6)  # betas pass through float32
    oracle = adam_step(np.array([w0]), np.array([g]), np.zeros(1), np.zeros(1), step=1, lr=lr)[0]
    assert steps["ours"] == pytest.approx(float(oracle[0]), abs=1e-15)
    assert abs(steps["stock"] - steps["ours"]) > 0.1 * lr  # the placement moves this step by 10%+
    for key in (
        "adam_epsilon_placement_keras",
        "adam_float32_betas_tf",
        "adam_default_epsilon_keras",
    ):
        assert value_of(key) > 0


def test_the_tf32_rounding_and_its_size():
    """round_to_tf32 agrees with impl/test_devices.py's bit rounding (away from ties) and keeps 11
    significant bits; the emulated TF32 effect lies above the float32 bound and within TF32's."""
    from parity_tests.impl.test_devices import round_to_tf32 as bitwise

    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    tie = (x.view(np.uint32) & np.uint32(0x1FFF)) == 0x1000
    ours = divergences.round_to_tf32(x)
    np.testing.assert_array_equal(ours[~tie], bitwise(x)[~tie].astype(np.float64))
    assert np.all(np.abs(ours - x) <= np.abs(x) * 2.0**-11)
    # The emulated oracle rounds matmul and einsum operands only.
    a = np.array([[1.0 + 2.0**-12]]).view(divergences._TF32Products)
    assert float(np.asarray(a @ np.ones((1, 1)))[0, 0]) == 1.0
    assert float(np.asarray(np.einsum("ij,jk->ik", a, np.ones((1, 1))))[0, 0]) == 1.0
    assert float(np.asarray(a + 0.0)[0, 0]) == 1.0 + 2.0**-12
    tf32 = value_of("tf32_jax")
    assert tf32 == value_of("tf32_tf")
    assert atol_for("float32") < tf32 < atol_for("float32", precision="tf32")


def test_fast_variance_cancels_at_a_large_offset():
    """In float32, E[x^2] - E[x]^2 of N(1e3, 1) loses the variance (both terms ~1e6, ulp 0.06);
    E[(x - mean)^2] keeps it. Worked in numpy, without Flax."""
    x = divergences.layer_norm_offset_inputs(np.float32)
    exact = np.asarray(x, np.float64).var(axis=-1)
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float32)
    fast = (x * x).mean(axis=-1, dtype=np.float32) - (mean * mean)[:, 0]
    two_pass = ((x - mean) ** 2).mean(axis=-1, dtype=np.float32)
    assert np.max(np.abs(two_pass - exact) / exact) < 1e-4
    assert np.max(np.abs(fast - exact) / exact) > 1e-2
    assert value_of("fast_variance_offset") > 100 * atol_for("float32")


def test_tf_bfloat16_products_follow_the_cpus_kernels():
    """With Eigen, tf.matmul on bfloat16 (CPU) is the float32 product cut to bfloat16 (its top
    16 bits), and tf.einsum's error is well past two roundings. With oneDNN, both are rounded to
    nearest once: within one rounding of the exact product. torch's is one rounding on any CPU.
    The class comes from TensorFlow's flag (tf_class), the facts from numpy here."""
    hardware_class = tf_class()
    import ml_dtypes
    import tensorflow as tf

    a, b = divergences.bf16_operands()
    f32 = a.astype(np.float32) @ b.astype(np.float32)
    truncated = (f32.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    with tf.device("/CPU:0"):
        got = tf.matmul(tf.constant(a), tf.constant(b)).numpy().astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    once = float(np.max(np.abs(exact.astype(ml_dtypes.bfloat16).astype(np.float64) - exact)))
    matmul, einsum = (value_of(k, hardware_class) for k in ("bf16_matmul_tf", "bf16_einsum_tf"))
    if hardware_class == "Eigen":
        assert np.array_equal(got, truncated)
        assert einsum > 4 * once
        assert once < matmul <= 2 * once * 1.01
    else:
        # float32 accumulation is ~1e-6 relative, far below a bfloat16 half-ulp (2^-9), so the
        # result rounds like the exact product except at a few near-ties.
        assert np.mean(got == f32.astype(ml_dtypes.bfloat16).astype(np.float32)) > 0.99
        assert float(np.max(np.abs(got - exact))) <= once * (1 + 1e-6)
        assert matmul <= once * (1 + 1e-6) and einsum <= once * (1 + 1e-6)
    # Each class's record states its own fact, whichever class this machine is in.
    assert value_of("bf16_einsum_tf", "Eigen") > 4 * once
    assert value_of("bf16_einsum_tf", "oneDNN") <= once * (1 + 1e-6)
    if unavailable_reason("torch") is None:
        import torch

        def t(x):
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)

        torch_error = float(np.max(np.abs((t(a) @ t(b)).float().numpy() - exact)))
        assert torch_error <= once * 1.01


def test_bfloat16_softmax_rows_against_one_rounding():
    """JAX's bfloat16 softmax is worse than one rounding of the exact result on any CPU; Keras's
    is worse with Eigen and one rounding with oneDNN (which computes it in float32). One rounding
    is computed here from the scores, not read from the catalogue."""
    import ml_dtypes

    s = np.asarray(divergences.bf16_scores(), np.float64)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    exact = e / e.sum(axis=-1, keepdims=True)
    once = float(np.max(np.abs(exact.astype(ml_dtypes.bfloat16).astype(np.float64) - exact)))
    assert value_of("bf16_softmax_jax") > 1.2 * once
    assert value_of("bf16_softmax_keras", "Eigen") > 1.2 * once
    # float32 statistics: the exact softmax to ~1e-7, then one rounding to bfloat16.
    assert abs(value_of("bf16_softmax_keras", "oneDNN") - once) <= 1e-6


def test_stock_einsum_dense_adds_a_per_head_bias_along_the_sequence():
    """The case behind the catalogue's bias row, worked by hand: (B, T, h, d_k) = (1, 2, 2, 1)
    with T = h. Stock EinsumDense adds bias[i] at sequence position i (tf.nn.bias_add, NCHW);
    HeadProjection adds bias[i] to head i, as numpy broadcasting does."""
    backend_or_skip("tf")
    import keras

    from transformer_rosetta.tf_impl.model import HeadProjection

    x = np.array([[[1.0, 2.0], [3.0, 4.0]]])
    kernel = np.array([[[1.0], [0.0]], [[0.0], [1.0]]])  # (d, h, k): head i reads feature i
    bias = np.array([[10.0], [20.0]])  # (h, k)
    product = np.einsum("btd,dnk->btnk", x, kernel)
    outputs = {}
    for cls in (keras.layers.EinsumDense, HeadProjection):
        layer = cls("btd,dnk->btnk", (None, 2, 1), bias_axes="nk", dtype="float64")
        layer.build((None, None, 2))
        layer.kernel.assign(kernel)
        layer.bias.assign(bias)
        outputs[cls] = keras.ops.convert_to_numpy(layer(x))
    np.testing.assert_array_equal(outputs[HeadProjection], product + bias[None, None, :, :])
    np.testing.assert_array_equal(
        outputs[keras.layers.EinsumDense], product + bias[:, 0][None, :, None, None]
    )
    assert value_of("einsum_dense_bias_keras") > atol_for("float32")


def test_nn_transformer_fast_path_row_differs_at_padding_only():
    assert value_of("nn_transformer_fast_path") > 0.1
    shown = recorded()["nn_transformer_fast_path"]["shown"]
    real = float(re.search(r"real positions: ([0-9.e+-]+)", shown).group(1))
    assert real <= atol_for("float64")
