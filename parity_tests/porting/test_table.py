"""Every step of the importer-table engine (common/porting/table.py, STEPS and the argument
steps), through a user's own map (`rosetta convert --map MAP.json`, common/porting/user_map.py),
with values where a wrong step shows.

One invented encoder-only model uses each step at least once: `zero_pad_row` with pad_id 3 (not
0, so a step that zeroes row 0 shows), `split:K/N` (rows of a packed matrix and of a packed
vector), `columns:K/N` (GPT-2's packed [in, 3 out] c_attn), `transpose`, `heads` (also after a
`{h}` source, one key per head), `squeeze:A` on axis 0 and on axis 1, and `scale:F` with F = 0.125
and F = -2.5 (neither 1, and multiplying by either differs from dividing by it for every nonzero
value). What `rosetta convert` writes is compared with what numpy computes here from the source
arrays, by slicing, transposing and reshaping them as each step's documented meaning says.

The way back (`from_canonical`, the engine's inverse, which Marian's export uses; the CLI has no
`--to map`) must give the source arrays again: every step inverted, the blocks of each packed key
stacked back, the per-head keys split again. Only the pad row, which the import zeroed, comes back
as zeros.

Exactness: every source value is k/8 with k a nonzero integer, |k| <= 40, in float32. Slicing,
transposing and reshaping copy values; k/8 * 0.125 = k/64 and k/8 * -2.5 = -5k/16 have at most 8
significant bits, so float32 holds them exactly, and dividing them back by 0.125 or -2.5 is exact
too (IEEE division is correctly rounded and the quotient is representable). So every comparison is
exact equality: no tolerance to derive, and none that could hide a wrong step.

Split blocks are equal by construction (`split:K/N` is block K of N equal blocks); a source whose
packed axis is not N times the canonical size is refused by name with both shapes, and a step
argument that is not K/N with K < N is refused as a one-line map error.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from transformer_rosetta.porting.table import from_canonical
from transformer_rosetta.porting.user_map import load_map
from transformer_rosetta.weights.format import load_weights

V, D, H, K, F = 7, 4, 2, 2, 6
# Scaled values are computed (a product, or its inverse's quotient), so they are compared within
# one float32 rounding (relative 2^-24) rather than bit for bit, although every one here is exact
# in IEEE arithmetic (see above). A scale that divides instead of multiplying is off by a factor
# of 64 or 6.25; copies, slices and transposes are compared the same way at no cost.
RTOL = 2.0**-24  # vocabulary, d_model, heads, d_k, d_ff; D = H * K
LAYERS = 2
PAD = 3  # not 0: a step that zeroed row 0 would keep this row
QKV = ("query", "key", "value")


def close(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal within one float32 rounding (RTOL), shapes equal."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= RTOL * np.abs(want)))


def rule(canonical: str, source: str, *steps: str) -> dict:
    return {"canonical": canonical, "source": source, "steps": list(steps)}


def layer_rules() -> list[dict]:
    """The map's entries for one encoder layer (pattern {i}), one step kind or more in each."""
    att, ff = "encoder.layers.{i}.self_attention", "encoder.layers.{i}.feed_forward"
    norm1, norm2 = "encoder.layers.{i}.self_attention_norm", "encoder.layers.{i}.feed_forward_norm"
    rules = []
    for n, proj in enumerate(QKV):
        # GPT-2's Conv1D: c_attn.weight is [in, 3 out], q | k | v along axis 1; its bias
        # [3 out], q | k | v along axis 0.
        rules.append(rule(f"{att}.{proj}.kernel", "L{i}.c_w", f"columns:{n}/3", "heads"))
        rules.append(rule(f"{att}.{proj}.bias", "L{i}.c_b", f"split:{n}/3", "heads"))
    return [
        *rules,
        # One Linear per head: head h's [d_k, d_model] block, the heads' outputs concatenated.
        rule(f"{att}.output.kernel", "L{i}.o{h}", "heads"),
        rule(f"{att}.output.bias", "L{i}.o_b", "squeeze:0"),
        rule(f"{norm1}.scale", "L{i}.ln1.g", "scale:0.125"),
        rule(f"{norm1}.bias", "L{i}.ln1.b", "squeeze:1", "scale:-2.5"),
        # Both feed-forward matrices packed as rows of one [2 d_model, d_ff] array: the first
        # block is W_1 as is ([d_model, d_ff]), the second W_2 transposed.
        rule(f"{ff}.intermediate.kernel", "L{i}.ff", "split:0/2"),
        rule(f"{ff}.output.kernel", "L{i}.ff", "split:1/2", "transpose"),
        rule(f"{ff}.intermediate.bias", "L{i}.ff_b1"),
        rule(f"{ff}.output.bias", "L{i}.ff_b2"),
        rule(f"{norm2}.scale", "L{i}.ln2.g"),
        rule(f"{norm2}.bias", "L{i}.ln2.b"),
    ]


