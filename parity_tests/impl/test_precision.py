"""Matmul precision modes (common/spec/precision.py): each model runs every call under its own
mode, in its framework's own switch, and leaves the switch as it found it; the modes' bounds; the
CLI's --precision and --device.

The switches are process-wide settings, so they are checked on any machine, GPU or not: what
matters is the setting a call runs under, read from inside the call. That the setting then
really changes a GPU's matmul is impl/test_devices.py's (test_gpu_float32_matmul_is_not_tf32).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from transformer_rosetta.cli import main
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.precision import (
    BENCH_PRECISIONS,
    PRECISIONS,
    bench_setting,
    check_precision,
)
from transformer_rosetta.spec.tolerances import ATOL, atol_for
from transformer_rosetta.weights.init import init_weights


def _torch_setting() -> tuple[str, str]:
    import torch

    return torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision


def _tf_setting() -> bool:
    import tensorflow as tf

    return tf.config.experimental.tensor_float_32_execution_enabled()


def _jax_setting() -> str | None:
    import jax

    return jax.config.jax_default_matmul_precision


# What each framework's switch reads, and what it must read inside a call of each mode.
SETTINGS: dict[str, Callable[[], object]] = {
    "torch": _torch_setting,
    "tf": _tf_setting,
    "jax": _jax_setting,
}
EXPECTED = {
    "torch": {"highest": ("ieee", "ieee"), "tf32": ("tf32", "tf32")},
    "tf": {"highest": False, "tf32": True},
    "jax": {"highest": "highest", "tf32": "tensorfloat32"},
}


class SettingSpy:
    """Stands in for a model's module and records its framework's switch whenever it is called."""

    def __init__(self, module: object, read: Callable[[], object]) -> None:
        self.module, self.read, self.seen = module, read, []

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        self.seen.append(self.read())
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self.module, name)


def tiny_model(framework: str, precision: str):
    config = preset("tiny")
    weights = init_weights(config, seed=0, scheme="perturbed", dtype="float64")
    backend = backend_or_skip(framework)
    return backend.build(config, weights, dtype="float32", precision=precision), config


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_a_forward_runs_in_its_models_precision_and_restores_the_switch(framework, precision):
    if framework not in SETTINGS:
        pytest.skip(f"no precision switch is read for {framework}")
    model, config = tiny_model(framework, precision)
    read = SETTINGS[framework]
    spy = SettingSpy(model.module, read)
    model.module = spy
    before = read()
    src = np.array([[3, 4, 5, 6]])
    model.forward(src, np.array([[config.bos_id, 7, 8]]))
    assert model.precision == precision
    assert spy.seen == [EXPECTED[framework][precision]], f"the forward ran under {spy.seen}"
    assert read() == before, "the model left its framework's switch changed"


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_two_models_of_one_process_keep_their_own_modes(framework):
    """A tf32 model built after a highest one does not change what the first runs under."""
    if framework not in SETTINGS:
        pytest.skip(f"no precision switch is read for {framework}")
    first, config = tiny_model(framework, "highest")
    tiny_model(framework, "tf32")[0].forward(np.array([[3, 4]]), np.array([[config.bos_id]]))
    spy = SettingSpy(first.module, SETTINGS[framework])
    first.module = spy
    first.forward(np.array([[3, 4]]), np.array([[config.bos_id]]))
    assert spy.seen == [EXPECTED[framework]["highest"]]


@pytest.mark.parametrize("framework", ["numpy", *IMPLEMENTATIONS])
def test_an_unknown_precision_is_refused_naming_the_modes(framework):
    backend = backend_or_skip(framework)
    config = preset("tiny")
    weights = init_weights(config, seed=0, dtype="float64")
    with pytest.raises(ValueError, match=r"precision: unknown 'fast'; allowed: highest, tf32"):
        backend.build(config, weights, dtype=backend.dtypes[0], precision="fast")


def test_the_modes_and_the_bench_names():
    assert PRECISIONS == ("highest", "tf32") and check_precision("tf32") == "tf32"
    assert BENCH_PRECISIONS == ("highest", "tf32", "bf16")
    assert [bench_setting(n) for n in BENCH_PRECISIONS] == [
        ("float32", "highest"),
        ("float32", "tf32"),
        ("bfloat16", "highest"),
    ]
    with pytest.raises(ValueError, match="allowed: highest, tf32, bf16"):
        bench_setting("fp8")


def test_each_mode_has_its_bound():
    """tf32's bounds follow their derivation in common/spec/tolerances.py: 8 stages x 2u x 4 with
    u = 2^-11 on the tiny grid, twice that at the base sizes; the dtype's own bounds elsewhere."""
    tiny, base = preset("tiny"), preset("base")
    assert atol_for("float32", tiny, "tf32") == 8 * 2 * 2.0**-11 * 4 == 2.0**-5
    assert atol_for("float32", base, "tf32") == 2.0**-4
    assert atol_for("float32", tiny, "highest") == ATOL["float32"] == 1e-5
    assert atol_for("float32", base) == ATOL["float32_base"]
    # The precision of float32 products says nothing about float64 or bfloat16 tensors.
    assert atol_for("float64", base, "tf32") == ATOL["float64"]
    assert atol_for("bfloat16", tiny, "tf32") == ATOL["bfloat16"]
    # TF32's own rounding (2^-11, relative) is 50x the float32 bound: "highest" cannot pass by
    # accident with TF32 on, which is why it is the tier that catches bugs.
    assert 2.0**-11 > 40 * ATOL["float32"]
    with pytest.raises(ValueError, match="precision: unknown"):
        atol_for("float32", tiny, "fast")


# -- the command line ----------------------------------------------------------------------------


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_parity_in_tf32_uses_the_tf32_bound_and_says_so(capsys):
    code, out, _ = run(
        capsys, "parity", "--frameworks", "numpy,torch", "--precision", "tf32", "--json"
    )
    report = json.loads(out)
    assert code == 0 and report["precision"] == "tf32" and report["dtype"] == "float32"
    assert {c["tolerance"] for c in report["comparisons"]} == {2.0**-5}


def test_parity_says_tf32_in_its_summary(capsys):
    code, out, _ = run(capsys, "parity", "--frameworks", "numpy,torch", "--precision", "tf32")
    assert code == 0 and "(float32 (tf32))" in out.splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["parity", "--precision", "fast"], "argument --precision: invalid choice: 'fast'"),
        (["parity", "--device", "tpu"], "argument --device: unknown device 'tpu'"),
        (["parity", "--device", "cuda:x"], "argument --device: unknown device 'cuda:x'"),
    ],
)
def test_bad_precision_or_device_is_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_a_device_no_framework_sees_is_refused_before_any_work(capsys, tmp_path):
    """On a machine without a GPU; where there is one, cuda:7 still names no device."""
    out_file = tmp_path / "m.safetensors"
    code, out, err = run(
        capsys, "train", "--framework", "torch", "--task", "numbers", "--device", "cuda:7",
        "--out", str(out_file),
    )  # fmt: skip
    assert code == 2 and "--device cuda:7: torch sees no such device (it sees cpu" in err
    assert err.count("\n") == 1 and not out_file.exists()
