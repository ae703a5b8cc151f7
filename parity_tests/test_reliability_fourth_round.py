"""The fourth hostile round's classes (issue 29), each at its root and on every command that
shares it. Signals during verification: test_reliability_post_write.py.

- A folder destination is checked against the input folders whether it exists or not: nothing
  is written inside a folder the command reads (`convert MARIAN_DIR MARIAN_DIR/sub --to marian`
  wrote a folder inside its source).
- `export --max-steps N` is bounded before any work: by max_len for learned positions, by the
  decoding cache's memory for sinusoids (10^9, 10^23 and 2^63 were a traceback and exit 1).
"""

from __future__ import annotations

import pytest

from common.app.cli.main import main
from common.files.memory import GIB, USABLE_FRACTION, available_memory
from common.files.outputs import OutputError, check_output_folder, refuse_inside_an_input
from common.porting.onnx_file import CACHE_ROWS, cache_bytes
from common.weights.format import load_weights
from parity_tests.conftest import backend_or_skip
from parity_tests.test_port_marian_export import config_of, export
from parity_tests.test_vectors import HERE

VECTOR = HERE / "post_ln_shared.safetensors"


def refused(code: int, err: str, *needles: str) -> None:
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(
    ("sub", "needle"),
    [
        ("sub", "is inside the input folder"),
        ("sub/deeper", "is inside the input folder"),
        (".", "source and destination are the same file"),
    ],
)
def test_a_marian_folder_is_never_written_inside_its_source(capsys, tmp_path, sub, needle):
    backend_or_skip("torch")
    _, folder = export(tmp_path, config_of("separate-untied-gelu"))
    before = sorted(p.name for p in folder.iterdir())
    capsys.readouterr()  # the export's own progress
    code = main(["convert", str(folder), str(folder / sub), "--to", "marian", "--force"])
    refused(code, capsys.readouterr().err, needle)
    assert sorted(p.name for p in folder.iterdir()) == before  # no sub folder, nothing replaced


def test_the_folder_check_applies_to_a_folder_that_does_not_exist_yet(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    for target in (source / "new", source / "new" / "deeper", source):
        with pytest.raises(OutputError, match="is inside the input folder"):
            check_output_folder(target, ["a.json"], what="DST", inputs=[source])
        with pytest.raises(OutputError, match="is inside the input folder"):
            refuse_inside_an_input(target, [source], "DST")
    # Beside the source, or above it, is fine (a name clash is check_output_file's to refuse).
    check_output_folder(tmp_path / "elsewhere" / "new", ["a.json"], what="DST", inputs=[source])
    assert not (tmp_path / "elsewhere").exists()  # the check makes nothing


def test_the_cache_estimate_is_the_caches_real_size():
    """cache_bytes against the arrays torch's decoder really allocates for the same request: the
    self-attention keys and values, float64 (8 bytes) as estimated."""
    torch_backend = backend_or_skip("torch")
    import torch

    from torch_impl import decode

    wf = load_weights(VECTOR)
    model = torch_backend.build(wf.config, wf.tensors, dtype="float64").module
    src = torch.full((CACHE_ROWS, 4), 5, dtype=torch.int64)
    steps = 37
    with torch.no_grad():
        cache = decode.init_cache(model, src, 1, steps)
    self_bytes = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.self_key, layer.self_value)
    )
    assert cache_bytes(wf.config, CACHE_ROWS, steps) == self_bytes


@pytest.mark.parametrize("steps", ["1000000000", str(10**23), str(2**63)])
def test_export_refuses_a_cache_that_cannot_fit_before_any_work(capsys, tmp_path, steps):
    backend_or_skip("torch")
    backend_or_skip("onnx")
    out = tmp_path / "step.onnx"
    code = main(["export", str(VECTOR), str(out), "--graph", "decoder_step", "--max-steps", steps])
    need = cache_bytes(load_weights(VECTOR).config, CACHE_ROWS, int(steps))
    assert need > available_memory() * USABLE_FRACTION
    refused(
        code,
        capsys.readouterr().err,
        f"--max-steps {steps} needs about {need / GIB:,.1f} GiB of memory",
        f"(the decoding cache for {CACHE_ROWS} rows)",
    )
    assert list(tmp_path.iterdir()) == []


def test_learned_positions_bound_max_steps_by_max_len(capsys, tmp_path):
    backend_or_skip("onnx")
    vector = HERE / "pre_ln_untied.safetensors"  # learned positions
    max_len = load_weights(vector).config.max_len
    code = main(
        ["export", str(vector), str(tmp_path / "s.onnx"), "--graph", "decoder_step",
         "--max-steps", str(max_len + 1)]
    )  # fmt: skip
    refused(code, capsys.readouterr().err, f"learned positions stop at max_len {max_len}")
