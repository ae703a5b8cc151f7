"""Importing torch.nn.Transformer: a real nn.Transformer pipeline, converted, gives the same logits
in our torch, Keras and Flax models (float32, 1e-5) and in the oracle (float64, 1e-10).

The pipeline is what a user writes around nn.Transformer: token embeddings * sqrt(d_model) plus a
sinusoid table (or learned positions), boolean padding masks (True = masked, the inverse of ours,
inverted here at that boundary only), a causal tgt_mask, and an output nn.Linear. Its reference
numbers come from nn.Transformer's slow path (torch.backends.mha.set_fastpath_enabled(False));
the fast path is tested apart, for the way it differs.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from parity_tests.grid import TINY  # noqa: E402
from transformer_rosetta.adapter.backends import get_backend  # noqa: E402
from transformer_rosetta.errors import ConfigError, WeightFileError  # noqa: E402
from transformer_rosetta.oracle import reference  # noqa: E402
from transformer_rosetta.porting.nn_transformer import (  # noqa: E402
    check_config,
    infer_sizes,
    mapping_table,
    nn_transformer_to_canonical,
)
from transformer_rosetta.spec.config import TransformerConfig  # noqa: E402
from transformer_rosetta.spec.inputs import ragged_batch  # noqa: E402
from transformer_rosetta.spec.masks import causal_mask, decoder_key_padding_mask, key_padding_mask  # noqa: E402
from transformer_rosetta.spec.names import canonical_shapes  # noqa: E402
from transformer_rosetta.spec.tolerances import atol_for  # noqa: E402

# norm_first x activation, and with them the pipeline knobs around nn.Transformer, each varied
# once: sharing/tying, output bias, position kind and layout, embedding scaling.
CASES = {
    "post-relu": dict(norm_position="post", activation="relu", output_bias=True),
    "post-gelu": dict(
        norm_position="post",
        activation="gelu",
        tie_output=True,
        sinusoid_layout="concatenated",
    ),
    "pre-relu": dict(
        norm_position="pre",
        activation="relu",
        share_embeddings=True,
        tie_output=True,
        tgt_vocab_size=TINY["src_vocab_size"],
        position_kind="learned",
    ),
    "pre-gelu": dict(
        norm_position="pre", activation="gelu", output_bias=True, scale_embeddings=False
    ),
}


def case_config(case: str) -> TransformerConfig:
    base = dict(TINY, final_norm=True, share_embeddings=False, tie_output=False)
    return TransformerConfig(**{**base, "output_bias": False, **CASES[case]})


class NNTransformerPipeline(nn.Module):
    """A user's model around nn.Transformer, as the importer's key rule expects it."""

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.c = c
        with warnings.catch_warnings():  # norm_first=True: "enable_nested_tensor is True, but..."
            warnings.simplefilter("ignore", UserWarning)
            self.transformer = nn.Transformer(
                d_model=c.d_model,
                nhead=c.num_heads,
                num_encoder_layers=c.num_encoder_layers,
                num_decoder_layers=c.num_decoder_layers,
                dim_feedforward=c.d_ff,
                dropout=0.0,
                activation=c.activation,
                layer_norm_eps=c.layer_norm_eps,
                batch_first=True,
                norm_first=c.norm_position == "pre",
            )
        self.src_embedding = nn.Embedding(c.src_vocab_size, c.d_model)
        # Sharing and tying by assigning one module / Parameter twice: the state_dict then holds
        # identical arrays under both keys.
        self.tgt_embedding = (
            self.src_embedding if c.share_embeddings else nn.Embedding(c.tgt_vocab_size, c.d_model)
        )
        self.output = nn.Linear(c.d_model, c.tgt_vocab_size, bias=c.output_bias)
        if c.tie_output:
            self.output.weight = self.tgt_embedding.weight
        if c.position_kind == "learned":
            self.src_position_embedding = nn.Embedding(c.max_len, c.d_model)
            self.tgt_position_embedding = nn.Embedding(c.max_len, c.d_model)
        else:
            table = reference.sinusoidal_positions(c.max_len, c.d_model, c.sinusoid_layout)
            self.register_buffer("sinusoids", torch.from_numpy(table), persistent=False)

    def embed(self, table: nn.Embedding, positions: str, ids: torch.Tensor) -> torch.Tensor:
        x = table(ids)
        if self.c.scale_embeddings:
            x = x * math.sqrt(self.c.d_model)
        length = ids.shape[1]
        if self.c.position_kind == "learned":
            return x + getattr(self, positions).weight[:length]
        return x + self.sinusoids[:length].to(x.dtype)

    def forward(self, src: np.ndarray, tgt_in: np.ndarray) -> torch.Tensor:
        pad = self.c.pad_id
        # Our masks are True = may attend; nn.Transformer's are True = masked: invert here only.
        src_masked = torch.from_numpy(~key_padding_mask(src, pad)[:, 0, 0, :])
        tgt_masked = torch.from_numpy(~decoder_key_padding_mask(tgt_in, pad)[:, 0, 0, :])
        future = torch.from_numpy(~causal_mask(tgt_in.shape[1])[0, 0])
        src_t, tgt_t = torch.from_numpy(src), torch.from_numpy(tgt_in)
        y = self.transformer(
            self.embed(self.src_embedding, "src_position_embedding", src_t),
            self.embed(self.tgt_embedding, "tgt_position_embedding", tgt_t),
            tgt_mask=future,
            src_key_padding_mask=src_masked,
            tgt_key_padding_mask=tgt_masked,
            memory_key_padding_mask=src_masked,
            tgt_is_causal=True,
        )
        return self.output(y)


def random_pipeline(c: TransformerConfig, seed: int = 0) -> NNTransformerPipeline:
    """nn.Transformer's own init leaves every bias at 0 and every LayerNorm at (1, 0), which
    would hide a bias or norm mapped to the wrong place; draw everything instead."""
    model = NNTransformerPipeline(c).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied Parameter is listed once
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() > 1:
                p.copy_(noise / math.sqrt(p.shape[-1]))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)
    return model


def state_dict_arrays(model: nn.Module, prefix_transformer: bool = True) -> dict[str, np.ndarray]:
    """What the CLI's read_tensors gives: every state_dict key as a numpy array."""
    out = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    if not prefix_transformer:
        out = {k.removeprefix("transformer."): v for k, v in out.items()}
    return out


