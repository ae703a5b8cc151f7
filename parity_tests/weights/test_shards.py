"""Sharded models: Hugging Face's layout (huggingface_hub's split, transformers' index and
reader), bit-exact round trips through load_weights, and one named problem per way a folder of
shards can be wrong, found before any tensor is read."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.weights import format as fmt
from transformer_rosetta.weights import shards
from transformer_rosetta.weights.init import init_weights

CONFIG = preset("tiny").replace(share_embeddings=False, tgt_vocab_size=40, output_bias=True)
INDEX = "model.safetensors.index.json"


def weights(dtype="float32"):
    return init_weights(CONFIG, seed=9, scheme="perturbed", dtype=dtype)


def write(tmp_path, max_shard_size, dtype="float32", name="shards", **kwargs):
    folder = tmp_path / name
    w = weights(dtype)
    fmt.save_weights(folder, w, CONFIG, "test", max_shard_size=max_shard_size, **kwargs)
    return folder, w


def problems_loading(path) -> list[str]:
    with pytest.raises(WeightFileError) as info:
        fmt.load_weights(path)
    assert str(info.value).startswith(str(path))
    return info.value.problems


def hf_split(w, max_shard_size):
    """huggingface_hub's own split (what transformers' save_pretrained writes) of the weights
    in canonical order, each tensor's size its bytes."""
    serialization = pytest.importorskip("huggingface_hub.serialization")
    ordered = {name: w[name] for name in canonical_shapes(CONFIG)}
    return serialization.split_state_dict_into_shards_factory(
        ordered,
        get_storage_size=lambda a: a.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )


# The tiny model's tensors take 64 to 2,560 bytes in float32 (47,424 in all): 1 byte gives one
# shard per tensor, 1000 puts the embeddings (over the limit) in shards of their own among the
# others, 20 KB a few shards, 1 MB one model.safetensors.
SIZES = [1, 1000, 20_000, 10**6]


