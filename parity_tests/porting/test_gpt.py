"""Importing the decoder-only models (common/porting/gpt.py): minGPT, nanoGPT (with and without
biases), Hugging Face GPT-2, the GPT that seed text 000's blocks make, and seed text 002's encoder
GPT. Each fixture is the model written fresh the way its text writes it
(parity_tests/fixtures/mingpt.py, seed_000_gpt.py, seed_gpt.py; GPT-2 is transformers' own
GPT2LMHeadModel built from a small GPT2Config), with random weights in which every bias and norm
is drawn, saved as its users save it and imported with `rosetta convert --from KIND`.

What is compared: the imported model's logits with the fixture's own forward in float64 (the
fixture run with `.double()`), on two batches: 3 full rows of 9 tokens (ids drawn from the whole
vocabulary except the config's pad id), and a right-padded ragged batch (4 rows of 9, pad id
after each row's end), compared at the real positions only. None of these models handles padding
(none masks anything by id); right padding needs no handling in a causal model, since a real
query sees only earlier, real keys, so the fixtures' real positions are exact. A pad query's row
is where the spec (which masks pad keys) and the texts (which attend them) differ, and no loss
reads it.

Bounds (common/spec/tolerances.py): the float64 oracle on a float64 file within 1e-10 (both sides
compute in float64; only summation order differs, ~1e-15 on these sizes), and each framework in
float32 on a float32 file within 1e-5 (float32's unit roundoff 6e-8 over a few dozen operations on
O(1) values, ~1e-6; the fixture's float64 run is the reference, so the gap is ours alone). The
two seed texts' models also run in each framework in float64 on the float64 file, within 1e-10.
Measured (docs/PORTING.md has the table): ~1e-15 in float64 on every side, ~1e-6 in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from parity_tests.fixtures import SIZES
from transformer_rosetta.oracle.reference import forward as oracle_forward
from transformer_rosetta.oracle.reference import sinusoidal_positions
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights

# The special ids given in --config: none of 0, 1, 2, so that a literal default shows. These
# models have none of their own (docs/PORTING.md, "Decoder-only models").
IDS = {"pad_id": 3, "bos_id": 4, "eos_id": 5}
LAYERS = {**SIZES, "num_decoder_layers": 2}
BLOCK_SIZE = 16  # block_size, n_positions: max_len
# case -> (the --from kind, what --config gives). The encoder GPT's file tells its heads. Seed
# text 000's blocks are minGPT's, renamed and with an is_causal switch: read as --from mingpt.
CASES = {
    "mingpt": ("mingpt", {"num_heads": 2, **IDS}),
    "seed-000": ("mingpt", {"num_heads": 2, **IDS}),
    "nanogpt": ("nanogpt", {"num_heads": 2, **IDS}),
    "nanogpt-no-bias": ("nanogpt", {"num_heads": 2, **IDS}),
    "gpt2": ("gpt2", {"num_heads": 2, **IDS}),
    "encoder-gpt": ("encoder-gpt", IDS),
}
SEEDS = ("seed-000", "encoder-gpt")  # the cases written from the seed texts' code
DTYPES = ("float32", "float64")


def run_convert(*args: object) -> int:
    from transformer_rosetta.cli import main

    return main(["convert", *map(str, args)])


# -- the fixtures -----------------------------------------------------------------------------


def hf_gpt2(seed: int = 7):
    """transformers' GPT2LMHeadModel at the fixtures' sizes (d_ff 20 through n_inner, so that it
    is read from the shapes), eager attention, every parameter drawn; float32, eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from parity_tests.fixtures.draws import draw

    config = GPT2Config(
        vocab_size=LAYERS["tgt_vocab_size"],
        n_positions=BLOCK_SIZE,
        n_embd=LAYERS["d_model"],
        n_layer=LAYERS["num_decoder_layers"],
        n_head=LAYERS["num_heads"],
        n_inner=LAYERS["d_ff"],
        bos_token_id=IDS["bos_id"],
        eos_token_id=IDS["eos_id"],
        attn_implementation="eager",
    )
    torch.random.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # lm_head.weight is wte's: drawn once
            shape = tuple(p.shape)
            if name.endswith(("wte.weight", "wpe.weight")):
                value = draw(rng, "embedding", shape, LAYERS["d_model"])
            elif ".ln_" in name and name.endswith(".weight"):
                value = draw(rng, "gain", shape)
            elif name.endswith(".weight"):  # Conv1D: [in, out]
                value = draw(rng, "kernel", shape, fans=shape)
            else:
                value = draw(rng, "bias", shape)
            p.copy_(torch.from_numpy(value).to(p.dtype))
    return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.double().numpy()


