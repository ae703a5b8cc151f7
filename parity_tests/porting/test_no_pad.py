"""A decoder-only model without a pad token has no pad (issue 41, class 7; docs/FORMAT.md, "Special
ids"): transformers' GPT2LMHeadModel and LlamaForCausalLM at tiny random sizes, saved with
save_pretrained without a pad_token_id (as the real GPT-2 and most Llama checkpoints are) and
converted by the CLI, import with pad_id = the vocabulary size, the virtual pad, which names no
token. So no real token is masked: a prompt holding the id the old rule took as the pad (the
highest id that is neither BOS nor EOS: 95 of GPT-2's 97 with <|endoftext|> 96, 60 of Llama's 61
with BOS 1, EOS 2), whose greedy continuation produces that id again, gives transformers' tokens
in every framework, cached and uncached; beam search and seeded sampling give the tokens of the
same search run over transformers' own model. Where the virtual pad pads a ragged batch it embeds
as the zero vector and is masked as a key, so the real positions are transformers' with its
attention_mask, and the unpadded rows'.

Bounds (parity_tests/cli/test_generate.py's argument). Greedy: each framework's float32 logits
lie within atol_for("float32") = 1e-5 of the float64 truth, and so do transformers' float32 ones,
so a decision whose float64 top-1 minus top-2 log-probability exceeds 4 * atol is taken alike:
asserted at every step first. Beam search and sampling run in float64 on both sides (transformers'
GPT-2 in float64 computes in float64 throughout; its Llama does with test_llama.py's
float64_internals), whose logits agree to ~1e-14: no beam ranking is that close, and every
sampling draw is asserted to lie more than CDF_MARGIN = 1e-9 from a boundary of the oracle's
cumulative distribution. Logits in float64: 1e-9 (test_llama.py's F64_BOUND) against
transformers, atol_for("float64") = 1e-10 between our own padded and unpadded rows.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from contextlib import nullcontext
from functools import partial

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip, import_or_skip
from parity_tests.impl.test_today import CDF_MARGIN, cdf_margin
from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.app.generation import generate_ids
from transformer_rosetta.cli import main
from transformer_rosetta.decoding.sampling import sample_search
from transformer_rosetta.decoding.search import beam_search, greedy_search, prompt_prefix
from transformer_rosetta.errors import ConfigError, InputError
from transformer_rosetta.oracle import reference
from transformer_rosetta.oracle.training import oracle_loss
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights
from transformer_rosetta.weights.init import init_weights

torch = import_or_skip("torch", "transformers' models are torch modules")
import_or_skip("transformers", "transformers builds the GPT-2 and Llama fixtures")
from parity_tests.cli.test_generate import gpt2_model  # noqa: E402
from parity_tests.porting.test_llama import float64_internals, hf_model  # noqa: E402

F64_BOUND = 1e-9
MAX_NEW = 10
BACKENDS = ["numpy", *IMPLEMENTATIONS]
# model -> (the id the old rule chose as pad_id, prompts holding it whose greedy continuation
# (transformers', asserted) produces it again). Found once by a seeded search over prompts.
OLD_PAD = {"gpt2": 95, "llama": 60}
PROMPTS = {
    "gpt2": [[29, 63, 95]],  # continues 95, 95, 38, 47, ...
    # They continue ..., 46, 60, 54, 11; 11, 60, 12, 6, EOS; 4, 18, 18, 49, 60, ... The last two
    # are one batch (one length): the row that ends at EOS is fed a filler while the other goes on.
    "llama": [[41, 59, 60], [51, 53, 21, 60], [20, 60, 49, 6]],
}
SAMPLING = {"temperature": 0.8, "top_p": 0.9}
SEED = 4  # its paths draw the old pad id: GPT-2's twice, the second Llama prompt's once
# Keras and Flax compile every new shape (uncached: every prefix length) at ~1 s each on 2 cores:
# those cases are slow (pytest -m slow); the default tier runs each framework cached, and numpy
# and torch in every case.
COMPILED = ("tf", "jax")


def cases(*, greedy: bool) -> list:
    """(backend, cached) params, the compiled frameworks' slow ones marked."""
    out = []
    for backend in BACKENDS:
        for cached in (True, False):
            slow = backend in COMPILED and (not cached or not greedy)
            out.append(
                pytest.param(
                    backend,
                    cached,
                    id=f"{backend}-{'cached' if cached else 'uncached'}",
                    marks=[pytest.mark.slow] if slow else [],
                )
            )
    return out


