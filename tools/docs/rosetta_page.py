"""The side-by-side pages of the Rosetta: docs/ROSETTA.md's concept sections and docs/rosetta.html.

Both are built from `tools.docs.idioms.excerpts()` (code cut from the implementations by
qualified name, or between `# rosetta:` markers inside a function) and, for the HTML page, the
divergence catalogue of `tools.docs.divergences`. `python -m tools.docs` writes them; both are
deterministic (no dates), so its `--check` compares bytes. The HTML page is self-contained (inline CSS, no script,
no font or stylesheet from the network); its code is highlighted by Pygments, whose output
changes between versions, which is why constraints.txt pins it.

`python -m tools.docs.rosetta_page --screenshot docs/rosetta.png` renders docs/rosetta.html in a
headless Chromium driven by Selenium and saves a PNG; parity_tests/docs/test_rosetta_page.py checks
the page's layout the same way.
"""

from __future__ import annotations

import argparse
import html
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.docs.checkout import ROOT
from tools.docs.idioms import CONCEPTS, FRAMEWORKS, Excerpt, excerpts
from transformer_rosetta.errors import RosettaError

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

PAGE = ROOT / "docs" / "rosetta.html"

Table = dict[str, dict[str, list[Excerpt]]]

# Between two excerpts of one framework in one pane.
GAP = "# …"
# The catalogue's columns: (row key, heading).
CATALOGUE_COLUMNS = (
    ("topic", "Topic"),
    ("framework", "Framework"),
    ("default", "Framework default"),
    ("ours", "What this project does"),
    ("effect", "Keeping the default would"),
    ("shown", "Measured"),
)
INSTALL_HINT = "apt-get install -y chromium chromium-driver (Debian)"
NO_BROWSER = f"no browser: {INSTALL_HINT}"
# Flags for a headless Chromium on a machine without network: no first-run UI, no sandbox (root
# in a container), and none of the background connections a closed network refuses.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--force-device-scale-factor=1",
)


def _joined(found: Sequence[Excerpt]) -> str:
    """A framework's excerpts of one concept as one pane's code, a `# …` line between them."""
    return f"\n{GAP}\n".join(e.code for e in found)


def _source_link(excerpt: Excerpt) -> str:
    """The excerpt's file and line, relative to docs/ (where both pages live)."""
    return f"../{excerpt.path}#L{excerpt.first_line}"


def _fence(code: str) -> str:
    """A backtick fence longer than any run of backticks in `code`."""
    longest = max((len(run) for run in re.findall(r"`+", code)), default=0)
    return "`" * max(3, longest + 1)


# -- docs/ROSETTA.md ---------------------------------------------------------------------------


def concepts_markdown(table: Table | None = None) -> str:
    """The body of ROSETTA.md's `concepts` block: per concept (in CONCEPTS order) a `## title`, its
    three excerpts side by side in an HTML table GitHub renders (each pane labelled with a link
    to its source line), then why the three differ."""
    table = excerpts() if table is None else table
    sections = []
    for concept in CONCEPTS:
        panes = table[concept.key]
        lines = [f"## {concept.title}", "", "<table>"]
        lines.append("<tr>" + "".join(f"<th>{title}</th>" for _, title, _ in FRAMEWORKS) + "</tr>")
        lines.append("<tr>")
        for framework, _, _ in FRAMEWORKS:
            found = panes[framework]
            code = _joined(found)
            fence = _fence(code)
            label = ", ".join(f"[`{e.path}:{e.first_line}`]({_source_link(e)})" for e in found)
            lines += [
                '<td valign="top">',
                "",
                label,
                "",
                f"{fence}python",
                code,
                fence,
                "",
                "</td>",
            ]
        lines += ["</tr>", "</table>", "", concept.why]
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


# -- docs/rosetta.html --------------------------------------------------------------------------