@pytest.mark.parametrize("max_shard_size", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact(tmp_path, max_shard_size, dtype):
    folder, w = write(tmp_path, max_shard_size, dtype)
    for path in [folder] + ([folder / INDEX] if (folder / INDEX).exists() else []):
        loaded = fmt.load_weights(path)
        assert loaded.config == CONFIG and loaded.dtype == dtype and loaded.producer == "test"
        assert list(loaded.tensors) == list(canonical_shapes(CONFIG))
        for name, want in w.items():
            got = loaded.tensors[name]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
            assert not got.flags.writeable, name


@pytest.mark.parametrize("max_shard_size", SIZES)
def test_the_layout_is_huggingface_hubs_split(tmp_path, max_shard_size):
    folder, w = write(tmp_path, max_shard_size)
    split = hf_split(w, max_shard_size)
    assert sorted(os.listdir(folder)) == sorted(
        [*split.filename_to_tensors, *([INDEX] if split.is_sharded else [])]
    )
    for file, names in split.filename_to_tensors.items():
        with safe_open(str(folder / file), framework="np") as f:
            assert sorted(f.keys()) == sorted(names), file
    assert fmt.planned_files(CONFIG, "float32", max_shard_size) == sorted(os.listdir(folder))
    if max_shard_size == 1:
        assert len(split.filename_to_tensors) == len(w)  # one tensor a shard
    if max_shard_size == 10**6:
        assert os.listdir(folder) == ["model.safetensors"]


@pytest.mark.parametrize("max_shard_size", [1, 1000, 20_000])
def test_the_index_is_the_one_transformers_writes_and_reads(tmp_path, max_shard_size):
    from transformers.utils.hub import get_checkpoint_shard_files

    folder, w = write(tmp_path, max_shard_size)
    split = hf_split(w, max_shard_size)
    parameters = sum(a.size for a in w.values())
    # save_pretrained: {"metadata": {"total_parameters", **split.metadata}, "weight_map"},
    # json.dumps(indent=2, sort_keys=True) + "\n".
    expected = {
        "metadata": {"total_parameters": parameters, **split.metadata},
        "weight_map": split.tensor_to_filename,
    }
    text = (folder / INDEX).read_text()
    assert text == json.dumps(expected, indent=2, sort_keys=True) + "\n"
    assert split.metadata["total_size"] == sum(a.nbytes for a in w.values())
    files, metadata = get_checkpoint_shard_files(str(folder), str(folder / INDEX))
    assert sorted(metadata["all_checkpoint_keys"]) == sorted(w)
    read = {}
    for file in files:
        part = safetensors.numpy.load_file(file)
        assert not set(part) & set(read)
        read.update(part)
    assert {n: a.tobytes() for n, a in read.items()} == {n: a.tobytes() for n, a in w.items()}


def test_every_shard_carries_the_whole_metadata(tmp_path):
    folder, _ = write(tmp_path, 1000, task="numbers", metadata={"provenance": "{}"})
    files = fmt.weight_paths(folder)
    assert [f.name for f in files] == sorted(f for f in os.listdir(folder) if f != INDEX)
    for file in files:
        with safe_open(str(file), framework="np") as f:
            metadata = f.metadata()
        assert json.loads(metadata["config"]) == CONFIG.to_dict(), file
        assert metadata["format"] == "transformer-rosetta" and metadata["format_version"] == "1"
        assert (metadata["producer"], metadata["task"], metadata["provenance"]) == (
            "test",
            "numbers",
            "{}",
        )
    assert fmt.weights_size(folder) == sum(a.nbytes for a in weights().values())


def test_read_header_of_a_folder_is_the_union(tmp_path):
    folder, w = write(tmp_path, 1000)
    header, metadata = fmt.read_header(folder)
    assert set(header) == set(w)
    assert metadata["producer"] == "test"
    assert fmt.read_header(folder / INDEX)[0] == header


def test_a_folder_with_model_safetensors_reads_it_as_transformers_does(tmp_path):
    folder, w = write(tmp_path, 1000)
    other = weights() | {"output.bias": np.zeros(40, np.float32)}
    fmt.save_weights(folder / "model.safetensors", other, CONFIG, "single")
    assert fmt.load_weights(folder).producer == "single"  # transformers' preference
    assert fmt.load_weights(folder / INDEX).producer == "test"


def test_a_folder_without_a_model_is_not_a_weight_file(tmp_path):
    assert problems_loading(tmp_path) == ["is a folder, not a weight file"]


def test_a_new_split_replaces_the_old_one_whole(tmp_path):
    folder, w = write(tmp_path, 1)
    assert len(os.listdir(folder)) == len(w) + 1
    (folder / "README.md").write_text("kept")
    fmt.save_weights(folder, w, CONFIG, "second", max_shard_size=20_000)
    assert sorted(os.listdir(folder)) == sorted(
        [*fmt.planned_files(CONFIG, "float32", 20_000), "README.md"]
    )
    assert fmt.load_weights(folder).producer == "second"
    fmt.save_weights(folder, w, CONFIG, "third", max_shard_size=10**6)
    assert sorted(os.listdir(folder)) == ["README.md", "model.safetensors"]
    fmt.save_weights(folder, w, CONFIG, "fourth", max_shard_size=1000)
    assert "model.safetensors" not in os.listdir(folder)
    assert fmt.load_weights(folder).producer == "fourth"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]


def test_replaced_files_names_the_stale_shards(tmp_path):
    folder, _ = write(tmp_path, 1000)
    planned = fmt.planned_files(CONFIG, "float32", 10**6)
    assert planned == ["model.safetensors"]
    assert shards.replaced_files(folder, planned) == sorted(os.listdir(folder) + planned)
    assert shards.replaced_files(tmp_path / "none", planned) == planned


def test_add_metadata_updates_every_shard_in_place(tmp_path):
    folder, w = write(tmp_path, 1000)
    inodes = {f: f.stat().st_ino for f in fmt.weight_paths(folder)}
    fmt.add_metadata(folder, {"provenance": '{"verify": {}}'})
    for file, inode in inodes.items():
        assert file.stat().st_ino == inode
        with safe_open(str(file), framework="np") as f:
            assert f.metadata()["provenance"] == '{"verify": {}}'
    assert fmt.load_weights(folder / INDEX).metadata["provenance"] == '{"verify": {}}'


