"""Canonical weights <-> the torch model's state_dict.

Every name comes from transformer_rosetta.spec.names; this file says only what is special to torch. nn.Linear
computes y = x W^T + b with W stored [out, in], while the canonical layout is y = x @ kernel + b:

    canonical                          shape            state_dict               shape
    *.query.kernel                     [d, h, d_k]      *.weight (merge, T)      [h*d_k, d]
    *.{key,value}.kernel               [d, g, d_k]      *.weight (merge, T)      [g*d_k, d]
    *.{query,key,value}.bias           [h or g, d_k]    *.bias (merge)           [h*d_k or g*d_k]
    *_attention.output.kernel          [h, d_k, d]      *.weight (merge, T)      [d, h*d_k]
    feed_forward.*.kernel              [in, out]        *.weight (T)             [out, in]
    output.kernel (untied)             [d, V]           output.weight (T)        [V, d]
    *.scale (LayerNorm, RMSNorm)       [d]              *.weight                 [d]
    embeddings                         [vocab, d]       *.weight                 [vocab, d]

g is the key/value heads (num_kv_heads; h unless grouped-query). feed_forward.* is gate (the
gated feed-forward's W_gate), intermediate and output. A bias the config leaves out (attention,
output projection or feed-forward biases off; an RMSNorm's, which it never has) is in neither
list: the nn.Linear is built with bias=False, and RMSNorm has a weight alone.

Tied tensors are one Parameter under several state_dict keys: a shared embedding is
encoder.embedding.weight and decoder.embedding.weight, a tied output is also output.weight.
Every shape is asserted before a copy (nanoGPT's from_pretrained). A half of the family has only
the tensors canonical_specs lists, and its Transformer has no module for the rest (`encoder`, or
`decoder` and `output`, or each decoder layer's `cross_attention` is None), so its state_dict
holds exactly those keys.

The native checkpoint is torch.save(model.state_dict()), and it is read only with
torch.load(weights_only=True): a pickle that would build anything but tensors is refused unrun.
Both directions hold no second copy of the model: write_native builds the state_dict from the
canonical arrays themselves (no module), and read_native maps the file and hands out views.
"""

from __future__ import annotations

import math
import os
import pickle
import pickletools
import re
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import ml_dtypes
import numpy as np
import torch
from torch import Tensor, nn

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.files.array_writes import write_array, write_arrays, write_at
from transformer_rosetta.files.os_names import library_path
from transformer_rosetta.files.outputs import atomic_write
from transformer_rosetta.files.safe_read import listing, os_problem, shown
from transformer_rosetta.files.zip_records import Member, ZipLayoutError, set_crc32, stored_members
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import TensorSpec, canonical_specs, embedding_names
from transformer_rosetta.weights.format import (
    check_layer_counts,
    dtype_problems,
    weight_file_path,
)


def native_name_map(config: TransformerConfig) -> dict[str, str]:
    """{canonical name: state_dict key}, in canonical order (for docs and converters). A tied
    tensor maps to its first key; native_aliases lists them all."""
    emb = embedding_names(config)
    # Token embeddings live in the stacks; a shared one is the encoder's (assigned last, wins).
    # A half of the family lacks one stack (its embedding name is None).
    stacks = {emb["target"]: "decoder.embedding", emb["source"]: "encoder.embedding"}
    modules = {name: module for name, module in stacks.items() if name is not None}
    names = {}
    for spec in canonical_specs(config):
        if spec.name in modules:
            names[spec.name] = f"{modules[spec.name]}.weight"
        elif spec.role == "embedding":  # learned positions and segments: nn.Embedding, same path
            names[spec.name] = f"{spec.name}.weight"
        else:  # kernel and LayerNorm scale -> weight; bias -> bias (embedding_norm's too)
            stem, _, leaf = spec.name.rpartition(".")
            names[spec.name] = f"{stem}.{'bias' if leaf == 'bias' else 'weight'}"
    return names


# idiom: a tied tensor is one Parameter that the state_dict lists under several keys
def native_aliases(config: TransformerConfig) -> dict[str, list[str]]:
    """{canonical name: every state_dict key that holds it}; more than one only when tied."""
    aliases = {name: [key] for name, key in native_name_map(config).items()}
    emb = embedding_names(config)
    if config.share_embeddings:
        aliases[emb["target"]].append("decoder.embedding.weight")
    if config.tie_output:
        aliases[emb["output"]].append("output.weight")
    return aliases


