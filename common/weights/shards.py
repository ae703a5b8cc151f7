"""The shared format in shards: Hugging Face's layout, as transformers' `save_pretrained(
max_shard_size=...)` writes it (docs/FORMAT.md, "Sharded files").

A model too large for one comfortable file is a folder: `model-00001-of-0000N.safetensors`, ...,
each a complete weight file of the format (the same metadata in every one), plus
`model.safetensors.index.json` = {"metadata": {"total_parameters": P, "total_size": BYTES},
"weight_map": {tensor: shard file}}. A model that fits one shard is one `model.safetensors` in
the folder, with no index, as transformers writes it.

This module knows the layout only: the file names, which tensor goes to which shard, the index,
and the checks that need no tensor header. format.py reads the shards' headers, checks them
against the index here (`shard_problems`), and reads and writes the tensors.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from transformer_rosetta.errors import InputError, InputTypeError, WeightFileError
from transformer_rosetta.files.safe_read import (
    MAX_HEADER_BYTES,
    FileProblem,
    brief,
    is_int,
    json_type,
    listing,
    parse_json,
    read_bytes,
    shown,
)
from transformer_rosetta.spec.arguments import check_int

SINGLE_FILE = "model.safetensors"  # a model that fits one shard (transformers' SAFE_WEIGHTS_NAME)
INDEX_FILE = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
INDEX_SUFFIX = ".index.json"  # any `*.safetensors.index.json` given by name is an index
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # what save_pretrained names
# An index lists one line per tensor; a header's limit is ample for it too.
MAX_INDEX_BYTES = MAX_HEADER_BYTES

# huggingface_hub's units (parse_size_to_int: decimal, as disks are sold), and the binary ones.
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
# A size's digits at most: 20 digits of terabytes is beyond any disk, and a longer number is
# refused before Python's Fraction() spends time on it.
MAX_SIZE_DIGITS = 20


def parse_size(text: str) -> int:
    """Bytes from a size such as "2GB", "200MB", "1.5GB", "1GiB" or a plain byte count; a
    ValueError whose message is one line for anything else: 0, a negative size, an unknown unit
    ("2XB"), or a fraction of a byte ("1.5", "1.1KiB").

    KB, MB, GB and TB are powers of 10, as in huggingface_hub's parse_size_to_int, which
    transformers' save_pretrained reads its max_shard_size with, and a decimal number with a
    unit is read as it reads one ("1.5GB" is 1,500,000,000 bytes); KiB to TiB are powers of 2.
    Unlike parse_size_to_int, which truncates, a size that is no whole number of bytes is
    refused: "1.5" would otherwise become 1 byte, a shard per tensor."""
    if not isinstance(text, str):
        raise ValueError(f"{brief(text)} is not a size: give it as text, such as 2GB")
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{brief(text)} is not a size: give a number of bytes or one with a unit, such as "
            "2GB, 200MB or 500KB"
        )
    number, unit = match.groups()
    if unit.upper() not in _SIZE_UNITS:
        raise ValueError(
            f"{brief(text)}: unknown unit {brief(unit)}; use KB, MB, GB, TB (powers of 10), "
            "KiB, MiB, GiB, TiB (powers of 2), or none for bytes"
        )
    if sum(c.isdigit() for c in number) > MAX_SIZE_DIGITS:
        raise ValueError(f"{brief(text)}: more than {MAX_SIZE_DIGITS} digits is not a size")
    # Exact arithmetic: a float would round 2**63 + 1 bytes, and truncate 1.5 to 1 unnoticed.
    size = Fraction(number) * _SIZE_UNITS[unit.upper()]
    if size < 1:
        raise ValueError(f"{brief(text)}: a shard holds at least 1 byte")
    if size.denominator != 1:
        raise ValueError(
            f"{brief(text)} is not a whole number of bytes; give a whole number, or a decimal "
            "with a unit (1.5GB)"
        )
    return int(size)


def check_shard_size(value: object, name: str = "max_shard_size") -> int:
    """A max_shard_size given to the API (save_weights, RosettaModel.save, convert): an integer
    number of bytes >= 1, as --max-shard-size's parse_size gives it. A bool or a float is
    refused by type (InputTypeError), 0 or a negative count by range (InputError); a string
    too, with the way to read one ("2GB" is parse_size("2GB") bytes)."""
    if isinstance(value, str):
        raise InputTypeError(
            f"{name}: must be a number of bytes (an int >= 1), got {brief(value)}; "
            f"transformer_rosetta.weights.shards.parse_size({brief(value)}) reads a size with a "
            "unit"
        )
    size = check_int(value, name)
    if size < 1:
        raise InputError(f"{name}: a shard holds at least 1 byte, got {size}")
    return size


def split_into_shards(sizes: Mapping[str, int], max_shard_size: int) -> list[list[str]]:
    """The tensors of each shard, by huggingface_hub's rule (split_state_dict_into_shards_factory,
    which save_pretrained uses): walk the tensors in order; a tensor bigger than max_shard_size
    gets a shard of its own at once; any other closes the current shard when it would take it
    past max_shard_size, and starts the next. No packing: [6, 6, 2, 6, 2, 2] GB under 10 GB is
    [6], [6, 2], [6, 2, 2]."""
    check_shard_size(max_shard_size)  # every caller checked it: a caller's bug, named anyway
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes.items():
        if size > max_shard_size:
            shards.append([name])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    """The file of each of `count` shards: model.safetensors alone, else model-00001-of-0000N..."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def planned_files(sizes: Mapping[str, int], max_shard_size: int) -> list[str]:
    """Every file a sharded write of tensors of these byte sizes makes: its shards, and the
    index when there are several."""
    names = shard_file_names(len(split_into_shards(sizes, max_shard_size)))
    return names if len(names) == 1 else [*names, INDEX_FILE]


