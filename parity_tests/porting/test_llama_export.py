"""`rosetta convert W.safetensors OUTDIR --to llama` (common/porting/llama_export.py): the way out,
through the import's table (common/porting/llama.py, TABLE) with its steps inverted.

- A transformers folder read in and written out again holds the same tensors, bit for bit, and
  reads in again to the same file (llama -> rosetta -> llama -> rosetta).
- Our models (every bias drawn, in the layouts a Llama or a Qwen2 holds, float32 and bfloat16)
  written out load in `AutoModelForCausalLM.from_pretrained` with no missing or unexpected key,
  give the oracle's logits (transformers in float64 with its float32 internals patched, as in
  test_llama.py: within 1e-9; transformers in float32: within atol_for("float32") = 1e-5), read
  back bit for bit with the same config (rosetta -> llama -> rosetta), and transformers' greedy
  `generate` yields our greedy tokens.
- Interleaved rotary positions are written permuted to the half-split layout (the same logits).
- What transformers' Llama cannot hold is refused by field, one line, before anything is written.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from parity_tests.conftest import import_or_skip
from parity_tests.porting.test_llama import (
    CASES,
    F64_BOUND,
    MAX_NEW,
    PROMPTS,
    batches,
    gap,
    hf_logits,
    imported,  # noqa: F401 (the fixture)
    reference,
    run_cli,
    transformers_greedy,
)
from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.app.generation import generate_ids
from transformer_rosetta.oracle.reference import forward as oracle_forward
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights, save_weights
from transformer_rosetta.weights.init import init_weights

torch = import_or_skip("torch", "transformers' Llama models are torch modules")
transformers = import_or_skip("transformers", "transformers loads the written folders")
from safetensors.numpy import load_file  # noqa: E402

# No pad token (pad_id one past the vocabulary), as a Llama has none: a folder read in masks
# nothing by id, so that only such a model comes back as it went out.
BASE = preset("tiny_llama").replace(src_vocab_size=61, tgt_vocab_size=61, max_len=48, pad_id=61)
# Each layout of biases and heads that a Llama or a Qwen2 holds, and bfloat16.
HELD: dict[str, tuple[TransformerConfig, str]] = {
    "gqa-no-bias": (BASE, "float32"),
    "llama-biases-tied": (
        BASE.replace(
            attention_bias=True, feed_forward_bias=True, tie_output=True, rope_theta=300.0
        ),
        "float32",
    ),
    "qwen2-biases-key-dim": (
        BASE.replace(attention_bias=True, attention_output_bias=False, key_dim=6, num_kv_heads=1),
        "float32",
    ),
    "gelu-mha-bfloat16": (
        BASE.replace(num_kv_heads=None, activation="gelu_tanh", layer_norm_eps=1e-5),
        "bfloat16",
    ),
}


def convert(*args: object) -> int:
    return run_cli("convert", *args, "--no-verify")


def export(tmp_path, config: TransformerConfig, dtype: str = "float32", seed: int = 0):
    """Our weights for `config` (every bias drawn) written as a Llama folder by the CLI."""
    weights = init_weights(config, seed=seed, scheme="perturbed", dtype=dtype)
    save_weights(tmp_path / "ours.safetensors", weights, config, producer="test")
    folder = tmp_path / "llama"
    assert convert(tmp_path / "ours.safetensors", folder, "--to", "llama") == 0
    return weights, folder


def load(folder):
    """AutoModelForCausalLM of the folder, eager attention, eval mode: no key missing, unexpected
    or of another shape."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


def test_llama_in_then_out_is_the_same_file(imported, tmp_path):  # noqa: F811
    """llama -> rosetta -> llama -> rosetta: every tensor save_pretrained wrote comes back, bit
    for bit, and the second import is the first, config and tensors."""
    for case in CASES:
        _, _, folder, wf = imported(case)
        first, out = tmp_path / f"{case}.safetensors", tmp_path / case
        again = tmp_path / f"{case}-again.safetensors"
        assert convert(folder, first) == 0
        assert convert(first, out, "--to", "llama") == 0
        assert convert(out, again) == 0
        before = load_file(str(folder / "model.safetensors"))
        after = load_file(str(out / "model.safetensors"))
        assert sorted(after) == sorted(before), case
        for key, value in before.items():
            assert after[key].dtype == value.dtype and after[key].tobytes() == value.tobytes(), key
        a, b = load_weights(first), load_weights(again)
        assert a.config == b.config == wf.config, case
        assert all(a.tensors[k].tobytes() == b.tensors[k].tobytes() for k in a.tensors), case