def make_case(case: str):
    """(a fresh model in float32 (the same weights on every call), its forward: (model, tokens)
    -> float64 logits, save(model, folder) -> the file to convert, as its users save it)."""
    backend_or_skip("torch")
    import torch

    from parity_tests.fixtures import mingpt, seed_000_gpt, seed_gpt

    def torch_save(model, folder: Path) -> Path:
        torch.save(model.state_dict(), folder / "model.pt")
        return folder / "model.pt"

    if case == "encoder-gpt":
        return seed_gpt.make_model(LAYERS, seed=7), seed_gpt.forward, torch_save
    if case == "seed-000":
        model = seed_000_gpt.make_model(LAYERS, seed=7, block_size=BLOCK_SIZE)
        return model, seed_000_gpt.forward, torch_save
    if case == "gpt2":
        pytest.importorskip("transformers")

        def hf_save(model, folder: Path) -> Path:
            model.save_pretrained(folder / "hf")  # model.safetensors: lm_head.weight left out
            return folder / "hf" / "model.safetensors"

        return hf_gpt2(), hf_logits, hf_save
    model = mingpt.make_model(
        LAYERS,
        seed=7,
        nanogpt=case.startswith("nanogpt"),
        bias=case != "nanogpt-no-bias",
        block_size=BLOCK_SIZE,
    )
    return model, mingpt.forward, torch_save


def saved(case: str, folder: Path) -> Path:
    """The case's fixture in float32, saved in `folder`."""
    model, _, save = make_case(case)
    return save(model, folder)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the fixture model in float64, its forward, the imported WeightFile) per (case, dtype):
    the model saved in `dtype` (`.double()` for float64) and converted by the CLI, once."""
    cache = {}

    def get(case: str, dtype: str):
        if (case, dtype) not in cache:
            model, fx_forward, save = make_case(case)
            if dtype == "float64":
                model = model.double()
            folder = tmp_path_factory.mktemp(f"{case}-{dtype}")
            (folder / "given.json").write_text(json.dumps(CASES[case][1]))
            out = folder / "model.safetensors"
            code = run_convert(
                "--from",
                CASES[case][0],
                save(model, folder),
                out,
                "--config",
                folder / "given.json",
            )
            assert code == 0, f"rosetta convert --from {CASES[case][0]} failed"
            cache[case, dtype] = (model.double(), fx_forward, load_weights(out))
        return cache[case, dtype]

    return get


def batches(config) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (tokens (B, T), real positions (B, T)): a full batch with every id but pad_id, and
    ragged_batch's right-padded one (its rows start with bos_id; the pad id only after the end)."""
    rng = np.random.default_rng(5)
    allowed = np.array([t for t in range(config.tgt_vocab_size) if t != config.pad_id])
    full = allowed[rng.integers(0, len(allowed), size=(3, 9))]
    _, padded = ragged_batch(config, batch=4, src_len=1, tgt_len=9, seed=5)
    assert (padded == config.pad_id).any() and (padded[:, 0] != config.pad_id).all()
    return {
        "full": (full, np.ones(full.shape, bool)),
        "right-padded": (padded, np.cumprod(padded != config.pad_id, axis=1).astype(bool)),
    }