def run_cli(capsys, *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def hf_float64(name: str):
    """A context in which transformers' float64 model of `name` computes in float64 throughout
    (Llama's float32 internals patched: test_llama.py)."""
    return float64_internals() if name == "llama" else nullcontext()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> (transformers' float32 model, its float64 copy, the save_pretrained folder, the
    WeightFile that `rosetta convert FOLDER out.safetensors` wrote, and that file's path), built
    once per name. The
    folders have no pad_token_id; the Llama one is converted with the default verification
    (its probes are padded with the virtual pad)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model = gpt2_model() if name == "gpt2" else hf_model("llama")
            assert model.config.pad_token_id is None
            root = tmp_path_factory.mktemp(name)
            model.save_pretrained(root / "folder")
            out = root / "model.safetensors"
            assert main(["convert", str(root / "folder"), str(out), "--from", name]) == 0
            double = copy.deepcopy(model).double()
            cache[name] = (model, double, root / "folder", load_weights(out), out)
        return cache[name]

    return get


def transformers_greedy(model, double, name: str, prompt: list[int], eos: int) -> list[int]:
    """transformers' greedy new tokens (float32, as users run it; up to and with EOS), after
    asserting that the float64 model's margin at every decision exceeds 4 * atol."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        new = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            pad_token_id=eos,
        )[0, len(prompt) :].tolist()
        if eos in new:
            new = new[: new.index(eos) + 1]
        with hf_float64(name):
            logits = double(torch.tensor([prompt + new])).logits[0].numpy()
    steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(new)]
    top2 = np.sort(steps, axis=-1)[:, -2:]  # log-softmax shifts a row: the margin is the same
    margin = float((top2[:, 1] - top2[:, 0]).min())
    assert margin > 4 * atol_for("float32"), f"{prompt}: a greedy near-tie ({margin:.3g})"
    return new


@pytest.fixture(scope="module")
def wanted(imported):
    """name -> transformers' greedy new tokens of each of its prompts."""
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            model, double, _, wf, _ = imported(name)
            cache[name] = [
                transformers_greedy(model, double, name, p, wf.config.eos_id) for p in PROMPTS[name]
            ]
        return cache[name]

    return get


class TransformersStepper:
    """transformers' model behind the project's Stepper (common/decoding/search.py), the whole
    prefix run at every step: the search is the project's, the model transformers'."""

    def __init__(self, model, prompt: np.ndarray, beams: int) -> None:
        self.model = model
        self.prefix = prompt_prefix(prompt, beams)  # the search feeds the last token first

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.prefix = np.concatenate([self.prefix, np.asarray(tokens, np.int64)[:, None]], axis=1)
        with torch.no_grad():
            return self.model(torch.as_tensor(self.prefix)).logits[:, -1].numpy()

    def reorder(self, rows: np.ndarray) -> None:
        self.prefix = self.prefix[np.asarray(rows)]


# -- the import -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OLD_PAD))
def test_the_import_has_no_pad(imported, name):
    """pad_id is the vocabulary size: the virtual pad, no row of the embedding, never a real
    token (the old rule took OLD_PAD), and the folder's BOS and EOS as they are."""
    model, _, _, wf, _ = imported(name)
    c = wf.config
    vocab = model.config.vocab_size
    assert (c.tgt_vocab_size, c.pad_id, c.virtual_pad) == (vocab, vocab, True)
    assert (c.bos_id, c.eos_id) == (model.config.bos_token_id, model.config.eos_token_id)
    assert wf.tensors["decoder.embedding"].shape[0] == vocab  # no row was added for it


# -- generation: transformers' tokens ---------------------------------------------------------


@pytest.mark.parametrize(("backend_name", "cached"), cases(greedy=True))
@pytest.mark.parametrize("name", list(OLD_PAD))
def test_greedy_equals_transformers_generate_with_the_old_pad_id(
    imported, wanted, name, backend_name, cached
):
    backend = backend_or_skip(backend_name)
    _, _, _, wf, _ = imported(name)
    want = wanted(name)
    old = OLD_PAD[name]
    assert all(old in p for p in PROMPTS[name]) and all(old in w for w in want)
    dtype = "float64" if backend_name == "numpy" else "float32"
    ours = backend.build(wf.config, wf.tensors, dtype=dtype)
    got = generate_ids(ours, PROMPTS[name], max_new_tokens=MAX_NEW, cached=cached)
    assert got == want


@pytest.mark.parametrize(("backend_name", "cached"), cases(greedy=False))
@pytest.mark.parametrize("name", list(OLD_PAD))
def test_beam_and_sampling_equal_the_same_search_over_transformers_model(
    imported, name, backend_name, cached
):
    """Beam search (3 beams, GNMT's length penalty: common/decoding/search.py, not transformers'
    beam scorer) and seeded sampling (temperature 0.8, top-p 0.9) in float64, over our model and
    over transformers' float64 one: the same tokens (and beam scores within 1e-9)."""
    backend = backend_or_skip(backend_name)
    _, double, _, wf, _ = imported(name)
    c = wf.config
    ours = backend.build(c, wf.tensors, dtype="float64")
    searches = {
        "beam": partial(beam_search, beam=3, extra_len=6),
        "sample": partial(sample_search, extra_len=MAX_NEW, seed=SEED, **SAMPLING),
    }
    oracle = get_backend("numpy").build(c, wf.tensors)
    for prompt in PROMPTS[name]:
        batch = np.array([prompt])
        for what, search in searches.items():
            with hf_float64(name):
                want = search(
                    lambda p, beams, _steps: TransformersStepper(double, p, beams), c, batch
                )
            if what == "sample":
                assert len(want.tokens[0]) > 0, f"{prompt}: EOS drawn first"
                margin = cdf_margin(oracle, c, batch, want.tokens, SEED, **SAMPLING)
                assert margin > CDF_MARGIN, f"{prompt}: a uniform {margin:.3g} from a boundary"
            got = search(partial(ours.stepper, cached=cached), c, batch)
            assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens], what
            if what == "beam":
                np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=F64_BOUND)