@pytest.mark.parametrize("case", list(HELD))
def test_our_model_loads_in_transformers_and_computes_the_same(tmp_path, case):
    config, dtype = HELD[case]
    weights, folder = export(tmp_path, config, dtype)
    model = load(folder)
    hf = json.loads((folder / "config.json").read_text())
    want = "Qwen2ForCausalLM" if case.startswith("qwen2") else "LlamaForCausalLM"
    assert type(model).__name__ == want and hf["architectures"] == [want]
    assert str(model.dtype) == f"torch.{dtype}"  # config.json's dtype, from_pretrained's default
    double = copy.deepcopy(model).double()
    for name, tokens in batches(config).items():
        ours = oracle_forward(weights, config, None, tokens).logits
        diff = gap(reference(double, tokens, config.pad_id), ours)
        assert diff <= F64_BOUND, f"{case}, {name}: float64 {diff:.3g}"
        if dtype == "float32":  # transformers as users run it
            diff = gap(hf_logits(model, tokens, config.pad_id), ours)
            assert diff <= atol_for("float32", config), f"{case}, {name}: float32 {diff:.3g}"
    # ... and reads back as it was written, config and tensors, bit for bit.
    assert convert(folder, tmp_path / "back.safetensors") == 0
    back = load_weights(tmp_path / "back.safetensors")
    assert back.config == config and list(back.tensors) == list(weights)
    for name, value in weights.items():
        assert back.tensors[name].dtype == value.dtype, name
        assert back.tensors[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("case", ["gqa-no-bias", "qwen2-biases-key-dim"])
def test_transformers_greedy_generation_gives_our_tokens(tmp_path, case):
    config, _ = HELD[case]
    weights, folder = export(tmp_path, config, seed=2)  # no pad id among the greedy tokens
    model = load(folder)
    double = copy.deepcopy(model).double()
    want = [transformers_greedy(model, double, prompt, config) for prompt in PROMPTS]
    assert len({tuple(w) for w in want}) == len(want), "the continuations should differ"
    ours = get_backend("numpy").build(config, weights)
    assert generate_ids(ours, PROMPTS, max_new_tokens=MAX_NEW) == want


def test_interleaved_rotary_is_written_permuted(tmp_path):
    """Meta's interleaved layout goes out permuted into transformers' half-split one: the same
    logits; read back, the config says half_split and each query and key head holds its even
    dimensions first, then its odd ones."""
    config = HELD["llama-biases-tied"][0].replace(rotary_layout="interleaved")
    weights, folder = export(tmp_path, config)
    hf = json.loads((folder / "config.json").read_text())
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 300.0}
    double = load(folder).double()
    for name, tokens in batches(config).items():
        ours = oracle_forward(weights, config, None, tokens).logits
        assert gap(reference(double, tokens, config.pad_id), ours) <= F64_BOUND, name
    assert convert(folder, tmp_path / "back.safetensors") == 0
    back = load_weights(tmp_path / "back.safetensors")
    assert back.config == config.replace(rotary_layout="half_split")
    for name, value in weights.items():
        if ".self_attention.query." in name or ".self_attention.key." in name:
            value = np.concatenate([value[..., 0::2], value[..., 1::2]], axis=-1)
        np.testing.assert_array_equal(back.tensors[name], value, err_msg=name)


def test_the_written_folder_carries_its_verification(tmp_path):
    """--to llama runs the folder in transformers against the float64 oracle on our file and
    stores the record in model.safetensors' header, which transformers ignores."""
    from safetensors import safe_open

    config = HELD["qwen2-biases-key-dim"][0]
    save_weights(tmp_path / "ours.safetensors", init_weights(config, seed=1), config, "test")
    folder = tmp_path / "out"
    assert run_cli("convert", tmp_path / "ours.safetensors", folder, "--to", "llama") == 0
    with safe_open(folder / "model.safetensors", "np") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    check = json.loads(metadata["provenance"])["verify"]
    assert check["passed"] and check["sides"] == [
        "numpy float64 oracle",
        f"transformers {transformers.__version__} Qwen2ForCausalLM (float32)",
    ]
    # The bound follows the model (docs/PARITY.md, "The verification bound"): for these O(1)
    # logits it is float32's parity bound or within a few times of it, never loose.
    assert 0 < check["max_abs_logit_diff"] <= check["bound"]
    assert atol_for("float32") <= check["bound"] <= 5 * atol_for("float32")
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    assert json.loads((folder / "config.json").read_text())["pad_token_id"] is None


@pytest.mark.parametrize(
    "changes, named",
    [
        (
            dict(num_encoder_layers=2, share_embeddings=False, pad_id=0),  # a real pad
            "num_encoder_layers: a Llama is decoder-only; an encoder cannot be written",
        ),
        (dict(norm_kind="layer_norm"), "norm_kind: a Llama's norms are RMSNorm, not 'layer_norm'"),
        (dict(norm_position="post"), "norm_position: a Llama block is pre-norm"),
        (dict(final_norm=False), "final_norm: a Llama ends its stack with a norm"),
        (dict(position_kind="learned"), "position_kind: a Llama has rotary positions, not learned"),
        (dict(position_kind="sinusoidal"), "position_kind: a Llama has rotary positions"),
        (dict(gated_feed_forward=False), "gated_feed_forward: a Llama's MLP is gated"),
        (dict(scale_embeddings=True), "scale_embeddings: a Llama does not scale"),
        (dict(output_bias=True), "output_bias: a Llama's lm_head has no bias"),
        (dict(dropout=0.1), "dropout: 0.1 (on the residuals and embeddings) has no field in"),
        (
            dict(attention_bias=False, attention_output_bias=True),
            "attention_output_bias: q/k/v biases False, output bias True and MLP biases False",
        ),
        (
            dict(attention_bias=True, attention_output_bias=False, feed_forward_bias=True),
            "LlamaConfig has one switch for q/k/v/o (attention_bias) and one for the MLP",
        ),
    ],
)
def test_what_llama_cannot_hold_is_refused_by_field(tmp_path, capsys, changes, named):
    config = BASE.replace(**changes)
    save_weights(tmp_path / "ours.safetensors", init_weights(config, seed=0), config, "test")
    capsys.readouterr()
    code = run_cli("convert", tmp_path / "ours.safetensors", tmp_path / "m", "--to", "llama")
    err = capsys.readouterr().err
    assert code == 2 and named in err and err.count("\n") == 1, err
    assert not (tmp_path / "m").exists()
