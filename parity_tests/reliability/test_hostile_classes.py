"""Hostile inputs by class (folder destinations, unbounded sizes, foreign files), each fixed at
its root and checked on every command that shares it. Signals during verification: reliability/test_post_write.py.

- A folder destination is checked against the input folders whether it exists or not: nothing
  is written inside a folder the command reads (`convert MARIAN_DIR MARIAN_DIR/sub --to marian`
  wrote a folder inside its source).
- `export --max-steps N` is bounded before any work: by max_len for learned positions, by the
  decoding cache's memory for sinusoids (10^9, 10^23 and 2^63 were a traceback and exit 1).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.oracle.test_vectors import HERE
from parity_tests.paths import ROOT
from parity_tests.porting.test_marian_export import config_of, export
from transformer_rosetta.cli import main
from transformer_rosetta.files.memory import GIB, USABLE_FRACTION, available_memory
from transformer_rosetta.files.outputs import (
    OutputError,
    check_output_folder,
    refuse_inside_an_input,
)
from transformer_rosetta.porting.onnx_file import CACHE_ROWS, cache_bytes
from transformer_rosetta.weights.format import load_weights

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

    from transformer_rosetta.torch_impl import decode

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


# -- every .h5 goes through one HDF5 reader ------------------------------------------------------

OUTSIDE = "datasets stored outside the file, which are never read"


def store_one_dataset_outside(src: Path, dst: Path, how: str) -> str:
    """Copy HDF5 file `src` to `dst`, its largest dataset's bytes kept in another file: raw bytes
    by external storage, or a virtual dataset over another HDF5 file. Returns that dataset's
    path. The file is otherwise what its kind's code wrote, so only this can refuse it."""
    import h5py

    with h5py.File(src, "r") as f:
        arrays = {}
        f.visititems(
            lambda n, d: arrays.__setitem__(n, d[()]) if isinstance(d, h5py.Dataset) else None
        )
    name = max(arrays, key=lambda n: arrays[n].size)
    with h5py.File(dst, "w") as out:
        for key, value in arrays.items():
            if key != name:
                out.create_dataset(key, data=value)
            elif how == "external":
                raw = dst.with_name("secret.bin")
                raw.write_bytes(value.tobytes())
                out.create_dataset(key, shape=value.shape, dtype=value.dtype,
                                   external=[(str(raw), 0, value.nbytes)])  # fmt: skip
            else:
                other = dst.with_name("other.h5")
                with h5py.File(other, "w") as o:
                    o.create_dataset("data", data=value)
                layout = h5py.VirtualLayout(shape=value.shape, dtype=value.dtype)
                layout[...] = h5py.VirtualSource(str(other), "data", shape=value.shape)
                out.create_virtual_dataset(key, layout)
    return name


def keras_sources(tmp_path: Path) -> dict[str, tuple[Path, dict]]:
    """{kind: (a .weights.h5 its own code wrote, the config fields convert needs)}."""
    import importlib

    from parity_tests.porting.test_tutorials import FIXTURES, sizes_of
    from transformer_rosetta.spec.config import preset
    from transformer_rosetta.weights.init import init_weights

    tf = backend_or_skip("tf")
    out = {}
    config = preset("tiny")
    path = tmp_path / "native.weights.h5"
    tf.save_native(path, config, init_weights(config, seed=0, dtype="float32"))
    out["keras"] = (path, config.to_dict())
    for kind in ("tf-tutorial-v1", "tf-tutorial-v2", "keras-prenorm"):
        module, _, _, ids = FIXTURES[kind]
        fx = importlib.import_module(f"parity_tests.fixtures.{module}")
        sizes = sizes_of(kind)
        path = tmp_path / f"{kind}{fx.SUFFIX}"
        fx.save(fx.make_model(sizes, seed=5, dtype="float32"), path)
        out[kind] = (path, {"num_heads": sizes["num_heads"], **ids})
    return out


@pytest.mark.parametrize("how", ["external", "virtual"])
def test_no_h5_importer_reads_a_dataset_stored_outside_its_file(capsys, tmp_path, how):
    """Every kind that reads a .weights.h5 (Keras's own, the two TensorFlow tutorials, the Keras
    pre-norm model) refuses the file by name before anything is written; the tutorial path read
    the outside bytes into the written weights before."""
    import json

    for kind, (source, fields) in keras_sources(tmp_path).items():
        folder = tmp_path / f"{kind}-{how}"
        folder.mkdir()
        crafted = folder / source.name
        name = store_one_dataset_outside(source, crafted, how)
        given = folder / "given.json"
        given.write_text(json.dumps(fields))
        out = folder / "out.safetensors"
        code = main(["convert", str(crafted), str(out), "--from", kind, "--config", str(given)])
        refused(code, capsys.readouterr().err, OUTSIDE, name)
        assert not out.exists(), kind
        # The kind inferred from the names reads it through the same reader.
        code = main(["convert", str(crafted), str(out), "--config", str(given)])
        refused(code, capsys.readouterr().err, OUTSIDE)


def test_a_map_reads_h5_through_the_same_reader(tmp_path):
    from transformer_rosetta.errors import WeightFileError
    from transformer_rosetta.porting.sources import read_source_tensors

    source, _ = keras_sources(tmp_path)["tf-tutorial-v2"]
    crafted = tmp_path / "crafted" / source.name
    crafted.parent.mkdir()
    store_one_dataset_outside(source, crafted, "external")
    with pytest.raises(WeightFileError, match=OUTSIDE):
        read_source_tensors(crafted)


def test_an_outside_fifo_is_never_opened(tmp_path):
    """External storage that names a FIFO: opening it to read would block, so a command that
    returns at all (exit 2, within the timeout) did not open it."""
    import subprocess
    import sys

    import h5py

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    crafted = tmp_path / "x.weights.h5"
    with h5py.File(crafted, "w") as h5:
        h5.create_dataset("layer/vars/0", shape=(4,), dtype="f4", external=[(str(fifo), 0, 16)])
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_rosetta", "convert", str(crafted), str(tmp_path / "o.pt"),
         "--from", "tf-tutorial-v2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2 and OUTSIDE in proc.stderr, proc.stderr