def test_a_prompt_cannot_hold_the_virtual_pad(imported, capsys):
    """The virtual pad is no token: generation refuses it in a prompt, as any id past the
    vocabulary, in the API and on the command line."""
    _, _, _, wf, path = imported("gpt2")
    ours = get_backend("numpy").build(wf.config, wf.tensors)
    with pytest.raises(InputError, match=r"token id 97 at position 1 is outside the vocabulary"):
        generate_ids(ours, [[5, 97]], max_new_tokens=2)
    capsys.readouterr()
    args = ("--ids", "5,97", "--max-new-tokens", 2)
    code, _, err = run_cli(capsys, "generate", "--weights", path, *args)
    assert code == 2 and err.count("\n") == 1 and "97" in err, err


class RecordingStepper:
    """A stepper whose row 0 picks EOS at its first step and whose row 1 picks `other` at every
    step, recording each step's fed tokens: what a search feeds a row that is done."""

    def __init__(self, c, other: int) -> None:
        self.c, self.other, self.fed = c, other, []

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.fed.append(np.asarray(tokens).tolist())
        logits = np.zeros((2, self.c.tgt_vocab_size))
        logits[0, self.c.eos_id] = logits[1, self.other] = 10.0
        return logits

    def reorder(self, rows: np.ndarray) -> None:
        pass


@pytest.mark.parametrize("no_pad", [True, False], ids=["virtual pad", "a real pad"])
def test_a_finished_row_is_fed_eos_when_the_model_has_no_pad(no_pad):
    """common/decoding/search.py, filler_id: a row done while another goes on is fed the pad id,
    which the cache masks; a model without a pad (whose pad_id names no token, and which a
    stepper refuses) is fed its EOS instead, as transformers' generate feeds pad_token_id =
    eos_token_id when the model has no pad. Greedy over a two-row batch whose first row ends at
    once: the tokens fed to it from the second step on."""
    base = preset("tiny_decoder_only")
    c = base.replace(pad_id=base.tgt_vocab_size) if no_pad else base
    assert c.virtual_pad == no_pad
    stepper = RecordingStepper(c, other=9)
    got = greedy_search(lambda _p, _b, _s: stepper, c, np.array([[5, 6], [7, 8]]), extra_len=3)
    assert [t.tolist() for t in got.tokens] == [[], [9, 9, 9]]
    want = c.eos_id if no_pad else c.pad_id  # 2 (EOS), or 0 (the preset's pad)
    assert (want, c.pad_id) == ((2, 48) if no_pad else (0, 0))
    assert stepper.fed == [[6, 8], [want, 9], [want, 9]]


