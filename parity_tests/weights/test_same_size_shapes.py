"""A tensor with the right number of elements in the wrong shape is refused, by name.

A transposed FFN kernel ([d_ff, d] where [d, d_ff] is needed), or an attention kernel laid out
as [h, d_k, d] where [d, h, d_k] is needed (and the reverse), has exactly as many elements as the
right one: a check that compared sizes, or a reshape that "fixed" it, would load it silently as
garbage weights. Every reader must refuse it and name the tensor: `load_weights`, each
framework's native loader, and `rosetta convert` from any of them.

The sizes make each wrong shape a same-size one and unambiguous: d = 12, h = 2, d_k = 6,
d_ff = 20 (the grid's tiny config, untied so that the output kernel is a tensor of its own).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from parity_tests.conftest import backend_or_skip
from parity_tests.grid import variant
from transformer_rosetta.adapter.backends import unavailable_reason
from transformer_rosetta.cli import main
from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.weights import format as fmt
from transformer_rosetta.weights.init import init_weights

# d_model = h * d_k here (the grid's key_dim rider off): the same-size wrong forms below reshape
# square projections.
CONFIG = variant("post", "relu", "sin-interleaved", "untied", True).replace(key_dim=None)
D, H, DK, DFF = CONFIG.d_model, CONFIG.num_heads, CONFIG.head_dim, CONFIG.d_ff
NATIVE = {"torch": "model.pt", "tf": "model.weights.h5", "jax": "model.msgpack"}

Rewrite = Callable[[np.ndarray], np.ndarray]
# In the canonical layout (the shared format, Keras and Flax store it as it is): each tensor and
# how it is wrongly laid out, with as many elements as the right one.
CANONICAL_WRONG: dict[str, Rewrite] = {
    # [d, d_ff] stored transposed as [d_ff, d], and [d_ff, d] as [d, d_ff]
    "encoder.layers.0.feed_forward.intermediate.kernel": lambda t: t.T,
    "decoder.layers.0.feed_forward.output.kernel": lambda t: t.T,
    # the query kernel [d, h, d_k] in the output kernel's layout [h, d_k, d], and the reverse
    "encoder.layers.1.self_attention.query.kernel": lambda t: t.transpose(1, 2, 0),
    "decoder.layers.0.cross_attention.output.kernel": lambda t: t.transpose(2, 0, 1),
    # the untied output kernel [d, V] transposed
    "output.kernel": lambda t: t.T,
}
# torch's state_dict holds nn.Linear weights as (out, in): a transposed kernel is the canonical
# shape there, and the attention kernels are (d, d) matrices, whose wrong same-size forms are the
# canonical 3-d layouts.
TORCH_WRONG: dict[str, Rewrite] = {
    "encoder.layers.0.feed_forward.intermediate.kernel": lambda t: t.T,
    "decoder.layers.0.feed_forward.output.kernel": lambda t: t.T,
    "encoder.layers.1.self_attention.query.kernel": lambda t: t.reshape(H, DK, D),
    "decoder.layers.0.cross_attention.output.kernel": lambda t: t.reshape(D, H, DK),
    "output.kernel": lambda t: t.T,
}


def test_the_wrong_shapes_are_same_size_ones():
    shapes = canonical_shapes(CONFIG)
    assert len({D, DFF, H * DK, CONFIG.tgt_vocab_size}) == 3 and DFF != D  # d = h * d_k only
    for table in (CANONICAL_WRONG, TORCH_WRONG):
        for name, wrong in table.items():
            right = np.zeros(shapes[name] if table is CANONICAL_WRONG else torch_shape(name))
            bad = wrong(right)
            assert bad.size == right.size and bad.shape != right.shape, name


def torch_shape(name: str) -> tuple[int, ...]:
    """The state_dict shape of a canonical kernel: nn.Linear's (out, in)."""
    shape = canonical_shapes(CONFIG)[name]
    if name.endswith("query.kernel"):  # [d, h, d_k] -> (h * d_k, d)
        return (math.prod(shape[1:]), shape[0])
    if name.endswith("output.kernel") and len(shape) == 3:  # [h, d_k, d] -> (d, h * d_k)
        return (shape[2], math.prod(shape[:2]))
    return shape[::-1]


def assert_each_named(problems: list[str], names: list[str], aliases: dict[str, str]) -> None:
    """One wrong-shape problem per tensor, naming it (canonically, or by the native key when the
    loader speaks in its framework's names)."""
    text = "\n".join(problems)
    for name in names:
        hits = [p for p in problems if "wrong shape" in p and aliases.get(name, name) in p]
        assert hits, f"{name} is not named as wrong-shaped in:\n{text}"


