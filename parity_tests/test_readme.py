"""The README's Python example runs as written, with the import paths users see."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [re.sub(r"^  ", "", b, flags=re.M) for b in blocks]  # the list item's indent


def test_the_readme_python_example_runs(tmp_path, monkeypatch):
    blocks = readme_python_blocks()
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert (tmp_path / "tiny.safetensors").is_file()
    model, config = scope["model"], scope["config"]
    src = np.array([[5, 6, 7, 2]])
    tgt_in = np.array([[1, 8, 9]])
    logits = model.forward(src, tgt_in).logits
    assert logits.shape == (1, 3, config.tgt_vocab_size) and logits.dtype == np.float64
    assert np.isfinite(logits).all()