# idiom: nn.Linear stores W^T and merged heads (the table above); docs and porting read it
def native_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The shape of canonical tensor `spec` in the state_dict."""
    if spec.role == "kernel":
        return (spec.fan_out, spec.fan_in)
    if spec.role == "bias":
        return (math.prod(spec.shape),)
    return spec.shape


# idiom: per tensor, canonical -> nn.Linear's (out, in) layout; the others map whole models
def tensor_to_native(spec: TensorSpec, t: Tensor) -> Tensor:
    """Canonical layout -> nn.Linear / nn.LayerNorm / nn.Embedding layout (exact: no arithmetic).

    A kernel, of any rank, is a view of the matrix (fan_in, fan_out) that nn.Linear stores
    transposed: attention kernels merge their head axes first, (d, h, d_k) -> (d, h*d_k).
    """
    assert tuple(t.shape) == spec.shape, f"{spec.name}: {tuple(t.shape)} != {spec.shape}"
    # rosetta: checkpoints
    if spec.role == "kernel":
        return t.reshape(spec.fan_in, spec.fan_out).T.contiguous()  # (out, in)
    return t.reshape(native_shape(spec))  # attention biases (h, d_k) -> (h*d_k,)


# idiom: per tensor, the inverse of tensor_to_native
def tensor_to_canonical(spec: TensorSpec, t: Tensor) -> Tensor:
    """Inverse of tensor_to_native."""
    want = native_shape(spec)
    assert tuple(t.shape) == want, f"{spec.name}: state_dict has {tuple(t.shape)}, needs {want}"
    out = t.T if spec.role == "kernel" else t  # (out, in) -> (in, out), then split the heads
    return out.reshape(spec.shape).contiguous()


# idiom: the state_dict is torch's native container (load_state_dict, torch.save)
def state_dict_from_canonical(
    config: TransformerConfig, weights: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """A state_dict for Transformer(config) (every alias of a tied tensor included)."""
    aliases = native_aliases(config)
    state = {}
    for spec in canonical_specs(config):
        native = tensor_to_native(spec, weights[spec.name])
        for key in aliases[spec.name]:
            state[key] = native
    return state


# idiom: the inverse, over any state_dict-shaped mapping (train.py passes the .grad tensors)
def canonical_from_state_dict(
    config: TransformerConfig, state: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Canonical tensors, in canonical order, from a Transformer(config) state_dict."""
    keys = native_name_map(config)
    return {
        spec.name: tensor_to_canonical(spec, state[keys[spec.name]])
        for spec in canonical_specs(config)
    }