def weights() -> dict[str, np.ndarray]:
    return init_weights(CONFIG, seed=4, scheme="perturbed")


def bad_safetensors(path: Path) -> Path:
    """The shared format with every CANONICAL_WRONG tensor in its wrong same-size shape."""
    tensors = weights()
    for name, wrong in CANONICAL_WRONG.items():
        tensors[name] = np.ascontiguousarray(wrong(tensors[name]))
    metadata = {"format": fmt.FORMAT_NAME, "format_version": "1", "config": CONFIG.to_json()}
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)
    return path


def test_load_weights_refuses_same_size_wrong_shapes(tmp_path):
    path = bad_safetensors(tmp_path / "bad.safetensors")
    with pytest.raises(WeightFileError) as info:
        fmt.load_weights(path)
    assert_each_named(info.value.problems, list(CANONICAL_WRONG), {})
    for name, wrong in CANONICAL_WRONG.items():  # the message gives both shapes
        want = list(canonical_shapes(CONFIG)[name])
        got = list(wrong(np.zeros(want)).shape)
        assert f"file has {got}, config needs {want}" in "\n".join(info.value.problems), name


def bad_native(tmp_path: Path, framework: str) -> tuple[Path, dict[str, str]]:
    """A native checkpoint written by the framework, then edited so that each tensor of the wrong
    table is stored in its wrong same-size shape. Returns (path, {canonical: native name})."""
    backend = backend_or_skip(framework)
    path = tmp_path / NATIVE[framework]
    backend.save_native(path, CONFIG, weights())
    if framework == "torch":
        import torch

        from transformer_rosetta.torch_impl.weights import native_name_map

        keys = native_name_map(CONFIG)
        state = torch.load(path, map_location="cpu", weights_only=True)
        for name, wrong in TORCH_WRONG.items():
            state[keys[name]] = torch.from_numpy(wrong(state[keys[name]].numpy()).copy())
        torch.save(state, path)
        return path, {name: keys[name] for name in TORCH_WRONG}
    if framework == "tf":
        import h5py

        from transformer_rosetta.tf_impl.weights import native_layout

        where = {name: ds for ds, name in native_layout(CONFIG).items()}
        with h5py.File(path, "r+") as h5:
            for name, wrong in CANONICAL_WRONG.items():
                data = wrong(h5[where[name]][()])
                del h5[where[name]]
                h5.create_dataset(where[name], data=data)
        return path, {}
    from flax import serialization

    tree = serialization.msgpack_restore(path.read_bytes())
    for name, wrong in CANONICAL_WRONG.items():
        *parents, leaf = name.split(".")
        node = tree
        for part in parents:
            node = node[part] if part in node else node[int(part)]
        node[leaf] = np.ascontiguousarray(wrong(np.asarray(node[leaf])))
    path.write_bytes(serialization.msgpack_serialize(tree))
    return path, {}


def convert(capsys, *argv: object) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_convert_refuses_a_same_size_wrong_shape_from_the_shared_format(tmp_path, capsys):
    src = bad_safetensors(tmp_path / "bad.safetensors")
    targets = [tmp_path / "copy.safetensors"] + [
        tmp_path / NATIVE[f] for f in NATIVE if unavailable_reason(f) is None
    ]
    for dst in targets:
        code, err = convert(capsys, "convert", src, dst)
        assert code == 2, (dst, err)
        for name in CANONICAL_WRONG:
            assert name in err, (dst, name, err)
        assert not dst.exists()


@pytest.mark.parametrize("framework", list(NATIVE))
def test_each_native_loader_and_convert_refuse_same_size_wrong_shapes(tmp_path, capsys, framework):
    src, aliases = bad_native(tmp_path, framework)
    wrong = TORCH_WRONG if framework == "torch" else CANONICAL_WRONG
    with pytest.raises(WeightFileError) as info:
        backend_or_skip(framework).load_native(src, CONFIG)
    assert_each_named(info.value.problems, list(wrong), aliases)

    # `rosetta convert` from that file: exit 2, every tensor named, nothing written.
    config_file = tmp_path / "config.json"
    config_file.write_text(CONFIG.to_json())
    dst = tmp_path / "out.safetensors"
    code, err = convert(capsys, "convert", src, dst, "--config", config_file)
    assert code == 2, err
    for name in wrong:
        assert aliases.get(name, name) in err, (name, err)
    assert not dst.exists()