def gap(got: np.ndarray, want: np.ndarray, real: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64)[real] - want[real])))


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_the_oracle_matches_each_fixture_in_float64(imported, case):
    model, fx_forward, wf = imported(case, "float64")
    assert wf.dtype == "float64" and wf.config.kind == "decoder_only"
    for name, (tokens, real) in batches(wf.config).items():
        want = fx_forward(model, tokens)
        got = oracle_forward(wf.tensors, wf.config, None, tokens).logits
        diff = gap(got, want, real)
        assert diff <= atol_for("float64"), f"{case}, {name} batch: off by {diff:.3g}"


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_each_framework_matches_each_fixture_in_float32(imported, case, framework):
    backend = backend_or_skip(framework)
    model, fx_forward, wf = imported(case, "float32")
    assert wf.dtype == "float32"
    ours = backend.build(wf.config, wf.tensors, dtype="float32")
    for name, (tokens, real) in batches(wf.config).items():
        want = fx_forward(model, tokens)
        diff = gap(ours.forward(None, tokens).logits, want, real)
        assert diff <= atol_for("float32", wf.config), f"{case} in {framework}, {name}: {diff:.3g}"


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", SEEDS)
def test_each_framework_matches_the_seed_fixtures_in_float64(imported, case, framework):
    """The seed texts' models in float64 in each framework, on the float64 file: the fixture's
    float64 run is the reference, so the bound is float64's (measured: ~1e-15)."""
    backend = backend_or_skip(framework)
    model, fx_forward, wf = imported(case, "float64")
    ours = backend.build(wf.config, wf.tensors, dtype="float64")
    for name, (tokens, real) in batches(wf.config).items():
        diff = gap(ours.forward(None, tokens).logits, fx_forward(model, tokens), real)
        assert diff <= atol_for("float64"), f"{case} in {framework}, {name}: {diff:.3g}"


# -- what each table reads and decides ----------------------------------------------------------


def test_the_configs_are_what_each_text_fixes(imported):
    """The sizes come from the shapes (minGPT's d_ff is its 4 * n_embd, GPT-2's n_inner, the
    encoder GPT's heads and d_k from its per-head Linears); the rest is the tables' fixed fields."""
    configs = {case: imported(case, "float32")[2].config for case in CASES}
    for case, c in configs.items():
        assert (c.num_encoder_layers, c.num_decoder_layers) == (0, 2), case
        assert (c.tgt_vocab_size, c.d_model, c.num_heads, c.head_dim) == (29, 12, 2, 6), case
        assert (c.pad_id, c.bos_id, c.eos_id) == (3, 4, 5), case
        assert c.position_kind == "learned" and not c.scale_embeddings, case
    for case in ("mingpt", "seed-000", "nanogpt", "nanogpt-no-bias", "gpt2"):
        c = configs[case]
        assert (c.norm_position, c.final_norm, c.layer_norm_eps) == ("pre", True, 1e-5), case
        assert c.max_len == BLOCK_SIZE and not c.output_bias, case
    assert configs["mingpt"].d_ff == configs["seed-000"].d_ff == 48 and configs["gpt2"].d_ff == 20
    assert configs["seed-000"] == configs["mingpt"]
    assert [configs[k].activation for k in ("mingpt", "nanogpt", "gpt2", "encoder-gpt")] == [
        "gelu_tanh",
        "gelu",
        "gelu_tanh",
        "relu",
    ]
    assert [configs[k].tie_output for k in ("mingpt", "nanogpt", "gpt2", "encoder-gpt")] == [
        False,
        True,
        True,
        False,
    ]
    seed = configs["encoder-gpt"]
    assert (seed.norm_position, seed.final_norm, seed.output_bias) == ("post", False, True)
    assert (seed.d_ff, seed.max_len, seed.key_dim) == (20, 512, None)


def test_nanogpt_without_biases_imports_zero_biases(imported):
    """GPTConfig(bias=False): the file has no bias, which c_attn tells (attention_bias false); each
    feed-forward and LayerNorm bias is imported as zeros, the function F.linear and F.layer_norm
    compute with bias None."""
    _, _, wf = imported("nanogpt-no-bias", "float32")
    assert wf.config.attention_bias is False
    biases = [n for n in wf.tensors if n.endswith(".bias")]
    assert len(biases) == 2 * 4 + 1  # per layer: 2 norms and 2 feed-forward linears; then ln_f
    assert all(not wf.tensors[n].any() for n in biases)
    assert not any(".self_attention.query." in n and n.endswith("bias") for n in wf.tensors)


