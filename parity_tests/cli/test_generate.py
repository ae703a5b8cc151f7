"""`rosetta generate` on an imported GPT-2 (transformers' GPT2LMHeadModel, random weights, saved
with save_pretrained in shards and converted by the CLI): greedy ids equal transformers'
`generate(do_sample=False)` in numpy, torch, tf and jax, cached and uncached; beam search and
seeded sampling give the same tokens in every framework; the folder's config.json is read and
what the spec cannot express is refused by name; bad input is one line and exit 2.

Bounds. Each framework's float32 logits are within atol_for("float32") = 1e-5 of the float64
truth on this tiny model (parity_tests/porting/test_gpt.py measures ~1e-6), and so are
transformers' float32 ones. A log-softmax value then moves by at most 2 * atol, so a greedy
decision whose float64 top-1 minus top-2 log-probability exceeds 4 * atol is taken alike by every
float32 computation (parity_tests/decoding/test_parity.py's argument): the test asserts that margin at
every step before comparing tokens. Sampling: after temperature T the logits move by atol / T,
each probability by at most (exp(2 atol / T) - 1) p < 2.1 atol / T * p, so every CDF value, and
the top-p cumulative sums, by less than 2.1 atol / T; a draw (or a top-p cut) farther than
4.2 atol / T from every boundary is taken alike (asserted on the float64 path first). Beam search
runs in float64 in every framework (logits within ~1e-14 of each other, seeded weights: the same
scores on every CPU), where no decision is that close.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip, import_or_skip
from transformer_rosetta.adapter.backends import FRAMEWORKS
from transformer_rosetta.app.generation import _sample_seed, generate_ids
from transformer_rosetta.decoding.sampling import sample_search
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights

VOCAB = 97  # <|endoftext|> is the last id, as GPT-2's 50256 is
EOT = VOCAB - 1
N_POSITIONS = 64
MAX_NEW = 12
# Two of one length and one of another: generate_ids decodes one length group at a time.
PROMPTS = [[5, 17, 42], [60, 3, 88], [73, 37, 31, 85]]  # the third ends at EOS
UNCACHED = (0, 1)  # the prompts decoded without the cache (one length group)
BEAM = {"strategy": "beam", "beam": 3, "max_new_tokens": 6}
SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
SEED = 5  # every draw and cut of its paths is >= 5x the bound from a boundary
WEIGHT_SEED = 12
WORDS = [f"w{i}" for i in range(EOT)]  # the folder's WordLevel tokenizer: "w5" is id 5


def run_cli(capsys, *args: object) -> tuple[int, str, str]:
    from transformer_rosetta.cli import main

    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def gpt2_model():
    """A GPT2LMHeadModel with every parameter drawn (parity_tests/fixtures/draws.py, seeded), so
    that its greedy continuations vary; eager attention, float32, eval mode."""
    torch = import_or_skip("torch", "torch is needed to build the GPT-2 fixture")
    transformers = import_or_skip("transformers", "transformers builds the GPT-2 fixture")
    from parity_tests.fixtures.draws import draw

    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=N_POSITIONS,
        bos_token_id=EOT,
        eos_token_id=EOT,
        attn_implementation="eager",
    )
    torch.random.manual_seed(WEIGHT_SEED)
    model = transformers.GPT2LMHeadModel(config)
    rng = np.random.default_rng(WEIGHT_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith(("wte.weight", "wpe.weight")):
                value = draw(rng, "embedding", shape, 32)
            elif ".ln_" in name and name.endswith(".weight"):
                value = draw(rng, "gain", shape)
            elif name.endswith(".weight"):
                value = draw(rng, "kernel", shape, fans=shape)
            else:
                value = draw(rng, "bias", shape)
            p.copy_(torch.from_numpy(value).to(p.dtype))
    return model.eval()


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json: a WordLevel vocabulary "w0".."w95" and <|endoftext|>, split on spaces."""
    tokenizers = import_or_skip("tokenizers", "tokenizers reads the folder's tokenizer")
    vocab = {**{w: i for i, w in enumerate(WORDS)}, "<|endoftext|>": EOT}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(the transformers model, its save_pretrained folder (sharded, with a tokenizer), the
    converted .safetensors), once per module."""
    backend_or_skip("torch")
    model = gpt2_model()
    root = tmp_path_factory.mktemp("gpt2")
    folder = root / "folder"
    model.save_pretrained(folder, max_shard_size="20KB")
    write_tokenizer(folder)
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and (folder / "model.safetensors.index.json").is_file()
    out = root / "gpt2.safetensors"
    from transformer_rosetta.cli import main

    assert main(["convert", str(folder), str(out), "--from", "gpt2"]) == 0
    return model, folder, out


@pytest.fixture(scope="module")
def oracle(gpt2):
    """Per prompt, transformers' greedy new tokens (float32, as users run it), after asserting
    that the float64 model's margin at every decision exceeds 4 * atol (module docstring)."""
    import torch

    model, _, out = gpt2
    config = load_weights(out).config
    bound = 4 * atol_for("float32", config)
    double = copy.deepcopy(model).double()
    wanted = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                pad_token_id=EOT,
            )[0, len(prompt) :].tolist()
            logits = double(torch.tensor([prompt + generated])).logits[0].numpy()
        steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
        log_probs = steps - np.log(np.exp(steps - steps.max(-1, keepdims=True)).sum(-1))[:, None]
        top2 = np.sort(log_probs, axis=-1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
        assert margin > bound, f"prompt {prompt}: a greedy near-tie ({margin:.3g} <= {bound:.3g})"
        assert config.pad_id not in prompt + generated  # the spec masks pad keys; GPT-2 does not
        wanted.append(generated)
    assert len({tuple(w) for w in wanted}) == len(wanted), "the continuations should differ"
    return wanted


# -- the import ------------------------------------------------------------------------------------


def test_the_config_comes_from_config_json(gpt2):
    _, folder, out = gpt2
    wf = load_weights(out)
    c = wf.config
    assert c.kind == "decoder_only"
    assert (c.tgt_vocab_size, c.d_model, c.num_heads, c.num_decoder_layers) == (VOCAB, 32, 4, 2)
    assert (c.d_ff, c.max_len, c.activation, c.layer_norm_eps) == (128, 64, "gelu_tanh", 1e-5)
    assert (c.bos_id, c.eos_id, c.pad_id) == (EOT, EOT, VOCAB)  # no pad token: the virtual pad
    from transformer_rosetta.porting.convert import infer_source_kind

    assert infer_source_kind(folder) == "gpt2"


def test_the_folders_tokenizer_travels_with_the_weights(gpt2, capsys):
    _, _, out = gpt2
    code, text_out, _ = run_cli(
        capsys,
        "generate",
        "--weights",
        out,
        "--text",
        "w5 w17 w42",
        "--max-new-tokens",
        4,
        "--json",
    )
    assert code == 0
    by_text = json.loads(text_out)
    code, ids_out, _ = run_cli(
        capsys, "generate", "--weights", out, "--ids", "5,17,42", "--max-new-tokens", 4, "--json"
    )
    by_ids = json.loads(ids_out)
    assert by_text["ids"] == by_ids["ids"]
    words = [WORDS[i] for i in by_ids["ids"] if i != EOT]
    assert by_text["text"] == " ".join(words)


# -- greedy: transformers' tokens -----------------------------------------------------------------


# jax compiles each uncached prefix length anew: ~25 s on 2 cores, so that case is slow.
GREEDY_CASES = [
    pytest.param(
        framework,
        cached,
        id=f"{framework}-{'cached' if cached else 'uncached'}",
        marks=[pytest.mark.slow] if (framework, cached) == ("jax", False) else [],
    )
    for framework in FRAMEWORKS
    for cached in (True, False)
]


@pytest.mark.parametrize(("framework", "cached"), GREEDY_CASES)
def test_greedy_equals_transformers_generate(gpt2, oracle, capsys, framework, cached):
    backend_or_skip(framework)
    _, _, out = gpt2
    # Uncached, every prefix length is a new shape, which tf and jax compile anew (~1 s each):
    # one length group (the two prompts of 3 tokens) keeps that to 12 lengths.
    chosen = range(len(PROMPTS)) if cached else UNCACHED
    prompts = [arg for i in chosen for arg in ("--ids", ",".join(map(str, PROMPTS[i])))]
    cache = [] if cached else ["--no-cache"]
    args = ("--framework", framework, "--max-new-tokens", MAX_NEW, "--json", *cache)
    code, stdout, err = run_cli(capsys, "generate", "--weights", out, *prompts, *args)
    assert code == 0, err
    got = [row["ids"] for row in json.loads(stdout)]
    assert got == [oracle[i] for i in chosen]


def test_one_prompt_prints_one_object(gpt2, oracle, capsys):
    _, _, out = gpt2
    args = ("--framework", "numpy", "--ids", "5,17,42", "--max-new-tokens", MAX_NEW)
    code, stdout, _ = run_cli(capsys, "generate", "--weights", out, *args, "--json")
    assert code == 0 and json.loads(stdout)["ids"] == oracle[0]
    code, stdout, _ = run_cli(capsys, "generate", "--weights", out, *args)
    assert stdout.splitlines()[0] == "ids: " + " ".join(map(str, oracle[0]))
    assert stdout.splitlines()[1].startswith("text: ")


# -- beam and sampling: the same tokens in every framework -------------------------------------


@pytest.fixture(scope="module")
def models(gpt2):
    """framework -> {dtype: built model}, built on first use."""
    _, _, out = gpt2
    wf = load_weights(out)
    built: dict[tuple[str, str], object] = {}

    def get(framework: str, dtype: str):
        if (framework, dtype) not in built:
            backend = backend_or_skip(framework)
            built[framework, dtype] = backend.build(wf.config, wf.tensors, dtype=dtype)
        return built[framework, dtype]

    return get


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_beam_gives_the_oracles_tokens(models, framework):
    prompts = [PROMPTS[i] for i in UNCACHED]  # one length group: fewer shapes to compile
    want = generate_ids(models("numpy", "float64"), prompts, **BEAM)
    got = generate_ids(models(framework, "float64"), prompts, **BEAM)
    assert got == want


class Recording:
    """A stepper factory that keeps every step's logits (float64) of the stepper it wraps."""

    def __init__(self, model) -> None:
        self.model, self.logits = model, []

    def __call__(self, src, beams, max_steps):
        inner = self.model.stepper(src, beams, max_steps)
        record = self.logits

        class Stepper:
            def step(self, tokens):
                logits = inner.step(tokens)
                record.append(np.asarray(logits, dtype=np.float64)[0])
                return logits

            def reorder(self, rows):  # pragma: no cover - sampling never reorders
                inner.reorder(rows)

        return Stepper()


def sampling_margins(logits: np.ndarray, u: float) -> float:
    """The smallest distance of a decision of one sampling step to its boundary: the draw u to
    the CDF's steps and the top-p cut's cumulative sums to 1 - p (probabilities, which move by
    < 2.1 atol / T), and the gap between the k-th and k+1-th scaled logits (each moves by atol /
    T). Each is compared with 4.2 atol / T: twice the most it can move."""
    from parity_tests.decoding.test_sampling import expected_distribution

    t, k, p = SAMPLING["temperature"], SAMPLING["top_k"], SAMPLING["top_p"]
    scaled = np.sort(logits / t)[::-1]
    top_k_gap = scaled[k - 1] - scaled[k]  # each moves by atol / T: 2 atol / T may swap them
    kept = np.exp(scaled[:k] - scaled[0])
    kept /= kept.sum()
    ascending = np.cumsum(kept[::-1])
    top_p_gap = np.abs(ascending - (1 - p)).min()
    cdf = np.cumsum(expected_distribution(logits, t, k, p))
    draw_gap = np.abs(cdf - u).min()
    return float(min(top_k_gap, top_p_gap, draw_gap))


@pytest.fixture(scope="module")
def sampled(models):
    """generate_ids' seeded samples in float64 (numpy), each prompt's path checked to be clear of
    every boundary by 4.2 atol / T (module docstring)."""
    oracle_model = models("numpy", "float64")
    bound = 4.2 * atol_for("float32", oracle_model.config) / SAMPLING["temperature"]
    want = generate_ids(
        oracle_model, PROMPTS, max_new_tokens=MAX_NEW, strategy="sample", seed=SEED, **SAMPLING
    )
    for index, prompt in enumerate(PROMPTS):
        recording = Recording(oracle_model)
        seed = _sample_seed(SEED, index)
        decoded = sample_search(
            recording,
            oracle_model.config,
            np.array([prompt]),
            extra_len=MAX_NEW,
            seed=seed,
            **SAMPLING,
        )
        got = decoded.tokens[0].tolist() + (
            [oracle_model.config.eos_id] if decoded.finished[0] else []
        )
        assert got == want[index]
        uniforms = np.random.default_rng(seed).random(len(recording.logits))
        margin = min(
            sampling_margins(l, u) for l, u in zip(recording.logits, uniforms, strict=True)
        )
        assert margin > bound, (
            f"prompt {prompt}: a draw near a boundary ({margin:.3g} <= {bound:.3g})"
        )
    return want


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_sampling_gives_the_same_tokens_in_every_framework(models, sampled, framework):
    got = generate_ids(
        models(framework, "float32"),
        PROMPTS,
        max_new_tokens=MAX_NEW,
        strategy="sample",
        seed=SEED,
        **SAMPLING,
    )
    assert got == sampled


def test_the_same_seed_samples_alike_and_another_differently(models, sampled):
    model = models("numpy", "float64")
    again = generate_ids(
        model, PROMPTS, max_new_tokens=MAX_NEW, strategy="sample", seed=SEED, **SAMPLING
    )
    other = generate_ids(
        model, PROMPTS, max_new_tokens=MAX_NEW, strategy="sample", seed=SEED + 1, **SAMPLING
    )
    assert again == sampled
    assert other != sampled


def test_sampling_through_the_cli(gpt2, sampled, capsys):
    _, _, out = gpt2
    prompts = [arg for p in PROMPTS for arg in ("--ids", ",".join(map(str, p)))]
    options = ("--temperature", 0.8, "--top-k", 40, "--top-p", 0.9, "--seed", SEED)
    code, stdout, err = run_cli(
        capsys, "generate", "--weights", out, "--framework", "numpy", *prompts,
        "--max-new-tokens", MAX_NEW, "--sample", *options, "--json",
    )  # fmt: skip
    assert code == 0, err
    assert [row["ids"] for row in json.loads(stdout)] == sampled


# -- what is refused ------------------------------------------------------------------------------


def edited_folder(gpt2, tmp_path: Path, **changes) -> Path:
    _, folder, _ = gpt2
    copy_ = tmp_path / "folder"
    shutil.copytree(folder, copy_)
    config = json.loads((copy_ / "config.json").read_text())
    config.update(changes)
    (copy_ / "config.json").write_text(json.dumps(config))
    return copy_


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"activation_function": "swish"}, "activation_function"),
        ({"n_head": "4"}, "n_head"),
        ({"model_type": "gpt_neo"}, "model_type"),
        ({"add_cross_attention": True}, "add_cross_attention"),
        ({"eos_token_id": 50256}, "eos_token_id"),
        ({"n_embd": 48}, "wte.weight"),  # the shapes then disagree: the tensor is named
    ],
)
def test_config_json_values_are_refused_by_name(gpt2, tmp_path, capsys, changes, named):
    folder = edited_folder(gpt2, tmp_path, **changes)
    out = tmp_path / "out.safetensors"
    code, _, err = run_cli(capsys, "convert", folder, out, "--from", "gpt2")
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_pad_id_may_be_given_and_other_fields_must_agree(gpt2, tmp_path, capsys):
    _, folder, _ = gpt2
    given = tmp_path / "given.json"
    given.write_text(json.dumps({"pad_id": 0}))
    out = tmp_path / "out.safetensors"
    code, _, err = run_cli(capsys, "convert", folder, out, "--from", "gpt2", "--config", given)
    assert code == 0, err
    assert load_weights(out).config.pad_id == 0
    given.write_text(json.dumps({"d_model": 64}))
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "b.safetensors", "--config", given)
    assert code == 2 and "d_model" in err and "n_embd" in err, err