# -- what is wrong with a folder of shards, each named ------------------------------------------


def edit_index(folder, change):
    index = json.loads((folder / INDEX).read_text())
    change(index)
    (folder / INDEX).write_text(json.dumps(index))


def first_two(folder):
    return [f.name for f in fmt.weight_paths(folder)][:2]


def test_an_index_that_is_not_json(tmp_path):
    folder, _ = write(tmp_path, 1000)
    (folder / INDEX).write_text("{not json")
    (problem,) = problems_loading(folder)
    assert problem.startswith("not valid JSON")


def test_an_index_without_weight_map(tmp_path):
    folder, _ = write(tmp_path, 1000)
    edit_index(folder, lambda index: index.pop("weight_map"))
    assert problems_loading(folder) == [
        "the index lacks its weight_map, an object of tensor name -> shard file"
    ]


def test_a_missing_shard(tmp_path):
    folder, _ = write(tmp_path, 1000)
    a, _ = first_two(folder)
    (folder / a).unlink()
    assert problems_loading(folder / INDEX) == [f"missing shard {a} (named by {INDEX})"]


@pytest.mark.parametrize("name", ["../x.safetensors", "/tmp/x.safetensors", "sub/x.safetensors"])
def test_a_shard_name_that_leaves_the_folder(tmp_path, name):
    folder, _ = write(tmp_path, 1000)
    edit_index(folder, lambda index: index["weight_map"].update({"output.bias": name}))
    assert problems_loading(folder) == [
        f"shard {name} is not a file of the index's folder; refusing a path that leaves it "
        "(for output.bias)"
    ]


def test_a_tensor_claimed_by_two_shards(tmp_path):
    folder, w = write(tmp_path, 1000)
    a, b = first_two(folder)
    held = safetensors.numpy.load_file(str(folder / b))
    stolen = next(iter(safetensors.numpy.load_file(str(folder / a))))
    _, metadata = fmt.read_header(folder / a)
    safetensors.numpy.save_file({**held, stolen: w[stolen]}, str(folder / b), metadata=metadata)
    size = sum(a.nbytes for a in w.values())
    assert problems_loading(folder) == [
        f"tensors claimed by two shards (1): {stolen} ({a} and {b})",
        # the copy's bytes count too
        f"the index's total_size is {size} bytes, but the shards' tensors take "
        f"{size + w[stolen].nbytes}",
    ]


def test_a_tensor_in_another_shard_than_the_index_says(tmp_path):
    folder, _ = write(tmp_path, 1000)
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    # A shard of several tensors, so that the index still names it after one moves.
    a = next(f for f in files if list(weight_map.values()).count(f) > 1)
    b = next(f for f in files if f != a)
    name = next(n for n, f in weight_map.items() if f == a)
    edit_index(folder, lambda index: index["weight_map"].update({name: b}))
    assert problems_loading(folder) == [
        f"tensors in another shard than the index says (1): {name} (the index says {b}, {a} "
        "holds it)"
    ]


def test_a_shard_the_index_no_longer_names_is_not_read(tmp_path):
    """As in transformers, the shards are the files the index names: a tensor whose only shard
    it forgets is missing, and its bytes no longer count."""
    folder, w = write(tmp_path, 1000)
    a, b = first_two(folder)
    (name,) = safetensors.numpy.load_file(str(folder / a))  # the embedding, alone in its shard
    edit_index(folder, lambda index: index["weight_map"].update({name: b}))
    size = sum(a.nbytes for a in w.values())
    assert problems_loading(folder) == [
        f"tensors the index names that no shard holds (1): {name}",
        f"the index's total_size is {size} bytes, but the shards' tensors take "
        f"{size - w[name].nbytes}",
    ]


