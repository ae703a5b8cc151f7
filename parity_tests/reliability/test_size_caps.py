"""Every size cap in common/files/safe_read.py, at its boundary: the largest file it lets through
is read, one byte (or element, or level, or digit) more is refused, in one line naming the file
and the limit.

The caps are in bytes (docs: the generated limits table). Where a cap is gigabytes, the file is a
crafted .npy header claiming a shape, never the gigabytes: a header exactly at the cap passes the
size check and is then refused as truncated (it has no data), which shows which check spoke; one
element more is refused for its size. Each accepted integer dtype is checked at its own boundary,
so that a cap counted in elements instead of bytes (right only for 1-byte ids) is caught. The
limits are written out here, from their documentation, not read from the module, except where a
test lowers MAX_NPY_BYTES (read when a file is read) to check real data on both sides of it.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile

import numpy as np
import pytest

from transformer_rosetta.errors import ConfigError, InputError, WeightFileError
from transformer_rosetta.files import safe_read
from transformer_rosetta.files.safe_read import (
    FileProblem,
    parse_json,
    read_ids,
    read_ids_npz,
    read_json,
)
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.weights.format import load_weights

TWO_GIB = 2 * 1024**3  # MAX_NPY_BYTES: one token-id array
ONE_MIB = 1024**2  # MAX_CONFIG_BYTES: a config (or any small JSON file)
NPY_HEADER = 10_000  # MAX_NPY_HEADER_BYTES: numpy's own default
SAFETENSORS_HEADER = 100_000_000  # MAX_HEADER_BYTES: safetensors' own limit
JSON_DEPTH = 64  # MAX_JSON_DEPTH
INT_DIGITS = 20  # MAX_INT_DIGITS: uint64's 18446744073709551615
LISTED = 10  # MAX_LISTED
QUOTED = 80  # MAX_QUOTED_CHARS

# Every integer dtype a token-id file may hold, with its size in bytes written out; big-endian
# ones are what np.save writes for such arrays.
ID_DTYPES = [
    ("int8", 1),
    ("int16", 2),
    ("int32", 4),
    ("int64", 8),
    ("uint8", 1),
    ("uint16", 2),
    ("uint32", 4),
    ("uint64", 8),
    (">i4", 4),
    (">u8", 8),
]
# Dtypes refused whatever the size, and the words that say why.
REFUSED_DTYPES = [
    ("float16", "dtype float16; token ids must be integers"),
    ("float32", "dtype float32; token ids must be integers"),
    ("float64", "dtype float64; token ids must be integers"),
    ("bool", "dtype bool; token ids must be integers"),
    ("complex64", "dtype complex64; token ids must be integers"),
    ("<U4", "dtype <U4; token ids must be integers"),
    ("datetime64[s]", "dtype datetime64[s]; token ids must be integers"),
    ("object", "Python objects (dtype object)"),
    ([("a", "<i4")], "a structured dtype"),
]


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def npy_header(dtype: object, shape: tuple[int, ...], version: tuple[int, int]) -> bytes:
    """A .npy header, written by numpy's own writer, claiming `shape` of `dtype`, with no data."""
    f = io.BytesIO()
    header = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
        "fortran_order": False,
        "shape": shape,
    }
    if version == (1, 0):
        np.lib.format.write_array_header_1_0(f, header)
    else:
        np.lib.format.write_array_header_2_0(f, header)
    return f.getvalue()


def npz_bytes(members: dict[str, bytes]) -> bytes:
    """An .npz (a zip of .npy files, stored) holding exactly these members' bytes."""
    f = io.BytesIO()
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return f.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    f = io.BytesIO()
    np.save(f, array, allow_pickle=False)
    return f.getvalue()


