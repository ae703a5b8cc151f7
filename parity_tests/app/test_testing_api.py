"""transformer_rosetta.testing and its pytest plugin: checking a user's own port against the oracle.

- The walkthrough (docs/TESTING_YOUR_PORT.md) runs as written: its python blocks in order, each
  printing what the doc shows, and its test file under the plugin with the doc's command line.
- reference_outputs is the oracle: on the shared test vectors (written by the oracle, and read by
  the forward written from FORMAT.md alone in docs/test_format_spec.py) for each of the three kinds.
- assert_matches_reference passes on the frameworks' own float32 outputs and names the first
  diverging output of an otherwise exact one; its bound is the one docs/PARITY.md tabulates.
- The plugin: --rosetta-device, rosetta_device and rosetta_reference, through pytester.

Bounds. VECTOR_ATOL = 1e-13: PARITY.md ("Shared test vectors") states that the oracle reproduces
the vectors' outputs to 1e-13 on any machine (float64 arithmetic whose last bits depend on the
BLAS kernels, values O(1)). The float32 bound of every comparison is the library's own
(atol_for), checked here against the number PARITY.md's table prints.
"""

from __future__ import annotations

import re
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip, import_or_skip
from parity_tests.paths import ROOT, VECTORS
from transformer_rosetta.errors import InputError, WeightFileError
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.testing import (
    ReferenceInputError,
    assert_matches_reference,
    compare_to_reference,
    forward_order,
    reference_outputs,
)
from transformer_rosetta.weights.format import save_weights
from transformer_rosetta.weights.init import init_weights

pytest_plugins = ["pytester"]

DOC = ROOT / "docs" / "TESTING_YOUR_PORT.md"
PARITY = ROOT / "docs" / "PARITY.md"
VECTOR_ATOL = 1e-13  # see the module docstring
KINDS = {"tiny": "post_ln_shared", "tiny_decoder_only": "gpt_decoder_only"}
KINDS["tiny_encoder_only"] = "bert_encoder_only"

# How the walkthrough's printed numbers may differ from the doc's on another CPU. Outputs that
# pass sit below the float32 bound (1e-5) on every CPU, so two of them differ by less than it.
# Outputs that fail show the bug's size (>= 0.1 here) to 2-3 digits: the print rounds by 0.5%
# at most, and float32 rounding differs between CPUs by ~1e-6 relative. Integers (counts, layer
# indices) are within either slack only when equal.
DOC_ABS, DOC_REL = 1e-5, 0.01
NUMBER = re.compile(r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)")


# -- the walkthrough --------------------------------------------------------------------------