def test_tensors_the_index_names_that_no_shard_holds_and_the_reverse(tmp_path):
    folder, _ = write(tmp_path, 1000)
    a, _ = first_two(folder)
    index = json.loads((folder / INDEX).read_text())
    dropped = next(n for n, f in index["weight_map"].items() if f == a)

    def change(index):
        index["weight_map"]["encoder.layers.7.extra"] = a
        del index["weight_map"][dropped]

    edit_index(folder, change)
    assert problems_loading(folder) == [
        "tensors the index names that no shard holds (1): encoder.layers.7.extra",
        f"tensors the index does not name (1): {dropped} (in {a})",
    ]


def test_an_index_that_lies_about_the_size(tmp_path):
    folder, w = write(tmp_path, 1000)
    true_size = sum(a.nbytes for a in w.values())
    edit_index(folder, lambda index: index["metadata"].update({"total_size": true_size + 4}))
    assert problems_loading(folder) == [
        f"the index's total_size is {true_size + 4} bytes, but the shards' tensors take {true_size}"
    ]


def test_shards_whose_metadata_disagree(tmp_path):
    folder, _ = write(tmp_path, 1000)
    a, b = first_two(folder)
    other = CONFIG.replace(layer_norm_eps=1e-5)
    held = safetensors.numpy.load_file(str(folder / b))
    _, metadata = fmt.read_header(folder / b)
    metadata = {**metadata, "config": other.to_json()}
    safetensors.numpy.save_file(held, str(folder / b), metadata=metadata)
    assert problems_loading(folder) == [
        f"shards disagree on their metadata (config): {a} and {b}; every shard carries the same"
    ]


def test_every_shard_is_checked_before_any_tensor_is_read(tmp_path):
    """Two broken shards and the index's total_size: the header problems of both, each under
    its shard's name, in one error (the cross-checks wait for readable headers)."""
    folder, _ = write(tmp_path, 1000)
    a, b = first_two(folder)
    (folder / a).write_bytes(b"junk")
    data = (folder / b).read_bytes()
    (folder / b).write_bytes(data[:-3])
    problems = problems_loading(folder)
    assert problems[0] == f"{a}: not a safetensors file (4 bytes)"
    assert problems[1].startswith(f"{b}: truncated: the header describes")
    assert len(problems) == 2


def test_a_sharded_model_for_another_config_is_refused_as_one_file_is(tmp_path):
    folder, _ = write(tmp_path, 1000)
    other = CONFIG.replace(layer_norm_eps=1e-5)
    with pytest.raises(WeightFileError, match="config differs from the expected one in "):
        fmt.load_weights(folder, other)


def test_a_copied_folder_is_still_whole(tmp_path):
    """Nothing in the layout names the folder: a copy elsewhere reads the same."""
    folder, w = write(tmp_path, 1000)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(folder, copy)
    loaded = fmt.load_weights(copy / INDEX).tensors
    assert all(loaded[n].tobytes() == a.tobytes() for n, a in w.items())