def layout_files(folder: str | os.PathLike) -> list[str]:
    """The files of a folder that belong to a sharded (or single-file) model of this layout: the
    ones a new write there replaces or removes."""
    try:
        names = os.listdir(folder)
    except OSError:  # no folder yet: nothing to replace
        return []
    return sorted(n for n in names if n in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.fullmatch(n))


def replaced_files(folder: str | os.PathLike, planned: Sequence[str]) -> list[str]:
    """What a sharded write of `planned` files into `folder` touches: those files and the
    layout's files already there, which it removes (a stale shard of an earlier, larger split).
    A caller checks them all (check_output_folder) so that nothing there goes without --force."""
    return sorted({*planned, *layout_files(folder)})


def index_text(weight_map: Mapping[str, str], total_size: int, total_parameters: int) -> str:
    """The index as save_pretrained writes it: its keys sorted, indented by 2, a final newline."""
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(weight_map),
    }
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


@dataclass(frozen=True)
class Layout:
    """Where a model of the shared format is: one file, or an index and the shards it names."""

    files: tuple[Path, ...]  # the safetensors files, in order (shards sorted by name)
    index: Path | None = None  # the index, for a sharded model
    weight_map: Mapping[str, str] | None = None  # tensor -> shard file name, from the index
    total_size: int | None = None  # the index's total_size, when it has one

    @property
    def sharded(self) -> bool:
        return self.index is not None


def locate(path: str | os.PathLike) -> Layout:
    """The files that make up the model at `path`: a weight file; a folder holding
    model.safetensors (preferred, as transformers prefers it) or model.safetensors.index.json;
    or an index itself. The index is parsed and checked here (its JSON, its weight_map, each
    shard's name and presence); a single file's checks are the header reader's."""
    if not os.fspath(path):  # Path("") would be the current folder
        raise WeightFileError('""', ["the file name is empty"])
    label = shown(path)
    given = Path(path)
    if given.is_dir():
        if os.path.lexists(given / SINGLE_FILE):
            return Layout((given / SINGLE_FILE,))
        if os.path.lexists(given / INDEX_FILE):
            return read_index(given / INDEX_FILE)
        # read_header's message for a folder that holds no model: "is a folder, not a weight file"
        return Layout((given,))
    if given.name.endswith(INDEX_SUFFIX):
        return read_index(given, label)
    return Layout((given,))


def _shard_name_problem(name: Any) -> str | None:
    """Why an index's shard entry is not a file of the index's folder (None when it is)."""
    if not isinstance(name, str) or not name:
        return f"{brief(name)} is not a file name"
    if os.path.isabs(name) or name != os.path.basename(name) or "\\" in name or "\0" in name:
        return f"{shown(name)} is not a file of the index's folder; refusing a path that leaves it"
    if name in (".", ".."):
        return f"{shown(name)} is not a file name"
    return None


