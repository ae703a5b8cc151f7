"""docs/ROSETTA.md's concept sections and docs/rosetta.html (tools/docs/rosetta_page.py), built
from a small fake excerpt table and catalogue, so these tests do not depend on the excerpts of the
implementations or on docs/divergences.json (docs/test_generated.py checks that the real pages are fresh).

Without a browser: the page's structure, its escaping, and that it loads nothing from the network.
With Chromium and chromedriver (`apt-get install -y chromium chromium-driver` on Debian; .ci/run
installs them when it runs as root): the page is rendered at a laptop's 1366x900 and its three
columns are measured, and seen in a screenshot, side by side."""

from __future__ import annotations

import io
import os
import re
from html.parser import HTMLParser
from itertools import pairwise
from pathlib import Path

import pytest

from tools.docs import rosetta_page
from tools.docs.idioms import CONCEPTS, FRAMEWORKS, Excerpt, excerpts, whole

WIDTH, HEIGHT = 1366, 900
ORDER = [f for f, _, _ in FRAMEWORKS]
LONG = "# " + "a line much wider than its column " * 8  # about 280 characters


def fake_table() -> dict[str, dict[str, list[Excerpt]]]:
    """Every concept in every framework, one excerpt each (two for torch's head layout), with a
    long line, and characters that HTML must escape."""
    table = {}
    for i, concept in enumerate(CONCEPTS):
        table[concept.key] = {
            framework: [
                Excerpt(
                    f"{package}/model.py",
                    10 * i + j + 1,
                    f"def {concept.key}_{framework}(x):\n    {LONG}\n"
                    f'    return x < 2 and "<b>&amp;</b>"',
                )
            ]
            for j, (framework, _, package) in enumerate(FRAMEWORKS)
        }
    table["heads"]["torch"].append(Excerpt("torch_impl/decode.py", 7, "q = q.view(b, t, h, d_k)"))
    return table


CATALOGUE = [
    {
        "key": "layer_norm_eps",
        "topic": "LayerNorm epsilon",
        "framework": "tf",
        "default": "`epsilon=1e-3`",
        "ours": "the config's `layer_norm_eps`",
        "effect": "max |logit difference|",
        "value": 1.2e-3,
        "shown": "1.2e-3 <script>alert(1)</script>",
    },
    {
        "key": "adam_eps",
        "topic": "Adam epsilon placement",
        "framework": "tf",
        "default": "eps before the bias correction",
        "ours": "eps on sqrt(v_hat)",
        "effect": "parameter difference after 10 steps",
        "value": 3e-6,
        "shown": "3.0e-6",
    },
    {
        "key": "fast_variance",
        "topic": "LayerNorm variance",
        "framework": "jax",
        "default": "use_fast_variance=True",
        "ours": "False",
        "effect": "max |logit difference| in float32",
        "value": 0.0,
        "shown": "",
    },
]


# -- a small DOM, from the standard library's html.parser ---------------------------------------

VOID = {"meta", "link", "img", "br", "hr", "input", "source", "col", "area", "base", "wbr"}


class Node:
    def __init__(self, tag: str, attrs: dict[str, str | None]) -> None:
        self.tag, self.attrs, self.children, self.parts = tag, attrs, [], []

    @property
    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text() for p in self.parts)

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()

    def find(self, tag: str | None = None, cls: str | None = None) -> list[Node]:
        return [
            n
            for n in self.walk()
            if n is not self and (tag is None or n.tag == tag) and (cls is None or cls in n.classes)
        ]


class Tree(HTMLParser):
    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        self.stack[-1].parts.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        for at in range(len(self.stack) - 1, 0, -1):
            if self.stack[at].tag == tag:
                del self.stack[at:]
                return
        raise AssertionError(f"</{tag}> closes nothing")

    def handle_data(self, data):
        self.stack[-1].parts.append(data)


@pytest.fixture(scope="module")
def page() -> str:
    return rosetta_page.html_page(fake_table(), CATALOGUE)


@pytest.fixture(scope="module")
def dom(page) -> Node:
    return Tree(page).root


# -- docs/ROSETTA.md ------------------------------------------------------------------------------