# -- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2GB", 2 * 10**9),
        ("200MB", 200 * 10**6),
        ("500KB", 500_000),
        ("20kb", 20_000),
        ("1.5GiB", 3 * 2**29),
        ("123", 123),
        ("64B", 64),
        (" 2 GB ", 2 * 10**9),
    ],
)
def test_sizes_read_as_huggingface_hub_reads_them(text, size):
    assert shards.parse_size(text) == size
    if text.strip().upper().endswith(("KB", "MB", "GB")):
        from huggingface_hub.serialization._base import parse_size_to_int

        assert parse_size_to_int(text) == size


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("0", "'0': a shard holds at least 1 byte"),
        ("0.0001KB", "'0.0001KB': a shard holds at least 1 byte"),
        ("-1", "'-1' is not a size"),
        ("2XB", "'2XB': unknown unit 'XB'"),
        ("GB", "'GB' is not a size"),
        ("", "'' is not a size"),
    ],
)
def test_bad_sizes_are_one_line(text, problem):
    with pytest.raises(ValueError) as info:
        shards.parse_size(text)
    assert str(info.value).startswith(problem)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        # exact arithmetic: a float holds neither 2**63 + 1 nor 10**20 - 1
        ("9223372036854775809", 2**63 + 1),
        ("99999999999999999999", 10**20 - 1),  # 20 digits, the most a size may have
        ("1.000000001GB", 10**9 + 1),
        ("0.001KB", 1),  # the least a shard may hold
        (".5KB", 500),
        ("1.", 1),
        ("0.5KiB", 512),
        ("1.25KiB", 1280),
        ("2MiB", 2 * 2**20),
        ("1gib", 2**30),
        ("1TiB", 2**40),
        ("3TB", 3 * 10**12),
        ("1 B", 1),
    ],
)
def test_sizes_are_read_exactly(text, size):
    got = shards.parse_size(text)
    assert got == size and type(got) is int


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        # 1e9 + 0.1 bytes: a float would round it to 1e9 and take it
        ("1.0000000000000000001GB", "'1.0000000000000000001GB' is not a whole number of bytes"),
        ("1.1KiB", "'1.1KiB' is not a whole number of bytes"),  # 1126.4
        ("0.0015KB", "'0.0015KB' is not a whole number of bytes"),  # 1.5
        ("1.5", "'1.5' is not a whole number of bytes"),
        ("0.5", "'0.5': a shard holds at least 1 byte"),
        ("100000000000000000000", "'100000000000000000000': more than 20 digits is not a size"),
        ("2.5e3", "'2.5e3' is not a size"),  # no exponents
        ("1 2", "'1 2' is not a size"),
    ],
)
def test_sizes_that_are_no_whole_byte_count_are_refused(text, problem):
    with pytest.raises(ValueError) as info:
        shards.parse_size(text)
    assert str(info.value).startswith(problem)


def test_a_size_that_is_not_text_is_refused():
    with pytest.raises(ValueError, match=r"^5 is not a size: give it as text"):
        shards.parse_size(5)


def test_split_rule_on_huggingface_hubs_own_example():
    """[6, 6, 2, 6, 2, 2] GB under 10 GB: [6], [6, 2], [6, 2, 2] (its docstring); and a tensor
    over the limit gets its own shard at once, before the one still open."""
    sizes = dict(zip("abcdef", [6, 6, 2, 6, 2, 2], strict=True))
    assert shards.split_into_shards(sizes, 10) == [["a"], ["b", "c"], ["d", "e", "f"]]
    assert shards.split_into_shards({"a": 1, "b": 9, "c": 1}, 5) == [["b"], ["a", "c"]]
    with pytest.raises(ValueError, match="at least 1 byte"):
        shards.split_into_shards(sizes, 0)


# -- the split rule at every boundary, against huggingface_hub's own torch split ----------------


def hf_torch_split(sizes, max_shard_size):
    """The shards huggingface_hub's split_torch_state_dict_into_shards (what transformers'
    save_pretrained calls) makes of uint8 tensors of these byte sizes, each its own storage,
    read off filename_to_tensors in order."""
    torch = pytest.importorskip("torch")
    from huggingface_hub import split_torch_state_dict_into_shards

    state_dict = {name: torch.empty(size, dtype=torch.uint8) for name, size in sizes.items()}
    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
    return [list(names) for names in split.filename_to_tensors.values()]