# -- MAX_NPY_BYTES: a token-id array, 2 GiB --------------------------------------------------


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
@pytest.mark.parametrize(("dtype", "itemsize"), ID_DTYPES)
def test_an_ids_file_of_exactly_two_gib_passes_the_size_check(tmp_path, dtype, itemsize, version):
    """A header claiming 2 GiB of `dtype` exactly is within the cap: what stops it is that the
    file holds none of the data, and the message says so with the byte count."""
    for shape in [(1, TWO_GIB // itemsize), (1024, TWO_GIB // itemsize // 1024)]:
        path = tmp_path / "src.npy"
        path.write_bytes(npy_header(dtype, shape, version))
        with pytest.raises(InputError) as refused:
            read_ids(path, "--src")
        assert one_line(refused) == (
            f"--src: {path} is not a readable .npy array (it is truncated: its header "
            f"describes 2147483648 bytes of data, it has 0)"
        )


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
@pytest.mark.parametrize(("dtype", "itemsize"), ID_DTYPES)
def test_an_ids_file_one_element_over_two_gib_is_refused_for_its_size(
    tmp_path, dtype, itemsize, version
):
    """One element more than 2 GiB holds (itemsize bytes over) is refused from the header alone,
    naming the file, the shape, the dtype and the limit. For 8-byte ids that is 2^28 + 1 elements,
    far fewer than 2^31: a cap that counted elements would let it through."""
    count = TWO_GIB // itemsize
    for shape in [(1, count + 1), (1024, count // 1024 + 1)]:
        path = tmp_path / "src.npy"
        path.write_bytes(npy_header(dtype, shape, version))
        with pytest.raises(InputError) as refused:
            read_ids(path, "--src")
        message = one_line(refused)
        assert message.startswith(f"--src: {path} is not a readable .npy array (its header claims ")
        assert f"shape {list(shape)} of {np.dtype(dtype)}" in message
        assert message.endswith("the limit is 2 GiB)")


@pytest.mark.parametrize(("dtype", "itemsize"), [("int32", 4), ("int64", 8), ("uint16", 2)])
def test_each_array_of_an_npz_has_the_same_cap(tmp_path, dtype, itemsize):
    """--inputs (an .npz of src and tgt): each member's header is judged before it is read, by
    the same byte cap: at 2 GiB it is only truncated, one element over it is too large."""
    small = npy_bytes(np.ones((1, 3), dtype=np.int64))
    count = TWO_GIB // itemsize
    at_limit = npy_header(dtype, (1, count), (1, 0))
    over = npy_header(dtype, (1, count + 1), (1, 0))
    path = tmp_path / "inputs.npz"

    path.write_bytes(npz_bytes({"src.npy": small, "tgt.npy": at_limit}))
    with pytest.raises(InputError) as refused:
        read_ids_npz(path, "--inputs")
    assert one_line(refused) == (
        f"--inputs: {path} is not a readable .npz file (tgt: it is truncated: its header "
        f"describes 2147483648 bytes of data, it has 0)"
    )

    path.write_bytes(npz_bytes({"src.npy": over, "tgt.npy": small}))
    with pytest.raises(InputError) as refused:
        read_ids_npz(path, "--inputs")
    message = one_line(refused)
    assert message.startswith(f"--inputs: {path} is not a readable .npz file (src: its header ")
    assert message.endswith("the limit is 2 GiB)")


@pytest.mark.parametrize(("dtype", "itemsize"), ID_DTYPES)
def test_real_arrays_on_both_sides_of_a_lowered_cap(tmp_path, monkeypatch, dtype, itemsize):
    """With the cap lowered to 64 bytes (it is read when a file is read), an array of exactly 64
    bytes of `dtype` is read back whole, in a .npy and in an .npz, and one element more is
    refused naming the 64-byte limit: the cap is in bytes for every width of id."""
    monkeypatch.setattr(safe_read, "MAX_NPY_BYTES", 64)
    fits = np.arange(64 // itemsize, dtype=dtype).reshape(2, -1)
    over = np.arange(64 // itemsize + 1, dtype=dtype).reshape(1, -1)
    path, archive = tmp_path / "src.npy", tmp_path / "inputs.npz"

    np.save(path, fits)
    got = read_ids(path, "--src")
    assert got.dtype == np.dtype(dtype) and got.tolist() == fits.tolist()
    np.savez(archive, src=fits, tgt=fits)
    src, tgt = read_ids_npz(archive, "--inputs")
    assert src.tolist() == tgt.tolist() == fits.tolist()

    np.save(path, over)
    with pytest.raises(InputError) as refused:
        read_ids(path, "--src")
    assert one_line(refused).endswith(
        f"(its header claims shape [1, {64 // itemsize + 1}] of {np.dtype(dtype)}, "
        f"{64 + itemsize} bytes; the limit is 64 bytes)"
    )
    np.savez(archive, src=fits, tgt=over)
    with pytest.raises(InputError) as refused:
        read_ids_npz(archive, "--inputs")
    assert one_line(refused).endswith("; the limit is 64 bytes)")


@pytest.mark.parametrize(("dtype", "why"), REFUSED_DTYPES)
def test_other_dtypes_are_refused_whatever_their_size(tmp_path, dtype, why):
    """Only integers are token ids: a float (or bool, text, object, structured) array is refused
    for its dtype both when tiny and when its header claims more than 2 GiB, so that the message
    names the real problem."""
    path = tmp_path / "src.npy"
    for shape in [(1, 2), (1, TWO_GIB)]:
        path.write_bytes(npy_header(dtype, shape, (1, 0)))
        with pytest.raises(InputError) as refused:
            read_ids(path, "--src")
        message = one_line(refused)
        assert message.startswith(f"--src: {path} is not a readable .npy array (it holds ")
        assert why in message and "limit" not in message


# -- MAX_NPY_HEADER_BYTES: a .npy header, 10,000 bytes ---------------------------------------


def npy_with_header_of(length: int, version: tuple[int, int]) -> bytes:
    """A .npy of the int64 array [[7, 9]] whose header text is exactly `length` bytes (the dict,
    then spaces, then a newline, as numpy pads it)."""
    text = "{'descr': '<i8', 'fortran_order': False, 'shape': (1, 2), }"
    text = text + " " * (length - len(text) - 1) + "\n"
    assert len(text) == length
    size = struct.pack("<H" if version == (1, 0) else "<I", length)
    data = np.array([7, 9], dtype="<i8").tobytes()
    return b"\x93NUMPY" + bytes(version) + size + text.encode("latin1") + data


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_an_npy_header_of_10000_bytes_is_read_and_one_more_is_refused(tmp_path, version):
    path = tmp_path / "src.npy"
    path.write_bytes(npy_with_header_of(NPY_HEADER, version))
    assert read_ids(path, "--src").tolist() == [[7, 9]]

    path.write_bytes(npy_with_header_of(NPY_HEADER + 1, version))
    with pytest.raises(InputError) as refused:
        read_ids(path, "--src")
    assert one_line(refused) == (
        f"--src: {path} is not a readable .npy array (its .npy header is damaged or longer "
        f"than 10000 bytes)"
    )


# -- MAX_CONFIG_BYTES: a config file, 1 MiB --------------------------------------------------


def config_text(size: int) -> str:
    """The tiny preset's config as JSON, padded with spaces to exactly `size` bytes."""
    text = json.dumps(preset("tiny").to_dict())
    return text + " " * (size - len(text))


def test_a_config_file_of_one_mib_is_read_and_one_byte_more_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(config_text(ONE_MIB))
    assert path.stat().st_size == ONE_MIB
    assert TransformerConfig.from_file(path) == preset("tiny")

    path.write_text(config_text(ONE_MIB + 1))
    with pytest.raises(ConfigError) as refused:
        TransformerConfig.from_file(path)
    assert one_line(refused) == (
        f"invalid config: {path}: too large for a config file: 1,048,577 bytes, over the limit "
        f"of 1,048,576"
    )


def test_config_text_of_one_mib_is_parsed_and_one_character_more_is_refused():
    assert TransformerConfig.from_json(config_text(ONE_MIB)) == preset("tiny")
    with pytest.raises(ConfigError) as refused:
        TransformerConfig.from_json(config_text(ONE_MIB + 1))
    assert one_line(refused) == (
        "invalid config: the JSON text is 1048577 characters, over the limit of 1048576"
    )


# -- MAX_JSON_DEPTH and MAX_INT_DIGITS: every JSON file read -----------------------------------


def nested(depth: int, kind: str) -> str:
    """JSON nested `depth` levels: arrays [[...[1]...]] or objects {"a": {"a": ... 1}}."""
    if kind == "array":
        return "[" * depth + "1" + "]" * depth
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize("kind", ["array", "object"])
def test_json_nested_64_levels_is_read_and_65_is_refused(tmp_path, kind):
    """Depth is counted per bracket, before the parser recurses; strings holding brackets do not
    count (the last case: 64 real levels around a string of 100 brackets)."""
    path = tmp_path / "map.json"
    path.write_text(nested(JSON_DEPTH, kind))
    value = read_json(path)
    for _ in range(JSON_DEPTH):
        value = value[0] if kind == "array" else value["a"]
    assert value == 1

    path.write_text(nested(JSON_DEPTH + 1, kind))
    with pytest.raises(FileProblem) as refused:
        read_json(path)
    assert one_line(refused) == f"{path}: not usable JSON (nested deeper than 64 levels)"

    value = parse_json("[" * JSON_DEPTH + '"' + "[" * 100 + '"' + "]" * JSON_DEPTH)
    for _ in range(JSON_DEPTH):
        value = value[0]
    assert value == "[" * 100


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12345678901234567890", 12345678901234567890),
        ("18446744073709551615", 2**64 - 1),  # uint64's largest: 20 digits
        ("-12345678901234567890", -12345678901234567890),  # the sign is not a digit
    ],
)
def test_an_integer_of_20_digits_is_read(text, value):
    assert parse_json(f'{{"n": {text}}}') == {"n": value}


@pytest.mark.parametrize("text", ["123456789012345678901", "-123456789012345678901", "1" * 4301])
def test_an_integer_of_21_digits_is_refused_in_one_line(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(f'{{"d_model": {text}}}')
    digits = len(text.lstrip("-"))
    with pytest.raises(FileProblem) as refused:
        read_json(path)
    assert one_line(refused) == (
        f"{path}: not usable JSON (an integer of {digits} digits (the limit is 20))"
    )


# -- MAX_HEADER_BYTES: a weight file's header, 100,000,000 bytes ------------------------------


def test_a_weight_file_header_length_of_10_to_the_8_is_allowed_and_one_more_refused(tmp_path):
    """The first 8 bytes of a .safetensors give its header's length: 10^8 is within the limit
    (this file is then cut short, and says so), 10^8 + 1 is not a safetensors file at all."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", SAFETENSORS_HEADER) + b"{")
    with pytest.raises(WeightFileError) as refused:
        load_weights(path)
    assert one_line(refused) == (
        f"{path}: truncated: the header needs 100000000 bytes, the file has 1"
    )

    path.write_bytes(struct.pack("<Q", SAFETENSORS_HEADER + 1) + b"{")
    with pytest.raises(WeightFileError) as refused:
        load_weights(path)
    assert one_line(refused) == (
        f"{path}: not a safetensors file (no valid header length at its start)"
    )


# -- MAX_LISTED and MAX_QUOTED_CHARS: how much of a user's data one message repeats ------------


def test_a_message_lists_ten_names_then_counts_the_rest(tmp_path):
    path = tmp_path / "inputs.npz"
    names = [f"a{i:02d}" for i in range(LISTED + 1)]
    member = npy_bytes(np.ones((1, 1), dtype=np.int64))

    path.write_bytes(npz_bytes({f"{n}.npy": member for n in names[:LISTED]}))
    with pytest.raises(InputError) as refused:
        read_ids_npz(path, "--inputs")
    assert one_line(refused) == (
        f"--inputs: {path} lacks src, tgt (has a00, a01, a02, a03, a04, a05, a06, a07, a08, a09)"
    )

    path.write_bytes(npz_bytes({f"{n}.npy": member for n in names}))
    with pytest.raises(InputError) as refused:
        read_ids_npz(path, "--inputs")
    assert one_line(refused) == (
        f"--inputs: {path} lacks src, tgt (has a00, a01, a02, a03, a04, a05, a06, a07, a08, a09 "
        f"and 1 more)"
    )


def test_a_message_quotes_80_characters_of_a_value_then_cuts(tmp_path):
    """A string value is quoted whole while its repr is 80 characters (78 and the quotes), and
    cut to 77 characters and "..." from 81 on."""
    fields = preset("tiny").to_dict()
    fields["d_model"] = "x" * (QUOTED - 2)
    with pytest.raises(ConfigError) as refused:
        TransformerConfig.from_dict(fields)
    assert one_line(refused).endswith(" got '" + "x" * 78 + "'")

    fields["d_model"] = "x" * (QUOTED - 1)
    with pytest.raises(ConfigError) as refused:
        TransformerConfig.from_dict(fields)
    assert one_line(refused).endswith(" got '" + "x" * 76 + "...")