def test_a_folder_without_config_json_or_with_a_missing_shard(gpt2, tmp_path, capsys):
    folder = edited_folder(gpt2, tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "a.safetensors", "--from", "gpt2")
    assert code == 2 and shard.name in err and len(err.strip().splitlines()) == 1, err
    (folder / "config.json").unlink()
    for kind in (("--from", "gpt2"), ()):
        code, _, err = run_cli(capsys, "convert", folder, tmp_path / "b.safetensors", *kind)
        assert code == 2 and "config.json" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--ids", "5,x"), "--ids"),
        (("--ids", "5,500"), "token id 500"),
        (("--ids", ",".join(["5"] * 60)), "positions"),
        (("--ids", "5", "--max-new-tokens", "0"), "--max-new-tokens"),
        (("--ids", "5", "--temperature", "0.5"), "--temperature"),
        (("--ids", "5", "--sample", "--temperature", "0"), "temperature"),
        (("--ids", "5", "--sample", "--top-p", "1.5"), "top_p"),
        (("--ids", "5", "--sample", "--beam", "2"), "--beam"),
        (("--ids", "5", "--text", "w5"), "--text"),
        (("--ids", "5", "--framework", "mxnet"), "--framework"),
    ],
)
def test_bad_cli_inputs_are_one_line_and_exit_2(gpt2, capsys, args, named):
    _, _, out = gpt2
    if "--max-new-tokens" not in args:
        args = (*args, "--max-new-tokens", "12")
    code, stdout, err = run_cli(capsys, "generate", "--weights", out, *args)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert stdout == ""