# -- a ragged batch ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("name", list(OLD_PAD))
def test_a_ragged_batch_padded_with_the_virtual_pad(imported, name, backend_name):
    """ragged_batch right-pads with pad_id (the virtual pad), and its rows hold the old pad id
    too: at the real positions the logits are transformers' with attention_mask (the pads
    replaced by id 0 for its lookup: masked, they are never read), and in the oracle its own
    unpadded rows' (a framework's follows: it equals transformers', which equals the oracle)."""
    backend = backend_or_skip(backend_name)
    _, double, _, wf, _ = imported(name)
    c = wf.config
    _, tokens = ragged_batch(c, batch=4, src_len=1, tgt_len=9, seed=5)
    tokens[:, 3] = OLD_PAD[name]
    real = tokens != c.pad_id
    assert (~real).any() and np.cumprod(real, axis=1).astype(bool).tolist() == real.tolist()
    ours = backend.build(c, wf.tensors, dtype="float64")
    got = ours.forward(None, tokens).logits
    with torch.no_grad(), hf_float64(name):
        theirs = double(
            input_ids=torch.as_tensor(np.where(real, tokens, 0)),
            attention_mask=torch.as_tensor(real.astype(np.int64)),
        ).logits.numpy()
    assert np.abs(got - theirs)[real].max() <= F64_BOUND
    if backend_name != "numpy":
        return
    for row, length in enumerate(real.sum(axis=1)):
        alone = ours.forward(None, tokens[row : row + 1, :length]).logits[0]
        assert np.abs(got[row, :length] - alone).max() <= atol_for("float64"), row


# -- the spec rule: the virtual pad embeds as zero ----------------------------------------------


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_the_virtual_pad_embeds_as_the_zero_vector(backend_name):
    """docs/FORMAT.md, step 2, by hand: with learned positions and scaled embeddings, a real id
    embeds as E[id] * sqrt(d) + P[pos] and the virtual pad as 0 * sqrt(d) + P[pos] = P[pos];
    with rotary positions (nothing added) it is the zero vector itself. In the oracle's embed
    and in each framework's embedding output (its first hidden state)."""
    backend = backend_or_skip(backend_name)
    learned = preset("tiny_decoder_only").replace(scale_embeddings=True)
    rotary = preset("tiny_llama")  # the same embedding code in a framework: the oracle's case
    for base in (learned, rotary) if backend_name == "numpy" else (learned,):
        c = base.replace(pad_id=base.tgt_vocab_size)
        assert c.virtual_pad
        w = init_weights(c, seed=1, scheme="perturbed", dtype="float64")
        pad = c.pad_id
        ids = np.array([[pad, 3, pad, 7]])
        table = np.asarray(w["decoder.embedding"])
        want = np.zeros((1, 4, c.d_model))
        want[0, 1], want[0, 3] = table[3], table[7]
        want *= math.sqrt(c.d_model) if c.scale_embeddings else 1.0
        if c.position_kind == "learned":
            want += np.asarray(w["decoder.position_embedding"])[:4]
        else:
            assert not want[0, ::2].any()  # rotary: the virtual pad is the zero vector
        if backend_name == "numpy":
            got = reference.embed(w, "decoder", "decoder.embedding", ids, c)
        else:
            out = backend.build(c, w, dtype="float64").forward(None, ids, hidden_states=True)
            got = out.decoder_hidden_states[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    "framework",
    ["numpy", *(pytest.param(f, marks=pytest.mark.slow) for f in IMPLEMENTATIONS)],
)
def test_a_padded_language_model_batch_trains_on_its_real_targets(framework):
    """Training: a target holding the virtual pad is no target (`tgt != pad_id`). The loss of a
    right-padded batch is the token-weighted mean of its rows' own losses (each row alone,
    unpadded), in the oracle and in every framework, with the real targets' count."""
    base = preset("tiny_decoder_only").replace(dropout=0.0)
    c = base.replace(pad_id=base.tgt_vocab_size)
    w = init_weights(c, seed=2, scheme="perturbed", dtype="float64")
    _, tgt = ragged_batch(c, batch=3, src_len=1, tgt_len=7, seed=1)
    tgt = tgt[:, 1:]  # the targets; the model reads them behind BOS
    lengths = (tgt != c.pad_id).sum(axis=1)
    assert lengths.min() < tgt.shape[1]
    rows = [oracle_loss(w, c, None, tgt[r : r + 1, :n]) for r, n in enumerate(lengths)]
    want = sum(loss * n for (loss, _, n) in rows) / lengths.sum()
    loss, _, tokens = oracle_loss(w, c, None, tgt)
    assert tokens == lengths.sum() and abs(loss - want) <= atol_for("float64")
    if framework != "numpy":
        model = backend_or_skip(framework).build(c, w, dtype="float64")
        got = model.loss_and_grads(None, tgt)
        assert abs(float(got.loss) - want) <= atol_for("float64"), framework


