"""`rosetta embed` and transformer_rosetta.app.embedding: sentence embeddings in every
framework equal to sentence-transformers' `encode`, i.e. transformers' BertModel on the
tokenizer's ids, mean-pooled over the attention mask and L2-normalised (the model's Transformer,
Pooling and Normalize modules; the reference is computed here by hand, as in porting/test_bert.py).

The reference tokenizes with AutoTokenizer.from_pretrained(folder) as sentence-transformers calls
it (padding, truncation to max_seq_length); ours uses the tokenizer the converted file carries,
and batches its own way (longest first, a batch size that splits the texts), so that the
comparison also covers tokenizing, truncating, padding, batching and putting rows back in order.

Bounds, on unit-length embeddings (max |difference| over all components):
- float32 (torch, Keras, Flax) against BertModel in float64: 1e-5, the project's float32 tier. Derivation: porting/test_bert.py derives 2e-6 (FLOAT32_BOUND) for any float32
  run of this model against float64: 13 rounding stages of inner products at most 1536 long,
  rounding errors adding in quadrature (sqrt(13 * 1536) * 2^-24 = 8.4e-6 relative, in 2-norm), the
  mean and the L2 norm not growing it, spread over 384 components (largest ~0.18 of the 2-norm).
  Sequences here are up to 256 tokens, not 30: the attention's inner products over keys are then
  256 long, still below the 1536 of the feed-forward that sets the count, and the mean over more
  tokens averages errors rather than adding them; so 2e-6 still holds, and 1e-5 leaves 5x for an
  unlucky CPU kernel while still catching a wrong LayerNorm eps (8.9e-6 on MiniLM, derived in
  porting/test_bert.py: close, so that check stays there) and anything coarser (a wrong pad mask
  or truncation moves an embedding by more than 1e-2).
- the numpy oracle (float64) against BertModel in float64: the float64 tier, 1e-10.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from parity_tests.bert_reference import sentence_transformers_reference
from parity_tests.conftest import backend_or_skip, import_or_skip
from parity_tests.paths import DATA
from transformer_rosetta.adapter.backends import FRAMEWORKS
from transformer_rosetta.app.embedding import EmbedError, embed_ids, embed_texts
from transformer_rosetta.cli import main
from transformer_rosetta.errors import InputError
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.tolerances import ATOL
from transformer_rosetta.weights.format import load_weights, save_weights
from transformer_rosetta.weights.init import init_weights
from transformer_rosetta.weights.tokenizer import read_tokenizer

TINY_BERT = DATA / "tiny-bert"
TINY_EXPECTED = DATA / "tiny-bert-expected.json"
MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's sentence_bert_config.json
BOUND = {"float32": ATOL["float32"], "float64": ATOL["float64"]}  # 1e-5 and 1e-10 (derived above)
DTYPES = {"numpy": "float64", "torch": "float32", "tf": "float32", "jax": "float32"}
# numpy in pairs: the float64 oracle pads the long text's batch-mates to 256 tokens, at a cost.
BATCH_SIZES = {"numpy": 2, "torch": 4, "tf": 32, "jax": 32}

TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "Héllo Wörld! Ça va? naïve café",
    "東京は日本の首都です。",
    "I ❤️ pizza 🍕 and emoji 👩‍👩‍👧",
    "Punctuation: (brackets), [square]; 'quotes' -- dashes... ?!",
    "Yes.",
    "",
    "The committee postponed its decision until the next quarterly meeting.",
    " ".join(f"sentence {i} is about quantum computing and the weather" for i in range(40)),
]
LONG = len(TEXTS) - 1  # over 256 tokens: cut at max_seq_length


@pytest.fixture(scope="module")
def transformers_module():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is read from local folders
    import_or_skip("torch", "transformers' BertModel needs torch")
    return import_or_skip(
        "transformers", "transformers is a test-only dependency (pip install transformers)"
    )


@pytest.fixture(scope="module")
def minilm(minilm_dir, tmp_path_factory) -> Path:
    """The folder converted once (verification skipped: porting/test_bert.py checks the weights)."""
    out = tmp_path_factory.mktemp("minilm") / "minilm.safetensors"
    assert main(["convert", "--from", "bert", "--no-verify", str(minilm_dir), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def reference(minilm_dir, transformers_module) -> np.ndarray:
    """One text at a time (sentence-transformers with batch_size 1: a row does not depend on its
    batch), so that the short texts are not padded to the long one's 256 tokens in float64."""
    return np.concatenate(
        [
            sentence_transformers_reference(transformers_module, minilm_dir, [t], MAX_SEQ_LENGTH)
            for t in TEXTS
        ]
    )


