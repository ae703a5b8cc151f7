"""Importing the models of the four texts (common/porting/tutorials.py): the Annotated
Transformer, PyTorch's translation tutorial, both TensorFlow tutorials and the Keras pre-norm
model. Each fixture (parity_tests/fixtures/) is the model written fresh the way its text writes
it, with random weights in which every bias and norm is non-trivial, saved with its framework's
own save call and imported with `rosetta convert`.

Bounds (common/spec/tolerances.py): the imported model's logits match the fixture's own forward
within 1e-5 in float32 and 1e-10 in float64 at every real target position (a pad query's row is
not part of any of these models' contract: the tutorials compute it differently, and the loss
ignores it), in the torch, Keras and Flax implementations and in the oracle (float64). The
Annotated Transformer's Generator returns log_softmax(logits): our logits are compared after
the same log_softmax. A converted model then decodes the fixture's greedy tokens on a fixed
input. The measured gaps are in docs/PORTING.md.
"""

from __future__ import annotations

import importlib
import json
from functools import partial

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from parity_tests.fixtures import SIZES
from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.decoding.search import greedy_search, log_softmax
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights

# Per fixture: its module, the framework it needs, its sizes where they differ from SIZES, and
# the special ids its text uses (Annotated: <s> 0, </s> 1, <blank> 2 as in its Multi30k
# example; PyTorch tutorial: PAD 1, BOS 2, EOS 3; TensorFlow: [PAD] 0, [START] 2, [END] 3; the
# Keras pre-norm model of seed text 004 names none: the table's defaults, BOS 1 and EOS 2, stand).
# Seed text 004 has one vocab_size for both tables and a feed-forward 4 * hidden_dim wide.
KERAS_PRENORM_SIZES = {"tgt_vocab_size": SIZES["src_vocab_size"], "d_ff": 4 * SIZES["d_model"]}
FIXTURES = {
    "annotated": ("annotated_transformer", "torch", {}, {"pad_id": 2, "bos_id": 0, "eos_id": 1}),
    "pytorch-tutorial": ("torch_tutorial", "torch", {"num_decoder_layers": 1}, {}),
    "tf-tutorial-v1": ("tf_tutorial_v1", "tf", {}, {"bos_id": 2, "eos_id": 3}),
    "tf-tutorial-v2": ("tf_tutorial_v2", "tf", {}, {"bos_id": 2, "eos_id": 3}),
    "keras-prenorm": ("keras_prenorm", "tf", KERAS_PRENORM_SIZES, {}),
}
DTYPES = ("float32", "float64")
GREEDY_STEPS = 6


def fixture_module(kind: str):
    module, framework, _, _ = FIXTURES[kind]
    backend_or_skip(framework)  # the fixture needs its framework
    return importlib.import_module(f"parity_tests.fixtures.{module}")


def sizes_of(kind: str) -> dict:
    return {**SIZES, **FIXTURES[kind][2]}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(fixture model, its module, the imported WeightFile) per (kind, dtype), built once."""
    from transformer_rosetta.cli import main

    cache = {}

    def get(kind: str, dtype: str):
        if (kind, dtype) not in cache:
            fx = fixture_module(kind)
            model = fx.make_model(sizes_of(kind), seed=7, dtype=dtype)
            folder = tmp_path_factory.mktemp(f"{kind}-{dtype}")
            path = folder / f"model{fx.SUFFIX}"
            fx.save(model, path)
            given = {"num_heads": SIZES["num_heads"], **FIXTURES[kind][3]}
            (folder / "given.json").write_text(json.dumps(given))
            out = folder / "model.safetensors"
            code = main(["convert", str(path), str(out), "--config", str(folder / "given.json")])
            assert code == 0, f"rosetta convert failed for {kind}"
            cache[kind, dtype] = (model, fx, load_weights(out))
        return cache[kind, dtype]

    return get


def inputs(config, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Ragged source and target (right padding, one full row), under the config's ids, with at
    least one real source token per row. An all-pad source leaves a query no key to attend:
    these models mask with -1e9 (or the dtype's minimum) and so attend every pad uniformly,
    where the spec gives that query a zero context (docs/FORMAT.md, step 4; the gap is in
    test_an_empty_source_is_where_the_texts_differ)."""
    src, tgt_in = ragged_batch(config, batch=4, src_len=7, tgt_len=6, seed=seed)
    empty = (src == config.pad_id).all(axis=1)
    src[empty, 0] = next(t for t in range(config.src_vocab_size) if t not in special(config))
    return src, tgt_in