def _methods(key: str, framework: str, n: int) -> list[str]:
    return [f"{key}_{framework}_{k}" for k in range(n)]


def test_concepts_markdown_shows_the_named_code_side_by_side(tmp_path):
    cuts: dict[str, dict[str, tuple]] = {c.key: {} for c in CONCEPTS}
    for framework, _, package in FRAMEWORKS:
        (tmp_path / package).mkdir()
        body = []
        for c in CONCEPTS:
            names = _methods(c.key, framework, n=2 if (c.key, framework) == ("cache", "jax") else 1)
            body += [f"    def {name}(x):\n        return x\n" for name in names]
            cuts[c.key][framework] = tuple(whole("model.py", f"M.{name}") for name in names)
        (tmp_path / package / "model.py").write_text("class M:\n" + "\n".join(body))
    table = excerpts(tmp_path, cuts)
    text = rosetta_page.concepts_markdown(table)
    assert text == rosetta_page.concepts_markdown(table)  # deterministic
    assert re.findall(r"^## (.*)$", text, re.M) == [c.title for c in CONCEPTS]
    sections = re.split(r"^## .*$", text, flags=re.M)[1:]
    for concept, section in zip(CONCEPTS, sections, strict=True):
        assert section.count("<table>") == 1 and section.count("</table>") == 1
        headings = re.findall(r"<th>(.*?)</th>", section)
        assert headings == [title for _, title, _ in FRAMEWORKS]
        cells = re.findall(r"<td[^>]*>\n\n(.*?)\n\n</td>", section, re.S)
        assert len(cells) == 3, concept.key
        for (framework, _, package), cell in zip(FRAMEWORKS, cells, strict=True):
            for excerpt in table[concept.key][framework]:
                link = f"[`{excerpt.path}:{excerpt.first_line}`](../{package}/model.py#L{excerpt.first_line})"
                assert link in cell
                assert excerpt.code in cell
            assert re.search(r"^```python\n.*\n```$", cell, re.S | re.M), cell
        assert section.rstrip().endswith(concept.why)
    # Two excerpts of one framework share one pane, a `# …` line between them.
    cache = sections[[c.key for c in CONCEPTS].index("cache")]
    cache_jax = re.findall(r"<td[^>]*>\n\n(.*?)\n\n</td>", cache, re.S)[2]
    assert "\n# …\n" in cache_jax and cache_jax.count("```") == 2


def test_a_backtick_fence_in_the_code_gets_a_longer_fence():
    table = fake_table()
    table["masks"]["tf"] = [Excerpt("tf_impl/model.py", 3, 'doc = """\n```\n"""')]
    text = rosetta_page.concepts_markdown(table)
    assert '````python\ndoc = """\n```\n"""\n````' in text


# -- docs/rosetta.html, without a browser -----------------------------------------------------


def test_one_row_per_concept_with_three_panes_in_order(dom):
    rows = dom.find(cls="concept")
    assert [r.attrs["id"] for r in rows] == [c.key for c in CONCEPTS]
    for concept, row in zip(CONCEPTS, rows, strict=True):
        assert concept.title in row.find("h2")[0].text()
        panes = row.find(cls="pane")
        assert [p.attrs.get("data-framework") for p in panes] == ORDER, concept.key
        for pane, (_, title, package) in zip(panes, FRAMEWORKS, strict=True):
            text = pane.text()
            assert title in text and f"{package}/model.py:" in text
            assert f"def {concept.key}_" in text  # the code itself, not only the header
        why = row.find("p", cls="why")
        assert len(why) == 1 and why[0].text().strip()


def test_panes_name_their_source_and_join_several_excerpts(dom):
    heads = next(r for r in dom.find(cls="concept") if r.attrs["id"] == "heads")
    torch = heads.find(cls="pane")[0]
    hrefs = [a.attrs["href"] for a in torch.find("a")]
    assert hrefs == ["../torch_impl/model.py#L11", "../torch_impl/decode.py#L7"]
    assert "# …" in torch.find("pre")[0].text()


