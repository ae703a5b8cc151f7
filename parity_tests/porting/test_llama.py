"""`rosetta convert FOLDER out.safetensors --from llama` (common/porting/llama.py): transformers'
LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM, built here from tiny configs with every
weight drawn (a bias of 0 or a norm gain of 1 would hide a swapped or dropped tensor), saved with
save_pretrained (whole, in shards with max_shard_size, and in bfloat16), imported by the CLI, and
run in the oracle (backend "numpy") and in every framework.

The cases (CASES): a Llama with every bias (attention_bias and mlp_bias), 4 query heads on 2
key/value heads and rope_theta 500; a tied Llama with head_dim 6 (not hidden / heads: key_dim),
multi-head attention and the tanh GELU; a Mistral with one key/value head (multi-query) and no
sliding window; a Qwen2 with its q/k/v biases and no output bias.

Bounds.
- float64: the imported model against transformers run in float64 (`.double()`), max |diff| <=
  1e-9 (measured 2.5e-15 to 6.2e-15 over the cases and backends: summation order only).
  transformers 5 keeps three computations in float32 even in a float64 model, which alone moves
  its logits by ~1e-6 here (measured 7.1e-7 to 9.3e-7); the reference
  patches them, within `float64_internals()` (a pytest.MonkeyPatch context), in each of
  modeling_llama, modeling_mistral and modeling_qwen2:
  * `<Family>RMSNorm.forward`, which casts the input `.to(torch.float32)` before the variance,
    becomes `weight * (x * rsqrt(mean(x^2) + eps))` in the input's dtype;
  * `<Family>RotaryEmbedding.forward`, whose `inv_freq` buffer was computed in float32 at init and
    whose angles, cos and sin it computes in float32 (`.float()`), becomes the same formula,
    `1 / theta ** (arange(0, d_k, 2) / d_k)`, then cos and sin of `pos * inv_freq`, in float64;
  * the module's `eager_attention_forward` (looked up by name at each call: the models run with
    attn_implementation="eager"), whose softmax has `dtype=torch.float32`, becomes the same
    function with the softmax in the scores' dtype.
  test_the_float64_patch_matters shows each one moves the logits and the unpatched gap.
- float32: each framework in float32 on the float32 file against that float64 reference, within
  atol_for("float32") = 1e-5 (common/spec/tolerances.py: float32's unit roundoff 6e-8 over a few
  dozen roundings of O(1) values, ~1e-6; every float32 gap above it was a bug). Measured 1.1e-6
  to 2.3e-6 in torch, Keras/TF and Flax/JAX (transformers' own float32 run: 1.7e-6 to 2.2e-6).
- bfloat16: the folder's bfloat16 weights are imported bit for bit; the oracle runs them in
  float64 against transformers' bfloat16 model cast to float64 (the same numbers), within 1e-9.

Greedy: transformers' float32 `generate(do_sample=False)` gives our greedy tokens in every
backend, where every decision's float64 top-1 minus top-2 log-probability exceeds 4 * atol
(parity_tests/cli/test_generate.py's argument), which the test asserts first.
"""

from __future__ import annotations

import copy
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip, import_or_skip
from parity_tests.fixtures.draws import draw
from transformer_rosetta.app.generation import generate_ids
from transformer_rosetta.cli import main
from transformer_rosetta.oracle.reference import forward as oracle_forward
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights

torch = import_or_skip("torch", "transformers' Llama models are torch modules")
transformers = import_or_skip("transformers", "transformers builds the Llama fixtures")
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

