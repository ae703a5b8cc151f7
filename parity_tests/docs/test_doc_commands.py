"""The docs are tests: every fenced block of the user-facing docs (DOCS) runs here, on small inputs
the test makes, and exits as the doc says. The blocks are read from the Markdown itself, never
copied into this file, so a command added to a doc runs (or fails this file) without anyone
remembering to add it. CONTRIBUTING.md ("Commands in the docs are tests") states the convention.

A block is classified by its marker, an HTML comment on the line just before its fence (invisible
when the Markdown is rendered), or else by its language:

    <!-- doc-test: setup=qwen2_folder,meta_llama exit=0 -->

Without a marker, a ```python block runs as a script, a ```bash or plain block whose every line is
a command runs with `set -e`, a ```text block is a sample of output and a ```json block must
parse. Any other block without a marker fails test_every_block_is_classified. The marker words
(MARKER_WORDS says what each one does; an unknown word fails) give the setups (SETUPS: small
files made in the block's temporary folder, named as the doc names them), the exit code, the
substitutions that turn a command for many hosts or hours into one that runs here (each OLD must
occur in the block, so a marker cannot silently outlive its doc), and the classes that do not run:
a usage synopsis (each flag and choice checked against the command's real --help), Python
signatures (checked against inspect.signature), a fragment (compiled, and checked by a function
of CHECKS), a JSON excerpt of a file (its complete entries found in the file), a sample of output
(compared with the output of the command that makes it), or a block run by another test.

Commands run as subprocesses in the block's own temporary folder, with the checkout's
.venv/bin first on PATH (`rosetta` is the installed command), so that they run as a user types
them. A comment line `# NAME.json: {...}` in a command block writes that file first: the doc's
comment is the file's content.

Output samples are compared line by line, as a contiguous run of lines of the real output, each
token equal, except: with `noise=X`, two numbers both below X in size match (float32 rounding
noise below the bound X, whose digits depend on the summation order the CPU's kernels pick); with
`digits=any`, a sample token that starts with a digit (a version, a hash, a measured figure)
matches any token starting with a digit or a hex letter.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from parity_tests.distributed.test_jax_distributed import XLA_COMPILE_FLAGS
from parity_tests.paths import ROOT, VECTORS

DOCS = (
    "README.md",
    "docs/PORTING.md",
    "docs/DISTRIBUTED.md",
    "docs/TESTING_YOUR_PORT.md",
    "CONTRIBUTING.md",
)
# What each marker word does (CONTRIBUTING.md repeats it).
MARKER_WORDS = {
    # classes of blocks that do not run as written
    "output": "a sample of output: compared with the run before it (story) or with `of`",
    "synopsis": "usage lines `rosetta CMD ...`: every --flag and a|b choice is in CMD --help",
    "signatures": "Python signatures `f(a, *, b=1) -> T` of `module`, against inspect.signature",
    "fragment": "Python that is a sketch, not a program: compiled, then CHECKS[check] if named",
    "excerpt": "a JSON excerpt with ... of the file `of`: each complete entry is in the file",
    "file": "Python written to the file its first comment names (`# my_port.py: ...`)",
    # how a block runs
    "setup": "comma-separated SETUPS made in the block's folder first",
    "exit": "the exit code the doc promises (default 0)",
    "cwd": "`root`: run in the checkout instead of a temporary folder",
    "replace": '"OLD -> NEW", repeatable: OLD must occur; NEW may hold {port} {root} {tmp}',
    "concurrent": "each command of the block runs at once, as on separate hosts",
    "expect": "text the block's output must contain",
    "story": "blocks of one story run in order, in one folder, Python in one interpreter",
    "of": "the command whose output an `output` sample is",
    "noise": "numbers below this size in an `output` sample match any such number",
    "digits": "`any`: tokens starting with a digit in an `output` sample match any such token",
    "module": "the module of `signatures`",
    "check": "the CHECKS function a `fragment` is checked with",
    "run-by": "FILE::TEST that runs the block (it must exist and be a test of that file)",
    "slow": "runs under -m slow only; `reason` says why",
    "skip": "not run; only where running is impossible here; `reason` says why",
    "reason": "why a block is slow or skipped",
}
CLASSES = ("output", "synopsis", "signatures", "fragment", "excerpt", "file")
COMMAND_WORDS = {"rosetta", "bash", "pytest", "torchrun", "python", "cd", "pip", "true"}
VENV_BIN = ROOT / ".venv" / "bin"
COMMAND_TIMEOUT = 600  # seconds; the longest block (the demo) takes about a minute


# -- reading the blocks -----------------------------------------------------------------------


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str  # dedented
    marker: dict[str, list[str]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.marker.get(key, [default])[-1]

    @property
    def kind(self) -> str | None:
        named = [c for c in CLASSES if c in self.marker]
        if len(named) > 1:
            return None
        if named:
            return named[0]
        if self.lang == "python":
            return "python"
        if (
            self.lang in ("bash", "sh", "")
            and command_lines(self.text)
            and all(is_command(c) for c in command_lines(self.text))
        ):
            return "commands"
        if self.lang == "text":
            return "output"
        if self.lang == "json":
            return "json"
        return None


FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!-- doc-test:(?P<words>.*?)-->\s*$")


def parse_marker(words: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for token in shlex.split(words):
        key, _, value = token.partition("=")
        out.setdefault(key, []).append(value)
    return out


def doc_blocks(doc: str) -> list[Block]:
    """Every fenced block of `doc`, with the marker on the line before its fence, if any."""
    lines = (ROOT / doc).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m["indent"], i
        end = next(
            j for j in range(i + 1, len(lines)) if lines[j].rstrip() == f"{indent}```"
        )  # a fence left open fails here
        body = textwrap.dedent("\n".join(lines[start + 1 : end])) + "\n"
        marked = MARKER.match(lines[start - 1]) if start else None
        marker = parse_marker(marked["words"]) if marked else {}
        blocks.append(Block(doc, start + 1, m["lang"], body, marker))
        i = end + 1
    return blocks


def command_lines(text: str) -> list[str]:
    """The block's commands: `\\` continuations joined, comment lines and blank lines dropped."""
    joined = text.replace("\\\n", " ")
    return [s.strip() for s in joined.splitlines() if s.strip() and not s.strip().startswith("#")]