def gap(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def run_cli(argv: list[str], monkeypatch, stdin: str | None = None) -> int:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8"))))
    return main(argv)


# -- the real MiniLM, every framework -------------------------------------------------------------


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_embed_texts_matches_sentence_transformers(name, minilm, reference):
    """embed_texts on the stored tokenizer; numpy and torch in several batches (longest first),
    the compiling frameworks in one (each new shape costs them a compilation)."""
    dtype = DTYPES[name]
    wf = load_weights(minilm)
    model = backend_or_skip(name).build(wf.config, wf.tensors, dtype=dtype)
    got = embed_texts(model, read_tokenizer(minilm), TEXTS, batch_size=BATCH_SIZES[name])
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.dtype(dtype)
    assert gap(got, reference) <= BOUND[dtype]  # measured: see docs/PORTING.md
    assert gap(np.linalg.norm(got, axis=1), 1.0) <= BOUND[dtype]
    if BATCH_SIZES[name] < len(TEXTS):  # a text's row does not depend on its batch
        alone = embed_texts(model, read_tokenizer(minilm), TEXTS[:1])
        assert gap(alone[0], got[0]) <= BOUND[dtype]


# How each framework's CLI run feeds and returns: (texts on stdin?, --out or --json).
CLI_MODES = {
    "numpy": ("stdin", "json"),
    "torch": ("args", "json"),
    "tf": ("stdin", "out"),
    "jax": ("args", "out"),  # the README's command
}


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_cli_matches_sentence_transformers(name, minilm, reference, tmp_path, capsys, monkeypatch):
    backend_or_skip(name)
    feed, give = CLI_MODES[name]
    argv = ["embed", "--weights", str(minilm), "--framework", name]
    out = tmp_path / "emb.npy"
    argv += ["--out", str(out)] if give == "out" else ["--json"]
    texts = TEXTS[:LONG]  # the long text's truncation is checked through embed_texts above
    if feed == "args":
        argv += texts
    code = run_cli(argv, monkeypatch, "".join(f"{t}\n" for t in texts) if feed == "stdin" else None)
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    if give == "out":
        got = np.load(out)
        assert got.dtype == np.float32  # float32 frameworks write float32
        assert f"wrote {out}: {len(texts)} embeddings of 384" in printed
    else:
        report = json.loads(printed)
        assert (report["framework"], report["dim"], report["count"]) == (name, 384, len(texts))
        got = np.array(report["embeddings"])
    dtype = DTYPES[name]
    assert got.shape == (len(texts), 384)
    assert gap(got, reference[: len(texts)]) <= BOUND[dtype]


def test_cli_default_output_and_numpy_npy(minilm, reference, tmp_path, capsys):
    """One line per text (index, dimension, first values, the text); numpy's .npy is float64."""
    assert main(["embed", "--weights", str(minilm), "--framework", "numpy", *TEXTS[:2]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("1: dim 384 [")
    shown = [float(v) for v in lines[0].split("[")[1].split("...")[0].split()]
    # printed to 4 decimals: within half a unit of the last place of BertModel's values
    assert len(shown) == 4 and gap(shown, reference[0, :4]) <= 5e-5 + BOUND["float64"]
    assert lines[0].endswith('"A man is eating food."')
    out = tmp_path / "e.npy"
    argv = ["embed", "--weights", str(minilm), "--framework", "numpy", "--out", str(out)]
    assert main([*argv, *TEXTS[:3]]) == 0
    got = np.load(out)
    assert got.dtype == np.float64 and gap(got, reference[:3]) <= BOUND["float64"]


# -- the committed tiny BERT: the wheel's smoke commands --------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """`rosetta convert parity_tests/data/tiny-bert t.safetensors --from bert`, as a user types
    it (verified against BertModel where transformers is installed, skipped where not)."""
    out = tmp_path_factory.mktemp("tiny") / "t.safetensors"
    assert main(["convert", str(TINY_BERT), str(out), "--from", "bert"]) == 0
    return out


@pytest.fixture(scope="module")
def tiny_expected() -> dict:
    return json.loads(TINY_EXPECTED.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_tiny_bert_smoke(name, tiny, tiny_expected, capsys):
    """The smoke test's command: the stored BertModel embeddings, no transformers needed."""
    backend_or_skip(name)
    texts = tiny_expected["texts"]
    argv = ["embed", "--weights", str(tiny), "--framework", name, "--json", *texts]
    assert main(argv) == 0
    got = np.array(json.loads(capsys.readouterr().out)["embeddings"])
    assert got.shape == (len(texts), 32)
    assert gap(got, tiny_expected["embeddings"]) <= BOUND[DTYPES[name]]


def test_tiny_bert_expected_is_transformers(tiny_expected, transformers_module):
    """The stored numbers are BertModel's, recomputed here (float64: within the float64 tier)."""
    texts = tiny_expected["texts"]
    again = sentence_transformers_reference(
        transformers_module, TINY_BERT, texts, tiny_expected["max_seq_length"]
    )
    assert gap(again, tiny_expected["embeddings"]) <= BOUND["float64"]
    # The longest text is cut at max_seq_length: its embedding is that of the cut ids.
    tokenizer = transformers_module.AutoTokenizer.from_pretrained(TINY_BERT)
    assert len(tokenizer(texts[-1])["input_ids"]) > tiny_expected["max_seq_length"]


def test_ids_input_equals_text_input(tiny, tmp_path, capsys):
    """--ids: the stored tokenizer's ids, padded with the pad id, give the same rows."""
    tokenizer = read_tokenizer(tiny)
    texts = ["The cat sat on the mat.", "Hello, world", "a dog"]
    rows = [e.ids for e in tokenizer.encode_batch(texts)]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int64)  # [PAD] is 0
    for n, r in enumerate(rows):
        ids[n, : len(r)] = r
    np.save(tmp_path / "ids.npy", ids)
    base = ["embed", "--weights", str(tiny), "--framework", "numpy", "--json"]
    assert main([*base, "--ids", str(tmp_path / "ids.npy")]) == 0
    from_ids = np.array(json.loads(capsys.readouterr().out)["embeddings"])
    assert main([*base, *texts]) == 0
    from_texts = np.array(json.loads(capsys.readouterr().out)["embeddings"])
    assert gap(from_ids, from_texts) <= BOUND["float64"]


# -- refusals: one line, exit 2, nothing written ----------------------------------------------------


def _plain_copy(tiny: Path, folder: Path) -> Path:
    """The same model without its tokenizer (written by the API, which stores none)."""
    wf = load_weights(tiny)
    out = folder / "plain.safetensors"
    save_weights(out, wf.tensors, wf.config, producer="test")
    return out


def _preset_file(folder: Path, name: str, **changes) -> Path:
    config = preset(name).replace(**changes)
    out = folder / f"{name}.safetensors"
    save_weights(out, init_weights(config, seed=0), config, producer="test")
    return out


REFUSALS = {
    "no tokenizer": (
        lambda tiny, d: ["--weights", str(_plain_copy(tiny, d)), "x"],
        None,
        "carries no tokenizer: convert the model again from its source folder",
    ),
    "an encoder-decoder": (
        lambda tiny, d: ["--weights", str(_preset_file(d, "tiny")), "x"],
        None,
        "an encoder-decoder model gives no sentence embedding",
    ),
    "a decoder-only model": (
        lambda tiny, d: ["--weights", str(_preset_file(d, "tiny_decoder_only")), "x"],
        None,
        "a decoder-only model gives no sentence embedding",
    ),
    "an encoder that does not pool": (
        lambda tiny, d: [
            "--weights",
            str(_preset_file(d, "tiny_encoder_only", pooling="none", pooled_l2_norm=False)),
            "x",
        ],
        None,
        "does not pool (config pooling none)",
    ),
    "empty stdin": (lambda tiny, d: ["--weights", str(tiny)], "", "standard input is empty"),
    "stdin not UTF-8": (
        lambda tiny, d: ["--weights", str(tiny), "-"],
        None,  # set below: bytes
        "standard input is not UTF-8 text",
    ),
    "texts and --ids": (
        lambda tiny, d: ["--weights", str(tiny), "--ids", str(d / "ids.npy"), "x"],
        None,
        "give TEXT arguments (or stdin) or --ids, not both",
    ),
    "'-' among texts": (
        lambda tiny, d: ["--weights", str(tiny), "x", "-"],
        None,
        "'-' (read standard input) cannot be mixed",
    ),
    "the pad token in a text": (
        lambda tiny, d: ["--weights", str(tiny), "fine", "a [PAD] inside"],
        None,
        "embed: text 1 holds the pad token (id 0)",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_in_one_line(case, tiny, tmp_path, capsys, monkeypatch):
    make_args, stdin, message = REFUSALS[case]
    out = tmp_path / "emb.npy"
    argv = ["embed", "--framework", "numpy", "--out", str(out), *make_args(tiny, tmp_path)]
    if case == "stdin not UTF-8":
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\xfe\n")))
    code = run_cli(argv, monkeypatch, stdin)
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_out_exists_without_force(tiny, tmp_path, capsys):
    out = tmp_path / "emb.npy"
    out.write_bytes(b"keep me")
    argv = ["embed", "--weights", str(tiny), "--framework", "numpy", "--out", str(out), "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "exists; pass --force to overwrite it" in err and len(err.splitlines()) == 1
    assert out.read_bytes() == b"keep me"
    assert main([*argv, "--force"]) == 0
    assert np.load(out).shape == (1, 32)


def test_api_refusals(tiny, tmp_path):
    """The library functions refuse by name too (RosettaError subclasses, one line)."""
    numpy_backend = backend_or_skip("numpy")
    wf = load_weights(tiny)
    model = numpy_backend.build(wf.config, wf.tensors, dtype="float64")
    with pytest.raises(InputError, match="row 1 holds only the pad id 0"):
        embed_ids(model, np.array([[2, 7, 3], [0, 0, 0]]))
    assert embed_texts(model, read_tokenizer(tiny), []).shape == (0, 32)
    config = preset("tiny")
    other = numpy_backend.build(config, init_weights(config, seed=0), dtype="float64")
    with pytest.raises(EmbedError, match="an encoder-decoder model gives no sentence embedding"):
        embed_texts(other, read_tokenizer(tiny), ["x"])
