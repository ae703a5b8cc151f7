"""Which rope_theta a Llama config.json means when it says it in more than one place, or in none
(common/porting/llama.py, `read_rope`), as the installed transformers reads it.

transformers 5 (modeling_rope_utils.py, RotaryEmbeddingConfigMixin.convert_rope_params_to_dict)
takes `rope_scaling` in place of `rope_parameters` when it is set, then fills the object's
missing rope_theta with `rope_parameters.setdefault("rope_theta", rope_theta)`, where rope_theta
is config.json's top-level key (a kwarg LlamaConfig has no field for), else the class's
`default_theta`, 10000.0. So an object's own rope_theta wins over a top-level one, and a
top-level one fills an object that has none. The expected theta of each case below is read from
transformers itself, twice: `LlamaConfig.from_pretrained(folder).rope_parameters["rope_theta"]`
and the theta behind the loaded model's `rotary_emb.inv_freq` (theta^(-2i/d_k), in float32: the
theta recovered from it agrees to 1e-4 relative, and the candidates here are far apart).

Each case is the same save_pretrained folder (parity_tests/porting/test_llama.py's "llama" case)
with config.json edited; it imports with transformers' theta, and the oracle's float64 logits of
the import equal transformers' LlamaForCausalLM loaded from that folder, run in float64 with its
float32 internals patched (test_llama.py, `reference`), within F64_BOUND = 1e-9. Using the other
candidate theta moves the logits by O(1) (measured 0.93 to 1.1; asserted > 0.1): the logits
tell the thetas apart.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parity_tests.conftest import import_or_skip
from parity_tests.porting.test_llama import (
    F64_BOUND,
    batches,
    gap,
    hf_model,
    reference,
    run_cli,
)
from transformer_rosetta.oracle.reference import forward as oracle_forward
from transformer_rosetta.weights.format import load_weights

torch = import_or_skip("torch", "transformers' Llama models are torch modules")
transformers = import_or_skip("transformers", "transformers reads the config.json cases")

OBJECT_THETA = 500.0  # the fixture's rope_parameters.rope_theta
TOP_THETA = 20000.0  # another theta, written at the top level
DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta, for case "none"


def rope_keys(hf: dict, case: str) -> dict:
    """config.json (transformers 5's, with rope_parameters) with its rope keys as in `case`."""
    hf = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_theta", "rope_scaling")}
    if case == "both, differing":  # the question of issue 42
        return {
            **hf,
            "rope_theta": TOP_THETA,
            "rope_parameters": {"rope_type": "default", "rope_theta": OBJECT_THETA},
        }
    if case == "object without theta":
        return {**hf, "rope_theta": TOP_THETA, "rope_parameters": {"rope_type": "default"}}
    if case == "transformers 4, rope_scaling null":
        return {**hf, "rope_theta": TOP_THETA, "rope_scaling": None}
    if case == "none":
        return hf
    raise AssertionError(case)


# case -> the other theta in play, which must not be the one read
CASES = {
    "both, differing": TOP_THETA,
    "object without theta": OBJECT_THETA,
    "transformers 4, rope_scaling null": OBJECT_THETA,
    "none": OBJECT_THETA,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The "llama" case of test_llama.py (4 heads of d_k 8 on 2 key/value heads, biases, theta
    500), saved once."""
    model = hf_model("llama")
    assert model.config.rope_parameters["rope_theta"] == OBJECT_THETA
    folder = tmp_path_factory.mktemp("rope") / "saved"
    model.save_pretrained(folder)
    return folder


def edited(saved: Path, tmp_path: Path, case: str) -> Path:
    folder = shutil.copytree(saved, tmp_path / "folder")
    hf = json.loads((folder / "config.json").read_text())
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": OBJECT_THETA}
    (folder / "config.json").write_text(json.dumps(rope_keys(hf, case)))
    return folder


def transformers_theta(folder: Path):
    """(the theta transformers reads from the folder, its model loaded from the folder)."""
    config = transformers.LlamaConfig.from_pretrained(folder)
    theta = float(config.rope_parameters["rope_theta"])
    model = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager")
    inv_freq = model.model.rotary_emb.inv_freq.double().numpy()  # theta^(-2i/d_k), float32
    d_k = 2 * inv_freq.shape[0]
    from_buffer = inv_freq[1] ** (-d_k / 2)  # i = 1: theta^(-2/d_k)
    assert abs(from_buffer / theta - 1) < 1e-4, (from_buffer, theta)
    assert model.config.rope_parameters["rope_theta"] == theta
    return theta, model.eval()


def test_the_installed_transformers_lets_the_objects_theta_win():
    """The fact the import follows, read off transformers itself (no file): a top-level
    rope_theta that differs from rope_parameters' is ignored; one beside an object without a
    theta fills it; with neither, default_theta."""
    both = transformers.LlamaConfig(
        rope_theta=TOP_THETA,
        rope_parameters={"rope_type": "default", "rope_theta": OBJECT_THETA},
    )
    assert both.rope_parameters["rope_theta"] == OBJECT_THETA
    filled = transformers.LlamaConfig(
        rope_theta=TOP_THETA, rope_parameters={"rope_type": "default"}
    )
    assert filled.rope_parameters["rope_theta"] == TOP_THETA
    assert transformers.LlamaConfig().rope_parameters["rope_theta"] == DEFAULT_THETA


@pytest.mark.parametrize("case", list(CASES))
def test_the_import_reads_transformers_theta_and_its_logits(saved, tmp_path, case):
    folder = edited(saved, tmp_path, case)
    theta, model = transformers_theta(folder)
    out = tmp_path / "model.safetensors"
    assert run_cli("convert", folder, out, "--from", "llama", "--no-verify") == 0
    wf = load_weights(out)
    assert wf.config.rope_theta == theta, (case, wf.config.rope_theta, theta)
    double = model.double()
    for name, tokens in batches(wf.config).items():
        want = reference(double, tokens, wf.config.pad_id)
        diff = gap(oracle_forward(wf.tensors, wf.config, None, tokens).logits, want)
        assert diff <= F64_BOUND, f"{case}, {name}: {diff:.3g}"
    # The other theta in play gives other logits: the comparison above tells them apart.
    tokens = batches(wf.config)["full"]
    other = wf.config.replace(rope_theta=CASES[case])
    assert CASES[case] != theta
    moved = gap(
        oracle_forward(wf.tensors, other, None, tokens).logits,
        reference(double, tokens, wf.config.pad_id),
    )
    assert moved > 0.1, moved