def is_command(line: str) -> bool:
    words = line.split()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value first
        words.pop(0)
    return bool(words) and (words[0] in COMMAND_WORDS or words[0].startswith(".venv/bin/"))


ALL_BLOCKS = [b for doc in DOCS for b in doc_blocks(doc)]
# Which test file runs which doc's blocks: in one file they would take about 5 minutes on 2
# cores, so each file holds a share that runs in under 2.
RUN_BY_FILE = {
    "test_doc_commands.py": ("README.md", "docs/TESTING_YOUR_PORT.md", "CONTRIBUTING.md"),
    "test_doc_commands_porting.py": ("docs/PORTING.md",),
    "test_doc_commands_distributed.py": ("docs/DISTRIBUTED.md",),
}
HERE = RUN_BY_FILE["test_doc_commands.py"]


# -- the setups: small inputs, named as the docs name them -------------------------------------


def setup_venv(folder: Path) -> None:
    """`.venv/` as a fresh clone has it after `bash .ci/install`: the test session's own."""
    (folder / ".venv").symlink_to(ROOT / ".venv")


def setup_minilm_folder(folder: Path) -> None:
    """./all-MiniLM-L6-v2: the real folder of the test-only package (conftest's minilm_dir)."""
    import importlib.util

    from parity_tests.conftest import MINILM_PACKAGE, NEEDS_MINILM, setup_missing

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        setup_missing(NEEDS_MINILM)
    package = Path(list(spec.submodule_search_locations)[0])
    (folder / "all-MiniLM-L6-v2").symlink_to(package / "model")


