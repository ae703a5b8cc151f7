"""Canonical weights <-> the torch model's state_dict.

Every name comes from transformer_rosetta.spec.names; this file says only what is special to torch. nn.Linear
computes y = x W^T + b with W stored [out, in], while the canonical layout is y = x @ kernel + b:

    canonical                          shape            state_dict               shape
    *.{query,key,value}.kernel         [d, h, d_k]      *.weight (merge, T)      [h*d_k, d]
    *.{query,key,value}.bias           [h, d_k]         *.bias (merge)           [h*d_k]
    *_attention.output.kernel          [h, d_k, d]      *.weight (merge, T)      [d, h*d_k]
    feed_forward.*.kernel              [in, out]        *.weight (T)             [out, in]
    output.kernel (untied)             [d, V]           output.weight (T)        [V, d]
    *.scale (LayerNorm)                [d]              *.weight                 [d]
    embeddings                         [vocab, d]       *.weight                 [vocab, d]

Tied tensors are one Parameter under several state_dict keys: a shared embedding is
encoder.embedding.weight and decoder.embedding.weight, a tied output is also output.weight.
Every shape is asserted before a copy (nanoGPT's from_pretrained). A half of the family has only
the tensors canonical_specs lists, and its Transformer has no module for the rest (`encoder`, or
`decoder` and `output`, or each decoder layer's `cross_attention` is None), so its state_dict
holds exactly those keys.

The native checkpoint is torch.save(model.state_dict()), and it is read only with
torch.load(weights_only=True): a pickle that would build anything but tensors is refused unrun.
"""

from __future__ import annotations

import math
import pickle
import pickletools
import re
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import torch
from torch import Tensor, nn

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.files.outputs import atomic_write
from transformer_rosetta.files.safe_read import listing, os_problem, shown
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import TensorSpec, canonical_specs, embedding_names
from transformer_rosetta.torch_impl.model import Transformer
from transformer_rosetta.weights.format import dtype_problems, weight_file_path


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
def load_canonical(model: nn.Module, weights: Mapping[str, Tensor]) -> None:
    """Copy canonical tensors (any float dtype) into `model`, casting to each parameter's dtype
    and device. Every tensor is shape-checked twice: canonical, then native."""
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
        native, key = tensor_to_native(spec, weights[spec.name]), keys[spec.name]
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
    """Every tensor of a .pt/.bin state_dict, loaded with `weights_only=True` and nothing else.

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
        with warnings.catch_warnings():
            # Plain pickles (protocol 4, not torch.save's 2) make torch warn; the load is the same.
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(path, map_location="cpu", weights_only=True)
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
            # The config ties these: a file in which they differ is not this model.
            if not torch.equal(state[key], first):
                problems.append(
                    f"{key} differs from {keys[0]}, but the config ties them (one tensor, {name})"
                )
    return problems


def write_native(
    path: str | Path, config: TransformerConfig, weights: Mapping[str, Tensor]
) -> None:
    """torch.save(model.state_dict()) of Transformer(config) holding canonical `weights`, written
    atomically, in the weights' dtype (bit-exact). The caller has validated `weights`.

    The module is built for real, random initialisation included, rather than on the meta device
    and `to_empty`: to_empty gives each module its own new Parameter and so unties the tied
    embeddings, which this file must keep as one tensor under several keys.
    """
    dtype = TORCH_DTYPES[_dtype_name(next(iter(weights.values())))]
    module = Transformer(config).to(dtype)
    load_canonical(module, weights)
    state = module.state_dict()
    filled = {key for keys in native_aliases(config).values() for key in keys}
    assert set(state) == filled, f"state_dict keys not from canonical: {set(state) ^ filled}"
    atomic_write(Path(path), lambda tmp: torch.save(state, tmp))


def read_native(path: str | Path, config: TransformerConfig) -> dict[str, Tensor]:
    """Canonical tensors, in canonical order and the stored dtype, from a Transformer(config)
    state_dict file; one WeightFileError lists every problem."""
    state = read_state_dict(path)
    problems = _state_dict_problems(config, state)
    if problems:
        raise WeightFileError(str(path), problems)
    return canonical_from_state_dict(config, state)
