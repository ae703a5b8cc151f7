"""The public API: `import transformer_rosetta as tr` names exactly what `__all__` lists, with the
signatures snapshotted here (a change to either is a change of this file, made on purpose), and
the model object behaves alike in every framework."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys

import numpy as np
import pytest

import transformer_rosetta as tr
from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from parity_tests.paths import ROOT
from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.decoding.search import greedy_search, top_log_probs
from transformer_rosetta.spec.tolerances import atol_for

PUBLIC = [
    "__version__",
    "BackendUnavailable",
    "ConfigError",
    "Converted",
    "ConvertError",
    "Decoded",
    "ForwardOutput",
    "InputError",
    "ParityReport",
    "PRESETS",
    "RosettaError",
    "RosettaModel",
    "TransformerConfig",
    "WeightFile",
    "WeightFileError",
    "beam_search",
    "convert",
    "greedy_search",
    "init_weights",
    "load",
    "load_weights",
    "parity",
    "preset",
    "sample_search",
    "save_weights",
]

# The callables' signatures as inspect prints them (annotations are strings: the package uses
# `from __future__ import annotations`).
SIGNATURES = {
    "beam_search": "(start: 'StepperFactory', c: 'TransformerConfig', src: 'np.ndarray', *, beam: 'int' = 4, alpha: 'float' = 0.6, extra_len: 'int' = 50) -> 'Decoded'",
    "convert": "(src: 'str | Path', dst: 'str | Path', *, from_kind: 'str | None' = None, to_kind: 'str | None' = None, config: 'TransformerConfig | Mapping[str, Any] | str | Path | None' = None, force: 'bool' = False, allow_nonfinite: 'bool' = False, also_read: 'Sequence[str | Path | None]' = (), table: 'Any' = None, learned_positions: 'bool' = False, verify: 'bool | None' = None, onnx: 'Mapping[str, Any] | None' = None, progress: 'Callable[[str], None] | None' = None, max_shard_size: 'int | None' = None) -> 'Converted'",
    "greedy_search": "(start: 'StepperFactory', c: 'TransformerConfig', src: 'np.ndarray', *, extra_len: 'int' = 50, stop_at_eos: 'bool' = True) -> 'Decoded'",
    "init_weights": "(c: 'TransformerConfig', seed: 'int' = 0, *, scheme: 'str' = 'paper', dtype: 'str' = 'float32') -> 'dict[str, np.ndarray]'",
    "load": "(path: 'str | Path', framework: 'str' = 'torch', *, device: 'str' = 'auto', dtype: 'str | None' = None, precision: 'str' = 'highest', allow_nonfinite: 'bool' = False) -> 'RosettaModel'",
    "load_weights": "(path: 'str | Path', config: 'TransformerConfig | None' = None) -> 'WeightFile'",
    "parity": "(weights: 'str | Path | None' = None, *, preset: 'str' = 'tiny', config: 'TransformerConfig | None' = None, src: 'np.ndarray | None' = None, tgt: 'np.ndarray | None' = None, frameworks: 'Sequence[str]' = ('numpy', 'torch', 'tf', 'jax'), dtype: 'str' = 'float32', device: 'str' = 'cpu', precision: 'str' = 'highest', seed: 'int' = 0) -> 'ParityReport'",
    "preset": "(name: 'str') -> 'TransformerConfig'",
    "sample_search": "(start: 'StepperFactory', c: 'TransformerConfig', src: 'np.ndarray', *, extra_len: 'int' = 50, temperature: 'float' = 1.0, top_k: 'int | None' = None, top_p: 'float | None' = None, seed: 'int' = 0, stop_at_eos: 'bool' = True) -> 'Decoded'",
    "save_weights": "(path: 'str | Path', tensors: 'Mapping[str, np.ndarray]', config: 'TransformerConfig', producer: 'str', *, task: 'str | None' = None, max_shard_size: 'int | None' = None, metadata: 'Mapping[str, str] | None' = None) -> 'None'",
    "RosettaModel.forward": "(self, src: 'np.ndarray | Sequence[Sequence[int]] | None' = None, tgt: 'np.ndarray | Sequence[Sequence[int]] | None' = None, *, attention: 'bool' = False, hidden_states: 'bool' = False) -> 'ForwardOutput'",
    "RosettaModel.generate": "(self, inputs: 'Prompt | Sequence[Prompt]', *, max_new_tokens: 'int' = 50, beam: 'int' = 1, sample: 'bool' = False, temperature: 'float' = 1.0, top_k: 'int | None' = None, top_p: 'float | None' = None, seed: 'int' = 0, cached: 'bool' = True) -> 'Generated'",
    "RosettaModel.embed": "(self, inputs: 'str | Sequence[str] | np.ndarray', *, batch_size: 'int' = 32) -> 'np.ndarray'",
    "RosettaModel.encode": "(self, inputs: 'str | Sequence[str] | np.ndarray', *, batch_size: 'int' = 32) -> 'np.ndarray'",
    "RosettaModel.save": "(self, path: 'str | Path', *, force: 'bool' = False, max_shard_size: 'int | None' = None) -> 'Path'",
}


def test_all_is_the_snapshot():
    assert sorted(tr.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(tr, name) is not None, name
    assert set(PUBLIC) <= set(dir(tr))
    with pytest.raises(AttributeError, match="no attribute 'Model'"):
        tr.Model  # noqa: B018  (internal names are not public)


def test_signatures_are_the_snapshot():
    for name, expected in SIGNATURES.items():
        owner, _, attr = name.rpartition(".")
        obj = getattr(getattr(tr, owner), attr) if owner else getattr(tr, name)
        assert str(inspect.signature(obj)) == expected, name


def test_the_typing_block_names_every_export():
    """The TYPE_CHECKING re-exports (what type checkers read) and the lazy table (what runs) name
    the same objects from the same modules."""
    tree = ast.parse((ROOT / "common" / "__init__.py").read_text())
    typed = {
        alias.name: node.module
        for block in tree.body
        if isinstance(block, ast.If)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    }
    assert typed == tr._EXPORTS
    assert set(typed) == set(PUBLIC) - {"__version__"}


def test_version_is_the_installed_distribution_version():
    from importlib.metadata import version

    assert tr.__version__ == version("transformer-rosetta")
    assert (ROOT / "common" / "py.typed").is_file()


def test_importing_a_core_module_does_not_load_the_application():
    code = (
        "import sys, transformer_rosetta.spec.config\n"
        "print(sorted(m for m in sys.modules if m.startswith(('transformer_rosetta.app', 'scipy',"
        " 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    config = tr.preset("tiny")
    path = tmp_path_factory.mktemp("api") / "tiny.safetensors"
    tr.save_weights(path, tr.init_weights(config, seed=3, scheme="perturbed"), config, "test")
    return config, path


SRC = np.array([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])
TGT = np.array([[1, 11, 12, 13], [1, 14, 15, 0]])


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_forward_matches_the_oracle_in_every_framework(framework, tiny_file):
    backend_or_skip(framework)
    config, path = tiny_file
    oracle = tr.load(path, "numpy").forward(SRC, TGT, attention=True).named()
    model = tr.load(path, framework, device="cpu")
    assert model.framework == framework and model.dtype == "float32" and model.device == "cpu"
    got = model.forward(SRC.tolist(), TGT.tolist(), attention=True).named()
    assert set(got) == set(oracle)
    bound = atol_for("float32", config)  # docs/PARITY.md's float32 bound for this size
    for name, expected in oracle.items():
        assert np.abs(got[name] - expected).max() <= bound, name


def _oracle_margins(config, weights, src, steps):
    """The smallest gap between the best and second-best log-probability over greedy decoding."""
    model = get_backend("numpy").build(config, weights)
    decoded = greedy_search(lambda s, b, n: model.stepper(s, b, n), config, src, extra_len=steps)
    stepper = model.stepper(src, 1, steps + src.shape[1])
    feed, margins = np.full(src.shape[0], config.bos_id), []
    for t in range(max(len(row) for row in decoded.tokens)):
        values, _ = top_log_probs(stepper, feed, 2)
        margins.append((values[:, 0] - values[:, 1]).min())
        feed = np.array([row[t] if t < len(row) else config.pad_id for row in decoded.tokens])
    return decoded, min(margins)


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_generate_gives_the_oracles_tokens_in_every_framework(framework, tiny_file):
    """An encoder-decoder's greedy tokens (ids in, ids out) are the oracle's, in float64 where
    the two differ by ~1e-12, far below the smallest top-2 margin, so a flip cannot happen."""
    backend_or_skip(framework)
    config, path = tiny_file
    weights = tr.load_weights(path).tensors
    expected, margin = _oracle_margins(config, weights, SRC, steps=6)
    assert margin > 1e3 * atol_for("float64")
    model = tr.load(path, framework, device="cpu", dtype="float64")
    rows = [[5, 6, 7, 8, 2], [9, 10, 2]]
    assert model.generate(rows, max_new_tokens=6) == [list(map(int, r)) for r in expected.tokens]
    assert model.generate(rows[0], max_new_tokens=6) == list(map(int, expected.tokens[0]))
    assert model.generate(np.array(rows[0]), max_new_tokens=6, cached=False) == list(
        map(int, expected.tokens[0])
    )


def test_save_writes_what_was_loaded_and_refuses_to_overwrite(tiny_file, tmp_path):
    config, path = tiny_file
    model = tr.load(path, "numpy")
    out = model.save(tmp_path / "copy.safetensors")
    again = tr.load_weights(out)
    original = tr.load_weights(path)
    assert again.config == config
    for name, tensor in original.tensors.items():
        assert np.array_equal(again.tensors[name], tensor), name  # seeded weights: bit for bit
    with pytest.raises(tr.RosettaError, match="exists"):
        model.save(out)
    assert model.save(out, force=True) == out


def test_each_kind_refuses_what_it_cannot_do(tiny_file, tmp_path):
    config, path = tiny_file
    model = tr.load(path, "numpy")
    with pytest.raises(tr.InputError, match="cannot embed"):
        model.embed(["a sentence"])
    with pytest.raises(tr.InputError, match="no tokenizer"):
        model.generate("a sentence")
    with pytest.raises(tr.RosettaError, match="unknown framework 'pytorch'"):
        tr.load(path, "pytorch")
    encoder = tr.preset("tiny_encoder_only")
    bert = tmp_path / "enc.safetensors"
    tr.save_weights(bert, tr.init_weights(encoder, seed=0), encoder, "test")
    with pytest.raises(tr.InputError, match="cannot generate"):
        tr.load(bert, "numpy").generate([5, 6])
    with pytest.raises(tr.WeightFileError):
        tr.load(tmp_path / "absent.safetensors", "numpy")


def test_parity_is_the_report_the_cli_prints(tiny_file):
    config, path = tiny_file
    report = tr.parity(path, frameworks=["numpy"])
    assert isinstance(report, tr.ParityReport) and report.passed
    assert report.config == config and report.src.shape[0] == 4  # the CLI's default batch


TINY_BERT = ROOT / "parity_tests" / "data" / "tiny-bert"


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """The committed tiny BERT folder (make_tiny_bert.py), converted with its tokenizer, and the
    float64 BertModel embeddings transformers gave for its texts."""
    import json

    path = tmp_path_factory.mktemp("bert") / "tiny-bert.safetensors"
    tr.convert(TINY_BERT, path, from_kind="bert", verify=False)
    expected = json.loads((ROOT / "parity_tests" / "data" / "tiny-bert-expected.json").read_text())
    return path, expected["texts"], np.array(expected["embeddings"])


@pytest.mark.parametrize("framework", ["numpy", *IMPLEMENTATIONS])
def test_embed_gives_transformers_embeddings_in_every_framework(framework, tiny_bert):
    """tr.load(...).embed(texts) through the stored tokenizer: transformers' BertModel + mean
    pooling + L2 norm, within the float32 bound (1e-5, docs/PARITY.md) or float64's."""
    backend_or_skip(framework)
    path, texts, expected = tiny_bert
    model = tr.load(path, framework, device="cpu")
    got = model.embed(texts)
    assert got.shape == expected.shape
    bound = atol_for("float64" if framework == "numpy" else "float32")
    assert np.abs(got - expected).max() <= bound
    assert np.array_equal(model.encode(texts[:1]), model.embed(texts[0]))


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_a_decoder_only_model_generates_the_oracles_tokens(framework, tmp_path):
    """Prompts of two lengths, greedy: in float64, the oracle's own greedy search over its
    stepper (the search is shared; what differs per framework is every logit)."""
    backend_or_skip(framework)
    config = tr.preset("tiny_decoder_only")
    path = tmp_path / "gpt.safetensors"
    tr.save_weights(path, tr.init_weights(config, seed=5, scheme="perturbed"), config, "test")
    oracle = get_backend("numpy").build(config, tr.load_weights(path).tensors)
    prompts = [[1, 7, 8, 9], [1, 10, 11]]
    expected = []
    for prompt in prompts:
        decoded = greedy_search(
            lambda s, b, n: oracle.stepper(s, b, n), config, np.array([prompt]), extra_len=6
        )
        expected.append([int(t) for t in decoded.tokens[0]])
    model = tr.load(path, framework, device="cpu", dtype="float64")
    got = model.generate(prompts, max_new_tokens=6)
    for row, want in zip(got, expected, strict=True):
        # generate keeps the EOS that ended a row (as transformers does); the search drops it
        assert row in (want, [*want, config.eos_id])
    sampled = [
        tr.load(path, "numpy").generate(prompts[0], max_new_tokens=6, sample=True, seed=s)
        for s in (1, 1)
    ]
    assert sampled[0] == sampled[1]  # the same seed, the same tokens
