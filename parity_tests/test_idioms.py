"""The excerpts of docs/ROSETTA.md (common/app/idioms.py): every concept is marked in all three
implementations, each excerpt is the code at the line it names, and a bad marker is an error that
names its file and line. No framework is imported: the markers are read as text."""

from __future__ import annotations

from pathlib import Path

import pytest

from transformer_rosetta.app import idioms

ROOT = Path(__file__).resolve().parents[1]


def test_every_concept_has_an_excerpt_in_every_framework():
    table = idioms.excerpts()
    assert list(table) == [c.key for c in idioms.CONCEPTS]
    assert len(table) >= 15
    for key, panes in table.items():
        assert list(panes) == ["torch", "tf", "jax"], key
        for framework, found in panes.items():
            assert found, (key, framework)


def test_each_excerpt_is_the_code_at_the_line_it_names():
    for panes in idioms.excerpts().values():
        for found in panes.values():
            for excerpt in found:
                lines = (ROOT / excerpt.path).read_text().splitlines()
                shown = excerpt.code.splitlines()
                source = lines[excerpt.first_line - 1 : excerpt.first_line - 1 + len(shown)]
                indent = len(source[0]) - len(source[0].lstrip())
                assert [s[indent:] for s in source] == shown, excerpt.path
                assert lines[excerpt.first_line - 2].strip().startswith("# rosetta: ")


def test_excerpts_stay_short_enough_to_read_side_by_side():
    # The longest today is jax's compiled training step (21 lines); a pane much longer than a
    # screen stops being a comparison.
    longest = max(
        (len(e.code.splitlines()), e.path, e.first_line)
        for panes in idioms.excerpts().values()
        for found in panes.values()
        for e in found
    )
    assert longest[0] <= 25, longest


def test_markers_live_only_in_the_files_the_extractor_reads():
    for _, _, package in idioms.FRAMEWORKS:
        for path in sorted((ROOT / package).glob("*.py")):
            if path.name not in idioms.IMPL_FILES:
                assert "# rosetta:" not in path.read_text(), path


def test_every_concept_has_a_title_and_a_reason():
    keys = [c.key for c in idioms.CONCEPTS]
    assert len(set(keys)) == len(keys)
    for concept in idioms.CONCEPTS:
        assert concept.title and len(concept.why) > 80, concept.key


def fake_repo(tmp_path: Path, torch_model: str) -> Path:
    """A repository whose tf and jax implementations mark every concept once, with
    `torch_model` as torch_impl/model.py."""
    every = "\n".join(f"# rosetta: {c.key}\nx = 1\n# rosetta: end" for c in idioms.CONCEPTS)
    for _, _, package in idioms.FRAMEWORKS:
        (tmp_path / package).mkdir()
        (tmp_path / package / "model.py").write_text(every + "\n")
    (tmp_path / "torch_impl" / "model.py").write_text(torch_model)
    return tmp_path


def test_a_fake_repository_with_every_marker_extracts(tmp_path):
    every = "\n".join(f"# rosetta: {c.key}\n    y = 2\n# rosetta: end" for c in idioms.CONCEPTS)
    table = idioms.excerpts(fake_repo(tmp_path, every + "\n"))
    first = table["parameters"]["torch"][0]
    assert first == idioms.Excerpt("torch_impl/model.py", 2, "y = 2")


@pytest.mark.parametrize(
    "source, message",
    [
        (
            "# rosetta: nonsense\nx = 1\n# rosetta: end\n",
            "torch_impl/model.py:1: unknown concept 'nonsense'",
        ),
        ("# rosetta: masks\nx = 1\n", "torch_impl/model.py:1: 'masks' is never closed"),
        ("x = 1\n# rosetta: end\n", "torch_impl/model.py:2: '# rosetta: end' without an opening"),
        (
            "# rosetta: masks\n# rosetta: cache\nx = 1\n# rosetta: end\n",
            "torch_impl/model.py:2: 'cache' opens inside 'masks'",
        ),
        (
            "# rosetta: masks\n\n# rosetta: end\n",
            "torch_impl/model.py:1: the excerpt 'masks' is empty",
        ),
    ],
)
def test_a_bad_marker_names_its_file_and_line(tmp_path, source, message):
    with pytest.raises(ValueError) as error:
        idioms.excerpts(fake_repo(tmp_path, source))
    assert message in str(error.value)


def test_a_concept_a_framework_lacks_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"no excerpt marked for parameters/torch, heads/torch"):
        idioms.excerpts(fake_repo(tmp_path, "x = 1\n"))