@contextlib.contextmanager
def fastpath(enabled: bool):
    """torch 2.13: one global switch (torch.backends.mha) governs the encoder's nested-tensor
    path, TransformerEncoderLayer's fused kernel and nn.MultiheadAttention's fast path."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def pipeline_logits(model: NNTransformerPipeline, src, tgt_in, *, fast: bool = False) -> np.ndarray:
    with fastpath(fast), torch.inference_mode():
        return model(src, tgt_in).numpy()


def inputs(c: TransformerConfig) -> tuple[np.ndarray, np.ndarray]:
    """Ragged batch (src length 7 != tgt length 5). ragged_batch pads the last source row fully;
    nn.Transformer gives NaN logits for such a row (softmax over no key), so it keeps 2 tokens."""
    src, tgt_in = ragged_batch(c, batch=4, src_len=7, tgt_len=5, seed=1)
    src[-1, :2] = src[0, :2]
    return src, tgt_in


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), "non-finite values"
    return float(np.max(np.abs(a - b)))


# -- parity with the nn.Transformer pipeline ----------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_imported_model_matches_the_nn_transformer_pipeline(backend, case):
    c = case_config(case)
    model = random_pipeline(c)
    src, tgt_in = inputs(c)
    want = pipeline_logits(model, src, tgt_in)
    weights = nn_transformer_to_canonical(state_dict_arrays(model), c)
    ours = backend.build(c, weights, dtype="float32")
    atol = atol_for("float32")
    for attention in (True, False):  # explicit probabilities, then the fused kernel
        diff = max_abs_diff(ours.forward(src, tgt_in, attention=attention).logits, want)
        assert diff <= atol, f"{backend.name} logits off by {diff:.3g} (attention={attention})"


@pytest.mark.parametrize("case", list(CASES))
def test_float64_oracle_matches_the_nn_transformer_pipeline(case):
    """In float64 the mapping is checked to 1e-10: a wrong transpose or split cannot hide."""
    c = case_config(case)
    model = random_pipeline(c).double()
    src, tgt_in = inputs(c)
    want = pipeline_logits(model, src, tgt_in)
    weights = nn_transformer_to_canonical(state_dict_arrays(model), c)
    assert all(w.dtype == np.float64 for w in weights.values())
    diff = max_abs_diff(reference.forward(weights, c, src, tgt_in).logits, want)
    assert diff <= atol_for("float64"), f"oracle logits off by {diff:.3g}"


def test_bare_nn_transformer_keys_import_the_same():
    c = case_config("post-relu")
    model = random_pipeline(c)
    prefixed = nn_transformer_to_canonical(state_dict_arrays(model), c)
    bare = nn_transformer_to_canonical(state_dict_arrays(model, prefix_transformer=False), c)
    assert list(bare) == list(prefixed) == list(canonical_shapes(c))
    for name, value in prefixed.items():
        assert np.array_equal(bare[name], value), name


def test_tied_copies_may_be_absent_and_identical_arrays_stay_separate_when_untied():
    c = case_config("pre-relu")  # shared embeddings and tied output
    arrays = state_dict_arrays(random_pipeline(c))
    once = {k: v for k, v in arrays.items() if k not in ("tgt_embedding.weight", "output.weight")}
    a, b = nn_transformer_to_canonical(arrays, c), nn_transformer_to_canonical(once, c)
    assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
    # The same file read with a config that shares nothing: three separate tensors.
    untied = c.replace(share_embeddings=False, tie_output=False)
    separate = nn_transformer_to_canonical(arrays, untied)
    assert np.array_equal(separate["encoder.embedding"], separate["decoder.embedding"])
    assert np.array_equal(separate["output.kernel"], separate["decoder.embedding"].T)


# -- nn.Transformer's fast path -----------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_fast_path_zeroes_padded_encoder_outputs_but_keeps_the_logits():
    """With the fast path on (eval, no grad, post-LN, even heads, a src_key_padding_mask), the
    encoder runs on nested tensors: padded positions are dropped and come back as 0, and the
    final encoder LayerNorm then turns them into exactly its bias. We, like the slow path,
    compute those positions as ordinary queries. Every attention masks padded keys, so the
    logits agree within float32 rounding."""
    c = case_config("post-relu")
    model = random_pipeline(c)
    src, tgt_in = inputs(c)
    pad = ~key_padding_mask(src, c.pad_id)[:, 0, 0, :]
    encoder = model.transformer.encoder

    def memory(fast: bool) -> np.ndarray:
        with fastpath(fast), torch.inference_mode():
            x = model.embed(model.src_embedding, "src_position_embedding", torch.from_numpy(src))
            return encoder(x, src_key_padding_mask=torch.from_numpy(pad)).numpy()

    slow, fast = memory(False), memory(True)
    norm_bias = encoder.norm.bias.detach().numpy()
    assert np.array_equal(fast[pad], np.broadcast_to(norm_bias, fast[pad].shape))
    assert max_abs_diff(slow[pad], fast[pad]) > 0.1  # the slow path computes them
    assert max_abs_diff(slow[~pad], fast[~pad]) <= atol_for("float32")

    ours = reference.forward(
        nn_transformer_to_canonical(state_dict_arrays(model), c), c, src, tgt_in
    )
    assert max_abs_diff(ours.encoder_output, slow) <= atol_for("float32")
    fast_logits = pipeline_logits(model, src, tgt_in, fast=True)
    assert max_abs_diff(fast_logits, pipeline_logits(model, src, tgt_in)) <= atol_for("float32")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_fully_padded_source_row_matches_on_the_slow_path_and_is_nan_on_the_fused_layer():
    """A source row that is all padding leaves its cross-attention queries no key. Measured on
    torch 2.13, CPU: the slow path (SDPA with a boolean mask) gives those rows zero attention,
    as our spec does, so its logits match ours; the fast path's fused pre-LN encoder layer
    (torch._transformer_encoder_layer_fwd) returns NaN for the whole row. The parity inputs
    keep a token in every row so that they do not depend on either behaviour."""
    c = case_config("pre-relu")
    model = random_pipeline(c)
    src, tgt_in = ragged_batch(c, batch=4, src_len=7, tgt_len=5, seed=1)
    assert np.all(src[-1] == c.pad_id)
    weights = nn_transformer_to_canonical(state_dict_arrays(model), c)
    ours = reference.forward(weights, c, src, tgt_in).logits
    slow = pipeline_logits(model, src, tgt_in)
    assert max_abs_diff(ours, slow) <= atol_for("float32")
    fast = pipeline_logits(model, src, tgt_in, fast=True)
    assert np.isnan(fast[-1]).all()
    assert max_abs_diff(ours[:-1], fast[:-1]) <= atol_for("float32")


# -- errors -------------------------------------------------------------------------------------


def test_every_missing_unexpected_and_misshaped_tensor_is_reported_at_once():
    c = case_config("post-relu")
    arrays = state_dict_arrays(random_pipeline(c))
    del arrays["transformer.decoder.norm.weight"], arrays["src_embedding.weight"]
    arrays["transformer.encoder.layers.0.self_attn.bias_k"] = np.zeros((1, 1, 12), np.float32)
    arrays["positional_encoding.pos_embedding"] = np.zeros((16, 12), np.float32)
    arrays["transformer.encoder.layers.1.linear1.weight"] = np.zeros((12, 20), np.float32)  # T
    arrays["transformer.decoder.layers.0.multihead_attn.in_proj_weight"] = np.zeros((12, 12))
    with pytest.raises(WeightFileError) as err:
        nn_transformer_to_canonical(arrays, c, source="model.pt")
    problems = err.value.problems
    assert err.value.path == "model.pt"
    assert problems[0] == (
        "missing tensors (2): src_embedding.weight, transformer.decoder.norm.weight"
    )
    assert problems[1] == (
        "unexpected tensors (2): positional_encoding.pos_embedding, "
        "transformer.encoder.layers.0.self_attn.bias_k"
    )
    assert (
        "wrong shape for transformer.encoder.layers.1.linear1.weight: file has [12, 20], "
        "config needs [20, 12]" in problems
    )
    assert (
        "wrong shape for transformer.decoder.layers.0.multihead_attn.in_proj_weight: "
        "file has [12, 12], config needs [36, 12]" in problems
    )
    assert any("mixed dtypes" in p for p in problems)  # the float64 in_proj_weight
    assert len(problems) == 5


def test_a_broken_tie_and_an_unconfigured_output_bias_are_reported():
    c = case_config("pre-relu")
    arrays = state_dict_arrays(random_pipeline(c))
    arrays["tgt_embedding.weight"] = arrays["tgt_embedding.weight"] + 1.0
    arrays["output.bias"] = np.zeros(c.tgt_vocab_size, np.float32)
    with pytest.raises(WeightFileError) as err:
        nn_transformer_to_canonical(arrays, c)
    problems = err.value.problems
    assert err.value.path == "<state_dict>"
    assert "unexpected tensors (1): output.bias" in problems
    assert any(p.startswith("output.bias: the file has an output bias") for p in problems)
    assert any(
        p.startswith("tgt_embedding.weight differs from src_embedding.weight") for p in problems
    )
    assert not any(p.startswith("output.weight differs") for p in problems)  # still equal


def test_config_that_no_nn_transformer_has_is_refused_naming_the_fields():
    c = case_config("post-relu").replace(final_norm=False, attention_bias=False)
    with pytest.raises(ConfigError) as err:
        check_config(c)
    assert [p.split(":")[0] for p in err.value.problems] == ["final_norm", "attention_bias"]
    with pytest.raises(ConfigError, match="final_norm"):
        nn_transformer_to_canonical({}, c.replace(attention_bias=True))


# -- the table and the sizes the file tells -----------------------------------------------------


def test_mapping_table_covers_every_canonical_tensor_and_every_state_dict_key():
    for case in CASES:
        c = case_config(case)
        rows = mapping_table(c)
        canonical = [
            n for _, names, how in rows if "optional" not in how for n in names.split(", ")
        ]
        assert sorted(canonical) == sorted(canonical_shapes(c)), case
        assert sorted(src for src, _, _ in rows) == sorted(state_dict_arrays(random_pipeline(c)))
    row = dict((src, (names, how)) for src, names, how in mapping_table(case_config("post-relu")))
    names, how = row["transformer.decoder.layers.0.multihead_attn.in_proj_weight"]
    assert names == ", ".join(
        f"decoder.layers.0.cross_attention.{p}.kernel" for p in ("query", "key", "value")
    )
    assert row["transformer.decoder.layers.0.norm3.weight"][0] == (
        "decoder.layers.0.feed_forward_norm.scale"
    )
    assert row["transformer.encoder.norm.bias"][0] == "encoder.final_norm.bias"


def test_infer_sizes_reads_what_the_state_dict_tells():
    for case in CASES:
        c = case_config(case)
        sizes = infer_sizes(state_dict_arrays(random_pipeline(c)))
        for field, value in sizes.items():
            assert getattr(c, field) == value, (case, field)
        assert {"src_vocab_size", "tgt_vocab_size", "d_model", "d_ff"} <= set(sizes)
        assert ("max_len" in sizes) == (c.position_kind == "learned")


def test_rosetta_convert_infers_nn_transformer_from_a_pt_file(tmp_path, capsys):
    """The whole CLI path: torch.save the pipeline, convert with the kind inferred from the
    tensor names, and the shared file's logits match the pipeline's slow path."""
    from transformer_rosetta.cli import main
    from transformer_rosetta.weights.format import load_weights

    c = case_config("post-relu")
    model = random_pipeline(c, seed=5)
    torch.save(model.state_dict(), tmp_path / "pipeline.pt")
    (tmp_path / "c.json").write_text(c.to_json())
    code = main(
        [
            "convert",
            str(tmp_path / "pipeline.pt"),
            str(tmp_path / "out.safetensors"),
            "--config",
            str(tmp_path / "c.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "(nn-transformer) ->" in out and "(rosetta)" in out
    wf = load_weights(tmp_path / "out.safetensors")
    src, tgt_in = inputs(c)
    got = get_backend("torch").build(wf.config, wf.tensors).forward(src, tgt_in).logits
    assert max_abs_diff(got, pipeline_logits(model, src, tgt_in)) <= 1e-5
    # Without --config the command says what is missing, and writes nothing.
    code = main(["convert", str(tmp_path / "pipeline.pt"), str(tmp_path / "again.safetensors")])
    assert code == 2 and "--config FILE.json is required" in capsys.readouterr().err
    assert not (tmp_path / "again.safetensors").exists()


def test_a_state_dict_in_bin_shards_converts_as_the_one_file_does(tmp_path):
    """A torch state_dict saved in shards (pytorch_model.bin.index.json and its .bin files, as
    transformers' save_pretrained(safe_serialization=False) writes them) converts, given by its
    index, to the bytes the one-file .pt converts to; a missing shard is named before any work."""
    from transformer_rosetta.porting.convert import convert
    from transformer_rosetta.weights.format import load_weights

    c = case_config("post-relu")
    state = random_pipeline(c).state_dict()
    whole = tmp_path / "whole.pt"
    torch.save(state, whole)
    keys = list(state)
    parts = {
        "pytorch_model-00001-of-00002.bin": keys[::2],
        "pytorch_model-00002-of-00002.bin": keys[1::2],
    }
    weight_map = {}
    for file, names in parts.items():
        torch.save({k: state[k] for k in names}, tmp_path / file)
        weight_map.update(dict.fromkeys(names, file))
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = tmp_path / "config.json"
    config.write_text(c.to_json())
    kinds = ("nn-transformer", None)  # given, and inferred from the index's tensors
    for i, kind in enumerate(kinds):
        convert(index, tmp_path / f"s{i}.safetensors", from_kind=kind, config=c, verify=False)
    convert(whole, tmp_path / "w.safetensors", from_kind="nn-transformer", config=c, verify=False)
    want = load_weights(tmp_path / "w.safetensors").tensors
    for i in range(len(kinds)):
        got = load_weights(tmp_path / f"s{i}.safetensors").tensors
        assert list(got) == list(want)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    (tmp_path / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(WeightFileError, match="pytorch_model-00002-of-00002.bin"):
        convert(index, tmp_path / "x.safetensors", from_kind="nn-transformer", config=c)
    assert not (tmp_path / "x.safetensors").exists()
