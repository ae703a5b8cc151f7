"""`rosetta convert FOLDER out.safetensors --from meta-llama` (common/porting/meta_llama.py): Meta's
original layout, params.json and consolidated.NN.pth.

The fixture is Meta's checkpoint of a small random transformers LlamaForCausalLM, made by
inverting Hugging Face's conversion (convert_llama_weights_to_hf.py): its state_dict renamed to
Meta's keys, and wq and wk un-permuted with the inverse of the converter's
`permute(w, n_heads, dim1, dim2) = w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2)
.reshape(dim1, dim2)` (wk over its key/value heads), so that the checkpoint rotates interleaved
pairs as Meta's apply_rotary_emb does. Its params.json gives ffn_dim_multiplier 1.3 and
multiple_of 16, whose d_ff (Meta's formula) is the model's intermediate_size, 112.

- The import equals the import of the transformers folder, config and tensors, bit for bit (from
  one rank, and from two ranks split as Meta's model parallelism splits them, the embedding along
  either axis), and its logits equal transformers' (float64, patched as in test_llama.py) within
  1e-9 in the oracle and every framework.
- The permutation matters and is the only difference between the layouts: the same tensors
  imported with rotary_layout "interleaved" and no permutation give the same logits (the spec
  holds both conventions), while running them as half_split without the permutation moves the
  logits by O(1) (measured 2.2, on logits of at most 2.8 in size; asserted > 0.5).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip, import_or_skip
from parity_tests.porting.test_llama import (
    F64_BOUND,
    batches,
    gap,
    hf_model,
    reference,
    run_cli,
)
from transformer_rosetta.oracle.reference import forward as oracle_forward
from transformer_rosetta.porting.meta_llama import meta_d_ff
from transformer_rosetta.porting.table import STEPS
from transformer_rosetta.porting.verify import sha256_of
from transformer_rosetta.spec.names import canonical_specs
from transformer_rosetta.weights.format import load_weights

torch = import_or_skip("torch", "Meta's checkpoints are torch.save files")
import_or_skip("transformers", "transformers builds the Llama the checkpoint is made from")

PARAMS = {
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "vocab_size": 61,
    "multiple_of": 16,
    "ffn_dim_multiplier": 1.3,
    "norm_eps": 1e-5,
    "rope_theta": 500.0,
}
GIVEN = {"bos_id": 1, "eos_id": 2, "max_len": 64}  # what params.json does not tell
META_NAMES = {  # transformers' layer module -> Meta's
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def hf_permute(w, n_heads: int, dim1: int, dim2: int):
    """convert_llama_weights_to_hf.py's permute, as Hugging Face wrote it."""
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def hf_unpermute(w, n_heads: int, dim1: int, dim2: int):
    """Its inverse: transformers' half-split rows back to Meta's interleaved pairs."""
    return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def meta_state(model) -> dict[str, torch.Tensor]:
    """The transformers model's weights as Meta's consolidated.00.pth holds them."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    out = {
        "tok_embeddings.weight": model.model.embed_tokens.weight,
        "norm.weight": model.model.norm.weight,
        "output.weight": model.lm_head.weight,
    }
    for i, layer in enumerate(model.model.layers):
        for hf, meta in META_NAMES.items():
            w = layer.get_submodule(hf).weight
            if hf == "self_attn.q_proj":
                w = hf_unpermute(w, c.num_attention_heads, c.hidden_size, c.hidden_size)
            elif hf == "self_attn.k_proj":
                kv = c.num_key_value_heads
                w = hf_unpermute(w, kv, kv * head_dim, c.hidden_size)
            out[f"layers.{i}.{meta}.weight"] = w
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def split_ranks(state: dict[str, torch.Tensor], ranks: int, embedding_axis: int) -> list[dict]:
    """Meta's model-parallel shards: column-parallel weights (wq, wk, wv, w1, w3, output) split
    along their rows, row-parallel ones (wo, w2) along their columns, tok_embeddings along
    `embedding_axis` (1: Llama 2's ParallelEmbedding, 0: Llama 3's VocabParallelEmbedding), the
    norms whole on every rank."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(ranks)]
    for key, value in state.items():
        if value.ndim == 1:
            parts = [value] * ranks
        else:
            axis = 1 if key.endswith((".wo.weight", ".w2.weight")) else 0
            if key == "tok_embeddings.weight":
                axis = embedding_axis
            parts = list(torch.tensor_split(value, ranks, dim=axis))
        for shard, part in zip(shards, parts, strict=True):
            shard[key] = part.clone().contiguous()
    return shards


