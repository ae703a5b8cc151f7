"""Canonical weights <-> the torch model's state_dict.

Every name comes from common.names; this file says only what is special to torch. nn.Linear
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
Every shape is asserted before a copy (nanoGPT's from_pretrained).

The native checkpoint is torch.save(model.state_dict()), and it is read only with
torch.load(weights_only=True): a pickle that would build anything but tensors is refused unrun.
"""

from __future__ import annotations

import math
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from common.config import TransformerConfig
from common.errors import WeightFileError
from common.format import atomic_write, dtype_problems
from common.names import TensorSpec, canonical_specs, embedding_names
from torch_impl.model import Transformer


def native_name_map(config: TransformerConfig) -> dict[str, str]:
    """{canonical name: state_dict key}, in canonical order (for docs and converters). A tied
    tensor maps to its first key; native_aliases lists them all."""
    emb = embedding_names(config)
    # Token embeddings live in the stacks; a shared one is the encoder's (assigned last, wins).
    modules = {emb["target"]: "decoder.embedding", emb["source"]: "encoder.embedding"}
    names = {}
    for spec in canonical_specs(config):
        if spec.name in modules:
            names[spec.name] = f"{modules[spec.name]}.weight"
        elif spec.role == "embedding":  # learned positions: an nn.Embedding under the same path
            names[spec.name] = f"{spec.name}.weight"
        else:  # kernel and LayerNorm scale -> weight; bias -> bias
            stem, _, leaf = spec.name.rpartition(".")
            names[spec.name] = f"{stem}.{'bias' if leaf == 'bias' else 'weight'}"
    return names


def native_aliases(config: TransformerConfig) -> dict[str, list[str]]:
    """{canonical name: every state_dict key that holds it}; more than one only when tied."""
    aliases = {name: [key] for name, key in native_name_map(config).items()}
    emb = embedding_names(config)
    if config.share_embeddings:
        aliases[emb["target"]].append("decoder.embedding.weight")
    if config.tie_output:
        aliases[emb["output"]].append("output.weight")
    return aliases