def special(config) -> set[int]:
    return {config.pad_id, config.bos_id, config.eos_id}


def real_positions(config, tgt_in: np.ndarray) -> np.ndarray:
    """(B, T) True at the target positions that are not padding (position 0 holds BOS, which
    may be the pad id)."""
    first = np.arange(tgt_in.shape[1]) == 0
    return (tgt_in != config.pad_id) | first


def gap(fx, config, got: np.ndarray, want: np.ndarray, tgt_in: np.ndarray) -> float:
    ours = log_softmax(np.asarray(got, np.float64)) if fx.OUTPUT == "log_probs" else got
    real = real_positions(config, tgt_in)
    return float(np.max(np.abs(np.asarray(ours, np.float64)[real] - want[real])))


def exact_keras_scale(model) -> int:
    """Give every keras.layers.MultiHeadAttention in `model` its 1/sqrt(key_dim) as a float64
    scalar; returns how many. Keras keeps it as a Python float, which the TensorFlow backend
    turns into a float32 tensor before the cast (docs/divergences.json, the TF scale row): a
    float64 model's scores then carry float32's rounding of the scale (6.9e-9 on these logits).
    Only the tf-tutorial-v2 fixture uses that layer."""
    import keras

    count = 0
    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.MultiHeadAttention):
            layer._inverse_sqrt_key_dim = np.float64(1.0 / np.sqrt(layer._key_dim))
            count += 1
    return count


def test_keras_multi_head_attention_rounds_its_scale_in_float64(converted):
    """The one float64 gap of the tutorials that is not ours: stock Keras is off by its scale's
    float32 rounding (> the 1e-10 bound), exact once the scale is float64 (next test)."""
    model, fx, wf = converted("tf-tutorial-v2", "float64")
    src, tgt_in = inputs(wf.config)
    want = fx.forward(model, src, tgt_in, wf.config.pad_id)
    got = get_backend("numpy").build(wf.config, wf.tensors).forward(src, tgt_in).logits
    stock = gap(fx, wf.config, got, want, tgt_in)
    assert exact_keras_scale(model) == 6  # 2 + 2 x 2 attentions
    want = fx.forward(model, src, tgt_in, wf.config.pad_id)
    assert 1e-9 < stock < 1e-7
    assert gap(fx, wf.config, got, want, tgt_in) <= atol_for("float64")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(FIXTURES))
def test_imported_logits_match_the_fixture_in_every_framework(converted, kind, dtype):
    model, fx, wf = converted(kind, dtype)
    assert wf.dtype == dtype
    if kind == "tf-tutorial-v2" and dtype == "float64":
        exact_keras_scale(model)  # see test_keras_multi_head_attention_rounds_its_scale_in_float64
    src, tgt_in = inputs(wf.config)
    want = fx.forward(model, src, tgt_in, wf.config.pad_id)
    frameworks = [*IMPLEMENTATIONS, *(["numpy"] if dtype == "float64" else [])]
    for name in frameworks:
        backend = backend_or_skip(name)
        got = backend.build(wf.config, wf.tensors, dtype=dtype).forward(src, tgt_in).logits
        diff = gap(fx, wf.config, got, want, tgt_in)
        assert diff <= atol_for(dtype), f"{kind} in {name}, {dtype}: off by {diff:.3g}"