def test_code_is_highlighted_by_pygments(page, dom):
    for pane in dom.find(cls="pane"):
        highlighted = pane.find("div", cls="highlight")
        assert len(highlighted) == 1
        kinds = {c for span in highlighted[0].find("span") for c in span.classes}
        assert {"k", "nf"} <= kinds  # the keyword `def` and a function name
    styles = dom.find("style")
    assert len(styles) == 1
    assert styles[0].text().count(".highlight .k {") == 1  # get_style_defs, embedded once
    assert "grid-template-columns: repeat(3, minmax(0, 1fr))" in page
    assert "overflow-x: auto" in page


def test_everything_shown_is_escaped(dom):
    assert not dom.find("b") and len(dom.find("script")) == 0
    code = dom.find(cls="pane")[0].text()
    assert '"<b>&amp;</b>"' in code  # shown as written, not interpreted


def test_the_catalogue_has_one_row_per_entry(dom):
    tables = dom.find("table", cls="catalogue")
    assert len(tables) == 1
    rows = tables[0].find("tbody")[0].find("tr")
    assert [r.attrs["data-key"] for r in rows] == [c["key"] for c in CATALOGUE]
    first = [td.text() for td in rows[0].find("td")]
    assert first[:4] == [
        "LayerNorm epsilon",
        "Keras 3",
        "epsilon=1e-3",
        "the config's layer_norm_eps",
    ]
    assert first[-1] == "1.2e-3 <script>alert(1)</script>"
    assert rows[2].find("td")[-1].text() == "0.0"  # no `shown`: the value


def test_an_empty_catalogue_says_so():
    text = rosetta_page.html_page(fake_table(), [])
    assert "Nothing measured yet" in text and 'class="catalogue"' not in text


def test_the_page_loads_nothing_from_the_network(page, dom):
    external = re.compile(r"^\s*(https?:)?//", re.I)
    for node in dom.walk():  # not even a link to follow: every href is relative
        for attr in ("src", "href", "srcset", "data", "poster", "action"):
            value = node.attrs.get(attr) or ""
            assert not external.match(value), (node.tag, attr, value)
    assert not dom.find("link") and not dom.find("script")
    css = "".join(s.text() for s in dom.find("style"))
    assert "@import" not in css and not re.search(r"url\(\s*['\"]?(https?:)?//", css)
    assert "@font-face" not in css


def test_the_page_is_deterministic_and_names_its_pygments(page):
    import pygments

    assert page == rosetta_page.html_page(fake_table(), CATALOGUE)
    assert f"Pygments {pygments.__version__}" in page
    assert "python -m tools.docs" in page