@torch.no_grad()
def load_canonical(model: nn.Module, weights: Mapping[str, Tensor | np.ndarray]) -> None:
    """Copy canonical tensors (any float dtype; torch tensors or numpy arrays, which may be
    mapped from a file) into `model`, casting to each parameter's dtype and device, one tensor
    at a time. Every tensor is shape-checked twice: canonical, then native."""
    config = model.config
    params = model.state_dict(keep_vars=True)
    expected = {s.name for s in canonical_specs(config)}
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ValueError(
            f"canonical weights: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    # rosetta: checkpoints
    keys = native_name_map(config)
    for spec in canonical_specs(config):
        given = weights[spec.name]
        if not isinstance(given, Tensor):  # numpy: torch's view of it (a copy if not contiguous)
            given = _from_numpy(np.ascontiguousarray(given))
        native, key = tensor_to_native(spec, given), keys[spec.name]
        assert native.shape == params[key].shape, f"{key}: {native.shape} != {params[key].shape}"
        params[key].copy_(native)  # a tied Parameter is copied once, through its first key


def export_canonical(model: nn.Module) -> dict[str, Tensor]:
    """Every canonical tensor of `model`, in canonical order, in the model's dtype."""
    return canonical_from_state_dict(model.config, model.state_dict())


# -- the native checkpoint: torch.save(model.state_dict()) ------------------------------------

# idiom: the format's dtype names -> torch dtypes (backend.py builds models in these)
TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _dtype_name(t: Tensor) -> str:
    """'float32', 'bfloat16', ..., 'int64': torch's name without the 'torch.' prefix, which for
    the floats is the format's name (transformer_rosetta.spec.dtypes)."""
    return str(t.dtype).removeprefix("torch.")


def _weights_only_detail(exc: Exception) -> str:
    """The one line of torch's long weights_only message that says what was refused."""
    text = str(exc)
    _, _, detail = text.partition("WeightsUnpickler error:")
    for line in detail.splitlines():
        line = line.strip()
        if line:
            return shown(line.split(". Please use")[0].rstrip("."))[:200]
    return "an object torch does not allow"


_ZIP_MAGIC = b"PK\x03\x04"
# The first byte of every binary pickle (protocol 2+), torch's legacy format included.
_PICKLE_PROTO = 0x80


def _pickle_scan(stream: IO[bytes]) -> tuple[str | None, int | None, list[str]]:
    """(why `stream` is not one well-formed pickle or None, its protocol, the globals it names),
    found by pickletools.genops, which only reads opcodes and builds nothing (so runs no code)."""
    protocol, names, strings = None, [], []
    try:
        for op, arg, _ in pickletools.genops(stream):
            if op.name == "PROTO":
                protocol = arg
            elif op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) == 2:
                names.append(".".join(strings))
            elif "UNICODE" in op.name:
                strings = [*strings[-1:], str(arg)]
    except Exception as exc:  # genops raises ValueError and others on bytes that are no pickle
        return shown(str(exc).split("\n")[0])[:120] or type(exc).__name__, protocol, names
    return None, protocol, names


_LEGACY_PICKLES = 5


def _refusal(path: Path, exc: Exception) -> str:
    """The problem for a file that torch's weights_only loader refused: damaged bytes, a plain
    pickle that loader cannot read, or a pickle naming objects other than tensors."""
    damaged, protocol, names, at_end = None, 2, [], False
    if not zipfile.is_zipfile(path):  # a zip's data.pkl was checked by _sniff
        size = path.stat().st_size
        with path.open("rb") as f:
            # torch's legacy format is five pickles (magic, protocol, sys info, the object,
            # storage keys), then raw storage bytes; a plain pickle is one.
            for i in range(_LEGACY_PICKLES):
                damaged, found, more = _pickle_scan(f)
                protocol = found if i == 0 else protocol
                names += more
                if damaged or f.tell() >= size:
                    break
            at_end = f.tell() >= size
    if damaged and at_end:
        return f"truncated or corrupt torch checkpoint (its pickle ends early: {damaged})"
    if damaged:  # bytes that only start like a pickle: nothing was refused, nothing ran
        return f"not a torch checkpoint (not a pickle: {damaged})"
    others = [n for n in dict.fromkeys(names) if not n.startswith(("torch.", "collections."))]
    if protocol is not None and protocol >= 4 and not others:
        return (
            f"not a torch checkpoint: a plain pickle (protocol {protocol}), which torch's "
            "weights_only loader does not read; save the state_dict with torch.save"
        )
    named = f"; it names {listing(others, 3)}" if others else ""
    return (
        "refused: the file's pickle holds objects other than tensors (weights_only loading); "
        f"unpickling it could run code, so it is not loaded ({_weights_only_detail(exc)}{named})"
    )


def _archive_problem(path: Path) -> str | None:
    """Why the zip at `path` is not a torch.save archive (one top folder holding data.pkl), or
    why its data.pkl is not a pickle; None when it looks like one."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            pickles = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
            if not pickles:
                return (
                    "not a torch checkpoint (a zip archive, but not torch.save's: it has no "
                    "data.pkl)"
                )
            with archive.open(pickles[0]) as data:
                problem, _, _ = _pickle_scan(data)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError, ValueError):
        return "truncated or corrupt torch checkpoint (a damaged zip archive)"
    if problem:
        return f"not a torch checkpoint (its data.pkl is not a pickle: {problem})"
    return None


def _sniff(path: Path) -> str | None:
    """A problem that the first bytes of `path` show before torch reads it: empty, neither a
    zip archive nor a binary pickle, a zip cut short or not torch's."""
    with path.open("rb") as f:
        head = f.read(4)
    if not head:
        return "not a torch checkpoint (the file is empty)"
    if head == _ZIP_MAGIC:
        if not zipfile.is_zipfile(path):
            return (
                "truncated or corrupt torch checkpoint (a zip archive without its central "
                "directory: cut short?)"
            )
        return _archive_problem(path)
    if head[0] != _PICKLE_PROTO:
        return (
            "not a torch checkpoint (neither a zip archive nor a binary pickle, the two formats "
            "torch.save writes)"
        )
    return None