@pytest.mark.parametrize("kind", list(FIXTURES))
def test_a_converted_model_decodes_the_fixtures_greedy_tokens(converted, kind):
    model, fx, wf = converted(kind, "float32")
    c = wf.config
    src, _ = inputs(c, seed=4)
    want = fx.greedy_decode(model, src, GREEDY_STEPS + 1, c.bos_id, c.pad_id)
    assert (want[:, 0] == c.bos_id).all()
    ours = get_backend("torch").build(c, wf.tensors, dtype="float32")
    decoded = greedy_search(
        partial(ours.stepper), c, src, extra_len=GREEDY_STEPS, stop_at_eos=False
    )
    compared = 0
    for row, tokens in enumerate(decoded.tokens):
        steps = min(len(tokens), GREEDY_STEPS)
        # After a generated pad id the texts part: tf-tutorial-v2's mask_zero masks the pad
        # *query* too (its next token comes from an all-masked row); the spec masks the key only
        # (docs/PORTING.md). Compared up to that token.
        pads = np.flatnonzero(tokens[:steps] == c.pad_id)
        steps = int(pads[0]) + 1 if pads.size else steps
        assert tokens[:steps].tolist() == want[row, 1 : 1 + steps].tolist(), f"{kind} row {row}"
        compared += steps
    assert compared >= len(decoded.tokens) * GREEDY_STEPS // 2, f"only {compared} tokens compared"


@pytest.mark.parametrize("kind", ["annotated", "tf-tutorial-v1"])
def test_an_empty_source_is_where_the_texts_differ(converted, kind):
    """A source of pads only: the texts' -1e9 masks attend the pads uniformly, the spec attends
    nothing (a zero context). The logits then differ by O(1), on that row alone."""
    model, fx, wf = converted(kind, "float64")
    src, tgt_in = inputs(wf.config)
    src[-1] = wf.config.pad_id
    want = fx.forward(model, src, tgt_in, wf.config.pad_id)
    got = get_backend("numpy").build(wf.config, wf.tensors).forward(src, tgt_in).logits
    assert gap(fx, wf.config, got[:-1], want[:-1], tgt_in[:-1]) <= atol_for("float64")
    assert gap(fx, wf.config, got[-1:], want[-1:], tgt_in[-1:]) > 0.1


# -- position buffers, the config, errors -------------------------------------------------------


def run_convert(*args: str) -> int:
    from transformer_rosetta.cli import main

    return main(["convert", *map(str, args)])


@pytest.fixture(scope="module")
def learned_annotated(tmp_path_factory):
    """An Annotated Transformer whose `pe` buffers were trained (random here): not sinusoids."""
    backend_or_skip("torch")
    import torch

    fx = fixture_module("annotated")
    model = fx.make_model(SIZES, seed=8, dtype="float32")
    rng = np.random.default_rng(8)
    with torch.no_grad():
        for embed in (model.src_embed, model.tgt_embed):
            embed[1].pe.copy_(torch.tensor(rng.normal(0, 0.5, embed[1].pe.shape)))
    folder = tmp_path_factory.mktemp("learned")
    fx.save(model, folder / "model.pt")
    (folder / "heads.json").write_text(json.dumps({"num_heads": 2}))
    return model, fx, folder