F64_BOUND = 1e-9
SIZES = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
# case -> (model_type, the config's other fields)
CASES = {
    "llama": (
        "llama",
        dict(
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    "llama-tied": (
        "llama",
        dict(
            num_key_value_heads=4,
            head_dim=6,
            tie_word_embeddings=True,
            hidden_act="gelu_pytorch_tanh",
        ),
    ),
    "mistral": (
        "mistral",
        dict(
            num_key_value_heads=1,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    "qwen2": ("qwen2", dict(num_key_value_heads=2)),
}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, modeling_llama, "Llama"),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        modeling_mistral,
        "Mistral",
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, modeling_qwen2, "Qwen2"),
}


def run_cli(*args: object) -> int:
    return main([str(a) for a in args])


# -- the fixtures -------------------------------------------------------------------------------


def hf_model(case: str, seed: int = 7, **changes):
    """transformers' model of `case` with every parameter drawn (parity_tests/fixtures/draws.py:
    embeddings normal(0, 1/sqrt(hidden_size)), kernels Glorot, biases normal(0, 0.1), norm gains 1 + normal(0,
    0.1)), eager attention, float32, eval mode."""
    model_type, fields = CASES[case]
    config_class, model_class, _, _ = FAMILIES[model_type]
    config = config_class(**{**SIZES, **fields, **changes}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_class(config)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("embed_tokens.weight"):  # O(1) logits when tied to lm_head
                value = draw(rng, "embedding", shape, config.hidden_size)
            elif name.endswith("norm.weight"):
                value = draw(rng, "gain", shape)
            elif name.endswith(".weight"):
                value = draw(rng, "kernel", shape, fans=shape)
            else:
                value = draw(rng, "bias", shape)
            p.copy_(torch.from_numpy(value).to(p.dtype))
    return model.eval()


def rms_norm_float64(self, hidden_states):
    """<Family>RMSNorm.forward in the input's dtype (transformers casts to float32 first)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotary_float64(self, x, position_ids):
    """<Family>RotaryEmbedding.forward (the default rope type) with inv_freq, the angles, cos and
    sin in float64 (transformers computes them in float32)."""
    theta = self.config.rope_parameters["rope_theta"]
    d_k = 2 * self.inv_freq.shape[0]
    inv_freq = 1.0 / theta ** (torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def eager_float64(module_of):
    """The module's eager_attention_forward with its softmax in the scores' dtype (transformers
    passes dtype=torch.float32)."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        keys = module_of.repeat_kv(key, module.num_key_value_groups)
        values = module_of.repeat_kv(value, module.num_key_value_groups)
        scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.matmul(probs, values).transpose(1, 2).contiguous(), probs

    return attention


@contextmanager
def float64_internals(parts: tuple[str, ...] = ("rms_norm", "rotary", "softmax")):
    """transformers' Llama, Mistral and Qwen2 with `parts` computed in the model's dtype (the
    module docstring says how each is patched)."""
    with pytest.MonkeyPatch.context() as mp:
        for _, _, module, family in FAMILIES.values():
            if "rms_norm" in parts:
                mp.setattr(getattr(module, f"{family}RMSNorm"), "forward", rms_norm_float64)
            if "rotary" in parts:
                mp.setattr(getattr(module, f"{family}RotaryEmbedding"), "forward", rotary_float64)
            if "softmax" in parts:
                mp.setattr(module, "eager_attention_forward", eager_float64(module))
        yield


def attention_mask(tokens: np.ndarray, pad_id: int) -> np.ndarray:
    """The spec's mask as transformers takes it: keys holding pad_id masked, but position 0."""
    mask = tokens != pad_id
    mask[:, 0] = True
    return mask.astype(np.int64)


def hf_logits(model, tokens: np.ndarray, pad_id: int) -> np.ndarray:
    """transformers' logits with the spec's mask. The virtual pad (a model without a pad token
    pads with the vocabulary size, docs/FORMAT.md "Special ids") names no row: it is given as
    the spec embeds it, the zero vector (inputs_embeds), so that every position is compared."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    virtual = ids == model.config.vocab_size
    with torch.no_grad():
        rows = model.get_input_embeddings()(ids.masked_fill(virtual, 0))
        out = model(
            inputs_embeds=rows.masked_fill(virtual[..., None], 0.0),
            attention_mask=torch.as_tensor(attention_mask(tokens, pad_id)),
        )
    return out.logits.double().numpy()


def reference(model, tokens: np.ndarray, pad_id: int) -> np.ndarray:
    """transformers' logits in float64, its float32 internals patched (float64_internals)."""
    with float64_internals():
        return hf_logits(model, tokens, pad_id)


def batches(config) -> dict[str, np.ndarray]:
    """A full batch (3 rows of 11 ids, none of them pad_id) and ragged_batch's right-padded one
    (4 rows of 9, rows starting with BOS; pads after each row's end: every position compared,
    pad queries too, since both sides mask the same keys)."""
    rng = np.random.default_rng(5)
    allowed = np.array([t for t in range(config.tgt_vocab_size) if t != config.pad_id])
    full = allowed[rng.integers(0, len(allowed), size=(3, 11))]
    _, padded = ragged_batch(config, batch=4, src_len=1, tgt_len=9, seed=5)
    assert (padded == config.pad_id).any()
    return {"full": full, "right-padded": padded}


def save(model, folder: Path, variant: str) -> Path:
    """The model saved as its users save it: "float32" (one model.safetensors), "sharded"
    (max_shard_size 20KB: several shards and their index), "bfloat16" (the model cast first)."""
    if variant == "sharded":
        model.save_pretrained(folder, max_shard_size="20KB")
        assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 2
    elif variant == "bfloat16":
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
    else:
        model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the float32 transformers model, its float64 copy, the folder, the imported WeightFile)
    per (case, variant), converted by the CLI once."""
    cache = {}

    def get(case: str, variant: str = "float32"):
        if (case, variant) not in cache:
            model = hf_model(case)
            root = tmp_path_factory.mktemp(f"{case}-{variant}")
            folder = save(model, root / "folder", variant)
            out = root / "model.safetensors"
            assert run_cli("convert", folder, out, "--from", "llama", "--no-verify") == 0
            if variant == "bfloat16":
                model = copy.deepcopy(model).to(torch.bfloat16)
            cache[case, variant] = (model, copy.deepcopy(model).double(), folder, load_weights(out))
        return cache[case, variant]

    return get


def gap(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)))


# -- what config.json maps to ---------------------------------------------------------------------


def test_each_config_is_read_from_config_json(imported):
    configs = {case: imported(case)[3].config for case in CASES}
    for case, c in configs.items():
        assert c.kind == "decoder_only" and c.num_encoder_layers == 0, case
        assert (c.tgt_vocab_size, c.d_model, c.d_ff, c.num_decoder_layers) == (61, 32, 48, 2)
        assert (c.num_heads, c.max_len, c.layer_norm_eps) == (4, 64, 1e-5), case
        assert (c.norm_position, c.final_norm, c.norm_kind) == ("pre", True, "rms_norm"), case
        assert (c.position_kind, c.rotary_layout, c.gated_feed_forward) == (
            "rotary",
            "half_split",
            True,
        ), case
        assert not c.scale_embeddings and not c.share_embeddings and not c.output_bias, case
        # No pad token: the virtual pad, one past the vocabulary (nothing is masked).
        assert (c.bos_id, c.eos_id, c.pad_id, c.dropout) == (1, 2, 61, 0.0), case
        assert c.virtual_pad, case
    llama, tied, mistral, qwen2 = (configs[k] for k in CASES)
    assert (llama.num_kv_heads, llama.key_dim, llama.rope_theta) == (2, None, 500.0)
    assert (llama.attention_bias, llama.attention_output_bias, llama.feed_forward_bias) == (
        True,
        None,
        True,
    )
    assert (llama.activation, llama.tie_output) == ("silu", False)
    assert (tied.num_kv_heads, tied.key_dim, tied.head_dim) == (None, 6, 6)
    assert (tied.activation, tied.tie_output, tied.rope_theta) == ("gelu_tanh", True, 10000.0)
    assert not tied.attention_bias and not tied.feed_forward_bias
    assert (mistral.num_kv_heads, mistral.rope_theta, mistral.attention_bias) == (1, 1e6, False)
    assert (qwen2.attention_bias, qwen2.attention_output_bias, qwen2.feed_forward_bias) == (
        True,
        False,
        False,
    )
    assert not qwen2.output_projection_bias


def test_the_kind_is_told_by_model_type(imported):
    from transformer_rosetta.porting.convert import infer_source_kind

    for case in CASES:
        assert infer_source_kind(imported(case)[2]) == "llama", case


def test_the_summary_says_a_named_pad_token_is_not_masked(imported, tmp_path, capsys):
    """Llama has no pad token and masks nothing by id, and neither does the import: pad_id is
    the virtual pad (61, one past the vocabulary) whatever config.json's pad_token_id says, and a
    pad_token_id it names is said in the summary, unmasked (parity_tests/porting/test_no_pad.py
    runs such prompts)."""
    _, _, folder, _ = imported("qwen2")
    capsys.readouterr()
    assert run_cli("convert", folder, tmp_path / "a.safetensors", "--no-verify") == 0
    assert "pad" not in capsys.readouterr().out  # no pad_token_id: nothing to say
    for pad in (7, 2):
        other = tmp_path / f"pad{pad}"
        shutil.copytree(folder, other)
        hf = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**hf, "pad_token_id": pad}))
        out = tmp_path / f"pad{pad}.safetensors"
        assert run_cli("convert", other, out, "--no-verify") == 0
        assert load_weights(out).config.pad_id == 61
        said = capsys.readouterr().out
        assert f"note: pad_id: config.json's pad_token_id {pad} is not masked" in said


def test_a_list_of_eos_ids_gives_the_first_and_says_so(imported, tmp_path, capsys):
    _, _, folder, _ = imported("llama")
    other = shutil.copytree(folder, tmp_path / "eos")
    hf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**hf, "eos_token_id": [2, 9]}))
    capsys.readouterr()
    assert run_cli("convert", other, tmp_path / "e.safetensors", "--no-verify") == 0
    assert load_weights(tmp_path / "e.safetensors").config.eos_id == 2
    assert "eos_token_id lists [2, 9]; the spec stops at one id, the first, 2" in (
        capsys.readouterr().out
    )


# -- logits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", ["numpy", *IMPLEMENTATIONS])
@pytest.mark.parametrize("case", list(CASES))
def test_float64_logits_equal_transformers(imported, case, backend_name):
    """Each backend in float64 on the imported file (float32 numbers) against transformers'
    float64 run of the same numbers, its float32 internals patched: within 1e-9."""
    backend = backend_or_skip(backend_name)
    _, double, _, wf = imported(case)
    ours = backend.build(wf.config, wf.tensors, dtype="float64")
    for name, tokens in batches(wf.config).items():
        diff = gap(ours.forward(None, tokens).logits, reference(double, tokens, wf.config.pad_id))
        assert diff <= F64_BOUND, f"{case} in {backend_name}, {name}: {diff:.3g}"


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_float32_logits_within_the_float32_bound(imported, case, framework):
    backend = backend_or_skip(framework)
    _, double, _, wf = imported(case)
    ours = backend.build(wf.config, wf.tensors, dtype="float32")
    for name, tokens in batches(wf.config).items():
        diff = gap(ours.forward(None, tokens).logits, reference(double, tokens, wf.config.pad_id))
        bound = atol_for("float32", wf.config)
        assert diff <= bound, f"{case} in {framework}, {name}: {diff:.3g}"


@pytest.mark.parametrize("case", list(CASES))
def test_the_float64_patch_matters(imported, case):
    """Unpatched, transformers' float64 model differs from the oracle by its float32 internals
    alone: more than the 1e-9 bound (measured 7.1e-7 to 9.3e-7), within float32's. Leaving out any
    one of the three patches moves the logits past 1e-9 too."""
    _, double, _, wf = imported(case)
    tokens = batches(wf.config)["full"]
    want = oracle_forward(wf.tensors, wf.config, None, tokens).logits
    unpatched = gap(hf_logits(double, tokens, wf.config.pad_id), want)
    assert F64_BOUND < unpatched <= atol_for("float32"), unpatched
    assert gap(reference(double, tokens, wf.config.pad_id), want) <= F64_BOUND
    parts = ("rms_norm", "rotary", "softmax")
    for left_out in parts:
        with float64_internals(tuple(p for p in parts if p != left_out)):
            diff = gap(hf_logits(double, tokens, wf.config.pad_id), want)
        assert diff > F64_BOUND, f"{case}: without the {left_out} patch, {diff:.3g}"


# -- the folder's layouts -------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_folder_imports_as_the_whole_one(imported, case):
    whole, sharded = imported(case)[3], imported(case, "sharded")[3]
    assert sharded.config == whole.config and list(sharded.tensors) == list(whole.tensors)
    for name, value in whole.tensors.items():
        assert sharded.tensors[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_a_bfloat16_folder_imports_its_numbers(imported, case):
    """The bfloat16 weights arrive bit for bit (the file is bfloat16), and the oracle's float64
    run of them equals transformers' float64 run of the same numbers within 1e-9."""
    model, double, _, wf = imported(case, "bfloat16")
    assert wf.dtype == "bfloat16"
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(
        np.asarray(wf.tensors["decoder.layers.1.feed_forward.gate.kernel"], np.float32),
        state["model.layers.1.mlp.gate_proj.weight"].T,
    )
    for name, tokens in batches(wf.config).items():
        got = oracle_forward(wf.tensors, wf.config, None, tokens).logits
        diff = gap(got, reference(double, tokens, wf.config.pad_id))
        assert diff <= F64_BOUND, f"{case}, {name}: {diff:.3g}"


def test_the_transformers_4_layout_reads_the_same(imported, tmp_path):
    """transformers 4 wrote `rope_theta` at the top level with `rope_scaling: null`; transformers
    5 writes `rope_parameters`. The same folder in the older layout imports to the same config,
    and transformers 5 still loads it with the same theta and logits."""
    model, _, folder, wf = imported("llama")
    old = shutil.copytree(folder, tmp_path / "old")
    hf = json.loads((old / "config.json").read_text())
    theta = hf.pop("rope_parameters")["rope_theta"]
    (old / "config.json").write_text(json.dumps({**hf, "rope_theta": theta, "rope_scaling": None}))
    out = tmp_path / "old.safetensors"
    assert run_cli("convert", old, out, "--from", "llama", "--no-verify") == 0
    assert load_weights(out).config == wf.config and wf.config.rope_theta == 500.0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(old, attn_implementation="eager")
    assert loaded.config.rope_parameters["rope_theta"] == 500.0
    tokens = batches(wf.config)["full"]
    np.testing.assert_array_equal(
        hf_logits(loaded.eval(), tokens, wf.config.pad_id),
        hf_logits(model, tokens, wf.config.pad_id),
    )


def test_older_inv_freq_buffers_are_checked_then_dropped(imported, tmp_path, capsys):
    """transformers 4.28 to 4.30 saved each layer's rotary_emb.inv_freq: checked to be
    rope_theta^(-2i/d_k) (within float32's computation of it), then dropped. One computed with
    another theta is refused by name."""
    from safetensors.numpy import load_file, save_file

    _, _, folder, wf = imported("llama")
    state = load_file(str(folder / "model.safetensors"))
    d_k = wf.config.head_dim
    for theta, code in ((500.0, 0), (10000.0, 2)):
        inv_freq = (1.0 / theta ** (torch.arange(0, d_k, 2).float() / d_k)).numpy()
        old = tmp_path / f"inv{int(theta)}"
        shutil.copytree(folder, old)
        extra = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq for i in range(2)}
        save_file({**state, **extra}, str(old / "model.safetensors"), metadata={"format": "pt"})
        out = tmp_path / f"inv{int(theta)}.safetensors"
        capsys.readouterr()
        assert run_cli("convert", old, out, "--no-verify") == code
        if code == 0:
            for name, value in load_weights(out).tensors.items():
                assert value.tobytes() == wf.tensors[name].tobytes(), name
        else:
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and not out.exists()
            assert (
                "not the rotary frequencies rope_theta^(-2i/d_k) (rope_theta 500, d_k 8), as a "
                "Llama-family model"
            ) in err