def test_text_without_a_tokenizer_and_a_model_that_is_not_decoder_only(gpt2, tmp_path, capsys):
    from transformer_rosetta.spec.config import preset
    from transformer_rosetta.weights.format import save_weights
    from transformer_rosetta.weights.init import init_weights

    wf = load_weights(gpt2[2])
    bare = tmp_path / "bare.safetensors"
    save_weights(bare, wf.tensors, wf.config, producer="test")
    code, _, err = run_cli(
        capsys, "generate", "--weights", bare, "--text", "w5", "--max-new-tokens", 2
    )
    assert code == 2 and "no tokenizer" in err and len(err.strip().splitlines()) == 1, err
    config = preset("tiny")
    seq2seq = tmp_path / "seq2seq.safetensors"
    save_weights(seq2seq, init_weights(config, seed=0), config, producer="test")
    code, _, err = run_cli(
        capsys, "generate", "--weights", seq2seq, "--ids", "5", "--max-new-tokens", 2
    )
    assert code == 2 and "encoder-decoder" in err and len(err.strip().splitlines()) == 1, err


def test_stdin_lines_are_prompts(gpt2, oracle, capsys, monkeypatch):
    """Two text lines (a blank one skipped) are the first two prompts: greedy's first 4 tokens."""
    import io

    _, _, out = gpt2
    monkeypatch.setattr("sys.stdin", io.StringIO("w5 w17 w42\n\nw60 w3 w88\n"))
    code, stdout, err = run_cli(
        capsys,
        "generate",
        "--weights",
        out,
        "--framework",
        "numpy",
        "--max-new-tokens",
        4,
        "--json",
    )
    assert code == 0, err
    rows = json.loads(stdout)
    assert [r["ids"] for r in rows] == [oracle[0][:4], oracle[1][:4]]