# idiom: any .pt/.bin state_dict, for the backend's read_tensors (porting other checkpoints)
def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a .pt/.bin state_dict, loaded with `weights_only=True` and nothing else,
    mapped from the file where its format allows (torch.load(mmap=True)).

    weights_only=True makes torch unpickle through an allow-list (tensors, dicts, lists, numbers),
    so a file whose pickle would build any other object (the classic `__reduce__` payload that
    runs os.system) is refused before anything in it runs. A `{"state_dict": {...}}` wrapper, as
    Lightning and many training scripts write, is unwrapped, and so is nanoGPT's training
    checkpoint `{"model": {...}, "optimizer": ..., ...}`. The path must be a regular file (a
    FIFO is refused unopened), and its first bytes must be a zip archive holding data.pkl or a
    binary pickle; every other problem becomes one WeightFileError, never a traceback from
    torch's zip or pickle readers, and never advice to load without weights_only.
    """
    path = weight_file_path(path, "a torch checkpoint")
    name = shown(path)
    try:
        problem = _sniff(path)
    except OSError as exc:
        raise WeightFileError(name, [os_problem(exc)]) from None
    if problem:
        raise WeightFileError(name, [problem])
    try:
        with path.open("rb") as f:
            # torch.save's zip format is mapped, not read: a tensor's pages come from the file
            # when they are used, and the file's bytes are never copied whole into memory. The
            # legacy format (one pickle stream) cannot be mapped, and is read.
            mapped = f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
        with warnings.catch_warnings():
            # Plain pickles (protocol 4, not torch.save's 2) make torch warn; the load is the same.
            warnings.simplefilter("ignore", UserWarning)
            # idiom: torch's zip reader takes the name as UTF-8 (h5py and safetensors, Keras's and
            # Flax's readers, encode it as the OS does): a name that is not (the C locale's
            # non-ASCII names) goes by the open file's (files/os_names.py).
            with library_path(path) as name:
                obj = torch.load(name, map_location="cpu", weights_only=True, mmap=mapped)
    except FileNotFoundError:
        raise WeightFileError(name, ["no such file"]) from None
    except PermissionError:
        raise WeightFileError(name, ["permission denied"]) from None
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            raise WeightFileError(name, [_refusal(path, exc)]) from None
        raise WeightFileError(name, [f"not a torch checkpoint ({_reason(exc)})"]) from None
    except EOFError:
        raise WeightFileError(
            name, ["truncated or corrupt torch checkpoint (its pickle ends early)"]
        ) from None
    except (RuntimeError, OSError) as exc:
        # torch's zip reader on a file cut short or damaged: "failed finding central directory",
        # "unexpected EOF", or an OSError from seeking past the end. The first sentence says it.
        raise WeightFileError(
            name, [f"truncated or corrupt torch checkpoint ({_reason(exc)})"]
        ) from None
    except Exception as exc:  # the legacy pickle reader fails with KeyError, ValueError, ...
        raise WeightFileError(
            name, [f"not a torch checkpoint ({type(exc).__name__}: {_reason(exc)})"]
        ) from None

    for wrapper in ("state_dict", "model"):  # Lightning's; nanoGPT's ckpt.pt
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
            break
    if not isinstance(obj, Mapping):
        raise WeightFileError(
            name, [f"not a state_dict: the file holds a {type(obj).__name__}, not a dict"]
        )
    others = [f"{k} ({type(v).__name__})" for k, v in obj.items() if not isinstance(v, Tensor)]
    if others:
        raise WeightFileError(
            name, [f"not a state_dict: entries that are not tensors: {listing(others)}"]
        )
    return {str(k): v for k, v in obj.items()}


def _reason(exc: BaseException) -> str:
    """The first sentence of torch's message, without its C++ source location, on one line."""
    text = re.sub(r"\[enforce fail at [^\]]*\]\s*\.?\s*", "", str(exc))
    return shown(text.split(". ")[0].strip())[:200] or type(exc).__name__