def test_a_position_buffer_that_is_no_sinusoid_is_refused_by_name(learned_annotated, capsys):
    _, _, folder = learned_annotated
    code = run_convert(
        folder / "model.pt", folder / "x.safetensors", "--config", folder / "heads.json"
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "src_embed.1.pe is not the interleaved sinusoid table (position 0 differs by" in err
    assert "tgt_embed.1.pe is not" in err and "pass --learned-positions" in err
    assert not (folder / "x.safetensors").exists()


def test_with_learned_positions_the_buffers_become_the_position_tables(learned_annotated):
    model, fx, folder = learned_annotated
    out = folder / "learned.safetensors"
    given = folder / "heads.json"
    assert run_convert(folder / "model.pt", out, "--config", given, "--learned-positions") == 0
    wf = load_weights(out)
    assert wf.config.position_kind == "learned" and wf.config.max_len == 5000
    np.testing.assert_array_equal(
        wf.tensors["encoder.position_embedding"], model.src_embed[1].pe[0].numpy()
    )
    src, tgt_in = inputs(wf.config)
    want = fx.forward(model, src, tgt_in, wf.config.pad_id)
    for name in IMPLEMENTATIONS:
        got = backend_or_skip(name).build(wf.config, wf.tensors).forward(src, tgt_in).logits
        assert gap(fx, wf.config, got, want, tgt_in) <= atol_for("float32"), name


def test_the_stored_float32_sinusoids_are_within_the_derived_bound():
    """The tutorials' own float32 tables (exp and products in float32) differ from the float64
    sinusoid by far less than sinusoid_bound allows: (11 pos + 1) eps, derived in
    common/porting/table.py. Measured at most 0.17 (pos + 1) eps over 5000 positions."""
    import torch

    from transformer_rosetta.oracle.reference import sinusoidal_positions
    from transformer_rosetta.porting.table import sinusoid_bound

    backend_or_skip("torch")
    for kind, key in (("annotated", "src_embed.1.pe"), ("pytorch-tutorial", None)):
        fx = fixture_module(kind)
        model = fx.make_model(sizes_of(kind), seed=0)
        state = model.state_dict()
        table = state[key][0] if key else state["positional_encoding.pos_embedding"][:, 0]
        assert table.dtype == torch.float32
        gaps = np.abs(table.double().numpy() - sinusoidal_positions(*table.shape)).max(axis=1)
        eps = float(np.finfo(np.float32).eps)
        ratio = gaps / ((np.arange(len(gaps)) + 1) * eps)
        assert ratio.max() < 0.5, kind
        assert np.all(gaps <= sinusoid_bound(len(gaps), np.float32, "stored")[:, 0])


@pytest.mark.parametrize(
    "given, message",
    [
        ({}, "num_heads: the file cannot tell it; give it in --config FILE.json"),
        (
            {"num_heads": 2, "norm_position": "post"},
            "norm_position: --config says 'post', but the Annotated Transformer is pre-norm",
        ),
        (
            {"num_heads": 2, "d_model": 16},
            "d_model: --config says 16, but the file's shapes say 12",
        ),
        (
            {"num_heads": 2, "num_hedas": 2},
            "num_hedas: unknown config field (did you mean 'num_heads'?)",
        ),
    ],
)
def test_the_config_is_assembled_and_each_contradiction_named(
    converted, tmp_path, capsys, given, message
):
    converted("annotated", "float32")  # the saved fixture
    fx = fixture_module("annotated")
    model = fx.make_model(SIZES, seed=1)
    fx.save(model, tmp_path / "model.pt")
    (tmp_path / "given.json").write_text(json.dumps(given))
    code = run_convert(
        tmp_path / "model.pt", tmp_path / "o.safetensors", "--config", tmp_path / "given.json"
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "o.safetensors").exists()


def test_the_kinds_are_told_apart_by_their_names(converted, tmp_path):
    """rosetta convert needs no --from for these files: their names tell the kind (and ours,
    torch's and Keras's own checkpoints stay ours)."""
    from transformer_rosetta.porting.convert import infer_source_kind

    for kind in FIXTURES:
        model, fx, wf = converted(kind, "float32")
        fx.save(model, tmp_path / f"{kind}{fx.SUFFIX}")
        assert infer_source_kind(tmp_path / f"{kind}{fx.SUFFIX}") == kind
    for framework, suffix in (("torch", ".pt"), ("tf", ".weights.h5")):
        get_backend(framework).save_native(tmp_path / f"ours{suffix}", wf.config, wf.tensors)
        assert infer_source_kind(tmp_path / f"ours{suffix}") == {"tf": "keras"}.get(
            framework, framework
        )
