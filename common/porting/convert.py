"""`rosetta convert`: move weights between the shared format, each framework's native checkpoint,
and outside models (torch.nn.Transformer, Hugging Face Marian, the four tutorials' models of
common/porting/tutorials.py, the decoder-only GPTs of common/porting/gpt.py, the Llama family of
common/porting/llama.py and meta_llama.py, and a user's own model through a JSON map,
common/porting/user_map.py).

Every conversion reads and validates the whole source first (all problems at once), then writes
atomically, and never overwrites the destination unless asked to. Framework files are read and
written through the backend registry, so this module imports no framework itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from transformer_rosetta.adapter.backends import NATIVE_BACKENDS, native_backend, tensor_reader
from transformer_rosetta.errors import ConfigError, InputTypeError, RosettaError, WeightFileError
from transformer_rosetta.files.memory import fits_problem
from transformer_rosetta.files.outputs import check_free_space, check_output_file, publish, staged
from transformer_rosetta.files.safe_read import brief, regular_file, shown
from transformer_rosetta.porting.tokenizer import carried_note, source_tokenizer
from transformer_rosetta.porting.verify import (
    PROBE_SHAPES,
    BackgroundDigest,
    Provenance,
    VerificationFailed,
    difference_text,
    package_version,
    why_not_runnable,
)
from transformer_rosetta.porting.verify import verify as run_verification
from transformer_rosetta.spec.arguments import (
    check_callable,
    check_choice,
    check_flag,
    check_mapping,
    check_path,
)
from transformer_rosetta.spec.config import TransformerConfig, is_inline_json, read_config_fields
from transformer_rosetta.spec.dtypes import DTYPES, dtype_name
from transformer_rosetta.spec.names import canonical_shapes, parameter_count, position_buffer_count
from transformer_rosetta.weights import shards
from transformer_rosetta.weights.format import (
    FORMAT_NAME,
    META_FORMAT,
    check_finite,
    check_tensors,
    load_weights,
    nonfinite_counts,
    planned_files,
    publish_weights,
    read_header,
    write_weights,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

NATIVE_KINDS = NATIVE_BACKENDS  # kind -> the backend whose native checkpoint it is
TABLE_KINDS = (
    "annotated",
    "pytorch-tutorial",
    "tf-tutorial-v1",
    "tf-tutorial-v2",
    "keras-prenorm",
    "mingpt",  # the decoder-only models of common/porting/gpt.py
    "nanogpt",
    "gpt2",
    "encoder-gpt",
    "seed-gpt",  # encoder-gpt's first name (common/porting/gpt.py, KIND_ALIASES)
    "map",  # the user's own table: --map MAP.json
)
IMPORT_KINDS = ("nn-transformer", "marian", "bert", "llama", "meta-llama", *TABLE_KINDS)
EXPORT_KINDS = ("marian", "llama", "onnx")  # outside models that can be written
EXPORT_ONLY_KINDS = ("onnx",)  # ... and that cannot be read
KINDS = ("rosetta", *NATIVE_KINDS, *IMPORT_KINDS)
SUFFIXES = {
    ".safetensors": "rosetta",
    ".onnx": "onnx",
    ".weights.h5": "keras",
    ".msgpack": "flax",
    ".pt": "torch",
    ".bin": "torch",
}


class ConvertError(RosettaError):
    """A conversion that cannot be done as asked (kind, config, destination)."""


@dataclass(frozen=True)
class Converted:
    src: str
    dst: str
    from_kind: str
    to_kind: str
    config: TransformerConfig
    tensors: int
    parameters: int
    dtype: str
    provenance: Provenance | None = None
    notes: tuple[str, ...] = ()  # what the importer dropped or decided (read_source's notes)

    def summary(self) -> str:
        lines = [
            f"converted {self.src} ({self.from_kind}) -> {self.dst} ({self.to_kind}): "
            f"{self.tensors} tensors, {self.parameters:,} parameters, {self.dtype}"
        ]
        lines += [f"note: {note}" for note in self.notes]
        record = self.provenance.verify if self.provenance else {}
        if difference_text(record) is not None:
            lines.append(
                f"verified: {difference_text(record)} <= "
                f"{record['bound']:.0e}, {' vs '.join(record['sides'])}, "
                f"{len(record['probe_shapes'])} seeded ragged probes"
            )
        elif "not_run" in record:
            lines.append(f"not verified: {record['not_run']}")
        if self.provenance and self.to_kind not in STAMPED_KINDS:
            lines.append(f"({self.to_kind} files have no metadata: the record is not stored)")
        return "\n".join(lines)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or a.samefile(b)
    except OSError:
        return False


def kind_from_suffix(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, kind in sorted(SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return kind
    return None


def infer_source_kind(path: Path) -> str:
    """The kind of an existing source, from its suffix and, where the suffix is shared by two
    kinds (a torch .pt/.bin is ours or an nn.Transformer's), from the tensor names inside."""
    if path.is_dir():
        if (path / "config.json").exists():
            from transformer_rosetta.porting.hf_folder import read_config_json
            from transformer_rosetta.porting.unread import READ_MODEL_TYPES, unread_model_type

            model_type = read_config_json(path).get("model_type")  # unreadable: names why
            if isinstance(model_type, str) and model_type in READ_MODEL_TYPES:
                return READ_MODEL_TYPES[model_type]
            raise ConvertError(f"{path / 'config.json'}: {unread_model_type(model_type)}")
        if _holds_the_shared_format(path):
            return "rosetta"  # the shared format written in shards (save_weights' folder)
        if (path / "params.json").exists():
            return "meta-llama"  # Meta's layout: params.json and consolidated.NN.pth
        raise ConvertError(
            f"{path}: a folder without config.json; --from marian, bert, gpt2 and llama expect a "
            f"Hugging Face model folder, --from meta-llama Meta's params.json and "
            f"consolidated.NN.pth, and a sharded model of the shared format holds "
            f"{shards.INDEX_FILE} and shards whose metadata names the format"
        )
    if path.name.endswith(shards.INDEX_FILE):  # a sharded model, given by its index
        return "rosetta"
    if path.name.endswith(TORCH_INDEX_SUFFIX):  # a sharded torch state_dict: its tensors tell
        found = _outside_kind(_torch_tensors(path), ORIGINS_PT)
        if found is None:
            raise ConvertError(
                f"{path}: a sharded torch state_dict whose names tell no kind; give --from "
                f"(one of {', '.join(TABLE_KINDS)}, or nn-transformer)"
            )
        return found
    kind = kind_from_suffix(path)
    if kind is None:
        raise ConvertError(
            f"{path}: cannot tell its kind from the name; give --from ({', '.join(KINDS)})"
        )
    if kind in EXPORT_ONLY_KINDS:
        raise ConvertError(f"{path}: {kind} is written, not read; convert from the weights")
    if kind == "torch":
        names = tensor_reader().read_tensors(path)
        return _outside_kind(names, ORIGINS_PT) or kind
    if kind == "keras":
        from transformer_rosetta.porting.sources import read_source_tensors

        return _outside_kind(read_source_tensors(path), ORIGINS_H5) or kind
    return kind


def _holds_the_shared_format(folder: Path) -> bool:
    """Whether a folder's safetensors files are the shared format's shards (or its one
    model.safetensors): the first one's header metadata names the format. A Hugging Face folder's
    shards name another ("pt"), and one without its config.json is not ours to read."""
    files = sorted(folder.glob("model*.safetensors"))
    if not files or not any((folder / n).exists() for n in (shards.INDEX_FILE, shards.SINGLE_FILE)):
        return False
    try:
        _, metadata = read_header(files[0])
    except WeightFileError:
        return False
    return (metadata or {}).get(META_FORMAT) == FORMAT_NAME


# A torch state_dict saved in shards, as transformers' save_pretrained(safe_serialization=False)
# writes them: pytorch_model.bin.index.json names the .bin file of every tensor.
TORCH_INDEX_SUFFIX = ".bin.index.json"


def _torch_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a torch .pt/.bin state_dict, or of all the shards a .bin index names (each
    checked first: a missing shard or a tensor claimed twice is named, common/porting/hf_folder)."""
    if path.name.endswith(TORCH_INDEX_SUFFIX):
        from transformer_rosetta.porting.hf_folder import read_sharded_weights

        return read_sharded_weights(path.parent, path.name)
    return tensor_reader().read_tensors(path)


# A name that only one outside model's files hold -> its kind (checked in this order).
ORIGINS_PT = {
    "src_embed.0.lut.weight": "annotated",
    "src_tok_emb.embedding.weight": "pytorch-tutorial",
    ".self_attn.in_proj_weight": "nn-transformer",
}
ORIGINS_H5 = {
    "/mha/wq/vars/0": "tf-tutorial-v1",
    "/mha/query_dense/vars/0": "tf-tutorial-v2",
    "/layer/k_dense_layer/vars/0": "keras-prenorm",
}


def _outside_kind(names: Mapping[str, Any], origins: Mapping[str, str]) -> str | None:
    for marker, kind in origins.items():
        if any(n == marker or (marker.startswith((".", "/")) and marker in n) for n in names):
            return kind
    return None


def infer_destination_kind(path: Path) -> str:
    kind = kind_from_suffix(path)
    if kind is None:
        raise ConvertError(
            f"{path}: cannot tell the kind to write from the name (.safetensors, .pt, "
            ".weights.h5, .msgpack, .onnx); give --to"
        )
    return kind


def read_source(
    path: Path,
    kind: str,
    config: TransformerConfig | Mapping[str, Any] | None,
    *,
    table: Any = None,
    learned_positions: bool = False,
    notes: list[str] | None = None,
) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """(config, canonical tensors) from a source of `kind`, fully validated. `config` is a whole
    config, or (for the table kinds) the fields the user gives; `table` is the user's map for
    kind "map". An importer that drops or decides something the tensors do not show (BERT's
    pooler) says so in `notes`."""
    if kind == "gpt2" and path.is_dir():  # a save_pretrained folder: its config.json is read
        return _read_gpt2_folder(path, config, table, learned_positions, notes)
    if kind in TABLE_KINDS:
        return _read_with_table(path, kind, config, table, learned_positions)
    if learned_positions:
        raise ConvertError(
            f"--learned-positions: only the tutorials' models and --map store a position table "
            f"to import as learned; --from {kind} has none"
        )
    if kind in ("llama", "meta-llama"):
        return _read_llama(path, kind, config, table, notes)
    if isinstance(config, Mapping):
        config = TransformerConfig.from_dict(dict(config))
    if kind == "rosetta":
        wf = load_weights(path, config=config)
        return wf.config, wf.tensors
    if kind == "marian":
        from transformer_rosetta.porting import marian

        hf_config, tensors = marian.read_marian_dir(path)
        found = marian.marian_config(hf_config)
        if config is not None and config != found:
            raise ConvertError(
                "--config does not apply to a Marian folder: its config.json is read"
            )
        return found, marian.marian_to_canonical(tensors, found)
    if kind == "bert":
        from transformer_rosetta.porting.bert import import_bert

        bert = import_bert(path)
        if config is not None and config != bert.config:
            raise ConvertError("--config does not apply to a BERT folder: its config.json is read")
        if notes is not None:
            notes.extend(bert.notes)
        return bert.config, bert.tensors
    if config is None:
        what = {"nn-transformer": "a torch.nn.Transformer state_dict"}.get(
            kind, f"a {kind} checkpoint"
        )
        raise ConvertError(
            f"--config FILE.json is required: {what} does not carry the model's config "
            "(heads, activation, norm position, eps, position kind)"
        )
    if kind == "nn-transformer":
        from transformer_rosetta.porting.nn_transformer import nn_transformer_to_canonical

        return config, nn_transformer_to_canonical(_torch_tensors(path), config)
    return config, native_backend(kind).load_native(path, config)


def _read_gpt2_folder(
    path: Path,
    config: TransformerConfig | Mapping[str, Any] | None,
    table: Any,
    learned_positions: bool,
    notes: list[str] | None,
) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """A GPT-2 save_pretrained folder (common/porting/gpt.py, import_gpt2_folder): --config may
    add what its config.json does not tell (pad_id) and must agree with the rest."""
    from transformer_rosetta.porting.gpt import import_gpt2_folder

    if table is not None:
        raise ConvertError("--map applies to --from map, not to --from gpt2")
    if learned_positions:
        raise ConvertError("--learned-positions: GPT-2's positions are learned already")
    given = config.to_dict() if isinstance(config, TransformerConfig) else config
    found = import_gpt2_folder(path, given)
    if notes is not None:
        notes.extend(found.notes)
    return found.config, found.tensors


def _read_llama(
    path: Path,
    kind: str,
    config: TransformerConfig | Mapping[str, Any] | None,
    table: Any,
    notes: list[str] | None,
) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """A Llama-family save_pretrained folder (common/porting/llama.py) or Meta's layout
    (common/porting/meta_llama.py): --config may add what the files do not tell (pad_id; Meta's
    bos_id and eos_id) and must agree with the rest."""
    if table is not None:
        raise ConvertError(f"--map applies to --from map, not to --from {kind}")
    given = config.to_dict() if isinstance(config, TransformerConfig) else config
    if kind == "llama":
        from transformer_rosetta.porting.llama import import_llama_folder

        found = import_llama_folder(path, given)
    else:
        from transformer_rosetta.porting.meta_llama import import_meta_llama

        found = import_meta_llama(path, given)
    if notes is not None:
        notes.extend(found.notes)
    return found.config, found.tensors


def _read_with_table(
    path: Path,
    kind: str,
    config: TransformerConfig | Mapping[str, Any] | None,
    table: Any,
    learned_positions: bool,
) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """An importer table's model: the file's arrays, the config assembled from the table, the
    shapes and the user's fields (common/porting/table.py), then the tensors."""
    from transformer_rosetta.porting.gpt import TABLES as GPT_TABLES
    from transformer_rosetta.porting.sources import read_source_tensors
    from transformer_rosetta.porting.table import assemble_config, to_canonical
    from transformer_rosetta.porting.tutorials import TABLES

    if kind == "map":
        if table is None:
            raise ConvertError("--from map needs --map MAP.json (the table of your model's names)")
    elif table is not None:
        raise ConvertError(f"--map applies to --from map, not to --from {kind}")
    else:
        table = {**TABLES, **GPT_TABLES}[kind]
    arrays = (
        _torch_tensors(path)
        if path.name.endswith(TORCH_INDEX_SUFFIX)
        else read_source_tensors(path)
    )
    given = config.to_dict() if isinstance(config, TransformerConfig) else dict(config or {})
    shapes = {k: tuple(np.shape(v)) for k, v in arrays.items()}
    model_config = assemble_config(table, shapes, given, learned_positions=learned_positions)
    return model_config, to_canonical(table, arrays, model_config, str(path))


def write_destination(
    path: Path,
    kind: str,
    config: TransformerConfig,
    tensors: Mapping[str, np.ndarray],
    producer: str,
    onnx: Mapping[str, Any] | None = None,
    *,
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | None = None,
    source_kind: str | None = None,
) -> None:
    """Write `tensors` as `kind`, each read from `tensors` as the writer streams it (never all
    at once; docs/PORTING.md, "Memory"). `onnx` holds write_onnx's graph options; `metadata`
    (the provenance record, a tokenizer) and `max_shard_size` (a folder of shards) are the
    shared format's. `source_kind`, the kind `tensors` were read from: a native checkpoint's
    framework puts its own transposed views into C order (a torch kernel's, 2.6x numpy's tiles)."""
    if kind == "rosetta":
        write_weights(
            path,
            tensors,
            config,
            producer=producer,
            metadata=metadata,
            max_shard_size=max_shard_size,
            copy_block=(
                native_backend(source_kind).transposing_copy
                if source_kind in NATIVE_KINDS
                else None
            ),
        )
    elif kind in NATIVE_KINDS:
        native_backend(kind).save_native(path, config, tensors)
    elif kind == "marian":
        from transformer_rosetta.porting.marian_export import write_marian_dir

        write_marian_dir(path, config, tensors)
    elif kind == "llama":
        from transformer_rosetta.porting.llama_export import write_llama_dir

        write_llama_dir(path, config, tensors)
    elif kind == "onnx":
        from transformer_rosetta.porting.onnx_file import write_onnx

        write_onnx(path, config, tensors, **(onnx or {}))
    else:
        raise ConvertError(
            f"--to {kind}: {kind} is import-only; write rosetta, torch, keras or flax"
        )


# The kinds whose files hold the provenance record (docs/FORMAT.md, "provenance").
STAMPED_KINDS = ("rosetta", "marian", "llama", "onnx")


def _checked_arguments(
    src: object,
    dst: object,
    *,
    from_kind: object,
    to_kind: object,
    config: object,
    flags: Mapping[str, object],
    also_read: object,
    learned_positions: object,
    verify: object,
    onnx: object,
    progress: object,
    max_shard_size: object,
) -> tuple[TransformerConfig | Mapping[str, Any] | None, tuple[str | Path, ...]]:
    """convert()'s arguments, each checked by its name before anything is read, by the checks
    the command line's options get (spec/arguments.py, shards.check_shard_size): InputError, or
    InputTypeError for a wrong type. Returns the config as read_source takes it (a str or Path is
    read as --config reads its value: the JSON itself when it starts with `{`, else a file,
    which joins also_read) and also_read without inline JSON, which names no file."""
    check_path(src, "src")
    check_path(dst, "dst")
    if from_kind is not None:
        check_choice(from_kind, "from_kind", KINDS)
    if to_kind is not None:
        check_choice(to_kind, "to_kind", (*KINDS, *EXPORT_ONLY_KINDS))
    for name, value in {**flags, "learned_positions": learned_positions}.items():
        check_flag(value, name)
    if verify is not None and not isinstance(verify, bool):
        raise InputTypeError(
            f"verify: must be True, False or None (where both sides can run), got {brief(verify)}"
        )
    if isinstance(also_read, (str, bytes, os.PathLike)) or not isinstance(also_read, Sequence):
        raise InputTypeError(f"also_read: must be a list of file names, got {brief(also_read)}")
    given = [check_path(f, "also_read") for f in also_read if f is not None]
    read = tuple(f if isinstance(f, str) else Path(f) for f in given if not is_inline_json(f))
    fields: TransformerConfig | Mapping[str, Any] | None
    if isinstance(config, (str, Path)):
        if not is_inline_json(config):
            read = (*read, config)
        fields = read_config_fields(config)
    elif config is None or isinstance(config, (TransformerConfig, Mapping)):
        fields = config
    else:
        raise InputTypeError(
            "config: must be a TransformerConfig, a dict of config fields, JSON text or a file "
            f"name, got {brief(config)}"
        )
    if onnx is not None:
        check_mapping(onnx, "onnx", "a dict of the ONNX graph's options, or None")
    if progress is not None:
        check_callable(progress, "progress", "a function of one message, or None")
    if max_shard_size is not None:
        shards.check_shard_size(max_shard_size)
    return fields, read


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    from_kind: str | None = None,
    to_kind: str | None = None,
    config: TransformerConfig | Mapping[str, Any] | str | Path | None = None,
    force: bool = False,
    allow_nonfinite: bool = False,
    also_read: Sequence[str | Path | None] = (),
    table: Any = None,
    learned_positions: bool = False,
    verify: bool | None = None,
    onnx: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    max_shard_size: int | None = None,
) -> Converted:
    """Read `src`, validate everything, then write `dst` atomically. Nothing is written on error.
    `config` is a TransformerConfig, a dict of its fields, or what --config takes: JSON text (it
    starts with `{`) or a config file's name. Weights holding NaN or Inf are refused unless
    `allow_nonfinite`. `also_read` names the other files the caller read (a config, a map),
    which `dst` may not be either. `table` is a user's importer table (--map; kind "map"); `learned_positions` imports a stored sinusoid
    table as learned positions. `onnx` holds the ONNX graph's options (graph, attention,
    max_steps). `progress` is told of the long steps (the export, the verification).
    `max_shard_size` (bytes) writes the shared format as a folder `dst` of shards in Hugging
    Face's layout (weights/shards.py); any other kind is refused.

    Memory: the tensors stay where the source's reader put them (mapped from the file where its
    format allows) from the read to the write, and every step reads them one at a time (the
    checks, the write, the summary); the verification runs one side's model, then the other's
    (common/porting/verify.py). docs/PORTING.md, "Memory", says what each kind holds.

    `verify`: None runs common/porting/verify.py where both sides can run here, True requires it
    (refused before any work where a side cannot run), False skips it. A destination that misses
    the bound is removed and VerificationFailed raised."""
    config, also_read = _checked_arguments(
        src,
        dst,
        from_kind=from_kind,
        to_kind=to_kind,
        config=config,
        flags={"force": force, "allow_nonfinite": allow_nonfinite},
        also_read=also_read,
        learned_positions=learned_positions,
        verify=verify,
        onnx=onnx,
        progress=progress,
        max_shard_size=max_shard_size,
    )
    for what, name in (("SRC", src), ("DST", dst)):
        if not os.fspath(name):  # Path("") would be the current folder
            raise ConvertError(f"{what}: the file name is empty")
    src, dst = Path(src), Path(dst)
    if not src.exists():
        if src.is_symlink():  # a dangling link or a loop: say which
            regular_file(src, "a file to convert")
        raise ConvertError(f"{shown(src)}: no such file or folder")
    if not src.is_dir():  # a FIFO or device is refused from its stat, never opened
        regular_file(src, "a file to convert")
    if dst.exists() and force and _same_file(src, dst):
        raise ConvertError("source and destination are the same file")
    if max_shard_size is not None:
        if to_kind not in (None, "rosetta"):
            raise ConvertError(  # the CLI refuses this first, in its own words
                f"max_shard_size: writes the shared format in shards, not to_kind {to_kind!r}; "
                "drop one"
            )
        to_kind = "rosetta"
        # The folder and the layout's files already in it (no --force, no overwrite); the
        # shards this model takes are checked too once its size is known (below).
        dst = _check_shard_folder(dst, force, (src, *also_read))
    elif to_kind in ("marian", "llama"):  # a folder of three files
        from transformer_rosetta.files.outputs import check_output_folder
        from transformer_rosetta.porting import llama_export, marian_export

        files = (marian_export if to_kind == "marian" else llama_export).EXPORT_FILES
        dst = check_output_folder(dst, files, what="DST", force=force, inputs=(src, *also_read))
    else:
        dst = check_output_file(dst, what="DST", force=force, inputs=(src, *also_read))
    from_kind = from_kind or ("map" if table is not None else infer_source_kind(src))
    to_kind = to_kind or infer_destination_kind(dst)
    if to_kind in IMPORT_KINDS and to_kind not in EXPORT_KINDS:
        raise ConvertError(
            f"--to {to_kind}: {to_kind} is import-only; write rosetta, torch, keras, flax, "
            "marian, llama or onnx"
        )
    if to_kind == "onnx" and not dst.name.lower().endswith(".onnx"):
        raise ConvertError(f"DST: {shown(dst)} should end in .onnx")
    if onnx and to_kind != "onnx":
        raise ConvertError(
            f"--graph, --attention and --max-steps apply to --to onnx, not {to_kind}"
        )
    why_not = _why_not_verified(from_kind, to_kind, onnx)
    if verify and why_not:
        raise ConvertError(f"--verify: {why_not}")
    # The source's sha256 (the provenance record's) is read in a thread from here on, beside
    # the checks and the write; the record takes it once the destination is written.
    with BackgroundDigest(src) as digest:
        notes: list[str] = []
        model_config, tensors = read_source(
            src, from_kind, config, table=table, learned_positions=learned_positions, notes=notes
        )
        check_tensors(src, model_config, tensors)  # an importer's slip: refused before writing
        dtype = dtype_name(np.asarray(next(iter(tensors.values()))).dtype)  # one per file, checked
        if max_shard_size is not None:
            planned = planned_files(model_config, dtype, max_shard_size)
            _check_shard_folder(dst, force, (src, *also_read), planned)
        check_finite(src, tensors, allow_nonfinite)
        tokenizer = source_tokenizer(src, from_kind, model_config)  # travels with a .safetensors
        if tokenizer is not None:
            notes.append(carried_note(tokenizer, to_kind))
        if verify and allow_nonfinite and nonfinite_counts(tensors):
            raise ConvertError(
                "--verify: the weights hold NaN or Inf, whose logits cannot be compared"
            )
        if to_kind == "onnx":
            from transformer_rosetta.porting.onnx_file import export_problems

            problems = export_problems(model_config, **_onnx_options(onnx))
            if problems:
                raise ConvertError("; ".join(problems))
        if to_kind == "llama":  # before any work on DST (write_llama_dir checks again)
            from transformer_rosetta.porting.llama_export import export_problems as llama_problems

            problems = llama_problems(model_config)
            if problems:
                raise ConfigError(problems)
        # Every kind stores about the tensors' bytes; a full disk mid-write can crash HDF5 outright.
        itemsize = np.dtype(DTYPES[dtype]).itemsize  # from the shapes: no tensor is looked at
        nbytes = itemsize * sum(
            math.prod(shape) for shape in canonical_shapes(model_config).values()
        )
        check_free_space(_existing_folder(dst), nbytes, "DST")
        say = progress or (lambda _message: None)
        provenance = _provenance(src, from_kind)
        provenance.notes = list(notes)
        if verify is False:
            provenance.verify = {"not_run": "--no-verify"}
        elif allow_nonfinite and nonfinite_counts(tensors):
            provenance.verify = {"not_run": "the weights hold NaN or Inf (--allow-nonfinite)"}
        elif why_not:
            provenance.verify = {"not_run": why_not}
        verifying = not provenance.verify
        if verifying:  # verification builds the models: their position tables need no tensor
            built = 8 * (parameter_count(model_config) + position_buffer_count(model_config))
            problem = fits_problem(built, "--verify's float64 model of this config")
            if problem:
                raise ConvertError(
                    f"{problem} (max_len {model_config.max_len}); --no-verify skips it"
                )
        if to_kind == "onnx":
            say(f"exporting the {_onnx_options(onnx)['graph']} graph with torch.onnx")
        # Written, verified and stamped beside DST, then moved into place last: until then DST is as
        # it was, whatever stops the work (a signal, an error, a verification that misses its bound).
        with staged(dst) as stage:
            write_destination(
                stage,
                to_kind,
                model_config,
                tensors,
                producer=f"rosetta convert from {from_kind}",
                onnx=_onnx_options(onnx),
                # The shared format takes the tokenizer in the header it writes; the record
                # follows once the source's digest is in (_stamp: in place, in the header room).
                metadata=_carried(tokenizer) if to_kind == "rosetta" else None,
                max_shard_size=max_shard_size,
                source_kind=from_kind,
            )
            if verifying:
                say(
                    f"verifying: {shown(src)} and {shown(dst)} on {len(PROBE_SHAPES)} seeded probes"
                )
                provenance.verify = run_verification(
                    model_config, (from_kind, src), (to_kind, stage)
                )
            if not provenance.passed:
                record = provenance.verify
                kept = "left as it was" if dst.exists() else "not written"
                raise VerificationFailed(
                    f"verification failed: {difference_text(record)} "
                    f"exceeds the bound {record['bound']:.0e} ({' vs '.join(record['sides'])}); "
                    f"{shown(dst)} was {kept}"
                )
            provenance.source_sha256 = digest.result()
            _stamp(stage, to_kind, provenance, tokenizer if to_kind != "rosetta" else None)
            if max_shard_size is not None:  # a folder: the stale shards of an earlier split go too
                publish_weights(stage, dst)
            else:
                publish(stage, dst)
        return Converted(
            str(src),
            str(dst),
            from_kind,
            to_kind,
            model_config,
            len(tensors),
            parameter_count(model_config),
            dtype,
            provenance,
            tuple(notes),
        )