def _state_dict_problems(config: TransformerConfig, state: Mapping[str, Tensor]) -> list[str]:
    """Everything wrong with `state` as a Transformer(config) state_dict, in state_dict keys
    (what a torch user sees in the file): missing, unexpected, wrong-shaped, a non-float or
    mixed dtype, and tied aliases that hold different values."""
    aliases = native_aliases(config)
    wanted = {key: spec for spec in canonical_specs(config) for key in aliases[spec.name]}
    missing = [k for k in wanted if k not in state]
    unexpected = sorted(k for k in state if k not in wanted)
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listing(unexpected)}")
    for key, spec in wanted.items():
        if key in state and tuple(state[key].shape) != native_shape(spec):
            also = f" ({spec.name})" if spec.name != key else ""
            problems.append(
                f"wrong shape for {key}{also}: file has {list(state[key].shape)}, "
                f"config needs {list(native_shape(spec))}"
            )
    problems += dtype_problems({k: (_dtype_name(t), tuple(t.shape)) for k, t in state.items()})
    if problems:
        return problems
    for name, keys in aliases.items():
        first = state[keys[0]]
        for key in keys[1:]:
            # The config ties these: a file in which they differ is not this model. torch.save
            # stores a tied tensor once, so its keys load as views of one storage: the same
            # memory, equal without reading it.
            if _same_view(state[key], first):
                continue
            if not torch.equal(state[key], first):
                problems.append(
                    f"{key} differs from {keys[0]}, but the config ties them (one tensor, {name})"
                )
    return problems


# idiom: Transformer(config).state_dict()'s key order: each top-level module's keys together
# (nn.Module registers encoder, decoder, output in that order), tied keys where their module is
_TOP_MODULES = {"encoder": 0, "decoder": 1, "output": 2}


def _state_dict_keys(config: TransformerConfig) -> dict[str, str]:
    """{state_dict key: canonical name} in the order Transformer(config).state_dict() lists them,
    found without building the module: an untied model's keys, in canonical order, grouped by
    top-level module (the canonical order lists both stacks' embeddings first)."""
    untied = config.replace(share_embeddings=False, tie_output=False)
    rank = {key: i for i, key in enumerate(native_name_map(untied).values())}
    owner = {key: name for name, keys in native_aliases(config).items() for key in keys}
    order = sorted(owner, key=lambda key: (_TOP_MODULES[key.split(".")[0]], rank[key]))
    return {key: owner[key] for key in order}


