"""The excerpts of docs/ROSETTA.md (tools/docs/idioms.py): every concept has an excerpt in all
three implementations, each excerpt is the code at the line it names, every definition the CUTS
table names is there, and a bad name or marker is an error that says where. No framework is
imported: the files are parsed, not run."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity_tests.paths import ROOT
from tools.docs import idioms


def test_every_concept_has_an_excerpt_in_every_framework():
    table = idioms.excerpts()
    assert list(table) == [c.key for c in idioms.CONCEPTS]
    assert len(table) >= 15
    for key, panes in table.items():
        assert list(panes) == ["torch", "tf", "jax"], key
        for framework, found in panes.items():
            assert found, (key, framework)


def test_each_excerpt_is_the_code_at_the_line_it_names():
    named = {excerpt for _, _, excerpt in idioms.named()}
    for panes in idioms.excerpts().values():
        for found in panes.values():
            for excerpt in found:
                lines = (ROOT / excerpt.path).read_text().splitlines()
                shown = excerpt.code.splitlines()
                source = lines[excerpt.first_line - 1 : excerpt.first_line - 1 + len(shown)]
                indent = len(source[0]) - len(source[0].lstrip())
                assert [s[indent:] for s in source] == shown, excerpt.path
                # Named in CUTS, or a slice that a marker opens on the line above.
                assert excerpt in named or lines[excerpt.first_line - 2].strip().startswith(
                    "# rosetta: "
                ), f"{excerpt.path}:{excerpt.first_line}"


def test_every_name_in_the_cuts_table_resolves():
    """Every definition that CUTS names is in its file, so a renamed or moved function fails here
    with the concept, file and name (and CUTS is where to follow it)."""
    problems = []
    for key, panes in idioms.CUTS.items():
        for framework, cuts in panes.items():
            for cut in cuts:
                try:
                    idioms.named(ROOT, {key: {framework: (cut,)}})
                except ValueError as error:
                    problems.append(str(error))
    assert problems == [], "\n".join(problems)


def test_markers_remain_only_for_slices_inside_a_function():
    """A whole definition is named in CUTS, never marked: no marked slice is exactly a named
    definition or a function's body, and (as idioms checks) every marker is inside a function."""
    named = {(e.path, e.code) for _, _, e in idioms.named()}
    for key, framework, excerpt in idioms.marked():
        assert (excerpt.path, excerpt.code) not in named, (key, framework, excerpt.path)
        assert not excerpt.code.startswith(("def ", "class ", "@")), (
            f"{excerpt.path}:{excerpt.first_line}: '{key}' marks a whole definition: name it in "
            "tools/docs/idioms.py CUTS"
        )


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


def _marked(key: str, code: str = "x = 1") -> str:
    """A function whose body is one slice marked as `key` (to the function's end: no end marker)."""
    return f"def f_{key}():\n    # rosetta: {key}\n    {code}\n"


def fake_repo(tmp_path: Path, torch_model: str) -> Path:
    """A repository whose tf and jax implementations mark every concept once, with
    `torch_model` as torch_impl/model.py."""
    every = "\n\n".join(_marked(c.key) for c in idioms.CONCEPTS)
    for _, _, package in idioms.FRAMEWORKS:
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "model.py").write_text(every)
    (tmp_path / "torch_impl" / "model.py").write_text(torch_model)
    return tmp_path


def test_a_fake_repository_with_every_marker_extracts(tmp_path):
    every = "\n\n".join(_marked(c.key, "y = 2") for c in idioms.CONCEPTS)
    table = idioms.excerpts(fake_repo(tmp_path, every), cuts={})
    first = table["parameters"]["torch"][0]
    assert first == idioms.Excerpt("torch_impl/model.py", 3, "y = 2")


@pytest.mark.parametrize(
    "source, message",
    [
        (
            "def f():\n    # rosetta: nonsense\n    x = 1\n    # rosetta: end\n",
            "torch_impl/model.py:2: unknown concept 'nonsense'",
        ),
        ("# rosetta: masks\nx = 1\n", "torch_impl/model.py:1: 'masks' is not inside a function"),
        (
            "def f():\n    x = 1\n    # rosetta: end\n",
            "torch_impl/model.py:3: '# rosetta: end' without an opening",
        ),
        (
            "def f():\n    # rosetta: masks\n    # rosetta: cache\n    x = 1\n    # rosetta: end\n",
            "torch_impl/model.py:3: 'cache' opens inside 'masks'",
        ),
        (
            "def f():\n    # rosetta: masks\n\n    # rosetta: end\n    x = 1\n",
            "torch_impl/model.py:2: the excerpt 'masks' is empty",
        ),
        (
            "def f():\n    # rosetta: masks\n    return 1\n    # rosetta: end\n",
            "torch_impl/model.py:4: '# rosetta: end' stands outside the function",
        ),
    ],
)
def test_a_bad_marker_names_its_file_and_line(tmp_path, source, message):
    with pytest.raises(ValueError) as error:
        idioms.excerpts(fake_repo(tmp_path, source), cuts={})
    assert message in str(error.value)


