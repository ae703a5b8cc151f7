"""What every importer of a Hugging Face model folder reads the same way (Marian, BERT): the
folder itself, its small JSON files, and its weights (`model.safetensors`, else
`pytorch_model.bin` through the torch backend's weights_only reader). Each problem is one
ConfigError or WeightFileError that names the file; no framework is imported here."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError, WeightFileError
from transformer_rosetta.files.safe_read import (
    MAX_CONFIG_BYTES,
    FileProblem,
    MissingFile,
    json_type,
    os_problem,
    read_json,
    shown,
)
from transformer_rosetta.porting.sources import read_source_tensors

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"


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


def read_folder_weights(folder: Path) -> dict[str, np.ndarray]:
    """{name: array} of model.safetensors, else pytorch_model.bin; WeightFileError when neither
    is there (a sharded checkpoint is named as such)."""
    # lexists, not is_file: a weight file that is a FIFO or a broken link is named as such by
    # the reader (which refuses it unopened) rather than reported absent.
    for path in (folder / SAFETENSORS_FILE, folder / TORCH_FILE):
        if os.path.lexists(path):
            return read_source_tensors(path)
    sharded = sorted(p.name for p in folder.glob("*.index.json"))
    if sharded:
        problem = f"sharded checkpoints ({', '.join(sharded)}) are not supported; save unsharded"
    else:
        problem = f"neither {SAFETENSORS_FILE} nor {TORCH_FILE} is in this folder"
    raise WeightFileError(str(folder), [problem])


def name_hf_key(problem: str, hf_field: Mapping[str, str], model: str) -> str:
    """'d_model (BERT hidden_size): ...': a config problem with the folder's key behind our field."""
    ours, sep, rest = problem.partition(":")
    if sep and ours in hf_field:
        return f"{ours} ({model} {hf_field[ours]}):{rest}"
    return problem
