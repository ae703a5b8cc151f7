"""`rosetta train`, `rosetta translate` and `rosetta demo`: the round trip through the shared
format in every framework, and one line with exit 2 for each bad input."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from parity_tests.paths import VECTORS
from transformer_rosetta.app.tasks import get_task
from transformer_rosetta.cli import main
from transformer_rosetta.weights.format import load_weights


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rosetta: error: "), err
    for needle in needles:
        assert needle in lines[0]


@pytest.fixture(scope="module")
def float64_file(tmp_path_factory) -> Path:
    """A numbers model trained 20 steps in torch, float64, written by `rosetta train --plot`."""
    backend_or_skip("torch")
    out = tmp_path_factory.mktemp("train") / "numbers.safetensors"
    code = main(
        ["train", "--framework", "torch", "--task", "numbers", "--steps", "20",
         "--dtype", "float64", "--out", str(out), "--plot"]
    )  # fmt: skip
    assert code == 0
    return out


def test_train_writes_the_shared_format_with_the_task_and_a_loss_curve(float64_file):
    wf = load_weights(float64_file)
    assert wf.metadata["task"] == "numbers" and wf.dtype == "float64"
    assert wf.config == get_task("numbers").config()
    png = float64_file.with_name("numbers.loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_translate_gives_the_same_text_in_every_framework(float64_file, capsys):
    # float64: the three agree to ~1e-14, so even this barely trained model decodes alike.
    texts = ["7", "40213", "999999"]
    outputs = {}
    for framework in IMPLEMENTATIONS:
        backend_or_skip(framework)
        code, out, err = run(
            capsys, "translate", "--framework", framework, "--weights", str(float64_file),
            "--dtype", "float64", "--beam", "4", "--json", *texts,
        )  # fmt: skip
        assert code == 0, err
        outputs[framework] = json.loads(out)
    first = next(iter(outputs.values()))
    assert [o["input"] for o in first] == texts
    assert all(o == first for o in outputs.values())


def test_translate_prints_input_and_output(float64_file, capsys):
    backend_or_skip("torch")
    code, out, _ = run(
        capsys, "translate", "--framework", "torch", "--weights", str(float64_file), "71", "105"
    )
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(" 71  ->  ") and lines[1].startswith("105  ->  ")


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["train", "--framework", "torch", "--task", "dates", "--out", "{tmp}/m.safetensors"],
         ["task: unknown 'dates'; known: numbers"]),
        (["train", "--framework", "torch", "--task", "numbers", "--steps", "0", "--out", "{tmp}/m.safetensors"],
         ["--steps", "must be >= 1, got 0"]),
        (["train", "--framework", "torch", "--task", "numbers", "--out", "{tmp}/no/such/m.safetensors"],
         ["--out: folder", "does not exist"]),
        (["train", "--framework", "torch", "--task", "numbers", "--out", "{tmp}/m.pt"],
         ["should end in .safetensors"]),
        (["translate", "--framework", "torch", "--weights", "{tmp}/missing.safetensors", "12"],
         ["missing.safetensors"]),
        (["translate", "--framework", "torch", "--weights", "{garbage}", "12"],
         ["not a safetensors file"]),
        (["translate", "--framework", "torch", "--weights", "{model}", "12a"],
         ["'a' not in the tokenizer", "allowed: '0123456789'"]),
        (["translate", "--framework", "torch", "--weights", "{model}", "1234567"],
         ["7 digits"]),
        (["translate", "--framework", "torch", "--weights", "{model}", "--beam", "0", "12"],
         ["--beam", "must be >= 1"]),
        (["demo", "--task", "dates"], ["task: unknown 'dates'"]),
        (["demo", "--steps", "0"], ["must be >= 1"]),
        (["demo", "--example", "x1", "--out", "{tmp}/demo"], ["'x' not in the tokenizer"]),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(argv, needles, float64_file, tmp_path, capsys):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    filled = [a.format(tmp=tmp_path, garbage=garbage, model=float64_file) for a in argv]
    code, out, err = run(capsys, *filled)
    one_line_error(code, err, *needles)
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "demo").exists()


def test_translate_needs_a_task_for_a_file_without_one(tmp_path, capsys):
    backend_or_skip("torch")
    vector = VECTORS / "post_ln_shared.safetensors"
    code, _, err = run(capsys, "translate", "--framework", "torch", "--weights", str(vector), "12")
    one_line_error(code, err, "names no task", "--task")
    code, _, err = run(
        capsys,
        "translate",
        "--framework",
        "torch",
        "--weights",
        str(vector),
        "--task",
        "numbers",
        "12",
    )
    one_line_error(code, err, "another shape than task numbers")


def demo_checks(out: str, folder: Path) -> None:
    for heading in ("1. train", "2. export", "3. translations", "4. parity", "5. files"):
        assert heading in out
    assert "test exact match (greedy, 500 held-out pairs)" in out
    assert "DIFFER" not in out and "PASS: 54 comparisons" in out
    for name in ("numbers.safetensors", "loss.png", "cross_attention.png"):
        assert str(folder / name) in out
    for png in ("loss.png", "cross_attention.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_weights(folder / "numbers.safetensors").metadata["task"] == "numbers"
    assert "   the same spec also runs decoder-only models (rosetta train --task numbers-lm)" in out


def test_demo_short_run_translates_alike_in_every_framework(tmp_path, capsys):
    for framework in IMPLEMENTATIONS:
        backend_or_skip(framework)
    code, out, err = run(capsys, "demo", "--steps", "300", "--out", str(tmp_path / "demo"))
    assert code == 0, out + err
    demo_checks(out, tmp_path / "demo")


@pytest.mark.slow
def test_demo_as_the_readme_runs_it_reaches_high_accuracy(tmp_path, capsys):
    for framework in IMPLEMENTATIONS:
        backend_or_skip(framework)
    code, out, err = run(capsys, "demo", "--out", str(tmp_path / "demo"))
    assert code == 0, out + err
    demo_checks(out, tmp_path / "demo")
    accuracy = float(out.split("held-out pairs): ")[1].split("%")[0])
    assert accuracy >= 95.0  # measured 98.4% at 3000 steps (docs/PARITY.md, "Decoding")


# -- numbers-lm: a decoder-only language model, trained and prompted --------------------------


@pytest.fixture(scope="module")
def lm_file(tmp_path_factory) -> tuple[Path, str]:
    """A numbers-lm model trained 20 steps in torch, float64, and what `rosetta train` printed."""
    backend_or_skip("torch")
    out = tmp_path_factory.mktemp("train_lm") / "lm.safetensors"
    argv = ["train", "--framework", "torch", "--task", "numbers-lm", "--steps", "20",
            "--dtype", "float64", "--out", str(out)]  # fmt: skip
    printed = io.StringIO()  # capsys is per test; this fixture is per module
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return out, printed.getvalue()


def test_train_numbers_lm_writes_a_decoder_only_model(lm_file):
    path, out = lm_file
    lines = out.splitlines()
    assert lines[0] == (
        "task numbers-lm (decoder-only LM): the numbers task for a decoder-only LM: "
        "'0 0 0 0 7 1 =' -> 'seventy-one'"
    )
    assert (
        lines[1].startswith("trained 20 steps in ") and "target tokens/s), final loss" in lines[1]
    )
    assert lines[2].startswith(
        "test exact match (greedy continuation of the prompt, 500 held-out pairs): "
    )
    assert lines[3] == f"wrote {path}"
    wf = load_weights(path)
    assert wf.metadata["task"] == "numbers-lm" and wf.config == get_task("numbers-lm").config()
    assert wf.config.kind == "decoder_only" and not any(
        n.startswith("encoder.") for n in wf.tensors
    )


def test_translate_continues_the_prompt_alike_in_every_framework(lm_file, capsys):
    path, _ = lm_file
    texts = ["7", "40213", "999999"]
    outputs = {}
    for framework in IMPLEMENTATIONS:
        backend_or_skip(framework)
        for beam in ("1", "4"):
            code, out, err = run(
                capsys, "translate", "--framework", framework, "--weights", str(path),
                "--dtype", "float64", "--beam", beam, "--json", *texts,
            )  # fmt: skip
            assert code == 0, err
            outputs[framework, beam] = json.loads(out)
    first = outputs["torch", "1"]
    assert [o["input"] for o in first] == texts
    for (_, beam), got in outputs.items():
        assert got == outputs["torch", beam]
    # The continuation is read with the sequence's vocabulary: words, digits or "=", never BOS.
    words = set(get_task("numbers-lm").target.symbols)
    assert all(set(o["output"].replace("-", " - ").split()) <= words for o in first)


def test_train_help_lists_every_task_with_its_description(capsys):
    with pytest.raises(SystemExit) as exit_code:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert exit_code.value.code == 0
    assert "--task TASK           one of: numbers, numbers-lm (see below)" in out
    assert out.rstrip().endswith(
        "tasks:\n"
        "  numbers     a number in digits -> English words, 0 to 999999 ('71' -> 'seventy-one')\n"
        "              (encoder-decoder, 3000 steps)\n"
        "  numbers-lm  the numbers task for a decoder-only LM: '0 0 0 0 7 1 =' -> 'seventy-one'\n"
        "              (decoder-only LM, 3000 steps)"
    )


def test_demo_refuses_the_decoder_only_task_and_names_the_family_in_its_help(tmp_path, capsys):
    code, out, err = run(capsys, "demo", "--task", "numbers-lm", "--out", str(tmp_path / "demo"))
    one_line_error(
        code, err, "--task numbers-lm: the demo follows an encoder-decoder and draws its "
        "cross-attention; numbers-lm trains a decoder-only model, which has none: run "
        "rosetta train --task numbers-lm",
    )  # fmt: skip
    assert out == "" and not (tmp_path / "demo").exists()
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "the same spec also runs decoder-only models (rosetta train --task numbers-lm) and "
        "encoder-only ones (rosetta convert DIR OUT.safetensors --from bert, e.g. "
        "all-MiniLM-L6-v2)" in help_text
    )
    assert "--task TASK one of: numbers --steps" in help_text
