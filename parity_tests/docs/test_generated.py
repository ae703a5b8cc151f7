"""docs/ agrees with the code: its generated tables and pages are what tools/docs generates now."""

from __future__ import annotations

import os
import re

import pytest

from tools.docs import build
from transformer_rosetta.adapter.backends import unavailable_reason
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import canonical_specs


def test_generated_tables_are_current():
    # The native-name table is printed from each framework's weights.py.
    missing = {n: r for n in ("torch", "tf", "jax") if (r := unavailable_reason(n))}
    if missing:
        pytest.skip(f"the native-name table needs every framework: {missing}")
    for doc, generators in build.DOCUMENTS.items():
        text = doc.read_text()
        assert build.render(text, generators) == text, f"{doc} is stale: run python -m tools.docs"


def test_every_name_the_code_can_produce_is_documented():
    documented = set(re.findall(r"^\| `([a-z_.{}]+)` \| `\[", build.DOC.read_text(), re.M))
    variants = [
        TransformerConfig(num_encoder_layers=2, num_decoder_layers=3),
        TransformerConfig(
            share_embeddings=False,
            tie_output=False,
            output_bias=True,
            final_norm=True,
            attention_bias=False,
            position_kind="learned",
        ),
    ]
    for config in variants:
        for spec in canonical_specs(config):
            assert re.sub(r"\.layers\.\d+\.", ".layers.{i}.", spec.name) in documented, spec.name


def test_a_stale_block_is_detected():
    """A row of the "names" block edited by hand is put back. That block comes from
    common/spec/names.py alone, so the check runs on any machine; only the "native_names" block
    imports every framework's weights.py (tf_impl's needs Keras on TensorFlow), so it is left out
    when a framework is missing (test_generated_tables_are_current skips with the reason then)
    instead of failing on the import; the edited block is checked either way."""
    text = build.DOC.read_text()
    row = "`[d_model, h, d_k]` | an encoder"
    edited = text.replace(row, "`[h, d_k]` | an encoder", 1)
    assert edited != text, "the row this test edits is gone from docs/FORMAT.md"
    missing = {n: r for n in ("torch", "tf", "jax") if (r := unavailable_reason(n))}
    generators = dict(build.GENERATORS)
    if missing:
        del generators["native_names"]
    assert build.render(edited, generators) != edited
    names_only = {"names": build.GENERATORS["names"]}
    assert build.render(edited, names_only) == build.render(text, names_only), (
        "rendering did not put the edited row back"
    )


def test_the_rosetta_pages_are_current():
    """docs/ROSETTA.md's blocks and docs/rosetta.html whole are what the excerpts of the three
    implementations and docs/divergences.json give now. Neither needs a framework: the sources
    are parsed, not run, and the catalogue's numbers come from the JSON that `--measure` wrote."""
    text = build.ROSETTA_DOC.read_text()
    assert build.render(text, build.ROSETTA_GENERATORS) == text, (
        f"{build.ROSETTA_DOC} is stale: run python -m tools.docs"
    )
    for path, generate in build.WHOLE_FILES.items():
        assert path.exists() and generate() == path.read_text(), (
            f"{path} is stale: run python -m tools.docs"
        )


def test_an_edited_excerpt_makes_the_rosetta_page_stale(tmp_path, monkeypatch):
    """The staleness check bites: one line changed in an implementation's excerpted code changes
    both generated pages."""
    from tools.docs import idioms

    for _, _, package in idioms.FRAMEWORKS:
        (tmp_path / package).mkdir()
        for name in idioms.IMPL_FILES:
            source = build.DOC.parents[1] / package / name
            if source.exists():
                (tmp_path / package / name).write_text(source.read_text())
    model = tmp_path / "torch_impl" / "model.py"
    text = model.read_text()
    edited = text.replace(
        "return (x if pre_norm else norm(x)), extra", "return edited_by_the_test, extra", 1
    )
    assert edited != text, "the line this test edits is gone from torch_impl/model.py"
    model.write_text(edited)
    before = build.rosetta_concepts(), build.rosetta_html()
    real = idioms.excerpts
    from tools.docs import rosetta_page

    monkeypatch.setattr(rosetta_page, "excerpts", lambda root=tmp_path: real(root))
    after = build.rosetta_concepts(), build.rosetta_html()
    for old, new in zip(before, after, strict=True):
        assert "edited_by_the_test" not in old and "edited_by_the_test" in new


def test_measure_names_what_it_measures():
    assert build._measure_kinds(["--measure"]) == ["parity", "divergences"]
    assert build._measure_kinds(["--measure", "divergences", "--check"]) == ["divergences"]
    assert build._measure_kinds(["--check"]) == []
    with pytest.raises(SystemExit, match="--measure: unknown 'speed'; give parity or divergences"):
        build._measure_kinds(["--measure", "speed"])


def test_the_docs_tools_read_the_checkout_that_holds_them(tmp_path):
    """tools/ is never installed: the checkout is the folder that holds it, and the package the
    tools import must be that checkout's common/. Run otherwise, they stop with one line that
    says why, before any work."""
    import subprocess
    import sys

    from tools.docs.checkout import ROOT, CheckoutError, check

    root = ROOT
    assert check() == ROOT == root
    with pytest.raises(CheckoutError, match="is not a checkout of transformer-rosetta"):
        check(tmp_path)
    # Another transformer_rosetta first on the path (an older install, say): the tables would
    # describe its code, not the checkout's.
    (tmp_path / "transformer_rosetta").mkdir()
    (tmp_path / "transformer_rosetta" / "__init__.py").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "tools.docs", "--check"],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=120,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert (
        f"transformer_rosetta is imported from {tmp_path.resolve()}/transformer_rosetta" in lines[0]
    )
    assert "pip install -e ." in lines[0]