def test_the_encoder_gpts_positions_are_its_formula_not_the_papers(imported):
    """pos / 1e4 ** (dim // dim_model): the integer division makes every frequency 1, so row pos
    is (sin pos, cos pos, ...). The imported table is that formula to one float64 ulp;
    the text's own position_encoding computes it in float32, within one float32 ulp of 1 (2^-24:
    sin and cos are at most 1, and torch's float32 sin/cos are within an ulp); it is O(1) away from
    the paper's sinusoid from position 1 on."""
    from parity_tests.fixtures.seed_gpt import position_encoding

    _, _, wf = imported("encoder-gpt", "float64")
    table = wf.tensors["decoder.position_embedding"]
    pos = np.arange(wf.config.max_len, dtype=np.float64)[:, None]
    want = np.tile(np.concatenate([np.sin(pos), np.cos(pos)], axis=1), (1, 6))
    # numpy's sin and cos of the same float64 positions: within one float64 ulp of values <= 1
    # on any CPU (SIMD kernels may round the last bit differently), not bit for bit.
    assert np.abs(table - want).max() <= 2.0**-52
    text = position_encoding(wf.config.max_len, 12)[0].numpy()
    assert text.dtype == np.float32
    assert np.abs(table - text).max() <= 2.0**-24
    paper = sinusoidal_positions(wf.config.max_len, 12)
    assert np.abs(table[0] - paper[0]).max() == 0  # sin 0 = 0, cos 0 = 1 in both
    assert np.abs(table[1:] - paper[1:]).max(axis=1).min() > 0.1
    # In a float32 file the table is the float64 one rounded once.
    _, _, wf32 = imported("encoder-gpt", "float32")
    np.testing.assert_array_equal(
        wf32.tensors["decoder.position_embedding"], table.astype(np.float32)
    )


def test_the_encoder_gpt_run_as_the_text_writes_it(imported):
    """The fixture's reference runs the text's code in float32 as written, and in float64 with its
    positions computed in float64 (seed_gpt.py says why). Run with the text's float32 positions,
    the float64 model is off by the float32 rounding of its positions: more than float64's bound,
    and within float32's."""
    import torch

    from parity_tests.fixtures import seed_gpt

    model, _, wf = imported("encoder-gpt", "float64")
    tokens, real = batches(wf.config)["full"]
    src = torch.as_tensor(tokens, dtype=torch.long)
    with torch.no_grad():  # the text's code as it stands: positions in float32
        text = model(src, seed_gpt.causal_mask(src.size(1), torch.float64)).numpy()
    assert seed_gpt.position_encoding is not seed_gpt._position_encoding_float64
    want = oracle_forward(wf.tensors, wf.config, None, tokens).logits
    diff = gap(text, want, real)
    assert atol_for("float64") < diff <= atol_for("float32"), diff


def test_seed_000s_blocks_are_mingpts(imported):
    """The text's SelfAttention, NewGELU and Block (minGPT's, renamed and with is_causal) under
    minGPT's GPT save exactly minGPT's keys and shapes, so --from mingpt reads them (the configs
    of the two files' imports are equal: test_the_configs_are_what_each_text_fixes). With the same
    draws, the two fixtures compute the same logits, in float32 and float64: measured bit for bit
    (asserted within float64's bound)."""
    from parity_tests.fixtures import mingpt, seed_000_gpt

    seed, _, _ = make_case("seed-000")
    ours, _, _ = make_case("mingpt")
    assert {k: tuple(v.shape) for k, v in seed.state_dict().items()} == {
        k: tuple(v.shape) for k, v in ours.state_dict().items()
    }
    assert sum(k.endswith(".attn.bias") for k in seed.state_dict()) == LAYERS["num_decoder_layers"]
    tokens = batches(imported("seed-000", "float32")[2].config)["full"][0]
    for a, b in ((seed, ours), (seed.double(), ours.double())):
        diff = np.abs(seed_000_gpt.forward(a, tokens) - mingpt.forward(b, tokens)).max()
        assert diff <= atol_for("float64"), diff


