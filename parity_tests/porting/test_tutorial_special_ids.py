"""Special ids per stack, shown with TensorFlow's older tutorial ("Transformer model for language
understanding", the code of seed text 003; fixture parity_tests/fixtures/tf_tutorial_v1.py).

The text numbers each language's markers after its own tokenizer: a Portuguese sentence is
`[tokenizer_pt.vocab_size] + tokenizer_pt.encode(s) + [tokenizer_pt.vocab_size + 1]`, and
decoding starts from `[tokenizer_en.vocab_size]` and stops at `tokenizer_en.vocab_size + 1`; each
vocabulary is its tokenizer's size + 2. With a source tokenizer smaller than the target's, the
target's end id lies outside the source vocabulary. bos_id and eos_id are the decoder's
(common/spec/config.py, special_id_vocabularies): such a model imports, and decodes what the
text's own `evaluate` loop decodes, end id included.
"""

from __future__ import annotations

import importlib
import json
from functools import partial

import numpy as np

from parity_tests.conftest import backend_or_skip
from parity_tests.fixtures import SIZES
from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.decoding.search import greedy_search
from transformer_rosetta.weights.format import load_weights

SRC_TOKENIZER, TGT_TOKENIZER = 40, 55  # tokenizer_pt.vocab_size, tokenizer_en.vocab_size
START, END = TGT_TOKENIZER, TGT_TOKENIZER + 1  # the target's markers: 55 and 56
SIZES_HERE = {**SIZES, "src_vocab_size": SRC_TOKENIZER + 2, "tgt_vocab_size": TGT_TOKENIZER + 2}
# One Portuguese sentence in the source's own markers (40 ... 41), no padding.
SENTENCE = [SRC_TOKENIZER, 5, 17, 3, 29, 11, SRC_TOKENIZER + 1]
STEPS = 8


def converted(tmp_path, end_bias: float | None = None):
    """The text's model (float64, seed 11) saved as its user saves it and imported with the
    target's ids; `end_bias` set on the end token's output bias first (to make it win)."""
    backend_or_skip("tf")
    from transformer_rosetta.cli import main

    fx = importlib.import_module("parity_tests.fixtures.tf_tutorial_v1")
    model = fx.make_model(SIZES_HERE, seed=11, dtype="float64")
    if end_bias is not None:
        bias = np.array(model.final_layer.bias.numpy())
        bias[END] = end_bias
        model.final_layer.bias.assign(bias)
    path = tmp_path / "model.weights.h5"
    fx.save(model, path)
    given = tmp_path / "given.json"
    given.write_text(json.dumps({"num_heads": SIZES["num_heads"], "bos_id": START, "eos_id": END}))
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(path), str(out), "--config", str(given)]) == 0
    return model, fx, load_weights(out)


def text_decodes(fx, model) -> list[int]:
    """The text's `evaluate`: the output ids after the start id, the end id not included."""
    import tensorflow as tf

    output, _ = fx.text_evaluate(model, tf.constant(SENTENCE), START, END, max_length=STEPS)
    ids = output.numpy().tolist()
    assert ids[0] == START
    return ids[1:]


def we_decode(wf, framework: str) -> tuple[list[int], bool]:
    """Our greedy search in `framework` (float64), limited to the text's STEPS new tokens: the
    ids (EOS not included, as in the text) and whether EOS ended it."""
    model = get_backend(framework).build(wf.config, wf.tensors, dtype="float64")
    src = np.array([SENTENCE], np.int64)
    extra = STEPS - len(SENTENCE)  # greedy_search allows the source's length + extra_len
    decoded = greedy_search(partial(model.stepper), wf.config, src, extra_len=extra)
    return [int(t) for t in decoded.tokens[0]], bool(decoded.finished[0])


def test_the_tutorials_numbering_imports_with_a_smaller_source_vocabulary(tmp_path):
    model, fx, wf = converted(tmp_path)
    c = wf.config
    assert (c.src_vocab_size, c.tgt_vocab_size, c.bos_id, c.eos_id) == (42, 57, 55, 56)
    assert c.eos_id >= c.src_vocab_size  # refused before: "outside the vocabulary (size 42)"
    want = text_decodes(fx, model)
    assert len(want) == STEPS and END not in want  # random weights: no end within 8 steps
    for framework in ("numpy", "torch", "tf", "jax"):
        backend_or_skip(framework)
        assert we_decode(wf, framework) == (want, False), framework


def test_the_end_id_ends_decoding_as_in_the_text(tmp_path):
    """With the end token's output bias at 50 the text's loop stops at its first step (output:
    the start id alone); ours picks EOS = 56 there and stops too, finished by EOS."""
    model, fx, wf = converted(tmp_path, end_bias=50.0)
    assert text_decodes(fx, model) == []
    for framework in ("numpy", "torch", "tf", "jax"):
        backend_or_skip(framework)
        assert we_decode(wf, framework) == ([], True), framework


def test_such_a_model_exports_its_decoder_step_to_onnx(tmp_path):
    """`rosetta export` builds the decoder-step graph's example cache by running the encoder on an
    example source, for real: an end id outside the source vocabulary must not be in it (it was:
    an index error). The export's own verification then runs the graph in onnxruntime against
    the float64 oracle on seeded probes (exit 0: within the bound)."""
    backend_or_skip("torch")
    backend_or_skip("onnx")
    from transformer_rosetta.cli import main

    _, _, wf = converted(tmp_path)
    out = tmp_path / "step.onnx"
    argv = ["export", str(tmp_path / "model.safetensors"), str(out), "--graph", "decoder_step"]
    assert main(argv) == 0 and out.exists()