def write_meta(folder: Path, shards: list[dict], params: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "params.json").write_text(json.dumps(params or PARAMS))
    for rank, shard in enumerate(shards):
        torch.save(shard, folder / f"consolidated.{rank:02d}.pth")
    return folder


def convert(src: Path, dst: Path, *more: object, given: dict | None = None) -> int:
    config = dst.with_suffix(".given.json")
    config.write_text(json.dumps(GIVEN if given is None else given))
    return run_cli("convert", src, dst, "--from", "meta-llama", "--config", config, *more)


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    """(the transformers model (float32), its float64 copy, Meta's folder, the import of it, the
    import of the transformers folder)."""
    model = hf_model(
        "llama",
        intermediate_size=meta_d_ff(32, 16, 1.3),
        attention_bias=False,
        mlp_bias=False,
    )
    root = tmp_path_factory.mktemp("meta")
    model.save_pretrained(root / "hf")
    assert run_cli("convert", root / "hf", root / "hf.safetensors", "--no-verify") == 0
    folder = write_meta(root / "meta", [meta_state(model)])
    assert convert(folder, root / "meta.safetensors", "--no-verify") == 0
    return (
        model,
        copy.deepcopy(model).double(),
        folder,
        load_weights(root / "meta.safetensors"),
        load_weights(root / "hf.safetensors"),
    )


def assert_same(a, b) -> None:
    assert a.config == b.config
    assert list(a.tensors) == list(b.tensors)
    for name, value in a.tensors.items():
        assert value.dtype == b.tensors[name].dtype, name
        assert value.tobytes() == b.tensors[name].tobytes(), name


# -- the import -----------------------------------------------------------------------------------


def test_meta_d_ff_is_model_py_s_formula():
    """FeedForward's hidden size, int(2 * 4 dim / 3) times ffn_dim_multiplier, rounded up to
    multiple_of: the sizes of Meta's released models."""
    assert meta_d_ff(4096, 256, None) == 11008  # Llama 2 7B
    assert meta_d_ff(5120, 256, None) == 13824  # Llama 2 13B
    assert meta_d_ff(8192, 4096, 1.3) == 28672  # Llama 2 and 3 70B
    assert meta_d_ff(4096, 1024, 1.3) == 14336  # Llama 3 8B
    assert meta_d_ff(32, 16, 1.3) == 112  # the fixture: int(1.3 * 85) = 110, rounded up


def test_the_import_is_the_transformers_folders_import(meta):
    """Un-permuted by the fixture, permuted back by the table's rotary_permute step: the same
    config and the same tensors, bit for bit, as the transformers folder's import."""
    _, _, _, from_meta, from_hf = meta
    assert from_meta.config.rotary_layout == "half_split"
    assert from_meta.config.d_ff == 112 and from_meta.config.num_kv_heads == 2
    assert_same(from_meta, from_hf)


@pytest.mark.parametrize("embedding_axis", [1, 0], ids=["llama2-embedding", "llama3-embedding"])
def test_two_ranks_join_into_the_same_model(meta, tmp_path, capsys, embedding_axis):
    model, _, _, from_meta, _ = meta
    folder = write_meta(tmp_path / "two", split_ranks(meta_state(model), 2, embedding_axis))
    capsys.readouterr()
    assert convert(folder, tmp_path / "two.safetensors", "--no-verify") == 0
    assert "note: 2 model-parallel ranks joined (consolidated.00 .. 01)" in capsys.readouterr().out
    assert_same(load_weights(tmp_path / "two.safetensors"), from_meta)


@pytest.mark.parametrize("backend_name", ["numpy", *IMPLEMENTATIONS])
def test_float64_logits_equal_transformers(meta, backend_name):
    backend = backend_or_skip(backend_name)
    _, double, _, wf, _ = meta
    ours = backend.build(wf.config, wf.tensors, dtype="float64")
    for name, tokens in batches(wf.config).items():
        diff = gap(ours.forward(None, tokens).logits, reference(double, tokens, wf.config.pad_id))
        assert diff <= F64_BOUND, f"{backend_name}, {name}: {diff:.3g}"


# Llama 1 and 2's params.json as Meta ships them (7B: {"dim": 4096, "multiple_of": 256, "n_heads":
# 32, "n_layers": 32, "norm_eps": 1e-05, "vocab_size": -1}), at the fixture's size: no rope_theta,
# no n_kv_heads, no ffn_dim_multiplier, the vocabulary left to the tokenizer.
LLAMA2_PARAMS = {
    "dim": 32,
    "multiple_of": 16,
    "n_heads": 4,
    "n_layers": 2,
    "norm_eps": 1e-05,
    "vocab_size": -1,
}
# What a params.json without rope_theta means: Llama 2's model.py calls precompute_freqs_cis with
# its default theta=10000.0, and Hugging Face's converter reads params.get("rope_theta", 10000.0).
META_DEFAULT_THETA = 10000.0