def setup_mingpt_pt(folder: Path) -> None:
    """model.pt: minGPT's state_dict (parity_tests/fixtures/mingpt.py) with the 6 heads that the
    doc's given.json names (d_model 12: d_k 2)."""
    from parity_tests.fixtures import mingpt

    sizes = {"tgt_vocab_size": 23, "d_model": 12, "num_heads": 6, "num_decoder_layers": 1}
    mingpt.save(mingpt.make_model(sizes, seed=3, block_size=16), folder / "model.pt")


def setup_qwen2_folder(folder: Path) -> None:
    """./Qwen2-0.5B: a tiny Qwen2ForCausalLM saved with save_pretrained (test_llama.py's)."""
    from parity_tests.porting.test_llama import hf_model

    hf_model("qwen2").save_pretrained(folder / "Qwen2-0.5B")


def setup_meta_llama(folder: Path) -> None:
    """./llama-2-7b: Meta's layout, consolidated.00.pth and params.json (test_meta_llama.py's)."""
    from parity_tests.porting.test_llama import hf_model
    from parity_tests.porting.test_meta_llama import PARAMS, meta_state, write_meta
    from transformer_rosetta.porting.meta_llama import meta_d_ff

    d_ff = meta_d_ff(PARAMS["dim"], PARAMS["multiple_of"], PARAMS["ffn_dim_multiplier"])
    model = hf_model("llama", intermediate_size=d_ff, attention_bias=False, mlp_bias=False)
    write_meta(folder / "llama-2-7b", [meta_state(model)])


def setup_home_made(folder: Path) -> None:
    """mine.safetensors, the home-made model of test_user_map.py, and the doc's worked example
    home_made.map.json beside it."""
    from safetensors.numpy import save_file

    from parity_tests.fixtures import SIZES
    from parity_tests.fixtures import annotated_transformer as fx
    from parity_tests.porting.test_user_map import EXAMPLE_MAP, invented

    model = fx.make_model(SIZES, seed=11, dtype="float32")
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    save_file(invented(state), str(folder / "mine.safetensors"))
    shutil.copy(EXAMPLE_MAP, folder / "home_made.map.json")


def setup_big_safetensors(folder: Path) -> None:
    """big.safetensors (the tiny preset, seeded) and src.npy / tgt.npy for `rosetta forward`."""
    import numpy as np

    from transformer_rosetta.spec.config import preset
    from transformer_rosetta.weights.format import save_weights
    from transformer_rosetta.weights.init import init_weights

    config = preset("tiny")
    save_weights(folder / "big.safetensors", init_weights(config, seed=0), config, producer="doc")
    np.save(folder / "src.npy", np.array([[5, 6, 7, 2], [8, 9, 2, 0]]))
    np.save(folder / "tgt.npy", np.array([[1, 10, 11], [1, 12, 0]]))


def setup_back_safetensors(folder: Path) -> None:
    """back.safetensors, converted from model.pt, the torch checkpoint of the pre_ln_untied test
    vector (as the doc's provenance sample says)."""
    from transformer_rosetta.cli import main
    from transformer_rosetta.weights.format import load_weights

    vector = VECTORS / "pre_ln_untied.safetensors"
    config = folder / "config.json"  # a torch checkpoint does not carry its config
    config.write_text(json.dumps(load_weights(vector).config.to_dict()))
    assert main(["convert", str(vector), str(folder / "model.pt"), "--no-verify"]) == 0
    back = ["convert", str(folder / "model.pt"), str(folder / "back.safetensors")]
    assert main([*back, "--config", str(config)]) == 0
    (folder / "model.pt").unlink()
    config.unlink()


