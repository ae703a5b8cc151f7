"""The one reader of a Hugging Face model folder, for every importer of one (Marian, BERT, GPT-2,
the Llama family):

- the folder and its small JSON files (`read_json_file`), and the model_type its config.json
  names (`model_type_of`, for `rosetta convert`'s guess of --from);
- config.json, through one `HfModel` per model kind: the keys' defaults and JSON types and our
  field behind each key are that kind's data, read by the same code (a key of the wrong type is
  refused first; a problem of our config names the key it came from);
- the weights, as save_pretrained writes them: `model.safetensors`, `pytorch_model.bin` (through
  the adapter's tensor_reader, weights_only), or either in shards with its index;
- the files a folder's digest covers (`digest_files`, for verify.sha256_of).

Each problem is one ConfigError or WeightFileError that names the file; no framework is imported
here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError, WeightFileError
from transformer_rosetta.files.safe_read import (
    MAX_CONFIG_BYTES,
    FileProblem,
    MissingFile,
    brief,
    is_int,
    json_type,
    listing,
    os_problem,
    read_json,
    shown,
    type_problem,
)
from transformer_rosetta.porting.sources import read_source_tensors
from transformer_rosetta.porting.unread import lacking
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.weights.format import read_header

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
INDEX_SUFFIX = ".index.json"  # a sharded checkpoint's index: tensor -> shard file
# What save_pretrained writes, in transformers' own order of preference when a folder has several.
WEIGHT_FILES = (
    SAFETENSORS_FILE,
    SAFETENSORS_FILE + INDEX_SUFFIX,
    TORCH_FILE,
    TORCH_FILE + INDEX_SUFFIX,
)
# The files beside the weights that a folder's digest covers: config.json, sentence-transformers'
# modules and pooling, the tokenizer (vocab.txt, merges.txt, tokenizer.json, ...).
DIGESTED_SUFFIXES = (".json", ".txt")
# Meta's original Llama layout: params.json and one consolidated.NN.pth per model-parallel rank
# (common/porting/meta_llama.py), digested in place of save_pretrained's weights.
META_SHARDS = "consolidated.*.pth"

# transformers' ACT2FN names -> ours. gelu_fast and gelu_accurate are the tanh form with
# sqrt(2/pi) written as a constant (0.7978845608, 3e-12 off); gelu_python is the erf form.
ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
}


# -- the folder and its JSON files -------------------------------------------------------------


def model_folder(path: str | Path, model: str) -> Path:
    """`path` as a folder; WeightFileError naming it otherwise (`model`: "Marian", "BERT")."""
    folder = Path(path)
    try:
        is_folder = stat.S_ISDIR(os.stat(folder).st_mode)
    except FileNotFoundError:
        raise WeightFileError(shown(folder), ["no such folder"]) from None
    except (OSError, ValueError) as exc:  # a symbolic-link loop, no permission, a NUL in the name
        problem = os_problem(exc) if isinstance(exc, OSError) else "not a valid folder name"
        raise WeightFileError(shown(folder), [problem]) from None
    if not is_folder:
        raise WeightFileError(
            shown(folder),
            [
                f"not a folder; a Hugging Face {model} model is a folder with config.json and "
                f"{SAFETENSORS_FILE} (or {TORCH_FILE})"
            ],
        )
    return folder


def read_json_file(path: Path, what: str, expected: type = dict) -> Any:
    """A small JSON file of the folder (a regular UTF-8 file of at most MAX_CONFIG_BYTES,
    depth-limited), of the expected type; ConfigError naming it."""
    try:
        data = read_json(path, what, MAX_CONFIG_BYTES)
    except MissingFile:
        raise ConfigError([f"{shown(path)}: missing; {what} is needed"]) from None
    except FileProblem as exc:
        raise ConfigError([str(exc)]) from None
    if not isinstance(data, expected):
        want = "a JSON object" if expected is dict else "a JSON list"
        raise ConfigError([f"{shown(path)}: must hold {want}, got {json_type(data)}"])
    return data


def read_config_json(folder: Path) -> dict[str, Any]:
    """The folder's config.json as a dict."""
    return read_json_file(folder / CONFIG_FILE, "a Hugging Face config.json")


def model_type_of(path: str | Path) -> str | None:
    """The model_type a folder's config.json names, or None where it names none or cannot be
    read (the importer then says why)."""
    try:
        data = read_json(Path(path) / CONFIG_FILE, "a Hugging Face config.json", MAX_CONFIG_BYTES)
    except FileProblem:
        return None
    found = data.get("model_type") if isinstance(data, dict) else None
    return found if isinstance(found, str) else None