def test_a_concept_a_framework_lacks_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"no excerpt for parameters/torch, heads/torch"):
        idioms.excerpts(fake_repo(tmp_path, "x = 1\n"), cuts={})


def test_a_slice_without_an_end_marker_runs_to_its_functions_end(tmp_path):
    source = (
        "def f(x):\n"
        '    """Doc."""\n'
        "    y = x\n"
        "    # rosetta: masks\n"
        "    z = y\n"
        "    return z\n"
        "\n"
        "\n"
        "def g():\n"
        "    # rosetta: cache\n"
        "    return 2\n"
    )
    found = [(k, e) for k, f, e in idioms.marked(fake_repo(tmp_path, source)) if f == "torch"]
    assert found == [
        ("masks", idioms.Excerpt("torch_impl/model.py", 5, "z = y\nreturn z")),
        ("cache", idioms.Excerpt("torch_impl/model.py", 11, "return 2")),
    ]


CUT_SOURCE = """\
import math


# idiom: a comment right above a definition belongs to it
@staticmethod
def first(x):
    \"\"\"Doc.\"\"\"
    return x


def second(x):
    return x


class Layer:
    def call(self, x):
        \"\"\"Doc
        on two lines.\"\"\"
        # the body's own comment
        y = x + 1
        return y

    def plain(self, x):
        # no docstring
        return x


def third():
    # rosetta: masks
    return 3
"""


def test_definitions_are_cut_by_qualified_name(tmp_path):
    others = "\n\n".join(_marked(c.key) for c in idioms.CONCEPTS if c.key != "masks")
    fake_repo(tmp_path, CUT_SOURCE + "\n\n" + others)
    cuts = {
        "masks": {"torch": (idioms.whole("model.py", "first", "second"),)},
        "heads": {"torch": (idioms.body("model.py", "Layer.call"),)},
        "cache": {"torch": (idioms.body("model.py", "Layer.plain"),)},
        "layer_norm": {"torch": (idioms.whole("model.py", "Layer.plain"),)},
    }
    found = {key: excerpt for key, _, excerpt in idioms.named(tmp_path, cuts)}
    lines = CUT_SOURCE.splitlines()
    assert found["masks"] == idioms.Excerpt(
        "torch_impl/model.py", 4, "\n".join(lines[3:12])
    )  # the comment above, the decorator, both functions and the blank lines between them
    assert found["heads"] == idioms.Excerpt(
        "torch_impl/model.py", 19, "# the body's own comment\ny = x + 1\nreturn y"
    )
    assert found["cache"] == idioms.Excerpt("torch_impl/model.py", 24, "# no docstring\nreturn x")
    assert found["layer_norm"].code.splitlines()[0] == "def plain(self, x):"
    # Named excerpts and marked slices of one framework come in file order.
    table = idioms.excerpts(tmp_path, cuts)
    assert table["masks"]["torch"] == [
        found["masks"],
        idioms.Excerpt("torch_impl/model.py", 30, "return 3"),
    ]


@pytest.mark.parametrize(
    "cut, message",
    [
        (idioms.whole("model.py", "Layer.nowhere"), "masks: torch_impl/model.py has no definition 'Layer.nowhere'"),
        (idioms.whole("model.py", "first", "third"), "masks: first, third are not consecutive definitions in torch_impl/model.py"),
        (idioms.body("model.py", "Layer"), "masks: body() names one function"),
        (idioms.whole("decode.py", "first"), "masks: no file torch_impl/decode.py"),
    ],
)  # fmt: skip
def test_a_bad_name_says_which_concept_file_and_name(tmp_path, cut, message):
    fake_repo(tmp_path, CUT_SOURCE)
    with pytest.raises(ValueError) as error:
        idioms.named(tmp_path, {"masks": {"torch": (cut,)}})
    assert message in str(error.value)