def test_seed_000s_position_figure_is_not_eq_5():
    """The text's get_positional_encoding (the code of its sin/cos figure, used by no model):
    its row 0 is zeros (Eq. (5)'s has cos 0 = 1 at odd dims), and dim j's frequency is
    10000^(-2j/d), its own index, where Eq. (5) gives dims 2i and 2i+1 the frequency
    10000^(-2i/d). Only dim 0 agrees. The spec's sinusoids cannot express it: a model built on it
    would be imported with it as a learned table."""
    from parity_tests.fixtures.seed_000_gpt import get_positional_encoding

    length, d = 100, 16  # the text's figure
    text = get_positional_encoding(max_seq_len=length, embed_dim=d)
    paper = sinusoidal_positions(length, d)
    assert not text[0].any() and paper[0, 1::2].tolist() == [1.0] * (d // 2)
    pos, j = np.arange(1, length)[:, None], np.arange(d)[None, :]
    angle = pos / 10000.0 ** (2 * j / d)
    want = np.where(j % 2 == 0, np.sin(angle), np.cos(angle))
    assert np.abs(text[1:] - want).max() <= 1e-12  # rounding only: the same terms, in float64
    assert np.abs(text[:, 0] - paper[:, 0]).max() <= 2.0**-52  # the same sin, another kernel
    assert np.abs(text[1:, 1:] - paper[1:, 1:]).max() > 1.0


def test_a_pad_id_inside_a_row_is_where_the_texts_and_the_spec_part(imported):
    """The spec masks every key that holds pad_id (docs/FORMAT.md); these models mask nothing by
    id. So a pad id inside a row changes our later positions and not the text's: pad_id must be
    an id the inputs never hold (docs/PORTING.md). Measured here on minGPT: 0.58."""
    model, fx_forward, wf = imported("mingpt", "float64")
    tokens = batches(wf.config)["full"][0].copy()
    tokens[:, 4] = wf.config.pad_id
    diff = np.abs(
        oracle_forward(wf.tensors, wf.config, None, tokens).logits - fx_forward(model, tokens)
    )
    assert diff[:, :4].max() <= atol_for("float64")  # before it, nothing differs
    assert diff[:, 5:].max() > 0.1


# -- the table engine's pieces ------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mingpt", "gpt2", "encoder-gpt"])
def test_the_way_back_gives_the_files_own_arrays(imported, case, tmp_path):
    """from_canonical inverts every step, so each fused or per-head source comes back bit for bit:
    minGPT's c_attn [3d, d] (split along rows), GPT-2's Conv1D c_attn [d, 3d] (`columns`, along
    axis 1), the encoder GPT's heads.{h}.q/k/v (one key per head) and its out.weight."""
    from transformer_rosetta.porting.gpt import TABLES
    from transformer_rosetta.porting.sources import read_source_tensors
    from transformer_rosetta.porting.table import from_canonical

    _, _, wf = imported(case, "float32")
    source = read_source_tensors(saved(case, tmp_path))
    if case == "gpt2":  # its table writes GPT2Model's keys (no optional prefix)
        source = {k.removeprefix("transformer."): v for k, v in source.items()}
    back = from_canonical(TABLES[CASES[case][0]], wf.tensors, wf.config)
    buffers = {k for k in source if k.endswith(".attn.bias")}  # constants: not weights
    assert set(back) == set(source) - buffers
    for key, value in back.items():
        np.testing.assert_array_equal(value, source[key], err_msg=key)


def test_old_transformers_buffers_are_checked_then_dropped(imported, tmp_path, capsys):
    """GPT2Model's keys (no `transformer.` prefix, no lm_head) with the buffers older transformers
    saved, `attn.bias` (the causal mask) and `attn.masked_bias` (-1e4): imported to the same
    tensors. A mask that is not causal is refused by name."""
    import torch

    _, _, wf = imported("gpt2", "float32")
    state = {k.removeprefix("transformer."): v for k, v in hf_gpt2().state_dict().items()}
    del state["lm_head.weight"]
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(
            1, 1, 16, 16
        )
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, tmp_path / "old.bin")
    (tmp_path / "given.json").write_text(json.dumps(CASES["gpt2"][1]))
    given = ("--config", tmp_path / "given.json")
    out = tmp_path / "old.safetensors"
    assert run_convert("--from", "gpt2", tmp_path / "old.bin", out, *given) == 0
    for name, value in load_weights(out).tensors.items():
        np.testing.assert_array_equal(value, wf.tensors[name], err_msg=name)

    state["h.1.attn.bias"] = torch.ones(1, 1, 16, 16)  # attends the future
    torch.save(state, tmp_path / "old.bin")
    capsys.readouterr()
    code = run_convert("--from", "gpt2", tmp_path / "old.bin", tmp_path / "x.safetensors", *given)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "not the causal mask (a lower-triangular matrix of ones)" in err
    assert "(1): h.1.attn.bias" in err and not (tmp_path / "x.safetensors").exists()


