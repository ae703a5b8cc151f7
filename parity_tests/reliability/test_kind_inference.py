"""A folder's kind comes from config.json's model_type: one that no importer reads is refused in
one line that names it, says what the spec lacks for a known family, and lists the model types
that are read (issue 41, class 6: a `gemma` folder used to be read as Marian and refused as "not
a Marian model"). The configs are transformers' own, saved as a user's folder holds them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING, AutoConfig  # noqa: E402

from parity_tests.cli.command_line import one_line_error, run  # noqa: E402
from transformer_rosetta.porting import hf_folder  # noqa: E402
from transformer_rosetta.porting.llama import ARCHITECTURES  # noqa: E402
from transformer_rosetta.porting.unread import READ_MODEL_TYPES, UNREAD  # noqa: E402


def _folder(tmp_path, model_type: str | None, **extra: object):
    folder = tmp_path / "model"
    folder.mkdir()
    if model_type is None or model_type not in CONFIG_MAPPING:
        data = {"hidden_size": 8, **extra}
        if model_type is not None:
            data["model_type"] = model_type
    else:
        data = {**AutoConfig.for_model(model_type).to_dict(), **extra}
    (folder / "config.json").write_text(json.dumps(data))
    (folder / "model.safetensors").write_bytes(b"")  # never reached: the refusal comes first
    return folder


def test_every_unread_model_type_is_transformers_own():
    """The table names model types as transformers spells them, or a folder would never match."""
    assert set(UNREAD) - set(CONFIG_MAPPING) == set()
    assert set(READ_MODEL_TYPES) <= set(CONFIG_MAPPING)
    assert not set(UNREAD) & set(READ_MODEL_TYPES)


def test_read_model_types_are_the_importers_own():
    """What inference says is read is what the importers read: the Llama family's model types and
    each Hugging Face model's."""
    from transformer_rosetta.porting.bert import BERT
    from transformer_rosetta.porting.gpt import GPT2_HF
    from transformer_rosetta.porting.marian import MARIAN

    expected = {t: "llama" for t in ARCHITECTURES} | {
        m.model_type: kind for m, kind in ((BERT, "bert"), (GPT2_HF, "gpt2"), (MARIAN, "marian"))
    }
    assert READ_MODEL_TYPES == expected


@pytest.mark.parametrize(
    ("model_type", "needles"),
    [
        ("gemma", ("'gemma' (Gemma)", "RMSNorm scaled by (1 + w)", "sqrt(d_model)")),
        ("mixtral", ("'mixtral' (Mixtral)", "mixture-of-experts")),
        ("qwen3", ("'qwen3' (Qwen3)", "RMSNorm on each head's q and k")),
        ("t5", ("'t5' (T5)", "relative position buckets")),
        ("roberta", ("'roberta' (RoBERTa)", "pad_token_id + 1")),
        ("phi3", ("'phi3' (Phi-3)", "fused qkv_proj")),
    ],
)
def test_an_unread_family_is_refused_by_its_missing_features(tmp_path, capsys, model_type, needles):
    folder = _folder(tmp_path, model_type)
    code, _, err = run(capsys, "convert", folder, tmp_path / "out.safetensors")
    one_line_error(code, err, *needles, "the model types read are bert, gpt2, llama, marian")
    assert "Marian" not in err
    assert not (tmp_path / "out.safetensors").exists()


def test_an_unknown_model_type_is_named(tmp_path, capsys):
    folder = _folder(tmp_path, "not-a-model")
    code, _, err = run(capsys, "convert", folder, tmp_path / "out.safetensors")
    one_line_error(code, err, "model_type 'not-a-model' is not a model type rosetta knows")


def test_a_config_without_model_type_is_refused(tmp_path, capsys):
    folder = _folder(tmp_path, None)
    code, _, err = run(capsys, "convert", folder, tmp_path / "out.safetensors")
    one_line_error(code, err, "config.json names no model_type", "or give --from")


@pytest.mark.parametrize(
    ("source", "model_type", "needle"),
    [
        ("llama", "gemma2", "Gemma 2 is not read yet: the spec lacks RMSNorm scaled by (1 + w)"),
        ("bert", "distilbert", "DistilBERT is not read yet"),
        ("gpt2", "opt", "OPT is not read yet: the spec lacks learned positions offset by 2"),
    ],
)
def test_from_a_family_names_what_another_lacks(tmp_path, capsys, source, model_type, needle):
    """`--from` given: the importer's own refusal, plus what the spec lacks for the family the
    folder holds."""
    folder = _folder(tmp_path, model_type)
    code, _, err = run(capsys, "convert", folder, tmp_path / "out.safetensors", "--from", source)
    one_line_error(code, err, f"model_type: '{model_type}'", needle)


def test_the_roberta_hint_is_not_offered_to_other_encoders(tmp_path):
    """The old hint, RoBERTa's position offset, was appended to every wrong model_type of BERT."""
    from transformer_rosetta.porting.bert import BERT

    for model_type in ("distilbert", "electra", "albert", "modernbert"):
        (problem,) = BERT.model_type_problems({"model_type": model_type})
        assert "pad_token_id + 1" not in problem, problem
    (problem,) = BERT.model_type_problems({"model_type": "roberta"})
    assert "pad_token_id + 1" in problem
    assert hf_folder.HfModel is type(BERT)


# model_type -> the importer a folder of it is read by, as docs/PORTING.md lists them (the
# Llama family's three through the one importer); written out, not read from READ_MODEL_TYPES.
INFERRED = {
    "marian": "marian",
    "bert": "bert",
    "gpt2": "gpt2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
}


@pytest.mark.parametrize(("model_type", "kind"), list(INFERRED.items()))
def test_a_read_model_type_is_inferred_as_its_importer(tmp_path, model_type, kind):
    """A folder of transformers' own config.json, without --from: the importer of its model_type
    (the table's entry for this model type, not another's)."""
    from transformer_rosetta.porting.convert import infer_source_kind

    assert set(INFERRED) == set(READ_MODEL_TYPES)
    assert infer_source_kind(_folder(tmp_path, model_type)) == kind


def test_a_folder_without_config_json_is_ours_or_metas(tmp_path):
    """No config.json: a folder of the shared format's shards is ours ("rosetta"), one holding
    params.json is Meta's layout ("meta-llama"); the shards' folder is not mistaken for Meta's
    when it holds a params.json too."""
    import transformer_rosetta as tr
    from transformer_rosetta.porting.convert import infer_source_kind

    config = tr.preset("tiny_decoder_only")
    shards = tmp_path / "shards"
    tr.save_weights(shards, tr.init_weights(config, seed=0), config, "test", max_shard_size=4096)
    assert not (shards / "config.json").exists()
    assert infer_source_kind(shards) == "rosetta"
    (shards / "params.json").write_text("{}")
    assert infer_source_kind(shards) == "rosetta"
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "params.json").write_text("{}")
    assert infer_source_kind(meta) == "meta-llama"