MAP = {
    "model": "an every-step encoder",
    "config": {
        "num_decoder_layers": 0,
        "share_embeddings": False,
        "tie_output": False,
        "pad_id": PAD,
        "bos_id": 1,
        "eos_id": 2,
    },
    "needs": ["num_heads"],
    "sizes": {"src_vocab_size": ["tok", 0], "d_model": ["tok", 1], "d_ff": ["L0.ff_b1", 0]},
    "layers": {"num_encoder_layers": "L{i}."},
    "tensors": [
        rule("encoder.embedding", "tok", "zero_pad_row"),
        *layer_rules(),
    ],
}


def source_arrays() -> dict[str, np.ndarray]:
    """The model's file: every value k/8, k a nonzero integer in [-40, 40] (module docstring)."""
    rng = np.random.default_rng(7)

    def draw(*shape: int) -> np.ndarray:
        k = rng.integers(1, 41, size=shape) * rng.choice([-1, 1], size=shape)
        return (k / 8).astype(np.float32)

    out = {"tok": draw(V, D)}
    for i in range(LAYERS):
        out |= {
            f"L{i}.c_w": draw(D, 3 * D),
            f"L{i}.c_b": draw(3 * D),
            **{f"L{i}.o{h}": draw(K, D) for h in range(H)},
            f"L{i}.o_b": draw(1, D),
            f"L{i}.ln1.g": draw(D),
            f"L{i}.ln1.b": draw(D, 1),
            f"L{i}.ff": draw(2 * D, F),
            f"L{i}.ff_b1": draw(F),
            f"L{i}.ff_b2": draw(D),
            f"L{i}.ln2.g": draw(D),
            f"L{i}.ln2.b": draw(D),
        }
    return out