def test_nanogpt_reads_a_compiled_models_keys(imported, tmp_path):
    """torch.compile'd models save every key under `_orig_mod.`, as nanoGPT's checkpoints hold
    them: an optional prefix of the nanogpt table. The checkpoint is nanoGPT's train.py dict,
    {"model": ..., "optimizer": ..., "model_args": ..., "iter_num": ...}, read as it is."""
    import torch

    _, _, wf = imported("nanogpt", "float32")
    state = make_case("nanogpt")[0].state_dict()
    checkpoint = {
        "model": {f"_orig_mod.{k}": v for k, v in state.items()},
        "optimizer": {"state": {}, "param_groups": [{"lr": 6e-4}]},
        "model_args": {"n_layer": 2, "bias": True},
        "iter_num": 5000,
    }
    torch.save(checkpoint, tmp_path / "c.pt")
    (tmp_path / "given.json").write_text(json.dumps(CASES["nanogpt"][1]))
    out = tmp_path / "c.safetensors"
    code = run_convert(
        "--from", "nanogpt", tmp_path / "c.pt", out, "--config", tmp_path / "given.json"
    )
    assert code == 0
    for name, value in load_weights(out).tensors.items():
        np.testing.assert_array_equal(value, wf.tensors[name], err_msg=name)


# -- the CLI ------------------------------------------------------------------------------------


def test_a_cli_round_with_mingpt(imported, tmp_path, capsys):
    """`rosetta convert --from mingpt model.pt out.safetensors --config given.json`: one summary,
    the file loads, and its logits are the fixture's (the oracle, float32 weights in float64:
    the bound is float64's, the weights being the same numbers)."""
    model, fx_forward, _ = imported("mingpt", "float32")
    src = saved("mingpt", tmp_path)
    (tmp_path / "given.json").write_text(json.dumps(CASES["mingpt"][1]))
    out = tmp_path / "out.safetensors"
    capsys.readouterr()
    assert run_convert("--from", "mingpt", src, out, "--config", tmp_path / "given.json") == 0
    printed = capsys.readouterr().out
    assert "(mingpt) -> " in printed and "37 tensors, 4,680 parameters, float32" in printed
    wf = load_weights(out)
    assert "output.kernel" in wf.tensors and "decoder.position_embedding" in wf.tensors
    tokens, real = batches(wf.config)["full"]
    got = oracle_forward(wf.tensors, wf.config, None, tokens).logits
    assert gap(got, fx_forward(model, tokens), real) <= atol_for("float64")


@pytest.mark.parametrize(
    "source, kind, given, message",
    [
        (
            "gpt2",
            "encoder-gpt",
            IDS,
            "transformer.* and lm_head.weight are minGPT's, nanoGPT's or GPT-2's keys: give "
            "--from mingpt, nanogpt or gpt2",
        ),
        (
            "encoder-gpt",
            "mingpt",
            CASES["mingpt"][1],
            "embedding.weight and encoder.layers.* are the encoder GPT's keys (a GPT of "
            "embedding, encoder, out): give --from encoder-gpt",
        ),
        (
            "gpt2",
            "mingpt",
            CASES["mingpt"][1],
            "transformer.h.0.attn.c_attn.weight is stored [in, out], as transformers' Conv1D "
            "stores it: give --from gpt2",
        ),
        (
            "mingpt",
            "gpt2",
            CASES["gpt2"][1],
            "transformer.h.0.attn.c_attn.weight is stored [out, in], as nn.Linear stores it "
            "(minGPT, nanoGPT): give --from mingpt or nanogpt",
        ),
        (
            "mingpt",
            "nanogpt",
            CASES["nanogpt"][1],
            "lm_head.weight differs from transformer.wte.weight, but nanoGPT ties them (minGPT "
            "does not: --from mingpt)",
        ),
        (
            "mingpt",
            "mingpt",
            IDS,
            "num_heads: the file cannot tell it; give it in --config FILE.json",
        ),
        (
            "mingpt",
            "mingpt",
            {"num_heads": 2},  # pad_id need not be given: without it the model has no pad
            "bos_id: the file cannot tell it; give it in --config FILE.json",
        ),
        (
            "nanogpt",
            "nanogpt",
            {**CASES["nanogpt"][1], "activation": "gelu_tanh"},
            "activation: --config says 'gelu_tanh', but nanoGPT's MLP uses nn.GELU(), the exact",
        ),
    ],
)
def test_a_wrong_kind_or_config_is_one_line_exit_2(tmp_path, capsys, source, kind, given, message):
    src = saved(source, tmp_path)
    (tmp_path / "given.json").write_text(json.dumps(given))
    capsys.readouterr()
    out = tmp_path / "x.safetensors"
    code = run_convert("--from", kind, src, out, "--config", tmp_path / "given.json")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert message in err
    assert not out.exists()