# -- config validation ------------------------------------------------------------------------


def test_only_a_decoder_only_model_may_have_no_pad():
    decoder = preset("tiny_decoder_only")
    vocab = decoder.tgt_vocab_size
    assert decoder.replace(pad_id=vocab).virtual_pad and not decoder.virtual_pad
    with pytest.raises(ConfigError) as refused:
        preset("tiny").replace(pad_id=vocab)  # an encoder-decoder masks its padding by pad_id
    assert "pad_id = tgt_vocab_size (no pad token) is for a decoder-only model only" in str(
        refused.value
    )
    encoder = preset("tiny_encoder_only")
    with pytest.raises(ConfigError, match="pad_id: 48 is outside the source vocabulary"):
        encoder.replace(pad_id=encoder.src_vocab_size)
    for changes, named in (
        ({"pad_id": vocab + 1}, f"pad_id: {vocab + 1} is outside the target vocabulary"),
        ({"pad_id": vocab, "bos_id": vocab}, f"bos_id: {vocab} is outside the target vocabulary"),
        ({"pad_id": vocab, "eos_id": vocab}, f"eos_id: {vocab} is outside the target vocabulary"),
    ):
        with pytest.raises(ConfigError, match=named):
            decoder.replace(**changes)


# -- what --config and config.json say --------------------------------------------------------


def test_a_pad_id_given_in_config_is_honoured(imported, tmp_path):
    """--config pad_id 60: the user names a pad, and every key holding it is masked, as
    transformers masks it when its attention_mask says so (and not otherwise)."""
    _, double, folder, _, _ = imported("llama")
    given = tmp_path / "given.json"
    given.write_text(json.dumps({"pad_id": 60}))
    out = tmp_path / "pad60.safetensors"
    assert main(["convert", str(folder), str(out), "--config", str(given), "--no-verify"]) == 0
    wf = load_weights(out)
    assert wf.config.pad_id == 60 and not wf.config.virtual_pad
    tokens = np.array([[1, 5, 60, 17, 42, 9]])
    got = reference.forward(wf.tensors, wf.config, None, tokens).logits
    mask = (tokens != 60).astype(np.int64)
    with torch.no_grad(), hf_float64("llama"):
        ids = torch.as_tensor(tokens)
        masked = double(input_ids=ids, attention_mask=torch.as_tensor(mask)).logits.numpy()
        unmasked = double(input_ids=ids).logits.numpy()
    assert np.abs(got - masked)[0, :2].max() <= F64_BOUND  # before the pad: nothing differs
    assert np.abs(got - masked)[0, 3:].max() <= F64_BOUND
    assert np.abs(got - unmasked)[0, 3:].max() > 0.01