SETUPS = {
    name.removeprefix("setup_"): fn for name, fn in globals().items() if name.startswith("setup_")
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Each setup built once, then copied into every folder that names it."""
    cache: dict[str, Path] = {}

    def into(names: list[str], folder: Path) -> None:
        for name in names:
            if name not in cache:
                cache[name] = tmp_path_factory.mktemp(f"setup-{name}")
                SETUPS[name](cache[name])
            for item in cache[name].iterdir():
                target = folder / item.name
                if item.is_symlink():
                    target.symlink_to(item.readlink())
                elif item.is_dir():
                    shutil.copytree(item, target)
                else:
                    shutil.copy(item, target)

    return into


# -- running --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_env() -> dict[str, str]:
    """The caller's environment with the checkout's .venv/bin first on PATH, and nothing of this
    pytest run's own settings (an xdist worker's name, jax.distributed's variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "JAX_"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # JAX's CPU compile with LLVM's optimisation off, about half the compile time; XLA's own
    # passes are untouched, and the commands keep the caller's XLA_FLAGS beside their own
    # (parity_tests/distributed/test_jax_distributed.py, XLA_COMPILE_FLAGS).
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_COMPILE_FLAGS}".strip()
    return env


def substituted(block: Block, folder: Path) -> str:
    text = block.text
    port = str(free_port())
    for rule in block.marker.get("replace", []):
        old, sep, new = rule.partition(" -> ")
        assert sep and old in text, f"{block.id}: replace {rule!r}: {old!r} is not in the block"
        new = new.replace("{port}", port).replace("{root}", str(ROOT)).replace("{tmp}", str(folder))
        text = text.replace(old, new)
    return text


def write_comment_files(text: str, folder: Path) -> None:
    """`# NAME.json: {...}` in a command block: the file the doc's comment describes."""
    for name, content in re.findall(r"^#\s*([\w.-]+\.json):\s*(\{.*\})\s*$", text, flags=re.M):
        json.loads(content)  # the doc shows valid JSON
        (folder / name).write_text(content + "\n")


def run_bash(script: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", "set -e\n" + script],
        cwd=cwd,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )


def run_commands(block: Block, folder: Path) -> str:
    """The block's commands, as the doc says: exit `exit` (default 0). Returns the output."""
    text = substituted(block, folder)
    write_comment_files(text, folder)
    cwd = ROOT if block.get("cwd") == "root" else folder
    want = int(block.get("exit", "0"))
    if "concurrent" in block.marker:  # output to files: a pipe nobody reads yet could block
        logs = [folder / f"_concurrent.{i}.log" for i in range(len(command_lines(text)))]
        procs = []
        for command, log in zip(command_lines(text), logs, strict=True):
            with log.open("w") as sink:
                procs.append(
                    subprocess.Popen(
                        ["bash", "-c", command],
                        cwd=cwd,
                        env=command_env(),
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                    )
                )
        try:
            codes = [p.wait(timeout=COMMAND_TIMEOUT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        output = "\n".join(log.read_text() for log in logs)
        for log in logs:
            log.unlink()
        assert codes == [want] * len(procs), f"{block.id}: exits {codes}\n{output[-6000:]}"
    else:
        done = run_bash(text, cwd)
        output = done.stdout + done.stderr
        assert done.returncode == want, (
            f"{block.id}: exit {done.returncode}, the doc says {want}\n{text}\n{output[-6000:]}"
        )
    for needle in block.marker.get("expect", []):
        assert needle in output, f"{block.id}: {needle!r} not in the output\n{output[-3000:]}"
    return output


SEPARATOR = "\x1e<doc-test block>\x1e"


def run_python(blocks: list[Block], folder: Path) -> list[str]:
    """Python blocks run in order in one fresh interpreter in `folder` (a story's blocks share
    their names, as the doc's reader's session does); each block's stdout."""
    driver = folder / "_doc_test_driver.py"
    driver.write_text(
        "import json, sys\n"
        "scope = {'__name__': '__main__'}\n"
        "for name, code in json.load(open(sys.argv[1])):\n"
        f"    print({SEPARATOR!r}, flush=True)\n"
        "    exec(compile(code, name, 'exec'), scope)\n"
    )
    (folder / "_doc_test_blocks.json").write_text(json.dumps([[b.id, b.text] for b in blocks]))
    done = subprocess.run(
        [sys.executable, driver.name, "_doc_test_blocks.json"],
        cwd=folder,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert done.returncode == 0, (
        f"{[b.id for b in blocks]}:\n{done.stdout[-3000:]}{done.stderr[-6000:]}"
    )
    driver.unlink()
    (folder / "_doc_test_blocks.json").unlink()
    return done.stdout.split(SEPARATOR + "\n")[1:]


# -- comparing output samples ---------------------------------------------------------------------


def as_float(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def token_matches(want: str, got: str, noise: float, digits_any: bool) -> bool:
    if want == got:
        return True
    if digits_any and want[:1].isdigit() and re.match(r"[0-9a-f]", got):
        return True
    w, g = as_float(want), as_float(got)
    return w is not None and g is not None and abs(w) < noise and abs(g) < noise


def assert_sample_in(sample: Block, output: str) -> None:
    """The sample's lines are a contiguous run of the output's lines (module docstring)."""
    noise = float(sample.get("noise", "0"))
    digits_any = sample.get("digits") == "any"
    want = [line.split() for line in sample.text.strip().splitlines()]
    got = [line.split() for line in output.splitlines()]

    def line_matches(w: list[str], g: list[str]) -> bool:
        return len(w) == len(g) and all(
            token_matches(a, b, noise, digits_any) for a, b in zip(w, g, strict=True)
        )

    for start in range(len(got) - len(want) + 1):
        if all(line_matches(w, got[start + k]) for k, w in enumerate(want)):
            return
    pytest.fail(f"{sample.id}: the sample is not in the output:\n{sample.text}\n--- got:\n{output}")


def assert_not_commands(block: Block) -> None:
    lines = command_lines(block.text)
    assert not any(is_command(line) for line in lines), f"{block.id}: a command in a sample"


# -- the checks of blocks that do not run as written ----------------------------------------------


def usage_of(command: str) -> str:
    """The usage paragraph of `rosetta COMMAND --help`, argparse's list of every option (the
    prose below it may name a flag that no longer exists)."""
    done = run_bash(f"rosetta {command} --help", ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n\n")[0]


def check_synopsis(block: Block) -> None:
    """Each usage line's command exists, and every flag and every a|b choice it names is in that
    command's usage, as its --help prints it."""
    usages: list[str] = []
    for line in block.text.splitlines():
        if line.startswith("rosetta "):
            usages.append(line)
        elif line.strip():
            usages[-1] += " " + line.strip()  # a continuation of the usage above
    assert usages, f"{block.id}: no usage line"
    for usage in usages:
        command = usage.split()[1]
        shown = usage_of(command)
        for flag in re.findall(r"--[a-z][a-z0-9-]*", usage):
            assert re.search(rf"{flag}\b(?!-)", shown), (
                f"{block.id}: {flag} not in {command} --help"
            )
        for choices in re.findall(r"\b(\w+(?:\|\w+)+)\b", usage):
            for choice in choices.split("|"):
                assert choice in shown, f"{block.id}: {choice} not in {command} --help"


def check_signatures(block: Block) -> None:
    """Each `name(params) -> T` is `module.name`'s signature: the same parameters, kinds and
    defaults, in order, and the return annotation's name; `(... the same ...)` is the previous
    function's."""
    import importlib

    module = importlib.import_module(block.get("module") or "")
    text = block.text
    entries = re.findall(r"^(\w+)\((.*?)\)\s*\n?\s*->\s*(\w+)", text, flags=re.M | re.S)
    assert entries, f"{block.id}: no signature"
    previous = None
    for name, params, returns in entries:
        real = inspect.signature(getattr(module, name))
        if params.strip() == "... the same ...":
            assert previous is not None and list(real.parameters.values()) == list(
                previous.parameters.values()
            ), f"{block.id}: {name} is not the same as the one before"
        else:
            shown = inspect.signature(_stub(params))
            assert [(p.name, p.kind, p.default) for p in shown.parameters.values()] == [
                (p.name, p.kind, p.default) for p in real.parameters.values()
            ], f"{block.id}: {name}{shown} is not {real}"
        annotation = real.return_annotation
        real_name = annotation if isinstance(annotation, str) else annotation.__name__
        assert real_name == returns, f"{block.id}: {name} returns {real_name}, not {returns}"
        previous = real


def _stub(params: str):
    """A function with the doc's parameter list (its defaults are literals)."""
    scope: dict = {}
    exec(f"def f({params}): pass", scope)
    return scope["f"]


def check_excerpt(block: Block) -> None:
    """Every line of the excerpt that is complete JSON (an object, or `"key": value` at the top
    level) is in the file: the object somewhere in it, the key with that value."""
    whole = json.loads((ROOT / (block.get("of") or "")).read_text())
    found = 0

    def contains(tree, item) -> bool:
        if tree == item:
            return True
        children = (
            tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else []
        )
        return any(contains(c, item) for c in children)

    for line in block.text.splitlines():
        line = line.strip().rstrip(",")
        if "..." in line or not line:
            continue
        for candidate in (line, "{" + line + "}"):
            try:
                item = json.loads(candidate)
            except json.JSONDecodeError:
                continue
            if candidate is line:
                assert contains(whole, item), f"{block.id}: {line} is not in {block.get('of')}"
            else:
                ((key, value),) = item.items()
                assert whole.get(key) == value, f"{block.id}: {key} is not {value} in the file"
            found += 1
            break
    assert found, f"{block.id}: no complete entry to check"


def check_nn_transformer_pipeline(block: Block) -> None:
    """The Pipeline sketch is the module the importer's tests build (test_nn_transformer.py's
    NNTransformerPipeline): each annotated attribute has that type, and every key the comments
    quote is in its state_dict."""
    import torch.nn as nn

    from parity_tests.porting.test_nn_transformer import CASES, NNTransformerPipeline, case_config

    config = case_config(next(iter(CASES)))
    model = NNTransformerPipeline(config.replace(output_bias=True, position_kind="learned"))
    (cls,) = ast.parse(block.text).body
    assert isinstance(cls, ast.ClassDef) and cls.name == "Pipeline"
    for item in cls.body:
        assert isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
        wanted = getattr(nn, ast.unparse(item.annotation).removeprefix("nn."))
        assert isinstance(getattr(model, item.target.id), wanted), item.target.id
    keys = set(model.state_dict())
    for quoted in re.findall(r'"([\w.]+)"', block.text):
        assert quoted in keys, f"{block.id}: {quoted} is no key of the pipeline's state_dict"
    for name in re.findall(r"\b(\w+_position_embedding)\b", block.text):
        assert isinstance(getattr(model, name), nn.Embedding), name


CHECKS = {"nn_transformer_pipeline": check_nn_transformer_pipeline}


def check_run_by(block: Block) -> None:
    path, _, test = (block.get("run-by") or "").partition("::")
    source = (ROOT / path).read_text()
    assert re.search(rf"^def {re.escape(test)}\(", source, flags=re.M), f"{block.id}: no {test}"
    assert Path(block.doc).name in source, f"{block.id}: {path} does not read {block.doc}"


# -- the tests ------------------------------------------------------------------------------------


def test_every_doc_runs_in_one_file():
    """RUN_BY_FILE shares the docs out among files that exist, each doc to one of them."""
    shared = [doc for docs in RUN_BY_FILE.values() for doc in docs]
    assert sorted(shared) == sorted(DOCS)
    for name in RUN_BY_FILE:
        assert (Path(__file__).parent / name).is_file(), name


def test_every_block_is_classified():
    """Every fenced block of the docs has a class (a marker's, or its language's), every marker
    word is known, every setup and check exists, and a slow or skipped block says why: a block
    nobody classified is a command nobody tests."""
    assert len(ALL_BLOCKS) >= 20  # the parser finds the docs' blocks (24 when written)
    problems = []
    for b in ALL_BLOCKS:
        if b.kind is None:
            problems.append(f"{b.id}: unclassified ```{b.lang} block (add a doc-test marker)")
        for word in b.marker:
            if word not in MARKER_WORDS:
                problems.append(f"{b.id}: unknown marker word {word!r}")
        for name in (b.get("setup") or "").split(",") if "setup" in b.marker else []:
            if name not in SETUPS:
                problems.append(f"{b.id}: unknown setup {name!r}")
        if "check" in b.marker and b.get("check") not in CHECKS:
            problems.append(f"{b.id}: unknown check {b.get('check')!r}")
        if ("slow" in b.marker or "skip" in b.marker) and not b.get("reason"):
            problems.append(f"{b.id}: slow or skip without a reason")
    assert not problems, "\n".join(problems)


def cases(docs: tuple[str, ...]) -> list:
    """One case per block of `docs`, and one per story (its blocks together)."""
    out, stories = [], {}
    for b in (b for b in ALL_BLOCKS if b.doc in docs):
        if "story" in b.marker:
            key = f"{b.doc}:{b.get('story')}"
            if key not in stories:
                stories[key] = []
                out.append((key, stories[key]))
            stories[key].append(b)
        else:
            out.append((b.id, [b]))
    params = []
    for key, blocks in out:
        marks = []
        for b in blocks:
            if "slow" in b.marker:
                marks.append(pytest.mark.slow)
            if "skip" in b.marker:
                marks.append(pytest.mark.skip(reason=b.get("reason")))
        params.append(pytest.param(blocks, id=key, marks=marks))
    return params


@pytest.mark.parametrize("blocks", cases(HERE))
def test_the_block_runs_as_the_doc_says(blocks: list[Block], made, tmp_path):
    """Each block (or story, in order) in a fresh folder with its setups: commands exit as the
    doc says, Python runs, samples are what the command before them printed, and the blocks
    that do not run as written are checked against what they describe."""
    run_case(blocks, made, tmp_path)


def run_case(blocks: list[Block], made, tmp_path: Path) -> None:
    """One case of test_the_block_runs_as_the_doc_says (shared with the other doc files)."""
    made([s for b in blocks for s in (b.get("setup") or "").split(",") if s], tmp_path)
    outputs: dict[int, str] = {}  # id(python block) -> its stdout
    last_output = ""
    for k, b in enumerate(blocks):
        if "run-by" in b.marker:
            check_run_by(b)
        elif b.kind == "python":
            if id(b) not in outputs:  # it runs with the story's next Python blocks
                group = [b]
                for later in blocks[k + 1 :]:
                    if later.kind == "python" and "run-by" not in later.marker:
                        group.append(later)
                    elif later.kind != "output" or later.get("of"):
                        break
                outputs.update(zip(map(id, group), run_python(group, tmp_path), strict=True))
            last_output = outputs[id(b)]
        elif b.kind == "commands":
            last_output = run_commands(b, tmp_path)
        elif b.kind == "file":
            name = re.match(r"#\s*([\w.]+\.py)\b", b.text)
            assert name, f"{b.id}: a file block's first line names its file"
            (tmp_path / name[1]).write_text(b.text)
        elif b.kind == "output":
            assert_not_commands(b)
            if b.get("of"):
                of = Block(b.doc, b.line, "bash", (b.get("of") or "") + "\n")
                assert_sample_in(b, run_commands(of, tmp_path))
            elif "story" in b.marker:
                assert k > 0, f"{b.id}: a story's sample follows what prints it"
                assert_sample_in(b, last_output)
        elif b.kind == "synopsis":
            check_synopsis(b)
        elif b.kind == "signatures":
            check_signatures(b)
        elif b.kind == "excerpt":
            check_excerpt(b)
        elif b.kind == "json":
            json.loads(b.text)
        elif b.kind == "fragment":
            compile(b.text, b.id, "exec")
            if b.get("check"):
                CHECKS[b.get("check") or ""](b)
        else:
            pytest.fail(f"{b.id}: unclassified")