def _from_numpy(a: np.ndarray) -> Tensor:
    """A tensor over `a`'s memory, never a copy: a read-only (mapped) array too, which torch
    warns about because a tensor cannot be read-only; these are only read (torch.save). torch
    cannot read ml_dtypes' bfloat16, so its bits pass as uint16 and are viewed back."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(a)


def _numpy_view(t: Tensor) -> np.ndarray:
    """A read-only numpy view of a CPU tensor, never a copy (bfloat16 as ml_dtypes.bfloat16)."""
    if t.dtype == torch.bfloat16:
        out = t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    else:
        out = t.numpy()
    out.flags.writeable = False
    return out


def _native_view(spec: TensorSpec, a: np.ndarray) -> np.ndarray:
    """tensor_to_native on a numpy array, as a view of its memory: a kernel's nn.Linear layout is
    the transposed canonical matrix, which is not C-contiguous."""
    if spec.role == "kernel":
        return a.reshape(spec.fan_in, spec.fan_out).T
    return a.reshape(native_shape(spec))


def _same_view(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors are the same view of the same memory (so equal, NaN included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def write_native(
    path: str | Path, config: TransformerConfig, weights: Mapping[str, np.ndarray]
) -> None:
    """torch.save of Transformer(config)'s state_dict holding canonical `weights` (numpy, one
    float dtype; the caller has validated them), written atomically, bit-exact, with every key
    in the order model.state_dict() gives and a tied tensor stored once under all its keys.

    No module is built and no tensor is held twice in memory. torch.save lays the archive out
    without the tensors' bytes (torch.serialization.skip_data): the pickle, and room for each
    storage. Each tensor's bytes then go into its room straight from the caller's array (a
    mapped file's pages, where they are nn.Linear's layout already; a kernel, stored
    transposed, a block at a time through torch's copy_), and each member's
    CRC-32 and the archive's serialization id are set as torch.save sets them: the file's bytes
    are torch.save(dict(model.state_dict()))'s for a model holding `weights`. Contiguous, not
    a transposed view (torch.save would keep its strides): the file holds what
    model.state_dict() holds, contiguous tensors, which every torch tool reads
    (safetensors.torch.save_file refuses non-contiguous ones, .view() may fail on them). A torch
    without skip_data, or whose archive is laid out otherwise, gets _write_staged's file, the
    same bytes.
    """
    specs = {spec.name: spec for spec in canonical_specs(config)}
    keys = _state_dict_keys(config)
    dtype = np.asarray(next(iter(weights.values()))).dtype
    nbytes = {name: math.prod(spec.shape) * dtype.itemsize for name, spec in specs.items()}

    def write(tmp: str) -> None:
        natives = {
            name: _native_view(spec, np.asarray(weights[name])) for name, spec in specs.items()
        }
        # idiom: torch.save takes the whole state_dict at once, so it lays the archive out and
        # the bytes are filled in after; Keras's file (h5py) and Flax's (msgpack) stream as written
        if hasattr(torch.serialization, "skip_data"):
            placeholders = {name: _placeholder(a) for name, a in natives.items()}
            with torch.serialization.skip_data():
                torch.save(_state(placeholders, keys), tmp)
            try:
                # the storages in the order torch.save numbers them: as the pickle meets them
                _fill_storages(tmp, [natives[name] for name in dict.fromkeys(keys.values())])
                return
            except ZipLayoutError:
                pass
        _write_staged(tmp, natives, keys)

    # the file, and where torch cannot lay it out first, the scratch copies of the kernels
    atomic_write(Path(path), write, 2 * sum(nbytes.values()))


def _state(tensors: Mapping[str, Tensor], keys: Mapping[str, str]) -> dict[str, Tensor]:
    """The state_dict: each key a tensor object of its own (detach: the same storage), as
    model.state_dict() gives a tied Parameter under each of its keys, so the pickle is the
    same: one storage, a tensor record per key."""
    return {key: tensors[name].detach() for key, name in keys.items()}


def _placeholder(a: np.ndarray) -> Tensor:
    """A contiguous tensor of `a`'s shape and dtype whose bytes torch.save(skip_data) never
    reads: `a`'s own memory where it is contiguous, else an allocation never touched (address
    space, no memory)."""
    if a.flags.c_contiguous:
        return _from_numpy(a)
    return torch.empty(a.shape, dtype=_from_numpy(np.empty(0, a.dtype)).dtype)


def _fill_storages(path: str, arrays: list[np.ndarray]) -> None:
    """Put each array's bytes into its storage's room in the archive torch.save(skip_data)
    laid out at `path`, and set the CRC-32s and the serialization id torch.save would have
    written. ZipLayoutError, before any byte is written, where the layout is not the expected
    one (a storage per array, in order, each of the array's size)."""
    members = stored_members(path)
    if not members:
        raise ZipLayoutError("torch.save wrote an empty archive")
    prefix = next(iter(members)).split("/", 1)[0]  # the archive's folder: the file's stem
    rooms = [members.get(f"{prefix}/data/{k}") for k in range(len(arrays))]
    stored = [name for name in members if name.startswith(f"{prefix}/data/")]
    if len(stored) != len(arrays) or any(
        room is None or room.size != a.nbytes for room, a in zip(rooms, arrays, strict=True)
    ):
        raise ZipLayoutError("torch.save laid the storages out otherwise")
    with open(path, "r+b", buffering=0) as f:
        placed = [(a, room.offset) for room, a in zip(rooms, arrays, strict=True) if room]
        sums = write_arrays(f.fileno(), placed, checksum=True, copy_block=transposing_copy)
        assert sums is not None
        crcs = {room.name: crc for room, crc in zip(rooms, sums, strict=True) if room}
        identity = members.get(f"{prefix}/.data/serialization_id")
        if identity is not None:
            crcs.update(_serialization_id(f.fileno(), members, identity, crcs))
    set_crc32(path, crcs)


# idiom: only torch's kernels are stored transposed, so only its writer has a transposing copy
def transposing_copy(out: np.ndarray, block: np.ndarray) -> None:
    """A strided block (rows of a transposed kernel) into the C-contiguous buffer `out`:
    torch's copy_, tiled and on every thread torch has (about twice numpy's tiles here)."""
    _from_numpy(out).copy_(_from_numpy(block))


def _serialization_id(
    fd: int, members: Mapping[str, Member], identity: Member, crcs: Mapping[str, int]
) -> dict[str, int]:
    """Rewrite the archive's serialization id as torch.save computes it once every member's
    bytes are in: 20 digits of its own, then 20 of c10::hash_combine folded over the CRC-32 of
    every member written before it (torch.save(skip_data) folded 0 for each storage). Its
    member's new CRC-32."""
    old = os.pread(fd, identity.size, identity.offset)
    if len(old) != 40 or not old.isdigit():
        raise ZipLayoutError("torch's serialization id is not 40 digits")
    combined = 0
    for name, member in members.items():
        if name == identity.name:
            break
        crc = crcs.get(name)
        if crc is None:  # a member torch.save wrote whole: its CRC-32 from its bytes
            crc = zlib.crc32(os.pread(fd, member.size, member.offset))
        combined = _hash_combine(combined, crc)
    new = old[:20] + f"{combined:020d}".encode()
    write_at(fd, new, identity.offset)
    return {identity.name: zlib.crc32(new)}


_U64 = (1 << 64) - 1


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t (boost's): what torch.save folds the CRCs with."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


def _write_staged(tmp: str, natives: Mapping[str, np.ndarray], keys: Mapping[str, str]) -> None:
    """write_native for a torch that cannot lay the archive out first: each kernel (not
    contiguous) is copied into an unnamed scratch file beside `tmp`, whose pages torch.save then
    reads; the scratch file has no name (O_TMPFILE where the OS has it), so nothing is left
    behind whatever stops the write, and its mapping holds the copies in the page cache, not
    in the process's own memory."""
    with tempfile.TemporaryFile(dir=os.path.dirname(tmp)) as scratch:
        total = sum(a.nbytes for a in natives.values())
        scratch.truncate(total)  # sparse: only what is written takes disk
        offset, places = 0, {}
        for name, native in natives.items():
            if not native.flags.c_contiguous:
                write_array(native, scratch.fileno(), offset)
                places[name] = offset
            offset += native.nbytes
        staged = np.memmap(scratch, np.uint8, "r", 0, total)
        tensors: dict[str, Tensor] = {}
        for name, native in natives.items():
            if name in places:
                begin = places[name]
                view = (
                    staged[begin : begin + native.nbytes].view(native.dtype).reshape(native.shape)
                )
            else:
                view = native
            tensors[name] = _from_numpy(view)
        torch.save(_state(tensors, keys), tmp)


def read_native(path: str | Path, config: TransformerConfig) -> dict[str, Tensor]:
    """Canonical tensors, in canonical order and the stored dtype, from a Transformer(config)
    state_dict file; one WeightFileError lists every problem.

    The file is mapped (torch.load(mmap=True), for torch.save's zip format), and each canonical
    tensor is a view of the mapped state_dict tensor (a kernel is the transposed view, its heads
    split by strides), so nothing is copied: they are not contiguous, and a reader that needs
    contiguous memory copies one tensor at a time.
    """
    state = read_state_dict(path)
    # A --config of 10^9 layers over a file of 2: refused before its names are built.
    check_layer_counts(path, config, state)
    problems = _state_dict_problems(config, state)
    if problems:
        raise WeightFileError(str(path), problems)
    keys = native_name_map(config)
    out = {}
    for spec in canonical_specs(config):
        t = state[keys[spec.name]]
        # A view splits the head axes by strides; a file whose tensors have other strides than
        # torch.save gives a contiguous tensor may need a copy (reshape makes one then).
        out[spec.name] = (t.T if spec.role == "kernel" else t).reshape(spec.shape)
    return out