def test_a_params_json_without_rope_theta_imports_with_theta_10000(tmp_path):
    """Llama 1 and 2's params.json states no rope_theta, n_kv_heads or ffn_dim_multiplier: the
    import takes Meta's defaults (rope_theta 10000.0, n_heads key/value heads, d_ff by
    meta_d_ff(32, 16, None) = 96, the vocabulary from tok_embeddings), and its float64 logits
    equal those of the transformers model with rope_theta 10000.0 that the checkpoint was made
    from (F64_BOUND) in the oracle and in torch. Llama 3's theta, 500000, moves them by O(1)
    (measured 1.1; asserted > 0.1)."""
    model = hf_model(
        "llama",
        intermediate_size=meta_d_ff(32, 16, None),
        num_key_value_heads=4,
        attention_bias=False,
        mlp_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": META_DEFAULT_THETA},
    )
    assert model.config.intermediate_size == 96
    folder = write_meta(tmp_path / "llama2", [meta_state(model)], LLAMA2_PARAMS)
    out = tmp_path / "llama2.safetensors"
    assert convert(folder, out, "--no-verify") == 0
    wf = load_weights(out)
    c = wf.config
    assert c.rope_theta == META_DEFAULT_THETA and isinstance(c.rope_theta, float)
    assert (c.num_kv_heads, c.d_ff, c.tgt_vocab_size, c.rotary_layout) == (
        None,
        96,
        61,
        "half_split",
    )
    double = copy.deepcopy(model).double()
    for backend_name in ("numpy", "torch"):
        ours = backend_or_skip(backend_name).build(c, wf.tensors, dtype="float64")
        for name, tokens in batches(c).items():
            want = reference(double, tokens, c.pad_id)
            diff = gap(ours.forward(None, tokens).logits, want)
            assert diff <= F64_BOUND, f"{backend_name}, {name}: {diff:.3g}"
    # The theta matters at these positions: Llama 3's 500000 gives other logits.
    tokens = batches(c)["full"]
    other = oracle_forward(wf.tensors, c.replace(rope_theta=500000.0), None, tokens).logits
    assert gap(other, reference(double, tokens, c.pad_id)) > 0.1


# -- the permutation ------------------------------------------------------------------------------


def test_the_step_is_hugging_faces_permute():
    """STEPS["rotary_permute"] on a query's [heads d_k, d] weight (and a key's, over its fewer
    heads) is convert_llama_weights_to_hf.py's permute; its invert undoes it."""
    rng = np.random.default_rng(0)
    step = STEPS["rotary_permute"]
    config = canonical_config()
    specs = {s.name: s for s in canonical_specs(config)}
    for proj, heads in (("query", 4), ("key", 2)):
        spec = specs[f"decoder.layers.0.self_attention.{proj}.kernel"]
        w = rng.normal(size=(heads * 8, 32))
        want = hf_permute(torch.from_numpy(w), heads, heads * 8, 32).numpy()
        got = step.apply(w, spec, config)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(step.invert(got, spec), w)
        assert not np.array_equal(got, w)
    assert "(Hugging Face's permute)" in step.describe


def canonical_config():
    from transformer_rosetta.spec.config import preset

    return preset("tiny_llama").replace(num_kv_heads=2)  # d_model 32, 4 heads of 8, 2 kv heads


def test_the_permutation_is_the_only_difference_between_the_layouts(meta, tmp_path):
    """Imported as stored (rotary_layout "interleaved", no permutation), the same logits: the
    spec holds Meta's convention too. Those unpermuted tensors run as half_split give wrong
    logits, by O(1): the permutation is what carries them across."""
    _, double, folder, half_split, _ = meta
    out = tmp_path / "interleaved.safetensors"
    assert convert(folder, out, "--no-verify", given={**GIVEN, "rotary_layout": "interleaved"}) == 0
    interleaved = load_weights(out)
    assert interleaved.config == half_split.config.replace(rotary_layout="interleaved")
    wq = "decoder.layers.0.self_attention.query.kernel"
    assert not np.array_equal(interleaved.tensors[wq], half_split.tensors[wq])
    wrong = interleaved.config.replace(rotary_layout="half_split")
    worst = 0.0
    for name, tokens in batches(wrong).items():
        want = reference(double, tokens, wrong.pad_id)
        ours = oracle_forward(interleaved.tensors, interleaved.config, None, tokens).logits
        assert gap(ours, want) <= F64_BOUND, name
        worst = max(
            worst, gap(oracle_forward(interleaved.tensors, wrong, None, tokens).logits, want)
        )
    assert worst > 0.5, worst  # measured 2.2


