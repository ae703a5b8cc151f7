"""The one way this project opens an HDF5 file: Keras's `.weights.h5` checkpoints
(tf_impl/weights.py), the tutorials' `.weights.h5` and a `--map`'s `.h5` (common/porting/sources.py).

HDF5 can keep a dataset's bytes outside the file: external storage (raw bytes in any other file,
/dev/zero, a FIFO) and virtual datasets (slices of other HDF5 files). A file Keras writes never
does. Every dataset is checked before any is read, and a file with one such dataset is refused
by name, so nothing outside the file is ever opened. Links to other files (external links) are
not followed: only the datasets that the file itself holds are visited. h5py reads arrays only;
no code in the file ever runs.

A dataset stored as one block in the file, as Keras stores every weight, is handed out as a
read-only view of the mapped file (dataset_views), so reading a model costs no memory of its own.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.files.safe_read import listing, shown

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@contextlib.contextmanager
def hdf5_datasets(path: str | Path, what: str = "HDF5 file") -> Iterator[dict[str, Any]]:
    """Every dataset of the HDF5 file at `path`, {its path in the file: the h5py Dataset}, open
    while the block runs. A file that is not HDF5, cannot be read (truncated, damaged), or holds
    a dataset stored outside it is one WeightFileError naming the problem; a read error inside
    the block is one too."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(len(HDF5_SIGNATURE)) != HDF5_SIGNATURE:
            raise WeightFileError(
                shown(path), [f"not a readable {what}: no HDF5 signature at its start"]
            )
    try:
        import h5py
    except ImportError:
        raise WeightFileError(
            shown(path), ["reading HDF5 needs h5py (pip install 'transformer-rosetta[tf]')"]
        ) from None
    try:
        with h5py.File(path, "r") as f:
            found: dict[str, Any] = {}
            f.visititems(
                lambda name, item: (
                    found.__setitem__(name, item) if isinstance(item, h5py.Dataset) else None
                )
            )
            # idiom: HDF5 can keep a dataset's bytes in other files; one that does is never read
            elsewhere = [name for name, ds in found.items() if ds.external or ds.is_virtual]
            if elsewhere:
                raise WeightFileError(
                    shown(path),
                    [
                        f"datasets stored outside the file, which are never read: {listing(elsewhere)}"
                    ],
                )
            yield found
    except OSError as exc:
        # h5py's messages say what is wrong: "file signature not found" (not HDF5), "truncated
        # file: eof = ..." (cut short), or a read error inside a damaged file.
        reason = str(exc).removeprefix("Unable to synchronously open file ").strip("()")
        raise WeightFileError(
            shown(path), [f"not a readable {what} (HDF5): {shown(reason)[:200]}"]
        ) from None


def stored_dtype(ds: Any) -> str:
    """The dtype a dataset holds, by numpy's name ("float32"): bfloat16 is an opaque 2-byte type
    with a "dtype" attribute (Keras's H5IOStore), anything else is what h5py reports."""
    if ds.attrs.get("dtype") == "bfloat16":
        return "bfloat16"
    return ds.dtype.name


def dataset_array(ds: Any) -> np.ndarray:
    """A dataset's values, bit for bit (Keras's opaque bfloat16 viewed as ml_dtypes.bfloat16)."""
    array = np.asarray(ds[()])
    if stored_dtype(ds) == "bfloat16":
        import ml_dtypes

        array = array.view(ml_dtypes.bfloat16)
    return np.ascontiguousarray(array)


def dataset_views(
    path: str | Path, datasets: Mapping[str, Any], what: str = "HDF5 file"
) -> dict[str, np.ndarray]:
    """{key: the values of datasets[key]} without reading them into memory where HDF5 keeps a
    dataset's bytes as one block in the file, as Keras writes every weight (contiguous layout,
    no filter, native byte order): a read-only array over those bytes, mapped from `path`, whose
    pages the OS reads when they are used and may drop again. Any other dataset (chunked,
    compressed, compact, another byte order) is read by h5py, one copy (dataset_array).

    `datasets` are h5py Datasets of the open file at `path` (hdf5_datasets), already checked to
    be stored inside it; a block that would reach past the file's end is a truncated file."""
    path = Path(path)
    views: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    for key, ds in datasets.items():
        offset = ds.id.get_offset()  # None unless its bytes are one block in the file
        if ds.chunks is not None or offset is None or not ds.dtype.isnative or ds.size == 0:
            views[key] = dataset_array(ds)
            continue
        nbytes = ds.size * ds.dtype.itemsize
        if offset + nbytes > size:
            raise WeightFileError(
                shown(path),
                [
                    f"truncated {what}: dataset {shown(ds.name)} needs bytes {offset}.."
                    f"{offset + nbytes}, the file has {size}"
                ],
            )
        array = np.frombuffer(mapped, ds.dtype, ds.size, offset).reshape(ds.shape)
        if stored_dtype(ds) == "bfloat16":
            import ml_dtypes

            array = array.view(ml_dtypes.bfloat16)
        views[key] = array
    return views


def read_hdf5(path: str | Path, what: str = "HDF5 file") -> dict[str, np.ndarray]:
    """Every dataset of the file, {path in the file: array}, through hdf5_datasets: read-only
    views of the mapped file where HDF5 keeps a dataset as one block (dataset_views)."""
    with hdf5_datasets(path, what) as datasets:
        return dataset_views(path, datasets, what)