def _carried(tokenizer: Tokenizer | None) -> dict[str, str]:
    """What a .safetensors destination's header carries from the start: the source's tokenizer
    (the provenance record is stamped after the write, when the source's digest is in)."""
    from transformer_rosetta.weights.tokenizer import tokenizer_metadata

    return tokenizer_metadata(tokenizer) if tokenizer is not None else {}


def _existing_folder(path: Path) -> Path:
    """The folder that `path` (a file, or a folder that may not exist yet) is written in: for
    the free-space check."""
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    return folder


def _check_shard_folder(
    dst: Path, force: bool, inputs: Sequence[str | Path | None], planned: Sequence[str] = ()
) -> Path:
    """A sharded destination's checks (check_output_folder): the folder, and each file the
    write touches, the `planned` shards and the layout's files already there (which it replaces
    or removes), none of them without --force."""
    from transformer_rosetta.files.outputs import check_output_folder

    names = shards.replaced_files(dst, planned) if dst.is_dir() else list(planned)
    return check_output_folder(dst, names, what="DST", force=force, inputs=inputs)


def _onnx_options(onnx: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"graph": "forward", "attention": False, "max_steps": None, **(onnx or {})}


# Sources whose check is a parity test rather than --verify (which compares logits).
VERIFIED_BY_TESTS = {
    "gpt2": "--verify runs no transformers model; parity_tests/porting/test_gpt.py and "
    "cli/test_generate.py check GPT-2's import (state_dicts and save_pretrained folders) against "
    "GPT2LMHeadModel",
    "meta-llama": "--verify runs no Meta code (its model.py needs fairscale and CUDA); "
    "parity_tests/porting/test_meta_llama.py checks the import against transformers' "
    "LlamaForCausalLM through Hugging Face's own conversion",
}