# -- config.json ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HfModel:
    """How config.json is read for one model kind: transformers' config class as data. A key the
    file omits takes the class's default; each key read has its JSON types; each of our fields
    names the key it comes from, in messages."""

    name: str  # in messages: "Marian", "BERT", "GPT-2"
    model_type: str  # what config.json's model_type must say
    defaults: Mapping[str, Any]  # the config class's defaults for the keys read
    types: Mapping[str, tuple[str, ...]]  # key -> its JSON types (safe_read.type_problem's names)
    hf_field: Mapping[str, str]  # our config field -> the key it comes from
    id_lists: bool = True  # a token id may be a one-id list (as generation configs write them)
    activations: Mapping[str, str] = field(default_factory=lambda: ACTIVATIONS)  # ACT2FN -> ours

    def get(self, hf: Mapping[str, Any], key: str) -> Any:
        """`key` of config.json, or the config class's default where the file omits it."""
        return hf.get(key, self.defaults.get(key))

    def check_types(self, hf: Any) -> None:
        """ConfigError naming every key of `types` in `hf` whose JSON type is wrong: what
        follows assumes these types."""
        if not isinstance(hf, Mapping):
            raise ConfigError([f"config.json must hold a JSON object, got {json_type(hf)}"])
        problems = [
            p for k, t in self.types.items() if k in hf and (p := type_problem(k, hf[k], *t))
        ]
        if problems:
            raise ConfigError(problems)

    def model_type_problems(self, hf: Mapping[str, Any]) -> list[str]:
        """[] where config.json's model_type is this kind's, else the one problem saying so."""
        found = hf.get("model_type")
        if found == self.model_type:
            return []
        return [
            f"model_type: {brief(found)} is not a {self.name} model "
            f"(expected {self.model_type!r}){lacking(found)}"
        ]

    def token_id(
        self, hf: Mapping[str, Any], key: str, problems: list[str], *, optional: bool = False
    ) -> int | None:
        """One token id of config.json; None where it is null and `optional`, or wrong (a
        problem is added)."""
        value = self.get(hf, key)
        if self.id_lists and isinstance(value, list) and len(value) == 1:
            value = value[0]
        if value is None and optional:
            return None
        if not is_int(value):
            problems.append(f"{key}: must be one token id (an integer), got {brief(value)}")
            return None
        return value

    def activation(self, hf: Mapping[str, Any], key: str, problems: list[str]) -> str | None:
        """Our activation for config.json's ACT2FN name under `key`; None (and a problem) for
        one the spec has not."""
        act = self.get(hf, key)
        if act in self.activations:
            return self.activations[act]
        allowed = ", ".join(self.activations)
        problems.append(f"{key}: {brief(act)} is not supported; allowed: {allowed}")
        return None

    def config(self, fields: dict[str, Any]) -> TransformerConfig:
        """Our config of `fields`; each problem names the key behind our field ('d_model (BERT
        hidden_size): ...'), so the user finds it in their config.json."""
        try:
            return TransformerConfig.from_dict(fields)
        except ConfigError as exc:
            raise ConfigError([self._name_key(p) for p in exc.problems]) from None

    def name_keys(self, problems: list[str]) -> list[str]:
        """`problems` ('field: ...') with the key behind each of our fields named, as `config`
        names them: for the count checks (porting/table.py, check_counts)."""
        return [self._name_key(p) for p in problems]

    def _name_key(self, problem: str) -> str:
        ours, sep, rest = problem.partition(":")
        if sep and ours in self.hf_field:
            return f"{ours} ({self.name} {self.hf_field[ours]}):{rest}"
        return problem


# -- the weights ---------------------------------------------------------------------------------


def weights_file(folder: Path) -> Path | None:
    """The first of WEIGHT_FILES in the folder (one weights file or a shard index), or None."""
    # lexists, not is_file: a weight file that is a FIFO or a broken link is named as such by
    # the reader (which refuses it unopened) rather than reported absent.
    return next((folder / n for n in WEIGHT_FILES if os.path.lexists(folder / n)), None)


def _weights_path(folder: Path) -> Path:
    """weights_file, or WeightFileError when the folder has none."""
    path = weights_file(folder)
    if path is None:
        raise WeightFileError(
            str(folder),
            [
                f"neither {SAFETENSORS_FILE} nor {TORCH_FILE} (nor a sharded checkpoint's "
                f"{INDEX_SUFFIX}) is in this folder"
            ],
        )
    return path


def read_folder_weights(folder: Path) -> dict[str, np.ndarray]:
    """{name: array} of the folder's weights (weights_file): one file, or every shard of a
    sharded checkpoint; WeightFileError when it has none."""
    path = _weights_path(folder)
    if path.name.endswith(INDEX_SUFFIX):
        return read_sharded_weights(folder, path.name)
    return read_source_tensors(path)