def test_screenshot_without_a_browser_exits_2_naming_the_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(rosetta_page, "find_browser", lambda: None)
    assert rosetta_page.main(["--screenshot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt-get install -y chromium chromium-driver" in err
    assert not (tmp_path / "x.png").exists()


# -- docs/rosetta.html in a headless Chromium ---------------------------------------------------

GEOMETRY = """
return {
  scrollWidth: document.documentElement.scrollWidth,
  clientWidth: document.documentElement.clientWidth,
  innerWidth: window.innerWidth,
  rows: Array.from(document.querySelectorAll('.concept')).map(c => ({
    id: c.id,
    panes: Array.from(c.querySelectorAll('.pane')).map(p => {
      const r = p.getBoundingClientRect();
      return {framework: p.dataset.framework, left: r.left, right: r.right, top: r.top,
              bottom: r.bottom, width: r.width, text: p.innerText,
              background: getComputedStyle(p).backgroundColor,
              border: parseFloat(getComputedStyle(p).borderTopWidth),
              padding: parseFloat(getComputedStyle(p).paddingTop)};
    }),
  })),
};
"""


def skip_without_browser() -> None:
    """Skip, saying how to install one, where no browser is installed; fail in CI (CI=true),
    whose .ci/run installs one, so that a green CI means the page was really rendered."""
    if rosetta_page.find_browser() is None:
        if os.environ.get("CI") == "true":
            pytest.fail(
                f"CI ran without a browser (.ci/run should have installed one): {rosetta_page.NO_BROWSER}"
            )
        pytest.skip(rosetta_page.NO_BROWSER)
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")


@pytest.fixture
def browser():
    skip_without_browser()
    with rosetta_page.headless_chromium(WIDTH, HEIGHT) as driver:
        yield driver


def _runs(pixels: list[tuple[int, ...]], colour: tuple[int, ...], slack: int = 2):
    """[start, end) of each run of pixels within `slack` of `colour` in every channel."""
    runs, start = [], None
    for x, p in enumerate([*pixels, None]):
        near = p is not None and all(
            abs(a - b) <= slack for a, b in zip(p[:3], colour, strict=True)
        )
        if near and start is None:
            start = x
        elif not near and start is not None:
            runs.append((start, x))
            start = None
    return runs


def test_three_columns_side_by_side_at_laptop_width(browser, tmp_path):
    from PIL import Image
    from selenium.webdriver.common.by import By

    page = tmp_path / "rosetta.html"
    page.write_text(rosetta_page.html_page(fake_table(), CATALOGUE))
    browser.get(page.as_uri())
    g = browser.execute_script(GEOMETRY)
    assert g["innerWidth"] == WIDTH
    # No horizontal page overflow: long code lines scroll inside their pane.
    assert g["scrollWidth"] <= g["clientWidth"] <= WIDTH, g["scrollWidth"]
    assert [r["id"] for r in g["rows"]] == [c.key for c in CONCEPTS]
    for row in g["rows"]:
        panes = row["panes"]
        assert [p["framework"] for p in panes] == ORDER, row["id"]
        for p in panes:
            assert p["text"].strip() and p["width"] > 200, (row["id"], p["framework"])
            assert 0 <= p["left"] and p["right"] <= g["clientWidth"], (row["id"], p)
        assert max(p["top"] for p in panes) - min(p["top"] for p in panes) <= 2, row["id"]
        for a, b in pairwise(panes):
            assert a["left"] < b["left"] and a["right"] <= b["left"], (row["id"], a, b)
    displayed = [e.is_displayed() for e in browser.find_elements(By.CSS_SELECTOR, ".pane")]
    assert len(displayed) == 3 * len(CONCEPTS) and all(displayed)

    # What a reader sees: one pixel row through the first concept's panes, inside their top
    # padding, crosses three separate runs of the pane background, one per pane.
    png = tmp_path / "rosetta-1366.png"
    png.write_bytes(browser.get_screenshot_as_png())
    image = Image.open(io.BytesIO(png.read_bytes())).convert("RGB")
    assert image.size == (WIDTH, HEIGHT)
    first = g["rows"][0]["panes"]
    assert first[0]["bottom"] < HEIGHT  # the first row is on screen
    colour = tuple(int(c) for c in re.findall(r"\d+", first[0]["background"])[:3])
    y = round(first[0]["top"] + first[0]["border"] + first[0]["padding"] / 2)
    runs = [
        r
        for r in _runs([image.getpixel((x, y)) for x in range(WIDTH)], colour)
        if r[1] - r[0] > 150
    ]
    assert len(runs) == 3, (runs, colour, y)
    for (start, end), pane in zip(runs, first, strict=True):
        assert pane["left"] - 1 <= start and end <= pane["right"] + 1, (start, end, pane)
        assert end - start > pane["width"] - 30  # the run spans (nearly) the whole pane
    # Between the columns the page background shows.
    for (_, end), (start, _) in pairwise(runs):
        assert image.getpixel(((end + start) // 2, y)) != colour


def test_screenshot_command_writes_a_png(tmp_path):
    skip_without_browser()
    from PIL import Image

    page = tmp_path / "rosetta.html"
    page.write_text(rosetta_page.html_page(fake_table(), CATALOGUE))
    png = tmp_path / "shot.png"
    assert rosetta_page.main(["--screenshot", str(png), "--page", str(page)]) == 0
    assert Image.open(png).size == (WIDTH, HEIGHT)


def test_the_screenshot_of_a_missing_page_is_an_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(rosetta_page, "find_browser", lambda: ("chromium", "chromedriver"))
    assert (
        rosetta_page.main(
            ["--screenshot", str(tmp_path / "x.png"), "--page", str(tmp_path / "no.html")]
        )
        == 2
    )
    assert "no such page" in capsys.readouterr().err


def test_find_browser_names_two_existing_files():
    skip_without_browser()
    found = rosetta_page.find_browser()
    assert all(Path(p).is_file() for p in found)