def _why_not_verified(from_kind: str, to_kind: str, onnx: Mapping[str, Any] | None) -> str | None:
    if from_kind in VERIFIED_BY_TESTS:
        return VERIFIED_BY_TESTS[from_kind]
    graph = _onnx_options(onnx)["graph"] if to_kind == "onnx" else None
    return why_not_runnable(from_kind) or why_not_runnable(to_kind, graph)


def _provenance(src: Path, from_kind: str) -> Provenance:
    """The record, but for the source's digest (BackgroundDigest's, filled in after the write)."""
    return Provenance(
        source=str(src),
        source_kind=from_kind,
        source_sha256="",
        converter=f"transformer-rosetta {package_version('transformer-rosetta')} (rosetta convert)",
        versions={"numpy": np.__version__, "safetensors": package_version("safetensors")},
    )


def _stamp(
    dst: Path, to_kind: str, provenance: Provenance, tokenizer: Tokenizer | None = None
) -> None:
    """Store the provenance record in the destination's metadata, where its format has a place,
    and in a .safetensors the source's tokenizer (weights/tokenizer.py), in the same rewrite."""
    from transformer_rosetta.weights.format import META_PROVENANCE, add_metadata
    from transformer_rosetta.weights.tokenizer import tokenizer_metadata

    text = provenance.to_json()
    if to_kind == "rosetta":
        carried = tokenizer_metadata(tokenizer) if tokenizer is not None else {}
        add_metadata(dst, {META_PROVENANCE: text, **carried})
    elif to_kind in ("marian", "llama"):
        from transformer_rosetta.porting.hf_folder import SAFETENSORS_FILE

        add_metadata(dst / SAFETENSORS_FILE, {META_PROVENANCE: text})
    elif to_kind == "onnx":
        from transformer_rosetta.porting.onnx_file import add_labels

        add_labels(dst, {META_PROVENANCE: text})
