"""`rosetta convert --map MAP.json`: a user's own importer table ports a model with invented names,
without code. The model is the Annotated Transformer fixture with every name changed (and its
position buffer squeezed to [length, d]), saved as a plain .safetensors; the map is
docs/examples/home_made.map.json, the worked example of docs/PORTING.md. Its logits must match the
fixture's own within the float32 bound (1e-5). Then every kind of mistake in a map file is one
line, exit 2, nothing written, and checked before any weight is read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.fixtures import SIZES
from parity_tests.paths import ROOT
from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.decoding.search import log_softmax
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights

EXAMPLE_MAP = ROOT / "docs" / "examples" / "home_made.map.json"
PROJECTIONS = {"0": "q", "1": "k", "2": "v", "3": "o"}
LEAVES = {"weight": "w", "bias": "b"}
# The Annotated Transformer's name -> the invented one (regex, replacement).
RENAMES = [
    (r"src_embed\.0\.lut\.weight", "emb.src"),
    (r"tgt_embed\.0\.lut\.weight", "emb.tgt"),
    (r"generator\.proj\.(weight|bias)", lambda m: f"head.{LEAVES[m[1]]}"),
    (r"(encoder|decoder)\.norm\.a_2", lambda m: f"{m[1][:3]}.norm.g"),
    (r"(encoder|decoder)\.norm\.b_2", lambda m: f"{m[1][:3]}.norm.b"),
    (
        r"(encoder|decoder)\.layers\.(\d+)\.(self_attn|src_attn)\.linears\.(\d)\.(weight|bias)",
        lambda m: (
            f"{m[1][:3]}.{m[2]}."
            f"{'attn' if m[1] == 'encoder' else 'self' if m[3] == 'self_attn' else 'cross'}."
            f"{LEAVES[m[5]]}{PROJECTIONS[m[4]]}"
        ),
    ),
    (
        r"(encoder|decoder)\.layers\.(\d+)\.sublayer\.(\d)\.norm\.(a_2|b_2)",
        lambda m: f"{m[1][:3]}.{m[2]}.norm{int(m[3]) + 1}.{'g' if m[4] == 'a_2' else 'b'}",
    ),
    (
        r"(encoder|decoder)\.layers\.(\d+)\.feed_forward\.w_(\d)\.(weight|bias)",
        lambda m: f"{m[1][:3]}.{m[2]}.ff.{LEAVES[m[4]]}{m[3]}",
    ),
]


def invented(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for key, value in state.items():
        if key == "src_embed.1.pe":
            out["pos"] = value[0]  # (1, L, d) -> (L, d)
            continue
        if key == "tgt_embed.1.pe":
            continue  # the same table
        for pattern, replacement in RENAMES:
            new, n = re.subn(f"^{pattern}$", replacement, key)
            if n:
                out[new] = value
                break
        else:
            raise AssertionError(f"no invented name for {key}")
    return out


@pytest.fixture(scope="module")
def home_made(tmp_path_factory):
    """(the fixture model, the invented-name file, a --config with the heads)."""
    backend_or_skip("torch")
    from safetensors.numpy import save_file

    from parity_tests.fixtures import annotated_transformer as fx

    model = fx.make_model(SIZES, seed=11, dtype="float32")
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    folder = tmp_path_factory.mktemp("home-made")
    save_file(invented(state), str(folder / "mine.safetensors"))
    (folder / "heads.json").write_text(json.dumps({"num_heads": 2, "pad_id": 0}))
    return model, folder


def convert(folder: Path, map_path: Path, out: str = "out.safetensors", *extra: str) -> int:
    from transformer_rosetta.cli import main

    args = ["convert", str(folder / "mine.safetensors"), str(folder / out), "--map", str(map_path)]
    return main([*args, "--config", str(folder / "heads.json"), *extra])


def test_the_worked_example_ports_the_home_made_model(home_made, capsys):
    from parity_tests.fixtures import annotated_transformer as fx

    model, folder = home_made
    assert convert(folder, EXAMPLE_MAP) == 0
    assert "(map) -> " in capsys.readouterr().out
    wf = load_weights(folder / "out.safetensors")
    assert wf.config.norm_kind == "std_plus_eps" and wf.config.max_len == 5000
    src = np.array([[5, 6, 7, 8, 0, 0], [3, 4, 9, 10, 11, 12], [7, 13, 0, 0, 0, 0]])
    tgt_in = np.array([[1, 2, 3, 0, 0], [1, 4, 5, 6, 7], [1, 8, 0, 0, 0]])
    want = fx.forward(model, src, tgt_in, 0)
    got = get_backend("torch").build(wf.config, wf.tensors).forward(src, tgt_in).logits
    real = tgt_in != 0
    real[:, 0] = True
    diff = np.abs(log_softmax(np.asarray(got, np.float64)) - want)[real].max()
    assert diff <= atol_for("float32")


def test_the_example_in_porting_md_is_the_example_file():
    text = (ROOT / "docs" / "PORTING.md").read_text()
    assert "docs/examples/home_made.map.json" in text
    first = json.loads(EXAMPLE_MAP.read_text())["tensors"][2]
    assert json.dumps(first) in text  # the excerpt shown is the file's


BROKEN = {
    "an unknown step": (
        {"steps": ["tranpose", "heads"]},
        "tensors[2].steps[0]: unknown step 'tranpose'; allowed: transpose",
    ),
    "a bad step argument": ({"steps": ["split:3/3"]}, "tensors[2].steps[0]: step 'split:3/3'"),
    "an unknown canonical name": (
        {"canonical": "encoder.layers.{i}.self_atention.query.kernel"},
        "is no canonical name (did you mean 'encoder.layers.{i}.self_attention.query.kernel'?)",
    ),
    "an unknown key": ({"sorce": "x"}, "tensors[2].sorce: unknown key (did you mean 'source'?)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_map_is_one_line_and_writes_nothing(home_made, tmp_path, capsys, case):
    _, folder = home_made
    change, message = BROKEN[case]
    data = json.loads(EXAMPLE_MAP.read_text())
    data["tensors"][2].update(change)
    bad = tmp_path / "bad.map.json"
    bad.write_text(json.dumps(data))
    assert convert(folder, bad, "broken.safetensors") == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (folder / "broken.safetensors").exists()


def test_a_map_that_misses_a_tensor_names_it(home_made, tmp_path, capsys):
    _, folder = home_made
    data = json.loads(EXAMPLE_MAP.read_text())
    del data["tensors"][3]  # encoder.layers.{i}.self_attention.query.bias
    bad = tmp_path / "short.map.json"
    bad.write_text(json.dumps(data))
    assert convert(folder, bad, "short.safetensors") == 2
    err = capsys.readouterr().err
    assert "encoder.layers.0.self_attention.query.bias: no rule in the table of a home-made" in err


def test_a_map_file_that_is_not_json_is_one_line(home_made, tmp_path, capsys):
    _, folder = home_made
    bad = tmp_path / "notjson.map.json"
    bad.write_text("{not json")
    assert convert(folder, bad, "x.safetensors") == 2
    assert "not valid JSON" in capsys.readouterr().err
