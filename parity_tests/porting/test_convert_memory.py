"""`rosetta convert` in bounded memory, by its shape rather than its RSS (benchmarks/ measure
that): the pipeline looks at each tensor a bounded number of times and keeps none of them after
its turn, a sharded destination is written, checked and read back, and `--verify` frees the
source's model before it builds the destination's."""

from __future__ import annotations

import gc
import json
import os
import signal
import time
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.paths import VECTORS
from transformer_rosetta.porting import convert as convert_module
from transformer_rosetta.porting import verify as verify_module
from transformer_rosetta.porting.convert import ConvertError, convert
from transformer_rosetta.weights.format import META_PROVENANCE, load_weights, read_header

VECTOR = VECTORS / "pre_ln_untied.safetensors"  # float64
DESTINATIONS = {"rosetta": "out.safetensors", "tf": "out.weights.h5", "jax": "out.msgpack"}


class Fresh(Mapping[str, np.ndarray]):
    """A source whose every lookup hands out a new copy of the tensor (as a reader that computes
    each on access does), counting the lookups and how many copies are alive at once: a pipeline
    that kept each tensor it saw would hold all of them."""

    def __init__(self, tensors: Mapping[str, np.ndarray]) -> None:
        self.tensors = tensors
        self.looks: Counter[str] = Counter()
        self.alive = self.most_alive = 0

    def _gone(self) -> None:
        self.alive -= 1

    def __getitem__(self, name: str) -> np.ndarray:
        self.looks[name] += 1
        copy = np.array(self.tensors[name])
        self.alive += 1
        self.most_alive = max(self.most_alive, self.alive)
        weakref.finalize(copy, self._gone)
        return copy

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


@pytest.mark.parametrize("kind", list(DESTINATIONS))
def test_the_pipeline_looks_at_each_tensor_a_few_times_and_keeps_none(tmp_path, monkeypatch, kind):
    """From the read to the summary (checks, finiteness, free space, write): each tensor is
    looked at a bounded number of times, and at most two are alive at any moment. (torch's
    writer keeps a view of each input until torch.save, which costs nothing for a mapped one;
    test_native_streaming checks it takes mapped inputs.)"""
    if kind != "rosetta":
        backend_or_skip(kind)
    wf = load_weights(VECTOR)
    source = Fresh(wf.tensors)
    monkeypatch.setattr(convert_module, "read_source", lambda *a, **k: (wf.config, source))
    done = convert(VECTOR, tmp_path / DESTINATIONS[kind], verify=False)
    assert done.tensors == len(wf.tensors) and done.dtype == "float64"
    assert set(source.looks) == set(wf.tensors)
    # check_tensors, check_finite, save_weights' own check and its write (a native writer: the
    # backend's check and the write); the first tensor once or twice more, for the file's dtype
    first, *others = source.looks.values()
    assert first <= 6 and max(others) <= 4, source.looks.most_common(3)
    assert source.most_alive <= 2, source.most_alive
    gc.collect()
    assert source.alive == 0


def test_a_sharded_destination_is_written_checked_and_read_back(tmp_path, capsys):
    """--max-shard-size: a folder of shards with the provenance record in every shard's header
    (the verification's result stamped after the write), read back bit for bit, and again as a
    source: its digest covers the index and every shard."""
    folder = tmp_path / "shards"
    size = VECTOR.stat().st_size // 3
    done = convert(VECTOR, folder, max_shard_size=size)
    names = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors.index.json" in names and len(names) >= 4, names
    record = json.loads(load_weights(folder).metadata[META_PROVENANCE])
    assert record["verify"]["passed"] and done.provenance is not None
    for shard in names[:-1]:
        _, metadata = read_header(folder / shard)
        assert metadata is not None and json.loads(metadata[META_PROVENANCE]) == record
    want = load_weights(VECTOR).tensors
    got = load_weights(folder).tensors
    assert all(got[n].tobytes() == w.tobytes() for n, w in want.items())

    # The folder as a source (its kind inferred), and its index as one: the same digest.
    back = convert(folder, tmp_path / "back.safetensors", verify=False)
    again = convert(folder / "model.safetensors.index.json", tmp_path / "again.safetensors")
    assert back.from_kind == again.from_kind == "rosetta"
    assert back.provenance and again.provenance
    assert back.provenance.source_sha256 == again.provenance.source_sha256
    (folder / names[0]).write_bytes((folder / names[0]).read_bytes()[:-1] + b"\x00")
    changed = verify_module.sha256_of(folder / "model.safetensors.index.json")
    assert changed != back.provenance.source_sha256  # a shard's byte is in the digest

    # Written again without --force: refused, naming the folder's files; with it, replaced.
    with pytest.raises(Exception, match="exists"):
        convert(VECTOR, folder, max_shard_size=size, verify=False)
    convert(VECTOR, folder, max_shard_size=size, verify=False, force=True)