def read_index(path: Path, label: str | None = None) -> Layout:
    """Parse and check a sharded model's index: every problem (not JSON, no weight_map, a
    total_size that is no byte count, a shard name that leaves the folder, a missing shard) in
    one WeightFileError naming the index."""
    label = label or shown(path)
    try:
        index = parse_json(read_bytes(path, "a sharded model's index", MAX_INDEX_BYTES))
    except FileProblem as exc:
        raise WeightFileError(label, [exc.problem]) from None
    if not isinstance(index, dict):
        raise WeightFileError(label, [f"the index is {json_type(index)}, not a JSON object"])
    problems: list[str] = []
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        problems.append(
            "the index lacks its weight_map, an object of tensor name -> shard file"
            if weight_map is None
            else f"the index's weight_map is {json_type(weight_map)}, not an object of tensor "
            "name -> shard file"
        )
        weight_map = {}
    metadata = index.get("metadata", {})
    total_size = metadata.get("total_size") if isinstance(metadata, dict) else None
    if not isinstance(metadata, dict):
        problems.append(f"the index's metadata is {json_type(metadata)}, not an object")
    elif total_size is not None and not (is_int(total_size) and total_size >= 0):
        problems.append(
            f"the index's total_size is {json_type(total_size)} {brief(total_size)}, not a byte "
            "count"
        )
        total_size = None
    bad: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        problem = _shard_name_problem(shard)
        if problem:
            bad.setdefault(problem, []).append(tensor)
    for problem, tensors in bad.items():
        problems.append(f"shard {problem} (for {listing(tensors)})")
    folder = path.parent
    shards = sorted({s for s in weight_map.values() if _shard_name_problem(s) is None})
    missing = [s for s in shards if not os.path.lexists(folder / s)]
    if missing:
        problems.append(f"missing shard {listing(missing)} (named by {shown(path.name)})")
    if problems:
        raise WeightFileError(label, problems)
    return Layout(tuple(folder / s for s in shards), path, dict(weight_map), total_size)


def shard_problems(
    layout: Layout,
    held: Mapping[str, Sequence[str]],
    data_bytes: int,
    metadata: Mapping[str, Mapping[str, str] | None],
) -> list[str]:
    """What is wrong with a sharded model whose shards (by file name) hold these tensors, with
    `data_bytes` bytes of tensor data in all and these metadata: a tensor claimed by two shards,
    or by another shard than the index says; one the index names that no shard holds, or one a
    shard holds that the index does not name; a total_size that is not the data's; shards that
    disagree on their metadata (each must carry the same, config first of all)."""
    problems: list[str] = []
    holders: dict[str, list[str]] = {}
    for shard, names in held.items():
        for name in names:
            holders.setdefault(name, []).append(shard)
    twice = [f"{n} ({' and '.join(s)})" for n, s in holders.items() if len(s) > 1]
    if twice:
        problems.append(f"tensors claimed by two shards ({len(twice)}): {listing(twice)}")
    weight_map = layout.weight_map or {}
    moved = [
        f"{n} (the index says {weight_map[n]}, {s[0]} holds it)"
        for n, s in holders.items()
        if len(s) == 1 and n in weight_map and weight_map[n] != s[0]
    ]
    if moved:
        problems.append(f"tensors in another shard than the index says ({len(moved)}): "
                        f"{listing(moved)}")  # fmt: skip
    absent = [n for n in weight_map if n not in holders]
    if absent:
        problems.append(
            f"tensors the index names that no shard holds ({len(absent)}): {listing(absent)}"
        )
    unlisted = [f"{n} (in {s[0]})" for n, s in holders.items() if n not in weight_map]
    if unlisted:
        problems.append(f"tensors the index does not name ({len(unlisted)}): {listing(unlisted)}")
    if layout.total_size is not None and layout.total_size != data_bytes:
        problems.append(
            f"the index's total_size is {layout.total_size} bytes, but the shards' tensors take "
            f"{data_bytes}"
        )
    files = list(metadata)
    first = (metadata[files[0]] or {}) if files else {}
    odd, keys = [], set()
    for shard in files[1:]:
        other = metadata[shard] or {}
        differ = {k for k in {*first, *other} if first.get(k) != other.get(k)}
        if differ:
            odd.append(shard)
            keys |= differ
    if odd:
        problems.append(
            f"shards disagree on their metadata ({listing(sorted(keys))}): {shown(files[0])} "
            f"and {listing(odd)}; every shard carries the same"
        )
    return problems