def expected_canonical(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The canonical tensors, by numpy from the source arrays, each step as documented: heads
    reshapes [d_model, h * d_k] to [d_model, h, d_k] and [h * d_k, d_model] to [h, d_k, d_model]."""
    s64 = {k: v.astype(np.float64) for k, v in s.items()}
    tok = s64["tok"].copy()
    tok[PAD] = 0.0  # row pad_id, and no other
    want = {"encoder.embedding": tok}
    for i in range(LAYERS):
        att, ff = f"encoder.layers.{i}.self_attention", f"encoder.layers.{i}.feed_forward"
        for n, proj in enumerate(QKV):
            want[f"{att}.{proj}.kernel"] = s64[f"L{i}.c_w"][:, n * D : (n + 1) * D].reshape(D, H, K)
            want[f"{att}.{proj}.bias"] = s64[f"L{i}.c_b"][n * D : (n + 1) * D].reshape(H, K)
        heads = np.concatenate([s64[f"L{i}.o{h}"] for h in range(H)], axis=0)  # [h * d_k, d]
        want[f"{att}.output.kernel"] = heads.reshape(H, K, D)
        want[f"{att}.output.bias"] = s64[f"L{i}.o_b"][0]
        want[f"encoder.layers.{i}.self_attention_norm.scale"] = s64[f"L{i}.ln1.g"] * 0.125
        want[f"encoder.layers.{i}.self_attention_norm.bias"] = s64[f"L{i}.ln1.b"][:, 0] * -2.5
        want[f"{ff}.intermediate.kernel"] = s64[f"L{i}.ff"][:D]
        want[f"{ff}.output.kernel"] = s64[f"L{i}.ff"][D:].T
        want[f"{ff}.intermediate.bias"] = s64[f"L{i}.ff_b1"]
        want[f"{ff}.output.bias"] = s64[f"L{i}.ff_b2"]
        want[f"encoder.layers.{i}.feed_forward_norm.scale"] = s64[f"L{i}.ln2.g"]
        want[f"encoder.layers.{i}.feed_forward_norm.bias"] = s64[f"L{i}.ln2.b"]
    return want


@pytest.fixture(scope="module")
def every_step(tmp_path_factory):
    """(folder, the source arrays, the map's path, the converted file read back)."""
    from safetensors.numpy import save_file

    from transformer_rosetta.cli import main

    folder = tmp_path_factory.mktemp("every-step")
    arrays = source_arrays()
    save_file(arrays, str(folder / "mine.safetensors"))
    (folder / "steps.map.json").write_text(json.dumps(MAP))
    (folder / "heads.json").write_text(json.dumps({"num_heads": H}))
    code = main(
        [
            "convert",
            str(folder / "mine.safetensors"),
            str(folder / "out.safetensors"),
            "--map",
            str(folder / "steps.map.json"),
            "--config",
            str(folder / "heads.json"),
        ]
    )
    assert code == 0
    return folder, arrays, folder / "steps.map.json", load_weights(folder / "out.safetensors")


def test_every_step_imports_what_numpy_computes(every_step):
    """Each canonical tensor written is exactly what numpy computes from the source arrays (see
    the module docstring for why equality is exact); float32 in, float32 out."""
    _, arrays, _, wf = every_step
    assert (wf.config.d_model, wf.config.num_heads, wf.config.d_ff) == (D, H, F)
    assert (wf.config.src_vocab_size, wf.config.num_encoder_layers) == (V, LAYERS)
    want = expected_canonical(arrays)
    assert sorted(wf.tensors) == sorted(want)  # nothing more, nothing less
    for name, value in want.items():
        got = wf.tensors[name]
        assert got.dtype == np.float32, name
        assert got.shape == value.shape, f"{name}: {got.shape} != {value.shape}"
        assert close(got, value), f"{name} differs"


def test_zero_pad_row_zeroes_row_pad_id_only(every_step):
    """pad_id 3: row 3 of the embedding is zero (the padding token adds nothing), every other
    row, row 0 included, is the file's row as stored."""
    _, arrays, _, wf = every_step
    assert wf.config.pad_id == PAD
    emb = wf.tensors["encoder.embedding"]
    assert np.array_equal(emb[PAD], np.zeros(D, np.float32))
    others = [r for r in range(V) if r != PAD]
    assert np.array_equal(emb[others], arrays["tok"][others])
    assert np.all(arrays["tok"][others] != 0)  # so a zeroed row among them would show


def test_scale_multiplies_by_its_factor(every_step):
    """scale:0.125 and scale:-2.5 multiply (k/8 -> k/64 and -5k/16); dividing would give 8 or
    -0.4 times the stored value instead, for every nonzero value drawn here."""
    _, arrays, _, wf = every_step
    for i in range(LAYERS):
        gain = wf.tensors[f"encoder.layers.{i}.self_attention_norm.scale"]
        bias = wf.tensors[f"encoder.layers.{i}.self_attention_norm.bias"]
        assert close(gain, arrays[f"L{i}.ln1.g"] / 8)  # 0.125 = 1/8
        assert close(bias, arrays[f"L{i}.ln1.b"][:, 0] * np.float32(-2.5))


def test_the_inverse_gives_back_the_source(every_step):
    """from_canonical with the same map: the file's own keys and arrays again (within RTOL)
    (scale divided back, squeezed axes restored, packed blocks stacked along their axis, the
    per-head keys split again), except the pad row, which the import set to zero."""
    _, arrays, map_path, wf = every_step
    back = from_canonical(load_map(map_path), wf.tensors, wf.config)
    want = dict(arrays)
    want["tok"] = arrays["tok"].copy()
    want["tok"][PAD] = 0.0
    assert sorted(back) == sorted(want)
    for key, value in want.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
        assert close(back[key], value), f"{key} differs after the way back"


def test_the_inverse_of_a_canonical_model_divides_by_the_scale(every_step):
    """The way out alone, from canonical tensors that did not come through the import: a gain of
    g in the model is stored as g / 0.125 = 8 g and a bias b as b / -2.5, so that importing it
    again gives g and b."""
    _, _, map_path, wf = every_step
    tensors = dict(wf.tensors)
    gain = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
    bias = np.array([1.25, -5.0, 2.5, 0.5], np.float32)
    tensors["encoder.layers.0.self_attention_norm.scale"] = gain
    tensors["encoder.layers.0.self_attention_norm.bias"] = bias
    back = from_canonical(load_map(map_path), tensors, wf.config)
    assert close(back["L0.ln1.g"], np.array([4.0, -8.0, 16.0, 2.0], np.float32))
    assert close(back["L0.ln1.b"], np.array([[-0.5], [2.0], [-1.0], [-0.2]], np.float32))


def convert_with(folder: Path, arrays: dict[str, np.ndarray], data: dict, name: str) -> int:
    from safetensors.numpy import save_file

    from transformer_rosetta.cli import main

    save_file(arrays, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.map.json").write_text(json.dumps(data))
    args = [str(folder / f"{name}.safetensors"), str(folder / f"{name}.out.safetensors")]
    return main(
        ["convert", *args, "--map", str(folder / f"{name}.map.json")]
        + ["--config", str(folder / "heads.json")]
    )


def test_a_packed_axis_that_is_not_n_blocks_is_refused_by_name(every_step, capsys):
    """split:K/N takes N equal blocks: a packed c_attn with 13 columns (no 3 equal blocks of 4)
    is refused, naming the key, the file's shape and the shape the map needs; nothing written."""
    folder, arrays, _, _ = every_step
    odd = {**arrays, "L1.c_w": np.ones((D, 3 * D + 1), np.float32)}
    capsys.readouterr()
    assert convert_with(folder, odd, MAP, "odd") == 2
    err = capsys.readouterr().err
    assert "wrong shape for L1.c_w: file has [4, 13], config needs [4, 12]" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (folder / "odd.out.safetensors").exists()


@pytest.mark.parametrize(
    "step, message",
    [
        ("split:1/3:4", "step 'split:1/3:4': expected split:K/N (block K of N along axis 0"),
        ("columns:3/3", "step 'columns:3/3': expected columns:K/N (block K of N along axis 1"),
        ("squeeze:a", "step 'squeeze:a': expected squeeze:A (drop axis A, of size 1)"),
        ("scale:1/8", "step 'scale:1/8': expected scale:F (multiply by the number F)"),
    ],
)
def test_a_step_argument_out_of_its_form_is_one_line(every_step, capsys, step, message):
    """Unequal or out-of-range blocks, a non-numeric axis, a fraction for a factor: refused as a
    map error naming the entry and the form allowed, before any weight is read; nothing written."""
    folder, arrays, _, _ = every_step
    data = json.loads(json.dumps(MAP))
    data["tensors"][1]["steps"][0] = step  # the query kernel's first step
    capsys.readouterr()
    assert convert_with(folder, arrays, data, "badstep") == 2
    err = capsys.readouterr().err
    assert f"tensors[1].steps[0]: {message}" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (folder / "badstep.out.safetensors").exists()


def test_the_inverse_undoes_steps_before_a_split(every_step):
    """A step that comes before the split (the packed array squeezed, or transposed, first) acts
    on the whole packed array: the import is the same model as the columns/split map's, and the
    way back stacks the blocks, then undoes that step, giving the file's [1, 3 d_model] bias and
    [d_model, 3 d_model] matrix again (not three [1, d_model] rows, nor the blocks transposed)."""
    folder, arrays, _, _ = every_step
    data = json.loads(json.dumps(MAP))
    for entry in data["tensors"]:
        steps = entry["steps"]
        if steps and steps[0].startswith("columns:"):  # the same blocks, another way
            entry["steps"] = ["transpose", "split:" + steps[0].split(":")[1], "transpose", "heads"]
        elif entry["source"] == "L{i}.c_b":
            entry["steps"] = ["squeeze:0", *steps]
    packed = {**arrays, **{f"L{i}.c_b": arrays[f"L{i}.c_b"][None] for i in range(LAYERS)}}
    assert convert_with(folder, packed, data, "before") == 0
    wf = load_weights(folder / "before.out.safetensors")
    want = expected_canonical(arrays)
    for name, value in want.items():
        assert close(wf.tensors[name], value), f"{name} differs"
    back = from_canonical(load_map(folder / "before.map.json"), wf.tensors, wf.config)
    packed["tok"] = arrays["tok"].copy()
    packed["tok"][PAD] = 0.0
    assert sorted(back) == sorted(packed)
    for key, value in packed.items():
        assert back[key].shape == value.shape, f"{key}: {back[key].shape} != {value.shape}"
        assert close(back[key], value), f"{key} differs after the way back"
