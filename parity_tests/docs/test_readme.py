"""The README's Python example runs as written, with the import paths users see."""

from __future__ import annotations

import re

import numpy as np
import pytest

import transformer_rosetta as tr
from parity_tests.paths import ROOT
from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.decoding.search import beam_search
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [re.sub(r"^  ", "", b, flags=re.M) for b in blocks]  # the list item's indent


def test_the_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    """The example runs as printed, in a fresh folder, and what it prints is right: the torch
    logits equal the float64 oracle's within the float32 bound, the beam search's tokens are the
    oracle's own beam search's, and the parity report passes."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    blocks = readme_python_blocks()
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert (tmp_path / "tiny.safetensors").is_file()
    model, config, out, tokens, report = (
        scope[k] for k in ("model", "config", "out", "tokens", "report")
    )
    oracle = get_backend("numpy").build(config, load_weights(tmp_path / "tiny.safetensors").tensors)
    src, tgt_in = np.array([[5, 6, 7, 2]]), np.array([[1, 8, 9]])
    expected = oracle.forward(src, tgt_in).logits
    assert out.logits.shape == (1, 3, config.tgt_vocab_size) == expected.shape
    assert np.abs(out.logits - expected).max() <= atol_for("float32", config)
    # Beam search on random weights: the oracle's float64 tokens, where the float32 model's
    # scores agree with it within its bound (ties are not expected on these seeded weights).
    decoded = beam_search(lambda s, b, n: oracle.stepper(s, b, n), config, src, beam=4, extra_len=5)
    assert tokens == [int(t) for t in decoded.tokens[0]]
    assert report.passed and {r.framework for r in report.runs} >= {"torch", "jax"}
    printed = capsys.readouterr().out.split()
    assert printed[0] == tr.__version__ and printed[-1] == "True"