# (sizes in bytes, max_shard_size, the shards by hand: a tensor larger than the limit gets its own
# shard at once, before the open one; any other joins the open shard unless it would take it past
# the limit, and then opens the next).
BOUNDARY_CASES = {
    # exactly the limit is not over it: no shard of its own at once, but nothing shares with it
    "exactly the limit between small ones": ({"a": 1, "b": 5, "c": 1}, 5, [["a"], ["b"], ["c"]]),
    "exactly the limit alone": ({"a": 5}, 5, [["a"]]),
    "two of exactly the limit": ({"a": 5, "b": 5}, 5, [["a"], ["b"]]),
    "exactly filling one shard": ({"a": 2, "b": 3}, 5, [["a", "b"]]),
    "exactly filling, then one more": ({"a": 2, "b": 3, "c": 1}, 5, [["a", "b"], ["c"]]),
    "one byte short of filling": ({"a": 2, "b": 2, "c": 1}, 5, [["a", "b", "c"]]),
    "one byte past filling": ({"a": 2, "b": 2, "c": 2}, 5, [["a", "b"], ["c"]]),
    "one byte over the limit alone": ({"a": 6}, 5, [["a"]]),
    "one byte over the limit first": ({"a": 6, "b": 1, "c": 4}, 5, [["a"], ["b", "c"]]),
    "one byte over the limit last": ({"a": 1, "b": 4, "c": 6}, 5, [["c"], ["a", "b"]]),
    # the oversized shard is appended at once, before the open one, which goes on after it
    "oversized between small ones": ({"a": 1, "b": 6, "c": 1}, 5, [["b"], ["a", "c"]]),
    "two oversized between small ones": (
        {"a": 1, "b": 7, "c": 2, "d": 9, "e": 2},
        5,
        [["b"], ["d"], ["a", "c", "e"]],
    ),
    "a zero-size tensor alone": ({"z": 0}, 5, [["z"]]),
    "a zero-size tensor on a full shard": ({"a": 5, "z": 0}, 5, [["a", "z"]]),
    "a zero-size tensor after an oversized one": ({"a": 6, "z": 0}, 5, [["a"], ["z"]]),
    "a zero-size tensor first": ({"z": 0, "a": 5, "b": 1}, 5, [["z", "a"], ["b"]]),
    "one byte a shard": ({"a": 1, "b": 1, "c": 1}, 1, [["a"], ["b"], ["c"]]),
    "every tensor over a 1-byte limit": ({"a": 2, "b": 1, "c": 3}, 1, [["a"], ["c"], ["b"]]),
    "everything in one shard": ({"a": 1, "b": 2, "c": 3}, 10**6, [["a", "b", "c"]]),
}


@pytest.mark.parametrize("case", list(BOUNDARY_CASES))
def test_the_split_at_each_boundary_is_huggingface_hubs(case):
    """Each boundary of the rule (a tensor of exactly the limit, a shard filled exactly, one
    byte over, an oversized tensor among small ones, a tensor of no bytes) gives the shards
    written by hand, and those are what huggingface_hub's torch split gives."""
    sizes, max_shard_size, want = BOUNDARY_CASES[case]
    assert hf_torch_split(sizes, max_shard_size) == want  # the hand-written list is its rule
    assert shards.split_into_shards(sizes, max_shard_size) == want
    assert shards.planned_files(sizes, max_shard_size) == (
        ["model.safetensors"]
        if len(want) == 1
        else [*shards.shard_file_names(len(want)), "model.safetensors.index.json"]
    )


def _sizes_and_limit():
    from hypothesis import strategies as st

    # At most one zero-size tensor: huggingface_hub's torch split gives every empty tensor the
    # same storage id (data pointer 0, 0 bytes) and so puts them all in the first one's shard,
    # which no model of ours holds (every tensor has at least one element).
    sizes = st.lists(st.integers(1, 12), min_size=1, max_size=8)
    zero_at = st.one_of(st.none(), st.integers(0, 8))
    return st.tuples(sizes, zero_at, st.integers(1, 12))


def test_the_split_is_huggingface_hubs_on_many_small_cases():
    """A few hundred random size lists (1 to 12 bytes each, perhaps one of 0) under limits of 1
    to 12 bytes, so that every boundary (equal, one over, one under, oversized) comes up often:
    our split is huggingface_hub's torch split, shard for shard, in order."""
    pytest.importorskip("torch")
    from hypothesis import given, settings

    @settings(max_examples=300, deadline=None, database=None)
    @given(_sizes_and_limit())
    def check(drawn):
        values, zero_at, max_shard_size = drawn
        if zero_at is not None:
            values = [*values[:zero_at], 0, *values[zero_at:]]
        sizes = {f"t{i}": size for i, size in enumerate(values)}
        assert shards.split_into_shards(sizes, max_shard_size) == hf_torch_split(
            sizes, max_shard_size
        )

    check()