def test_a_pad_token_id_in_config_json_is_said_and_not_masked(imported, tmp_path, capsys):
    """A GPT-2 folder whose config.json names pad_token_id 95: transformers masks nothing by
    id, so the import has no pad either (pad_id 97), says so, and a prompt holding 95 gives
    transformers' logits."""
    _, double, folder, _, _ = imported("gpt2")
    other = shutil.copytree(folder, tmp_path / "named")
    hf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**hf, "pad_token_id": 95}))
    out = tmp_path / "named.safetensors"
    code, printed, err = run_cli(capsys, "convert", other, out, "--from", "gpt2")
    assert code == 0, err
    assert "note: pad_id: config.json's pad_token_id 95 is not masked" in printed
    wf = load_weights(out)
    assert wf.config.pad_id == 97 and wf.config.virtual_pad
    tokens = np.array([[29, 95, 63, 95, 7]])
    got = reference.forward(wf.tensors, wf.config, None, tokens).logits
    with torch.no_grad():
        want = double(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(got - want).max() <= F64_BOUND


def test_a_table_import_without_pad_id_has_no_pad(tmp_path):
    """--from mingpt with --config giving the heads, BOS and EOS but no pad_id: the virtual pad;
    minGPT's own forward on ids that hold every id of the vocabulary is the oracle's."""
    from parity_tests.porting.test_gpt import make_case

    model, fx_forward, save = make_case("mingpt")
    (tmp_path / "given.json").write_text(json.dumps({"num_heads": 2, "bos_id": 4, "eos_id": 5}))
    out = tmp_path / "m.safetensors"
    src = save(model, tmp_path)
    args = ["convert", "--from", "mingpt", str(src), str(out), "--config"]
    assert main([*args, str(tmp_path / "given.json")]) == 0
    wf = load_weights(out)
    assert wf.config.pad_id == wf.config.tgt_vocab_size and wf.config.virtual_pad
    tokens = (np.arange(32) % wf.config.tgt_vocab_size).reshape(2, 16)  # max_len 16
    got = reference.forward(wf.tensors, wf.config, None, tokens).logits
    assert np.abs(got - fx_forward(model.double(), tokens)).max() <= atol_for("float32")


def test_the_llama_export_writes_no_pad_token(imported, tmp_path):
    """--to llama of a model without a pad token writes pad_token_id null (the folder it came
    from had none), and the folder reads back to the same config."""
    _, _, _, wf, path = imported("llama")
    folder = tmp_path / "out"
    args = ["convert", str(path), str(folder), "--to", "llama", "--no-verify"]
    assert main(args) == 0
    for name in ("config.json", "generation_config.json"):
        assert json.loads((folder / name).read_text())["pad_token_id"] is None, name
    back = tmp_path / "back.safetensors"
    assert main(["convert", str(folder), str(back), "--no-verify"]) == 0
    assert load_weights(back).config == wf.config


def test_gpt2s_own_vocabulary_generates_transformers_tokens_through_id_50255(tmp_path):
    """The issue's case at GPT-2's own vocabulary (50257, <|endoftext|> 50256): the old rule made
    50255 the pad and masked it. A prompt holding it twice, converted by the CLI and generated
    through the public API, gives transformers' greedy tokens. The weights are N(0, 1), so that
    each float64 top-1 exceeds the top-2 by more than 4 * atol_for("float32") times the logits'
    size, and float32 takes every decision alike (the module's greedy argument)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import transformer_rosetta as tr

    config = GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=50257,
        n_positions=32,
        bos_token_id=50256,
        eos_token_id=50256,
        attn_implementation="eager",
    )
    torch.random.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 1.0)
    model.save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "gpt2.safetensors"
    assert main(["convert", str(tmp_path / "gpt2"), str(out), "--from", "gpt2"]) == 0
    prompt = [50255, 7, 50255, 311]
    with torch.no_grad():
        want = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=50256
        )[0, len(prompt) :].tolist()
        double = copy.deepcopy(model).double()
        path = torch.tensor([prompt + want])
        logits = double(path).logits[0, len(prompt) - 1 : -1]
    top2 = torch.topk(torch.log_softmax(logits, -1), 2).values
    # float32's error grows with the logits' size (docs/PARITY.md, "The verification bound").
    scale = max(1.0, float(logits.abs().max()))
    assert float((top2[:, 0] - top2[:, 1]).min()) > 4 * atol_for("float32") * scale
    loaded = tr.load(out, framework="torch")
    assert loaded.config.pad_id == 50257
    assert loaded.generate(prompt, max_new_tokens=8) == want