_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body {
  margin: 0 auto; padding: 16px 20px 40px; max-width: 1800px;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
  color: #1f2328; background: #ffffff;
}
h1 { font-size: 22px; margin: 0 0 8px; }
h2 { font-size: 17px; margin: 0 0 8px; }
h2 a { color: inherit; text-decoration: none; }
h2 a:hover { text-decoration: underline; }
p { margin: 6px 0; max-width: 110ch; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace;
  font-size: 12px; background: #eff1f3; padding: 0 3px; border-radius: 3px; }
nav.toc { margin: 10px 0 18px; font-size: 13px; }
nav.toc a { margin-right: 12px; white-space: nowrap; }
a { color: #0969da; }
.concept { margin: 0 0 26px; padding-top: 6px; border-top: 1px solid #d0d7de; }
.panes { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 12px;
  align-items: start; }
.pane { min-width: 0; background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px;
  padding: 8px 10px; }
.pane-head { font-size: 12px; margin-bottom: 6px; color: #57606a; overflow-wrap: anywhere; }
.pane-head strong { color: #1f2328; margin-right: 6px; }
.pane-head a { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono",
  monospace; text-decoration: none; }
.pane-head a:hover { text-decoration: underline; }
.pane .highlight { background: transparent; overflow-x: auto; }
.pane pre { margin: 0; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas,
  "Liberation Mono", monospace; font-size: 12px; line-height: 1.4; }
.why { margin-top: 8px; }
.catalogue-wrap { overflow-x: auto; }
table.catalogue { border-collapse: collapse; width: 100%; font-size: 13px; }
table.catalogue th, table.catalogue td { border: 1px solid #d0d7de; padding: 4px 8px;
  text-align: left; vertical-align: top; overflow-wrap: anywhere; }
table.catalogue th { background: #f6f8fa; }
@media (max-width: 900px) { .panes { grid-template-columns: minmax(0, 1fr); } }
""".strip()


def _prose(text: str) -> str:
    """Escaped text with `backticked` spans as <code>."""
    parts = html.escape(text, quote=False).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def _framework_title(key: str) -> str:
    return {k: title for k, title, _ in FRAMEWORKS}.get(key, key)


def _cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if key == "shown" and value in (None, ""):
        value = row.get("value")
    if key == "framework":
        value = _framework_title(str(value))
    return "" if value is None else _prose(str(value))


def _catalogue_html(catalogue: Sequence[dict[str, Any]]) -> list[str]:
    out = [
        '<section id="the-divergence-catalogue" class="divergences">',
        '<h2><a href="#the-divergence-catalogue">The divergence catalogue</a></h2>',
        "<p>Every place where a framework's default differs from the spec, what this project sets "
        "instead, and the measured cost of keeping the default "
        "(<code>python -m tools.docs --measure divergences</code> measures each number).</p>",
    ]
    if not catalogue:
        out.append("<p>Nothing measured yet.</p>")
    else:
        out += ['<div class="catalogue-wrap">', '<table class="catalogue">', "<thead><tr>"]
        out += [f"<th>{html.escape(heading)}</th>" for _, heading in CATALOGUE_COLUMNS]
        out += ["</tr></thead>", "<tbody>"]
        for row in catalogue:
            key = html.escape(str(row.get("key", "")))
            cells = "".join(f"<td>{_cell(row, k)}</td>" for k, _ in CATALOGUE_COLUMNS)
            out.append(f'<tr data-key="{key}">{cells}</tr>')
        out += ["</tbody>", "</table>", "</div>"]
    out.append("</section>")
    return out


def html_page(table: Table | None = None, catalogue: Sequence[dict[str, Any]] | None = None) -> str:
    """docs/rosetta.html, whole: one row per concept with its PyTorch, Keras 3 and Flax NNX
    excerpts in three columns (highlighted by Pygments), then the divergence catalogue. Needs no
    network; the same inputs and Pygments version give the same bytes."""
    import pygments
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    table = excerpts() if table is None else table
    if catalogue is None:
        from tools.docs.divergences import load_catalogue

        catalogue = load_catalogue()
    formatter = HtmlFormatter(style="default", cssclass="highlight")
    lexer = PythonLexer()
    toc = " ".join(f'<a href="#{html.escape(c.key)}">{html.escape(c.title)}</a>' for c in CONCEPTS)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta name="generator" content="tools/docs/rosetta_page.py, Pygments '
        f'{html.escape(pygments.__version__)}">',
        "<title>The Rosetta: one Transformer in PyTorch, Keras 3 and Flax NNX</title>",
        "<style>",
        formatter.get_style_defs(".highlight"),
        _CSS,
        "</style>",
        "</head>",
        "<body>",
        "<h1>The Rosetta: one Transformer in PyTorch, Keras 3 and Flax NNX</h1>",
        "<p>Each row shows how the three implementations express one concept of the model, then "
        "why they differ. Every excerpt is cut from the code that the parity tests check "
        "(<code>parity_tests/</code>: the same logits, gradients, training steps and decoded "
        "tokens): whole definitions named in <code>tools/docs/idioms.py</code>, or the lines "
        "between <code># rosetta:</code> marker comments inside a function; each pane names its "
        "file and line. Regenerate this page with <code>python -m tools.docs</code>; the test "
        'suite fails when it is stale. <a href="ROSETTA.md">ROSETTA.md</a> has the same content.</p>',
        f'<nav class="toc">{toc} <a href="#the-divergence-catalogue">Divergence catalogue</a></nav>',
    ]
    for concept in CONCEPTS:
        key = html.escape(concept.key)
        out += [
            f'<section class="concept" id="{key}">',
            f'<h2><a href="#{key}">{html.escape(concept.title)}</a></h2>',
            '<div class="panes">',
        ]
        for framework, title, _ in FRAMEWORKS:
            found = table[concept.key][framework]
            links = ", ".join(
                f'<a href="{html.escape(_source_link(e))}">{html.escape(e.path)}:{e.first_line}</a>'
                for e in found
            )
            code = highlight(_joined(found), lexer, formatter).rstrip("\n")
            out += [
                f'<div class="pane" data-framework="{framework}">',
                f'<div class="pane-head"><strong>{html.escape(title)}</strong>{links}</div>',
                code,
                "</div>",
            ]
        out += ["</div>", f'<p class="why">{_prose(concept.why)}</p>', "</section>"]
    out += _catalogue_html(catalogue)
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


# -- a headless browser, for the layout test and the screenshot command ---------------------------


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidate = Path("/usr/bin") / name
    return str(candidate) if candidate.is_file() else None


def find_browser() -> tuple[str, str] | None:
    """(chromium, chromedriver) paths from PATH or /usr/bin, or None when either is missing."""
    browser = _which("chromium") or _which("chromium-browser")
    driver = _which("chromedriver")
    return (browser, driver) if browser and driver else None


@contextmanager
def headless_chromium(width: int = 1366, height: int = 900) -> Iterator[WebDriver]:
    """A Selenium driver for a headless Chromium whose viewport is `width` x `height` CSS pixels
    at scale 1, with a fresh profile removed afterwards. Selenium Manager is never asked for a
    driver: both paths come from find_browser(). Raises RuntimeError when there is no browser."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    found = find_browser()
    if found is None:
        raise RuntimeError(NO_BROWSER)
    browser, chromedriver = found
    with tempfile.TemporaryDirectory(prefix="rosetta-chromium-") as profile:
        options = Options()
        options.binary_location = browser
        for flag in (
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
        ):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
        try:
            # The window size includes no browser UI in headless mode; pin the viewport anyway.
            driver.execute_cdp_cmd(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            )
            yield driver
        finally:
            driver.quit()


def screenshot(page: Path, png: Path, width: int = 1366, height: int = 900) -> None:
    """Render `page` in a headless Chromium at `width` x `height` and save the viewport as `png`."""
    from transformer_rosetta.files.outputs import atomic_write

    page = Path(page).resolve()
    if not page.is_file():
        raise FileNotFoundError(f"{page}: no such page (python -m tools.docs writes it)")
    with headless_chromium(width, height) as driver:
        driver.get(page.as_uri())
        data = driver.get_screenshot_as_png()
    atomic_write(Path(png), lambda tmp: Path(tmp).write_bytes(data), size=len(data))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.docs.rosetta_page",
        description="Screenshot docs/rosetta.html in a headless Chromium.",
    )
    parser.add_argument("--screenshot", metavar="PNG", type=Path, required=True)
    parser.add_argument("--page", type=Path, default=PAGE, help="default: docs/rosetta.html")
    parser.add_argument("--width", type=int, default=1366)
    parser.add_argument("--height", type=int, default=900)
    args = parser.parse_args(argv)
    if find_browser() is None:
        print(NO_BROWSER, file=sys.stderr)
        return 2
    if not args.page.is_file():
        print(
            f"{args.page}: no such page: run python -m tools.docs",
            file=sys.stderr,
        )
        return 2
    try:
        screenshot(args.page, args.screenshot, args.width, args.height)
    except RosettaError as exc:  # e.g. the PNG's folder does not exist
        print(exc, file=sys.stderr)
        return 1
    print(f"wrote {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