# -- what the spec cannot hold ----------------------------------------------------------------------

REFUSED = {
    "mistral-sliding-window": (
        "mistral",
        {"sliding_window": 4096},
        "sliding_window: 4096 lets each token attend only the 4096 tokens before it; the spec's "
        "causal attention sees every earlier token (null imports)",
    ),
    "qwen2-sliding-window": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
            "layer_types": None,
        },
        "layer_types: ['sliding_attention'] layers (use_sliding_window, max_window_layers) attend "
        "a window of 8 tokens",
    ),
    "llama3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        },
        "rope_parameters: rope type 'llama3' rescales the rotary angles, which the spec (angle "
        "pos * rope_theta^(-2i/d_k)) cannot express; only 'default' is imported",
    ),
    "linear-rope-4.x": (
        "llama",
        {
            "rope_parameters": None,
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
        "rope_scaling: rope type 'linear' rescales the rotary angles",
    ),
    "dynamic-rope": (
        "mistral",
        {"sliding_window": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
        "rope_parameters: rope type 'dynamic' rescales",
    ),
    "yarn-rope": (
        "qwen2",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
        "rope_parameters: rope type 'yarn' rescales",
    ),
    "partial-rotary": (
        "llama",
        {"partial_rotary_factor": 0.5},
        "partial_rotary_factor: 0.5 rotates only part of each head; the spec rotates all of it",
    ),
    "final-softcap": (
        "llama",
        {"final_logit_softcapping": 30.0},
        "final_logit_softcapping: 30.0 caps scores with c * tanh(x / c), which the spec cannot",
    ),
    "attention-softcap": (
        "qwen2",
        {"attn_logit_softcapping": 50.0},
        "attn_logit_softcapping: 50.0 caps scores with c * tanh(x / c)",
    ),
    "unknown-model-type": (
        "llama",
        {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
        "model_type: 'gemma' is not a model of the Llama family that rosetta reads (expected "
        "'llama', 'mistral', 'qwen2')",
    ),
    "unknown-architecture": (
        "llama",
        {"architectures": ["LlamaForSequenceClassification"]},
        "architectures: ['LlamaForSequenceClassification'] is not what --from llama reads for "
        "model_type 'llama' (expected ['LlamaForCausalLM']: a causal language model with its "
        "lm_head)",
    ),
    "unknown-activation": (
        "llama",
        {"hidden_act": "relu2"},
        "hidden_act: 'relu2' is not supported; allowed: relu, gelu",
    ),
    "no-bos": (
        "qwen2",
        {"bos_token_id": None},
        "bos_id: config.json names no bos_token_id; give bos_id in --config",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_spec_cannot_hold_is_refused_by_name(imported, tmp_path, capsys, case):
    """One line, exit 2, nothing written; config.json is read (and refused) before any weight."""
    source, changes, message = REFUSED[case]
    folder = shutil.copytree(imported(source)[2], tmp_path / "folder")
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, **changes}))
    (folder / "model.safetensors").write_bytes(b"never read")
    out = tmp_path / "x.safetensors"
    capsys.readouterr()
    code = run_cli("convert", folder, out, "--from", "llama")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert message in err
    assert not out.exists()


def test_a_config_that_contradicts_the_folder_is_refused(imported, tmp_path, capsys):
    _, _, folder, _ = imported("llama")
    given = tmp_path / "given.json"
    for fields, message in (
        (
            {"num_heads": 2},
            "num_heads: --config says 2, but config.json's num_attention_heads says 4",
        ),
        (
            {"rotary_layout": "interleaved"},
            "rotary_layout: --config says 'interleaved', but "
            "transformers' rotate_half pairs dimension i with i + d_k/2",
        ),
    ):
        given.write_text(json.dumps(fields))
        capsys.readouterr()
        out = tmp_path / "x.safetensors"
        assert run_cli("convert", folder, out, "--config", given) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and not out.exists()
    given.write_text(json.dumps({"pad_id": 0}))  # what config.json does not tell: taken
    out = tmp_path / "pad0.safetensors"
    assert run_cli("convert", folder, out, "--config", given, "--no-verify") == 0
    assert load_weights(out).config.pad_id == 0


# -- greedy decoding and --verify -------------------------------------------------------------------

PROMPTS = [[1, 5, 17, 42], [1, 59, 3, 33, 28]]  # 60, once the pad, in test_no_pad.py
MAX_NEW = 8


def transformers_greedy(model, double, prompt: list[int], config) -> list[int]:
    """transformers' greedy new tokens (float32, as users run it; up to and with EOS), after
    asserting that the float64 model's margin at every decision exceeds 4 * atol."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        new = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            pad_token_id=config.pad_id,
        )[0, len(prompt) :].tolist()
    if config.eos_id in new:
        new = new[: new.index(config.eos_id) + 1]
    assert config.pad_id not in prompt + new  # the spec masks pad keys; transformers does not
    logits = reference(double, np.array([prompt + new]), config.pad_id)[0]
    steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(new)]
    top2 = np.sort(steps, axis=-1)[:, -2:]  # log-softmax shifts a row: the margin is the same
    margin = float((top2[:, 1] - top2[:, 0]).min())
    assert margin > 4 * atol_for("float32", config), f"a greedy near-tie ({margin:.3g})"
    return new


@pytest.mark.parametrize("backend_name", ["numpy", *IMPLEMENTATIONS])
@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_greedy_tokens_equal_transformers_generate(imported, case, backend_name):
    backend = backend_or_skip(backend_name)
    model, double, _, wf = imported(case)
    dtype = "float64" if backend_name == "numpy" else "float32"
    ours = backend.build(wf.config, wf.tensors, dtype=dtype)
    want = [transformers_greedy(model, double, p, wf.config) for p in PROMPTS]
    assert len({tuple(w) for w in want}) == len(want), "the continuations should differ"
    got = generate_ids(ours, PROMPTS, max_new_tokens=MAX_NEW)
    assert got == want


@pytest.mark.parametrize("case", ["llama-tied", "qwen2"])
def test_verify_runs_transformers_against_the_oracle(imported, tmp_path, capsys, case):
    """--verify: transformers' own model of the folder (float32) against the float64 oracle on
    the written file, recorded in its header."""
    _, _, folder, _ = imported(case)
    out = tmp_path / "v.safetensors"
    capsys.readouterr()
    assert run_cli("convert", folder, out, "--verify") == 0
    record = json.loads(load_weights(out).metadata["provenance"])
    check = record["verify"]
    architecture = "Qwen2ForCausalLM" if case == "qwen2" else "LlamaForCausalLM"
    assert check["passed"] and check["sides"][0].endswith(f"{architecture} (float32)")
    assert check["sides"][1] == "numpy float64 oracle"
    # The bound follows the model (docs/PARITY.md, "The verification bound"): for these O(1)
    # logits it is float32's parity bound or within a few times of it, never loose.
    assert 0 < check["max_abs_logit_diff"] <= check["bound"]
    assert atol_for("float32") <= check["bound"] <= 5 * atol_for("float32")
    assert record["source"]["kind"] == "llama"
    # No pad token: the probes' ragged rows are padded with the virtual pad, embedded as zero.
    assert load_weights(out).config.virtual_pad and not record.get("notes")


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_imported_models_sample_and_search_alike_in_every_framework(imported, case):
    """The imported model itself (not a random one): greedy and seeded sampling (temperature
    0.8, top-p 0.9, two seeds) in float64 give the oracle's tokens in every framework, cached and
    uncached. Sampling is compared only where no uniform lies within 1e-9 of a boundary of the
    oracle's cumulative distribution (impl/test_today.py, cdf_margin)."""
    from functools import partial

    from parity_tests.impl.test_today import CDF_MARGIN, cdf_margin
    from transformer_rosetta.adapter.backends import get_backend
    from transformer_rosetta.decoding.sampling import sample_search
    from transformer_rosetta.decoding.search import greedy_search

    _, _, _, wf = imported(case)
    config = wf.config
    prompt = np.array([p[:4] for p in PROMPTS])
    filters = dict(temperature=0.8, top_p=0.9)
    oracle = get_backend("numpy").build(config, wf.tensors)
    runs = {"greedy": lambda start: greedy_search(start, config, prompt, extra_len=MAX_NEW)}
    for seed in (0, 1):
        want = sample_search(
            oracle.stepper, config, prompt, extra_len=MAX_NEW, seed=seed, **filters
        )
        margin = cdf_margin(oracle, config, prompt, want.tokens, seed, **filters)
        assert margin > CDF_MARGIN, f"seed {seed}: a uniform lies {margin:.3g} from a boundary"
        runs[f"seed {seed}"] = partial(
            lambda start, seed: sample_search(
                start, config, prompt, extra_len=MAX_NEW, seed=seed, **filters
            ),
            seed=seed,
        )
    want = {name: run(oracle.stepper).tokens for name, run in runs.items()}
    assert all(sum(len(t) for t in tokens) >= 8 for tokens in want.values()), "too short"
    assert want["seed 0"][0].tolist() != want["greedy"][0].tolist(), "sampling drew greedy"
    for framework in IMPLEMENTATIONS:
        model = backend_or_skip(framework).build(config, wf.tensors, dtype="float64")
        for cached in (True, False):
            for name, run in runs.items():
                got = run(partial(model.stepper, cached=cached)).tokens
                assert [t.tolist() for t in got] == [t.tolist() for t in want[name]], (
                    framework,
                    cached,
                    name,
                )
