"""The one reader of a Hugging Face folder (common/porting/hf_folder.py), for Marian, BERT and
GPT-2 alike: the weights in shards (an index and its shard files, as save_pretrained writes a
large model) are read for every kind, bit-exact to the whole file, and a folder's sha256 (the
provenance of `rosetta convert`) covers every file the import reads.

The BERT folder is the committed tiny one (parity_tests/data/tiny-bert), split here into shards
the way save_pretrained(max_shard_size=...) splits it; where transformers is installed, its own
save_pretrained writes the shards too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from parity_tests.conftest import import_or_skip
from parity_tests.paths import DATA
from transformer_rosetta.cli import main
from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.porting import bert, marian
from transformer_rosetta.porting.hf_folder import digest_files
from transformer_rosetta.porting.marian_export import write_marian_dir
from transformer_rosetta.porting.verify import sha256_of
from transformer_rosetta.spec.names import canonical_specs

TINY_BERT = DATA / "tiny-bert"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"


def reshard(src: Path, dst: Path, shards: int = 3, *, torch_files: bool = False) -> Path:
    """A copy of the folder `src` at `dst` whose model.safetensors is split into `shards` files
    with their index, named as save_pretrained names them (`torch_files`: pytorch_model.bin
    shards, each a torch.save of a state dict)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    weight_map = {}
    for i, group in enumerate(np.array_split(np.array(sorted(tensors)), shards), 1):
        part = {str(name): tensors[str(name)] for name in group}
        if torch_files:
            import torch

            name = f"pytorch_model-{i:05d}-of-{shards:05d}.bin"
            torch.save({k: torch.from_numpy(v) for k, v in part.items()}, dst / name)
        else:
            name = f"model-{i:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(dst / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    index = TORCH_INDEX if torch_files else SAFETENSORS_INDEX
    (dst / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def assert_same_import(a: bert.BertImport, b: bert.BertImport) -> None:
    assert a.config == b.config
    assert list(a.tensors) == list(b.tensors)
    for name, tensor in a.tensors.items():
        assert tensor.dtype == b.tensors[name].dtype
        np.testing.assert_array_equal(tensor, b.tensors[name], err_msg=name)


# -- shards, for every kind ---------------------------------------------------------------------


@pytest.mark.parametrize("torch_files", [False, True], ids=["safetensors", "pytorch_model.bin"])
def test_a_sharded_bert_folder_imports_as_the_whole_one(tmp_path, torch_files):
    if torch_files:
        import_or_skip("torch", "pytorch_model.bin shards are torch.save files")
    folder = reshard(TINY_BERT, tmp_path / "sharded", torch_files=torch_files)
    assert len(list(folder.glob("*-of-00003.*"))) == 3
    assert_same_import(bert.import_bert(folder), bert.import_bert(TINY_BERT))


def test_a_save_pretrained_sharded_bert_folder(tmp_path):
    """transformers' own shards: the tiny BERT saved again with a small max_shard_size imports
    to the same tensors, and `rosetta convert` verifies it against BertModel."""
    import_or_skip("torch", "transformers' BertModel needs torch")
    transformers = import_or_skip("transformers", "transformers is a test-only dependency")
    model = transformers.BertModel.from_pretrained(TINY_BERT, add_pooling_layer=False)
    folder = tmp_path / "saved"
    shutil.copytree(TINY_BERT, folder)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and (folder / SAFETENSORS_INDEX).is_file()
    assert_same_import(bert.import_bert(folder), bert.import_bert(TINY_BERT))
    out = tmp_path / "t.safetensors"
    assert main(["convert", str(folder), str(out), "--from", "bert", "--verify"]) == 0


def test_a_sharded_marian_folder_reads_as_the_whole_one(tmp_path):
    hf = {
        "model_type": "marian",
        "vocab_size": 13,
        "d_model": 8,
        "encoder_layers": 1,
        "decoder_layers": 2,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 16,
        "decoder_ffn_dim": 16,
        "max_position_embeddings": 12,
        "pad_token_id": 12,
        "decoder_start_token_id": 12,
        "eos_token_id": 0,
    }
    config = marian.marian_config(hf)
    rng = np.random.default_rng(0)
    tensors = {s.name: rng.normal(size=s.shape).astype(np.float32) for s in canonical_specs(config)}
    write_marian_dir(tmp_path / "whole", config, tensors)
    folder = reshard(tmp_path / "whole", tmp_path / "sharded")
    found_hf, found = marian.read_marian_dir(folder)
    assert marian.marian_config(found_hf) == config
    back = marian.marian_to_canonical(found, config)
    assert list(back) == list(tensors)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(back[name], tensor, err_msg=name)


def test_a_missing_shard_is_named_in_one_line(tmp_path, capsys):
    folder = reshard(TINY_BERT, tmp_path / "sharded")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightFileError, match=f"missing shard {shard.name}"):
        bert.import_bert(folder)
    out = tmp_path / "t.safetensors"
    assert main(["convert", str(folder), str(out), "--from", "bert", "--no-verify"]) == 2
    err = capsys.readouterr().err.strip()
    assert shard.name in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_a_shard_that_holds_other_tensors_than_its_index_says(tmp_path):
    folder = reshard(TINY_BERT, tmp_path / "sharded")
    index = json.loads((folder / SAFETENSORS_INDEX).read_text())
    moved = next(iter(index["weight_map"]))
    index["weight_map"][moved] = "model-00003-of-00003.safetensors"
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index))
    with pytest.raises(WeightFileError) as err:
        bert.import_bert(folder)
    assert f"model-00003-of-00003.safetensors: lacks {moved}" in str(err.value)
    assert "model-00001-of-00003.safetensors: holds" in str(err.value)


# -- what a folder's sha256 covers ----------------------------------------------------------------


def test_a_file_hashes_as_itself():
    path = TINY_BERT / "model.safetensors"
    assert sha256_of(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_folder_digest_covers_what_the_import_reads(tmp_path):
    folder = reshard(TINY_BERT, tmp_path / "sharded")
    names = [p.relative_to(folder).as_posix() for p in digest_files(folder)]
    assert names == sorted(names, key=lambda n: n.split("/"))
    assert {
        "config.json",
        SAFETENSORS_INDEX,
        *(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
        "modules.json",
        "1_Pooling/config.json",
        "vocab.txt",
        "tokenizer.json",
    } <= set(names)
    before = sha256_of(folder)
    assert sha256_of(shutil.copytree(folder, tmp_path / "copy")) == before  # deterministic
    # What the import does not read leaves it as it was.
    (folder / "tf_model.h5").write_bytes(b"other weights")
    (folder / "README.md").write_text("# a model card")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.json").write_text("{}")
    assert sha256_of(folder) == before
    # A byte of a shard, of config.json or of the tokenizer changes it, and so does a renamed file.
    for name in ("model-00002-of-00003.safetensors", "config.json", "vocab.txt"):
        path = folder / name
        data = path.read_bytes()
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        assert sha256_of(folder) != before, name
        path.write_bytes(data)
        assert sha256_of(folder) == before
    (folder / "tokenizer.json").rename(folder / "tokenizer2.json")
    assert sha256_of(folder) != before
    assert sha256_of(TINY_BERT) != before  # the whole file is not its shards


def test_convert_records_the_folder_digest(tmp_path, capsys):
    folder = reshard(TINY_BERT, tmp_path / "sharded")
    out = tmp_path / "t.safetensors"
    assert main(["convert", str(folder), str(out), "--from", "bert", "--no-verify"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert f"sha256 {sha256_of(folder)}" in capsys.readouterr().out