# -- what Meta's files cannot tell, and what the spec cannot hold ---------------------------------


def test_rope_freqs_is_checked_then_dropped(meta, tmp_path, capsys):
    """Llama 1's checkpoints store `rope.freqs`, theta^(-2i/d_k) in float32 (or the weights'
    dtype): checked, then dropped. One of another theta is refused by name."""
    model, _, _, from_meta, _ = meta
    for theta, code in ((500.0, 0), (10000.0, 2)):
        state = meta_state(model)
        state["rope.freqs"] = 1.0 / theta ** (torch.arange(0, 8, 2).float() / 8)
        folder = write_meta(tmp_path / f"freqs{int(theta)}", [state])
        out = tmp_path / f"freqs{int(theta)}.safetensors"
        capsys.readouterr()
        assert convert(folder, out, "--no-verify") == code
        if code == 0:
            assert_same(load_weights(out), from_meta)
        else:
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and not out.exists()
            assert "not the rotary frequencies rope_theta^(-2i/d_k) (rope_theta 500, d_k 8)" in err


def refused_folder(tmp_path: Path, model, case: str) -> tuple[Path, dict]:
    state = meta_state(model)
    params, given = dict(PARAMS), dict(GIVEN)
    shards = [state]
    if case == "use_scaled_rope":
        params["use_scaled_rope"] = True
    elif case == "unknown key":
        params["vision_chunk_size"] = 560
    elif case == "no eos_id":
        del given["eos_id"]
    elif case == "wrong d_ff":
        params["multiple_of"] = 64
    elif case == "a missing rank":
        shards = split_ranks(state, 3, 1)
    elif case == "ranks that disagree":
        shards = split_ranks(state, 2, 1)
        shards[1]["norm.weight"] = shards[1]["norm.weight"] + 1
    folder = write_meta(tmp_path / "meta", shards, params)
    if case == "a missing rank":
        (folder / "consolidated.01.pth").unlink()
    return folder, given


REFUSED = {
    "use_scaled_rope": "use_scaled_rope: true rescales the rotary frequencies (Llama 3.1's "
    "scaling), which the spec (angle pos * rope_theta^(-2i/d_k)) cannot express",
    "unknown key": "params.json: unknown key 'vision_chunk_size'; --from meta-llama reads",
    "no eos_id": "eos_id: params.json does not tell it (the tokenizer's); give eos_id in --config",
    # Meta's formula gives 128 for these params; the count is named by its keys, before any work.
    "wrong d_ff": "d_ff (Meta Llama multiple_of, ffn_dim_multiplier): 128, but the file's "
    "layers.0.feed_forward.w1.weight is [112, 32]",
    "a missing rank": "missing shard consolidated.01.pth",
    "ranks that disagree": "norm.weight: differs between ranks, which each hold it whole",
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refusal_is_one_line_exit_2(meta, tmp_path, capsys, case):
    folder, given = refused_folder(tmp_path, meta[0], case)
    out = tmp_path / "x.safetensors"
    capsys.readouterr()
    assert convert(folder, out, given=given) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and REFUSED[case] in err, err
    assert not out.exists()


def test_the_cli_tells_the_kind_and_says_why_it_does_not_verify(meta, tmp_path, capsys):
    """A folder of params.json and consolidated.NN.pth is meta-llama; Meta's code is not run
    here (fairscale, CUDA), so --verify is refused saying where the import is checked, and a
    plain conversion says so in its summary. The folder's digest covers its shards."""
    from transformer_rosetta.porting.convert import infer_source_kind

    _, _, folder, _, _ = meta
    assert infer_source_kind(folder) == "meta-llama"
    capsys.readouterr()
    assert convert(folder, tmp_path / "v.safetensors", "--verify") == 2
    err = capsys.readouterr().err
    assert "--verify: --verify runs no Meta code (its model.py needs fairscale and CUDA)" in err
    out = tmp_path / "plain.safetensors"
    assert convert(folder, out) == 0
    printed = capsys.readouterr().out
    assert "not verified: --verify runs no Meta code" in printed
    record = json.loads(load_weights(out).metadata["provenance"])
    assert record["source"]["sha256"] == sha256_of(folder)
    changed = shutil.copytree(folder, tmp_path / "changed")
    shard = changed / "consolidated.00.pth"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert sha256_of(changed) != sha256_of(folder)
