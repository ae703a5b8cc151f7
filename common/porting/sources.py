"""Read an outside model's weights as {name: numpy array}, whatever framework saved them, for the
importer tables (common/porting/table.py). No code in a file ever runs:

- `.pt` / `.bin`: a torch state_dict, through the adapter's `tensor_reader` (the torch
  backend's torch.load with weights_only=True);
- `.h5` (a Keras `.weights.h5`): every HDF5 dataset, named by its path ("encoder/embedding/
  vars/0"), through h5py, which reads arrays and never unpickles;
- `.safetensors`: every tensor, through safetensors' numpy API;
- `.npz`: every array, with allow_pickle=False.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from transformer_rosetta.errors import BackendUnavailable, WeightFileError
from transformer_rosetta.files.hdf5 import read_hdf5
from transformer_rosetta.files.safe_read import FileProblem, MissingFile, regular_file, shown
from transformer_rosetta.weights.format import read_header

SOURCE_SUFFIXES = (".pt", ".bin", ".h5", ".safetensors", ".npz")


def read_source_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """{name: array} of the file at `path`, by its suffix (module docstring); WeightFileError
    naming the file for anything that cannot be read."""
    path = Path(path)
    try:
        regular_file(path, "a weight file")
    except MissingFile:
        raise WeightFileError(shown(path), ["no such file"]) from None
    except FileProblem as exc:
        raise WeightFileError(shown(path), [exc.problem]) from None
    suffix = path.suffix.lower()
    if suffix in (".pt", ".bin"):
        from transformer_rosetta.adapter.backends import tensor_reader

        try:
            return tensor_reader().read_tensors(path)
        except BackendUnavailable as exc:
            raise WeightFileError(
                shown(path), [f"reading a torch file needs torch ({exc})"]
            ) from None
    if suffix == ".h5":
        return _read_h5(path)
    if suffix == ".safetensors":
        return read_safetensors(path)
    if suffix == ".npz":
        return _read_npz(path)
    raise WeightFileError(
        shown(path),
        [f"cannot tell how to read it; the suffix must be one of {', '.join(SOURCE_SUFFIXES)}"],
    )


def _read_h5(path: Path) -> dict[str, np.ndarray]:
    """A `.h5` (a Keras `.weights.h5`, a tutorial's or a --map's) through the one HDF5 reader:
    a dataset stored outside the file is refused by name, and nothing outside it is read."""
    return read_hdf5(path, "Keras .weights.h5")


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (any, not only ours), as numpy."""
    from safetensors import safe_open

    read_header(path)  # names a file that is not safetensors, or is truncated, precisely
    try:
        with safe_open(str(path), framework="np") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for corrupt data
        raise WeightFileError(
            shown(path), [f"cannot read tensors ({shown(str(exc))[:200]})"]
        ) from None


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, ValueError) as exc:
        raise WeightFileError(
            shown(path), [f"cannot read it as .npz ({shown(str(exc))[:200]})"]
        ) from None
