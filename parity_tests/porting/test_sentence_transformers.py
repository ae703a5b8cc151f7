"""A sentence-transformers folder's pipeline (modules.json) decides the pooled vector that
`rosetta convert --from bert` imports (common/porting/bert.py, `sentence_pooling`): each variant a
user may have, on a tiny random BERT folder built here.

- Transformer, Pooling (mean): mean over the non-pad tokens, no normalisation;
- Transformer, Pooling (mean), Normalize: the same, then divided by its L2 norm (all-MiniLM-L6-v2
  is this one);
- Transformer, Pooling (cls), with and without Normalize: the first token ([CLS]).
- A Normalize anywhere but right after the Pooling (before it, with no Pooling at all, or twice)
  computes something the spec has no field for: refused with one line naming the module.

Each import's config (pooling, pooled_l2_norm) is read back from the written file, and the pooled
vector that `rosetta forward --framework numpy` writes is compared with the one computed here by
numpy from the encoder output written beside it: mean over the positions whose id is not pad_id
(or position 0), then divided by its L2 norm where the pipeline normalises.

Bound: both sides are float64 and compute the same sums in possibly another order. Over S <= 6
tokens whose hidden states are LayerNorm outputs (|h| <= 10 with these gains), two orders differ
by at most 2 (S - 1) u S max|h| ~ 7e-14 (u = 2^-53), and the division by a norm of O(1) (checked
below to be at least 0.1) keeps that within 1e-11. ATOL["float64"] = 1e-10 covers it, and every
wrong variant is far outside it (measured here: normalised or not 2.1, mean or [CLS] 0.68, the
pad positions counted in the mean 0.065).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from transformer_rosetta.spec.tolerances import ATOL
from transformer_rosetta.weights.format import load_weights

BERT = {
    "model_type": "bert",
    "vocab_size": 24,
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 12,
    "max_position_embeddings": 16,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PAD = BERT["pad_token_id"]
# Right-padded, of three lengths: a mean over every position would differ from the mean over
# the real ones, and the first token differs from the mean.
IDS = np.array([[1, 5, 9, 7, 2, 0], [1, 7, 3, 11, 4, 2], [1, 13, 2, 0, 0, 0]])

TRANSFORMER = {
    "idx": 0,
    "name": "0",
    "path": "",
    "type": "sentence_transformers.models.Transformer",
}
POOLING = {
    "idx": 1,
    "name": "1",
    "path": "1_Pooling",
    "type": "sentence_transformers.models.Pooling",
}
NORMALIZE = {
    "idx": 2,
    "name": "2",
    "path": "2_Normalize",
    "type": "sentence_transformers.models.Normalize",
}


def pooling_config(mode: str) -> dict:
    """1_Pooling/config.json as sentence-transformers writes it, with one mode on."""
    return {
        "word_embedding_dimension": BERT["hidden_size"],
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }


def bert_tensors() -> dict[str, np.ndarray]:
    """A BertModel state dict of random weights (every bias and LayerNorm drawn, so the hidden
    states are no LayerNorm's zero-mean unit vectors)."""
    rng = np.random.default_rng(3)
    d, f, v = BERT["hidden_size"], BERT["intermediate_size"], BERT["vocab_size"]
    shapes = {
        "embeddings.word_embeddings.weight": (v, d),
        "embeddings.position_embeddings.weight": (BERT["max_position_embeddings"], d),
        "embeddings.token_type_embeddings.weight": (BERT["type_vocab_size"], d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
    }
    p = "encoder.layer.0"
    for module in ("attention.self.query", "attention.self.key", "attention.self.value"):
        shapes |= {f"{p}.{module}.weight": (d, d), f"{p}.{module}.bias": (d,)}
    for module, shape in {
        "attention.output.dense": (d, d),
        "intermediate.dense": (f, d),
        "output.dense": (d, f),
    }.items():
        shapes |= {f"{p}.{module}.weight": shape, f"{p}.{module}.bias": (shape[0],)}
    for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
        shapes |= {f"{p}.{norm}.weight": (d,), f"{p}.{norm}.bias": (d,)}
    return {k: rng.normal(size=s).astype(np.float32) for k, s in sorted(shapes.items())}


def st_folder(folder: Path, modules: list[dict], mode: str = "mean") -> Path:
    """A sentence-transformers folder: config.json, model.safetensors, modules.json and, when
    the pipeline has a Pooling, its config."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(BERT))
    save_file(bert_tensors(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config(mode)))
    return folder


def rosetta(*args: str) -> int:
    from transformer_rosetta.cli import main

    return main(list(args))


# pipeline -> (modules, Pooling mode, the config it imports as, the note convert prints)
PIPELINES = {
    "mean": (
        [TRANSFORMER, POOLING],
        "mean",
        ("mean", False),
        "pooling mean (mean over the non-pad tokens): from",
    ),
    "mean, Normalize": (
        [TRANSFORMER, POOLING, NORMALIZE],
        "mean",
        ("mean", True),
        "pooling mean (mean over the non-pad tokens), then L2 norm: from",
    ),
    "cls": (
        [TRANSFORMER, POOLING],
        "cls",
        ("first", False),
        "pooling first (the [CLS] token): from",
    ),
    "cls, Normalize": (
        [TRANSFORMER, POOLING, NORMALIZE],
        "cls",
        ("first", True),
        "pooling first (the [CLS] token), then L2 norm: from",
    ),
}


def expected_pooled(hidden: np.ndarray, ids: np.ndarray, pooling: str, l2: bool) -> np.ndarray:
    """sentence-transformers' Pooling (then Normalize), by numpy from the hidden states."""
    if pooling == "first":
        pooled = hidden[:, 0]
    else:
        pooled = np.stack([hidden[b][ids[b] != PAD].mean(axis=0) for b in range(len(ids))])
    if l2:
        pooled = pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)
    return pooled


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_the_pipeline_sets_the_pooled_vector(tmp_path, capsys, pipeline):
    """The written config pools as the pipeline does, convert says so, and the pooled output of
    `rosetta forward` is the pipeline's vector computed here from the encoder output."""
    modules, mode, want, note = PIPELINES[pipeline]
    folder = st_folder(tmp_path / "st", modules, mode)
    out = tmp_path / "st.safetensors"
    assert rosetta("convert", "--from", "bert", str(folder), str(out), "--no-verify") == 0
    assert note in capsys.readouterr().out
    config = load_weights(out).config
    assert (config.pooling, config.pooled_l2_norm) == want

    np.save(tmp_path / "src.npy", IDS)
    arrays = tmp_path / "out.npz"
    args = ["--framework", "numpy", "--weights", str(out), "--src", str(tmp_path / "src.npy")]
    assert rosetta("forward", *args, "--out", str(arrays)) == 0
    with np.load(arrays) as got:
        hidden, pooled = got["encoder_output"], got["pooled_output"]
    assert hidden.shape == (*IDS.shape, BERT["hidden_size"]) and pooled.dtype == np.float64
    assert np.abs(hidden).max() <= 10  # the bound's premise (module docstring)
    want_pooled = expected_pooled(hidden, IDS, *want)
    raw = expected_pooled(hidden, IDS, want[0], False)
    assert np.linalg.norm(raw, axis=-1).min() >= 0.1  # the bound's premise
    assert np.abs(pooled - want_pooled).max() <= ATOL["float64"]


# pipeline -> (modules, the module refused)
MISPLACED = {
    "Normalize before Pooling": ([TRANSFORMER, {**NORMALIZE, "idx": 1}, {**POOLING, "idx": 2}], 1),
    "Normalize with no Pooling": ([TRANSFORMER, {**NORMALIZE, "idx": 1}], 1),
    "Normalize twice": ([TRANSFORMER, POOLING, NORMALIZE, {**NORMALIZE, "idx": 3}], 3),
}


@pytest.mark.parametrize("pipeline", list(MISPLACED))
def test_a_normalize_out_of_place_is_refused_in_one_line(tmp_path, capsys, pipeline):
    """A Normalize that does not come right after the Pooling normalises something the spec
    does not (the hidden states, or a unit vector again after another module): one line naming
    the module, exit 2, nothing written."""
    modules, index = MISPLACED[pipeline]
    folder = st_folder(tmp_path / "st", modules)
    out = tmp_path / "st.safetensors"
    assert rosetta("convert", "--from", "bert", str(folder), str(out), "--no-verify") == 2
    err = capsys.readouterr().err
    message = (
        f"modules.json: module {index} (sentence_transformers.models.Normalize) has no place in "
        "the spec; only Transformer, Pooling and a Normalize after the Pooling are imported"
    )
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()