def doc_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of the walkthrough, in order."""
    return re.findall(r"```(\w*)\n(.*?)```", DOC.read_text(), flags=re.S)


def same_output(shown: str, actual: str) -> None:
    """The doc's printed text against what the block printed: words equal, numbers within
    DOC_ABS or DOC_REL (see above)."""
    shown_words, actual_words = shown.split(), actual.split()
    assert len(shown_words) == len(actual_words), f"printed:\n{actual}\ndoc shows:\n{shown}"
    for s, a in zip(shown_words, actual_words, strict=True):
        s_parts, a_parts = NUMBER.split(s), NUMBER.split(a)
        assert len(s_parts) == len(a_parts), f"{a!r} printed where the doc shows {s!r}"
        for i, (sp, ap) in enumerate(zip(s_parts, a_parts, strict=True)):
            if i % 2 == 0:
                assert sp == ap, f"{a!r} printed where the doc shows {s!r}"
            else:
                x, y = float(sp), float(ap)
                assert abs(x - y) <= max(DOC_ABS, DOC_REL * abs(x)), f"{a} vs the doc's {s}"


@pytest.fixture(scope="module")
def flax_loaded():
    """flax and jax, imported before pytester's function-scoped snapshot of sys.modules: it
    removes whatever a test imported afterwards, and importing jaxlib a second time in one
    process aborts it (absl: "SetTimeZone() has already been called")."""
    return import_or_skip("flax.nnx", "flax is not installed: the walkthrough's port is Flax NNX")


@pytest.fixture(scope="module")
def torch_backend():
    """torch's backend, imported before pytester's snapshot (see flax_loaded)."""
    return backend_or_skip("torch")


def test_the_walkthrough_runs_as_written(flax_loaded, pytester, monkeypatch):
    """Each python block runs in order in one folder (pytester's, the cwd); a block that opens
    with '# NAME.py' is that file, written there; a text block after a block is what it prints.
    The doc's test file then runs under the plugin with the doc's pytest command."""
    monkeypatch.delitem(sys.modules, "my_port", raising=False)
    pytester.syspathinsert()
    blocks, scope, printed, command = doc_blocks(), {}, None, None
    files, ran = [], 0
    for lang, text in blocks:
        if lang == "python":
            name = re.match(r"# (\w+\.py)\b", text)
            if name:
                (pytester.path / name[1]).write_text(text)
                files.append(name[1])
                printed = None
                continue
            out = StringIO()
            with redirect_stdout(out):
                exec(compile(text, str(DOC), "exec"), scope)
            printed, ran = out.getvalue(), ran + 1
        elif lang == "text" and printed is not None:
            same_output(text, printed)
            printed = None
        elif lang == "bash" and text.startswith("pytest "):
            command = text.split()[1:]
    assert files == ["my_port.py", "test_my_port.py"] and ran == 2
    assert scope["report"].passed and len(scope["report"].rows) == 14
    assert (pytester.path / "tiny.safetensors").is_file()
    assert command == ["test_my_port.py", "--rosetta-device", "cpu"]
    result = pytester.runpytest_inprocess(*command, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_walkthrough_plants_its_bug_where_the_report_says():
    """The doc's bug report names encoder layer 1's self-attention first: the doc's claim,
    checked on its text (the run above checks the text against the code)."""
    text = DOC.read_text()
    assert "the first, in forward order, is encoder.layers.1.self_attention" in text
    assert 'prefix = "encoder.layers.1.self_attention"' in text


# -- reference_outputs ------------------------------------------------------------------------


@pytest.mark.parametrize("preset_name", list(KINDS))
def test_reference_outputs_are_the_oracles_vectors(preset_name):
    """Every kind: the shared vectors' outputs (every array they hold) within VECTOR_ATOL, the
    hidden states besides them (embedding plus one per layer, [B, L, d]), in forward order."""
    name = KINDS[preset_name]
    with np.load(VECTORS / f"{name}.npz", allow_pickle=False) as npz:
        arrays = dict(npz)
    src, tgt = arrays.pop("src", None), arrays.pop("tgt_in", None)
    got = reference_outputs(VECTORS / f"{name}.safetensors", src, tgt)
    c = got.config
    assert c.kind == preset(preset_name).kind
    for key, want in arrays.items():
        assert got[key].shape == want.shape, key
        assert np.max(np.abs(got[key] - want)) <= VECTOR_ATOL, key
    hidden = {k for k in got if ".hidden_states." in k}
    stacks = [("encoder", c.num_encoder_layers, src), ("decoder", c.num_decoder_layers, tgt)]
    expected = {f"{s}.hidden_states.{i}" for s, n, _ in stacks for i in range(n + 1 if n else 0)}
    assert hidden == expected and set(got) == set(arrays) | expected
    for s, n, ids in stacks:
        for i in range(n + 1 if n else 0):
            assert got[f"{s}.hidden_states.{i}"].shape == (*ids.shape, c.d_model)
    assert list(got) == forward_order(got)
    without = reference_outputs(VECTORS / f"{name}.safetensors", src, tgt, hidden_states=False)
    assert set(without) == set(arrays)


def test_forward_order_is_layer_by_layer():
    names = [
        "logits",
        "decoder.hidden_states.1",
        "decoder.layers.0.cross_attention",
        "encoder_output",
        "decoder.layers.0.self_attention",
        "encoder.hidden_states.1",
        "decoder.hidden_states.0",
        "encoder.layers.0.self_attention",
        "encoder.hidden_states.0",
        "encoder.layers.10.self_attention",
        "encoder.layers.2.self_attention",
    ]
    assert forward_order(names) == [
        "encoder.hidden_states.0",
        "encoder.layers.0.self_attention",
        "encoder.hidden_states.1",
        "encoder.layers.2.self_attention",
        "encoder.layers.10.self_attention",
        "encoder_output",
        "decoder.hidden_states.0",
        "decoder.layers.0.self_attention",
        "decoder.layers.0.cross_attention",
        "decoder.hidden_states.1",
        "logits",
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny preset in float64 (perturbed: no zero bias hides anything), saved, and a ragged
    batch with a fully padded source row."""
    config = preset("tiny")
    weights = init_weights(config, seed=0, scheme="perturbed", dtype="float64")
    path = tmp_path_factory.mktemp("tiny") / "tiny.safetensors"
    save_weights(path, weights, config, producer="test")
    src, tgt = ragged_batch(config, 3, 7, 5)
    return config, weights, path, src, tgt


def test_bad_arguments_are_one_line_errors(tiny, tmp_path):
    config, weights, path, src, tgt = tiny
    cases = [
        (ReferenceInputError, "config: a mapping", lambda: reference_outputs(weights, src, tgt)),
        (InputError, "tgt: the model has a decoder", lambda: reference_outputs(path, src)),
        (InputError, "token ids must be integers", lambda: reference_outputs(path, src * 1.0, tgt)),
        (InputError, "outside the vocabulary", lambda: reference_outputs(path, src + 100, tgt)),
        (WeightFileError, "no such file", lambda: reference_outputs(tmp_path / "none.safetensors")),
        (
            ReferenceInputError,
            "dtype: unknown",
            lambda: reference_outputs(path, src, tgt, dtype="x"),
        ),
        (ReferenceInputError, "either", lambda: assert_matches_reference({})),
        (
            ReferenceInputError,
            "precision: unknown",
            lambda: compare_to_reference({}, {}, precision="x"),
        ),
        (ReferenceInputError, "the float32 bound depends", lambda: compare_to_reference({}, {})),
    ]
    for error, words, call in cases:
        with pytest.raises(error) as info:
            call()
        message = str(info.value)
        assert words in message and "\n" not in message, message
    short = dict(weights)
    del short["shared_embedding"]
    with pytest.raises(WeightFileError, match="missing tensors"):
        reference_outputs(short, src, tgt, config=config)
    with pytest.raises(ReferenceInputError, match="names: not outputs of this model: logit"):
        compare_to_reference({}, weights=path, src=src, tgt=tgt, names=["logit"])


# -- assert_matches_reference -----------------------------------------------------------------


def parity_table_bound(dtype: str) -> float:
    """The bound docs/PARITY.md's generated table prints for `dtype` at the tiny sizes."""
    row = re.search(rf"^\| {dtype} \| tiny [^|]*\| ([^|]+) \|", PARITY.read_text(), flags=re.M)
    return float(row[1])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_each_frameworks_float32_outputs_pass(tiny, framework):
    config, weights, path, src, tgt = tiny
    model = backend_or_skip(framework).build(config, weights, dtype="float32")
    out = model.forward(src, tgt, attention=True, hidden_states=True)
    report = assert_matches_reference(out.named(), weights=path, src=src, tgt=tgt)
    assert report.passed and len(report.rows) == 14  # 2 + 2 layers: 6 maps, 6 states, 2 ends
    assert {r.bound for r in report.rows} == {parity_table_bound("float32")} == {1e-5}
    assert all(0.0 < r.max_abs < 1e-5 for r in report.rows)  # float32 rounding, not zero


@pytest.fixture(scope="module")
def exact(tiny):
    """The oracle's own float32-rounded outputs as a port's: every error 0."""
    config, weights, path, src, tgt = tiny
    want = reference_outputs(path, src, tgt, dtype="float32")
    return want, {k: v.astype(np.float32) for k, v in want.items()}


def first_line(error: pytest.ExceptionInfo) -> str:
    return str(error.value).splitlines()[0]


def test_a_perturbed_attention_map_is_named_first(exact):
    """1e-3 added to one probability of encoder layer 1: the only failure, named with its size
    (the float32 copy moves it by at most one rounding of a probability, 6e-8)."""
    want, outputs = exact
    outputs = dict(outputs)
    planted = outputs["encoder.layers.1.self_attention"].copy()
    planted[0, 1, 2, 3] += 1e-3
    outputs["encoder.layers.1.self_attention"] = planted
    with pytest.raises(AssertionError) as info:
        assert_matches_reference(outputs, want)
    line = first_line(info)
    assert line.startswith("FAIL: 1 of 14 outputs diverge (float32, highest products)")
    assert "encoder.layers.1.self_attention (encoder layer 1, self-attention probabilities)" in line
    report = compare_to_reference(outputs, want)
    row = report.first_failure
    assert row.name == "encoder.layers.1.self_attention" and row.bound == 1e-5
    assert abs(row.max_abs - 1e-3) <= 1e-7
    assert f"max abs {row.max_abs:.2e} > bound 1e-05" in line


def test_a_perturbed_hidden_state_is_named_with_the_rest(exact):
    """A hidden state off by 5e-5 (five bounds) fails and is named first, with what follows it
    listed; 5e-6 (half the bound) passes: the bound is 1e-5, not tighter and not looser."""
    want, outputs = exact
    shifted = dict(outputs)
    shifted["decoder.hidden_states.1"] = outputs["decoder.hidden_states.1"] + np.float32(5e-5)
    shifted["logits"] = outputs["logits"] + np.float32(1.0)
    with pytest.raises(AssertionError) as info:
        assert_matches_reference(shifted, want)
    lines = str(info.value).splitlines()
    assert (
        "first, in forward order, is decoder.hidden_states.1 (decoder layer 0, its output)"
        in lines[0]
    )
    assert lines[1] == "diverging after it (1): logits"
    row = next(line for line in lines if line.startswith("decoder.hidden_states.1 "))
    assert row.endswith("FAIL  <- first")
    half = dict(outputs)
    half["decoder.hidden_states.1"] = outputs["decoder.hidden_states.1"] + np.float32(5e-6)
    assert assert_matches_reference(half, want).passed


def test_missing_misshaped_and_nan_outputs_are_named(exact):
    want, outputs = exact
    broken = dict(outputs)
    del broken["encoder_output"]
    broken["logits"] = outputs["logits"][:, :2]
    broken["encoder.hidden_states.0"] = np.full_like(outputs["encoder.hidden_states.0"], np.nan)
    broken["extra"] = np.zeros(3)
    report = compare_to_reference(broken, want)
    bad = {r.name: r.problem for r in report.failures}
    assert bad == {
        "encoder.hidden_states.0": "NaN or inf",
        "encoder_output": "missing",
        "logits": "shape [3, 2, 48], the reference's [3, 5, 48]",
    }
    assert report.first_failure.name == "encoder.hidden_states.0"
    assert report.ignored == ["extra"]
    assert "FAIL (missing)" in str(report) and "not compared" in str(report)
    only = compare_to_reference(broken, want, names=["decoder.hidden_states.2"])
    assert only.passed and [r.name for r in only.rows] == ["decoder.hidden_states.2"]


def test_torch_tensors_and_the_float64_bound(tiny):
    """torch outputs that require grad are read as they are; float64 is held to 1e-10, the
    PARITY.md table's float64 bound, and a float32 port fails it."""
    torch = import_or_skip("torch", "torch is not installed")
    config, weights, path, src, tgt = tiny
    want = reference_outputs(path, src, tgt)
    as_torch = {k: torch.tensor(v, requires_grad=True) for k, v in want.items()}
    report = assert_matches_reference(as_torch, want, dtype="float64")
    assert {r.bound for r in report.rows} == {parity_table_bound("float64")} == {1e-10}
    assert all(r.max_abs == 0.0 for r in report.rows)
    float32 = {k: v.detach().float() for k, v in as_torch.items()}
    assert not compare_to_reference(float32, want, dtype="float64").passed


# -- the pytest plugin ------------------------------------------------------------------------


USER_TEST = """
import numpy as np
from transformer_rosetta.oracle import reference
from transformer_rosetta.testing import assert_matches_reference
from transformer_rosetta.weights.format import load_weights

SRC, TGT = np.load("ids.npy")[:, :7], np.load("ids.npy")[:, 7:]

def test_uses_the_fixtures(rosetta_reference, rosetta_device):
    assert rosetta_device == "cpu"
    first = rosetta_reference("tiny.safetensors", SRC, TGT)
    again = rosetta_reference("tiny.safetensors", SRC, TGT)
    assert again["logits"] is first["logits"] and not first["logits"].flags.writeable
    wf = load_weights("tiny.safetensors")
    oracle = reference.forward(wf.tensors, wf.config, SRC, TGT).logits
    assert np.max(np.abs(first["logits"] - oracle)) <= 1e-13
    assert_matches_reference(first, again, dtype="float64")
"""


def test_the_plugin_gives_the_reference_and_the_device(pytester, tiny):
    """A user's test file with both fixtures and --rosetta-device cpu. The cached reference is
    the same arrays (read-only) on a second call; it is the oracle's (same operations: 1e-13)."""
    config, weights, path, src, tgt = tiny
    save_weights(pytester.path / "tiny.safetensors", weights, config, producer="test")
    np.save(pytester.path / "ids.npy", np.concatenate([src, tgt], axis=1))
    pytester.makepyfile(test_user=USER_TEST)
    result = pytester.runpytest_inprocess("--rosetta-device", "cpu", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_an_unknown_device_is_a_usage_error(pytester):
    pytester.makepyfile(test_user="def test_never(rosetta_device):\n    raise AssertionError\n")
    result = pytester.runpytest_inprocess("--rosetta-device", "tpu9", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --rosetta-device: unknown device 'tpu9'; allowed:*"])
    result.stdout.no_fnmatch_line("*test_never*")


def test_the_plugin_is_registered_and_imports_nothing_heavy():
    """Every pytest run in the environment loads it: it must not pull numpy or a framework."""
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="pytest11")}
    assert plugins.get("transformer_rosetta") == "transformer_rosetta.pytest_plugin"
    code = (
        "import sys, transformer_rosetta.pytest_plugin; "
        "print(sorted(m for m in ('numpy', 'torch', 'jax', 'tensorflow', 'keras') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_device_fixture_skips_a_missing_gpu(torch_backend, pytester):
    """A GPU that is not there skips with the reason (never passes); run only where torch sees
    no GPU, so that the test means the same on every machine that runs it. torch, imported
    already, is the framework the plugin asks."""
    if torch_backend.devices() != ["cpu"]:
        pytest.skip("a GPU is visible: the skip path cannot be taken here")
    pytester.makepyfile(test_user="def test_gpu(rosetta_device):\n    raise AssertionError\n")
    result = pytester.runpytest_inprocess(
        "--rosetta-device", "cuda:0", "-rs", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*--rosetta-device cuda:0: no such GPU visible (* sees cpu)*"])