# -- the encoder GPT's names ----------------------------------------------------------------------


def test_seed_gpt_is_the_encoder_gpts_other_name(imported, tmp_path):
    """--from seed-gpt, the kind's first name, reads the same file to the same tensors and config."""
    _, _, wf = imported("encoder-gpt", "float32")
    (tmp_path / "given.json").write_text(json.dumps(IDS))
    out = tmp_path / "alias.safetensors"
    src = saved("encoder-gpt", tmp_path)
    assert run_convert("--from", "seed-gpt", src, out, "--config", tmp_path / "given.json") == 0
    again = load_weights(out)
    assert again.config == wf.config and set(again.tensors) == set(wf.tensors)
    for name, value in again.tensors.items():
        np.testing.assert_array_equal(value, wf.tensors[name], err_msg=name)


def test_an_output_named_linear_is_refused_saying_the_texts_name(tmp_path, capsys):
    """The text names its output layer `out` (self.out = nn.Linear(dim_model, n_vocab)). A file
    whose output is `linear.*` (what this project's earlier fixture saved, renamed from the
    text) is refused, not read: no code of the text saves it, and the hint says which name the
    text's file holds. One line, exit 2, nothing written."""
    import torch

    state = make_case("encoder-gpt")[0].state_dict()
    state = {
        k.replace("out.", "linear.", 1) if k.startswith("out.") else k: v for k, v in state.items()
    }
    assert {"linear.weight", "linear.bias"} <= set(state) and "out.weight" not in state
    torch.save(state, tmp_path / "renamed.pt")
    (tmp_path / "given.json").write_text(json.dumps(IDS))
    out = tmp_path / "x.safetensors"
    capsys.readouterr()
    code = run_convert(
        "--from", "encoder-gpt", tmp_path / "renamed.pt", out, "--config", tmp_path / "given.json"
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.count("its output layer is `out` (self.out = nn.Linear(dim_model, n_vocab))") == 1
    assert "missing tensors (2): out.weight, out.bias" in err
    assert "unexpected tensors (2): linear.bias, linear.weight" in err
    assert not out.exists()


def test_the_encoder_gpts_floored_head_size_is_read(tmp_path):
    """The text's dim_k = dim_v = dim_model // num_heads floors: 5 heads on d_model 12 are 5
    heads of 2, concatenated to 10 features that `linear` maps back to 12. The file tells both
    (key_dim 2, h d_k != d_model), and the oracle matches the fixture in float64."""
    from parity_tests.fixtures import seed_gpt

    model = seed_gpt.make_model({**LAYERS, "num_heads": 5}, seed=7).double()
    seed_gpt.save(model, tmp_path / "model.pt")
    (tmp_path / "given.json").write_text(json.dumps(IDS))
    out = tmp_path / "model.safetensors"
    given = ("--config", tmp_path / "given.json")
    assert run_convert("--from", "encoder-gpt", tmp_path / "model.pt", out, *given) == 0
    wf = load_weights(out)
    assert (wf.config.num_heads, wf.config.key_dim, wf.config.d_model) == (5, 2, 12)
    for name, (tokens, real) in batches(wf.config).items():
        got = oracle_forward(wf.tensors, wf.config, None, tokens).logits
        diff = gap(got, seed_gpt.forward(model, tokens), real)
        assert diff <= atol_for("float64"), f"{name}: {diff:.3g}"