def read_folder_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the folder's weights, as read_folder_weights would give them, from the
    headers alone where the format has one (safetensors: one file, or the shards its index
    names, each shard's tensors that the index puts there). An importer compares its config's
    counts with them (porting/table.py, check_counts) before it reads any tensor, and before
    anything proportional to a count is built. A torch file's shapes are its tensors', mapped and
    not read (torch.load(mmap=True) for torch.save's zip format)."""
    path = _weights_path(folder)
    if not path.name.endswith(INDEX_SUFFIX):
        return _file_shapes(path)
    shapes: dict[str, tuple[int, ...]] = {}
    for shard, expected in sorted(shard_map(folder, path.name).items()):
        shapes.update((k, v) for k, v in _file_shapes(folder / shard).items() if k in expected)
    return shapes


def _file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    if path.suffix.lower() == ".safetensors":
        header, _ = read_header(path)  # checked, naming a file that is not safetensors
        return {name: tuple(entry["shape"]) for name, entry in header.items()}
    return {name: tuple(a.shape) for name, a in read_source_tensors(path).items()}


def _shard_problem(name: Any) -> str | None:
    if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
        return f"{brief(name)} is not a file name in this folder"
    return None


def shard_map(folder: Path, index_name: str) -> dict[str, set[str]]:
    """{shard file: the tensors it holds} from a sharded checkpoint's index (its `weight_map`,
    tensor -> shard file); WeightFileError naming every entry that is not a file of the folder
    and every missing shard."""
    index = read_json_file(folder / index_name, "a sharded checkpoint's index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightFileError(
            shown(folder),
            [f"{index_name}: the sharded checkpoint's weight_map must be an object of tensor -> "
             "shard file"],
        )  # fmt: skip
    by_shard: dict[str, set[str]] = {}
    problems: list[str] = []
    for tensor, shard in weight_map.items():
        problem = _shard_problem(shard)
        if problem:
            problems.append(f"{index_name}: {brief(tensor)}: {problem}")
        else:
            by_shard.setdefault(shard, set()).add(tensor)
    missing = [s for s in sorted(by_shard) if not os.path.lexists(folder / s)]
    if missing:
        problems.append(f"missing shard {listing(missing)} (named by {index_name})")
    if problems:
        raise WeightFileError(shown(folder), problems)
    return by_shard


def read_sharded_weights(folder: Path, index_name: str) -> dict[str, np.ndarray]:
    """{name: array} of a sharded checkpoint: every shard of its index read and checked to hold
    exactly the tensors the index gives it. Every problem (a missing shard, a tensor the index
    names that its shard lacks, one it does not name) is reported at once, in one
    WeightFileError naming the folder."""
    tensors: dict[str, np.ndarray] = {}
    problems: list[str] = []
    for shard, expected in sorted(shard_map(folder, index_name).items()):
        held = read_source_tensors(folder / shard)
        absent = sorted(expected - held.keys())
        extra = sorted(held.keys() - expected)
        if absent:
            problems.append(f"{shard}: lacks {listing(absent)}, which {index_name} puts there")
        if extra:
            problems.append(f"{shard}: holds {listing(extra)}, which {index_name} does not name")
        tensors.update({k: v for k, v in held.items() if k in expected})
    if problems:
        raise WeightFileError(shown(folder), problems)
    return tensors


# -- what a folder's digest covers ---------------------------------------------------------------


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)  # a link to a file (the hub's cache) counts
    except (OSError, ValueError):
        return False


def digest_files(folder: Path) -> list[Path]:
    """The files a folder is read from, in order of their path in it: the weights (the one file,
    or the index and every shard it names) and every .json and .txt file of the folder and its
    subfolders (config.json, sentence-transformers' modules and pooling, the tokenizer); in a
    folder of Meta's layout, params.json and its consolidated.NN.pth shards. Weights in other
    formats (tf_model.h5, ...) are not read, and not listed; nor are hidden files or anything
    that is not a regular file."""
    files: set[Path] = set()
    weights = weights_file(folder)
    if weights is not None:
        files.add(weights)
        if weights.name.endswith(INDEX_SUFFIX):
            files.update(folder / shard for shard in shard_map(folder, weights.name))
    else:  # Meta's layout: every rank's shard
        files.update(folder.glob(META_SHARDS))
    for root, dirs, names in os.walk(folder):  # links to folders are not followed
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.endswith(DIGESTED_SUFFIXES) and not name.startswith("."):
                files.add(Path(root) / name)
    return sorted((p for p in files if _is_regular(p)), key=lambda p: p.relative_to(folder).parts)


def write_hf_folder(
    folder: str | Path, state: Mapping[str, np.ndarray], texts: Mapping[str, str]
) -> None:
    """A Hugging Face folder as save_pretrained writes it: `state` in model.safetensors (with
    transformers' {"format": "pt"} metadata), then each JSON text of `texts` ({file name: text}),
    each file atomically. If a later file fails, the files already written are removed, and the
    folder too when this call made it."""
    import shutil

    from safetensors.numpy import save_file

    from transformer_rosetta.files.outputs import atomic_write, make_folder, text_writer

    folder = Path(folder)
    made = not folder.exists()
    make_folder(folder, "DST")
    written: list[Path] = []
    try:
        size = sum(a.nbytes for a in state.values())
        atomic_write(
            folder / SAFETENSORS_FILE,
            lambda tmp: save_file(dict(state), tmp, metadata={"format": "pt"}),
            size,
        )
        written.append(folder / SAFETENSORS_FILE)
        for name, text in texts.items():
            atomic_write(folder / name, text_writer(text))
            written.append(folder / name)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