def test_shards_are_the_shared_formats_only(tmp_path):
    backend_or_skip("torch")
    with pytest.raises(ConvertError, match="max_shard_size: writes the shared format"):
        convert(VECTOR, tmp_path / "out", to_kind="torch", max_shard_size=1000)
    assert list(tmp_path.iterdir()) == []


def test_verify_frees_the_source_model_before_it_builds_the_destinations(tmp_path, monkeypatch):
    """The source side runs on every probe and is gone (its Runner and the model it holds) when
    the destination's runner is made: the two models are never in memory together."""
    backend_or_skip("torch")
    native = tmp_path / "model.pt"
    config_file = tmp_path / "config.json"
    config_file.write_text(load_weights(VECTOR).config.to_json())
    convert(VECTOR, native, verify=False, config=load_weights(VECTOR).config)

    real_runner = verify_module.runner
    built: list[weakref.ref] = []
    alive_when_destination_built: list[bool] = []
    real_build = type(verify_module.native_backend("torch")).build

    def build(self, *args, **kwargs):
        model = real_build(self, *args, **kwargs)
        built.append(weakref.ref(model))
        return model

    def runner(kind: str, path: Path, config):
        if path != native:  # the destination: the source's model must be gone by now
            alive_when_destination_built.append(any(ref() is not None for ref in built))
        return real_runner(kind, path, config)

    monkeypatch.setattr(type(verify_module.native_backend("torch")), "build", build)
    monkeypatch.setattr(verify_module, "runner", runner)
    done = convert(native, tmp_path / "back.safetensors", config=load_weights(VECTOR).config)
    assert done.provenance is not None and done.provenance.verify["passed"]
    assert len(built) == 1  # the torch source's model was built, and run
    assert alive_when_destination_built == [False]


@pytest.mark.parametrize("max_shard_size", [None, 4096], ids=["one-file", "shards"])
def test_a_torch_source_s_kernels_go_into_c_order_by_torch_s_copy(
    tmp_path, monkeypatch, max_shard_size
):
    """.pt -> the shared format: a torch kernel is read as a transposed view of its (out, in)
    storage, and the writer puts it into the file's C order with the source framework's own
    copy (TorchBackend.transposing_copy), each kernel block by block, with the bytes of the
    source exactly."""
    backend_or_skip("torch")
    config = load_weights(VECTOR).config
    native = tmp_path / "model.pt"
    convert(VECTOR, native, verify=False, config=config)
    torch_backend = type(convert_module.native_backend("torch"))
    real_copy = torch_backend.transposing_copy
    shapes: list[tuple[int, ...]] = []

    def counted(out, block):
        shapes.append(block.shape)
        real_copy(out, block)

    monkeypatch.setattr(torch_backend, "transposing_copy", staticmethod(counted))
    back = tmp_path / "back.safetensors"
    convert(native, back, verify=False, config=config, max_shard_size=max_shard_size)
    views = convert_module.native_backend("torch").load_native(native, config)
    transposed = [n for n, a in views.items() if not a.flags.c_contiguous]
    assert len(transposed) >= 4 * (config.num_encoder_layers + config.num_decoder_layers)
    assert len(shapes) == len(transposed)  # each in one block: a small model's are small
    got, want = load_weights(back).tensors, load_weights(VECTOR).tensors
    assert list(got) == list(want)
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)


def test_a_signal_during_the_collection_between_the_sides_still_stops_the_command():
    """The collection that frees the source's model runs gc callbacks (JAX registers one); a
    signal that lands in one is acted on once the collection is over, not lost inside it."""
    fired: list[bool] = []

    def callback(phase: str, _info: dict) -> None:
        if phase == "start" and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler would run here, inside the callback

    gc.callbacks.append(callback)
    try:
        with pytest.raises(KeyboardInterrupt):
            verify_module._collect_garbage()
    finally:
        gc.callbacks.remove(callback)
    assert fired == [True]