def native_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The shape of canonical tensor `spec` in the state_dict."""
    if spec.role == "kernel":
        return (spec.fan_out, spec.fan_in)
    if spec.role == "bias":
        return (math.prod(spec.shape),)
    return spec.shape


def to_native(spec: TensorSpec, t: Tensor) -> Tensor:
    """Canonical layout -> nn.Linear / nn.LayerNorm / nn.Embedding layout (exact: no arithmetic).

    A kernel, of any rank, is a view of the matrix (fan_in, fan_out) that nn.Linear stores
    transposed: attention kernels merge their head axes first, (d, h, d_k) -> (d, h*d_k).
    """
    assert tuple(t.shape) == spec.shape, f"{spec.name}: {tuple(t.shape)} != {spec.shape}"
    if spec.role == "kernel":
        return t.reshape(spec.fan_in, spec.fan_out).T.contiguous()  # (out, in)
    return t.reshape(native_shape(spec))  # attention biases (h, d_k) -> (h*d_k,)


def to_canonical(spec: TensorSpec, t: Tensor) -> Tensor:
    """Inverse of to_native."""
    want = native_shape(spec)
    assert tuple(t.shape) == want, f"{spec.name}: state_dict has {tuple(t.shape)}, needs {want}"
    out = t.T if spec.role == "kernel" else t  # (out, in) -> (in, out), then split the heads
    return out.reshape(spec.shape).contiguous()


def state_dict_from_canonical(
    config: TransformerConfig, weights: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """A state_dict for Transformer(config) (every alias of a tied tensor included)."""
    aliases = native_aliases(config)
    state = {}
    for spec in canonical_specs(config):
        native = to_native(spec, weights[spec.name])
        for key in aliases[spec.name]:
            state[key] = native
    return state


def canonical_from_state_dict(
    config: TransformerConfig, state: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Canonical tensors, in canonical order, from a Transformer(config) state_dict."""
    keys = native_name_map(config)
    return {
        spec.name: to_canonical(spec, state[keys[spec.name]]) for spec in canonical_specs(config)
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
    keys = native_name_map(config)
    for spec in canonical_specs(config):
        native, key = to_native(spec, weights[spec.name]), keys[spec.name]
        assert native.shape == params[key].shape, f"{key}: {native.shape} != {params[key].shape}"
        params[key].copy_(native)  # a tied Parameter is copied once, through its first key


def export_canonical(model: nn.Module) -> dict[str, Tensor]:
    """Every canonical tensor of `model`, in canonical order, in the model's dtype."""
    return canonical_from_state_dict(model.config, model.state_dict())


# -- the native checkpoint: torch.save(model.state_dict()) ------------------------------------

TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype_name(t: Tensor) -> str:
    """'float32', 'bfloat16', ..., 'int64': torch's name without the 'torch.' prefix, which for
    the floats is the format's name (common.dtypes)."""
    return str(t.dtype).removeprefix("torch.")


def _weights_only_detail(exc: Exception) -> str:
    """The one line of torch's long weights_only message that says what was refused."""
    text = str(exc)
    _, _, detail = text.partition("WeightsUnpickler error:")
    for line in detail.splitlines():
        line = line.strip()
        if line:
            return line.split(". Please use")[0].rstrip(".")
    return "an object torch does not allow"


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a .pt/.bin state_dict, loaded with `weights_only=True` and nothing else.

    weights_only=True makes torch unpickle through an allow-list (tensors, dicts, lists, numbers),
    so a file whose pickle would build any other object (the classic `__reduce__` payload that
    runs os.system) is refused before anything in it runs. A `{"state_dict": {...}}` wrapper, as
    Lightning and many training scripts write, is unwrapped. Every other problem becomes one
    WeightFileError, never a traceback from torch's zip or pickle readers.
    """
    path = Path(path)
    if path.is_dir():
        raise WeightFileError(str(path), ["is a folder, not a torch checkpoint"])
    try:
        with warnings.catch_warnings():
            # Plain pickles (protocol 4, not torch.save's 2) make torch warn; the load is the same.
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise WeightFileError(str(path), ["no such file"]) from None
    except PermissionError:
        raise WeightFileError(str(path), ["permission denied"]) from None
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            raise WeightFileError(
                str(path),
                [
                    "refused: the file's pickle holds objects other than tensors (weights_only "
                    f"loading); unpickling it could run code, so it is not loaded "
                    f"({_weights_only_detail(exc)})"
                ],
            ) from None
        raise WeightFileError(str(path), [f"not a torch checkpoint ({exc})"]) from None
    except EOFError:
        raise WeightFileError(str(path), ["not a torch checkpoint (the file is empty)"]) from None
    except (RuntimeError, OSError) as exc:
        # torch's zip reader on a file cut short or damaged: "failed finding central directory",
        # "unexpected EOF", or an OSError from seeking past the end. The first sentence says it.
        reason = str(exc).split(". ")[0]
        raise WeightFileError(
            str(path), [f"truncated or corrupt torch checkpoint ({reason})"]
        ) from None
    except Exception as exc:  # the legacy pickle reader fails with KeyError, ValueError, ...
        raise WeightFileError(
            str(path), [f"not a torch checkpoint ({type(exc).__name__}: {exc})"]
        ) from None

    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise WeightFileError(
            str(path), [f"not a state_dict: the file holds a {type(obj).__name__}, not a dict"]
        )
    others = [f"{k} ({type(v).__name__})" for k, v in obj.items() if not isinstance(v, Tensor)]
    if others:
        raise WeightFileError(
            str(path), [f"not a state_dict: entries that are not tensors: {', '.join(others)}"]
        )
    return {str(k): v for k, v in obj.items()}


def state_dict_problems(config: TransformerConfig, state: Mapping[str, Tensor]) -> list[str]:
    """Everything wrong with `state` as a Transformer(config) state_dict, in state_dict keys
    (what a torch user sees in the file): missing, unexpected, wrong-shaped, a non-float or
    mixed dtype, and tied aliases that hold different values."""
    aliases = native_aliases(config)
    wanted = {key: spec for spec in canonical_specs(config) for key in aliases[spec.name]}
    missing = [k for k in wanted if k not in state]
    unexpected = sorted(k for k in state if k not in wanted)
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
    for key, spec in wanted.items():
        if key in state and tuple(state[key].shape) != native_shape(spec):
            also = f" ({spec.name})" if spec.name != key else ""
            problems.append(
                f"wrong shape for {key}{also}: file has {list(state[key].shape)}, "
                f"config needs {list(native_shape(spec))}"
            )
    problems += dtype_problems({k: (torch_dtype_name(t), tuple(t.shape)) for k, t in state.items()})
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
    dtype = TORCH_DTYPES[torch_dtype_name(next(iter(weights.values())))]
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
    problems = state_dict_problems(config, state)
    if problems:
        raise WeightFileError(str(path), problems)
    return canonical_from_state_dict(config, state)
