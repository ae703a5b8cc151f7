"""The ONNX file `rosetta export` writes (docs/PORTING.md, "ONNX"): one graph of the torch
implementation, exported by torch's exporter (torch_impl/onnx_export.py), checked by
onnx.checker, and labelled in the model's metadata_props so that `rosetta inspect` can tell
what it is:
- "format": "transformer-rosetta onnx"; "config": the model's config as JSON;
- "graph": forward, encoder or decoder_step; "attention": "true" when the forward graph also
  outputs every attention map; "max_steps": the decoding cache's length (encoder, decoder_step);
- "provenance" (optional, common/porting/verify.py): where it came from and how it was checked.
`rosetta inspect` reads them back (common/app/cli/inspect.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.adapter.backends import onnx_exporter, unavailable_reason
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.files.memory import fits_problem
from transformer_rosetta.files.outputs import atomic_write
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import ONNX_GRAPHS, parameter_count

FORMAT = "transformer-rosetta onnx"
# protobuf refuses a message over 2 GiB; the weights are stored inside the graph (no external
# data files, so that one file is the whole model), leaving 16 MiB for the graph itself.
MAX_WEIGHT_BYTES = 2**31 - 2**24


class OnnxExportError(RosettaError):
    """An export that cannot be made as asked."""


# The most rows a cache of the exported graphs holds during the export and its verification: the
# tracer's example (2 rows) and common/porting/verify.py's probes (at most 3).
CACHE_ROWS = 3


def cache_bytes(config: TransformerConfig, rows: int, steps: int) -> int:
    """The decoding cache of `steps` positions for `rows` sequences: keys and values of every
    decoder layer's self-attention, [rows, h, steps, d_k] each, at 8 bytes a number (the widest
    dtype a side computes in)."""
    return 2 * config.num_decoder_layers * rows * config.num_heads * steps * config.head_dim * 8


def export_problems(
    config: TransformerConfig, graph: str, attention: bool, max_steps: int | None
) -> list[str]:
    """What stops an export, found before any work: the graph asked for, the model's size, and
    the packages the exporter needs."""
    problems = []
    if config.kind != "encoder_decoder":
        problems.append(
            f"ONNX export covers the encoder-decoder; this model is {config.kind_name}"
            " (export it as safetensors, or to a framework's native checkpoint)"
        )
    if graph not in ONNX_GRAPHS:
        problems.append(f"--graph: unknown {graph!r}; choose from {', '.join(ONNX_GRAPHS)}")
    if attention and graph != "forward":
        problems.append("--attention: only the forward graph outputs attention maps")
    if max_steps is not None:
        if graph == "forward":
            problems.append("--max-steps: only the encoder and decoder_step graphs have a cache")
        elif max_steps < 1:
            problems.append(f"--max-steps: must be at least 1, got {max_steps}")
        elif config.position_kind == "learned" and max_steps > config.max_len:
            problems.append(
                f"--max-steps {max_steps}: the model's learned positions stop at max_len "
                f"{config.max_len}"
            )
        else:  # sinusoids go on past max_len: the cache's memory is the bound
            problem = fits_problem(
                cache_bytes(config, CACHE_ROWS, max_steps), f"--max-steps {max_steps}"
            )
            if problem is not None:
                problems.append(f"{problem} (the decoding cache for {CACHE_ROWS} rows)")
    size = 4 * parameter_count(config)
    if size > MAX_WEIGHT_BYTES:
        problems.append(
            f"the model's float32 weights take {size / 2**30:.1f} GiB; one ONNX file holds at "
            "most 2 GiB (protobuf's limit)"
        )
    reason = unavailable_reason("onnx")
    if reason is not None:
        problems.append(f"ONNX export: {reason}")
    return problems


def write_onnx(
    path: str | Path,
    config: TransformerConfig,
    tensors: Mapping[str, np.ndarray],
    *,
    graph: str = "forward",
    attention: bool = False,
    max_steps: int | None = None,
) -> None:
    """Export one graph of a float32 model holding `tensors`, check it (onnx.checker), label it,
    and write it atomically."""
    import onnx

    problems = export_problems(config, graph, attention, max_steps)
    if problems:
        raise OnnxExportError("; ".join(problems))
    weights = {name: np.asarray(t, np.float32) for name, t in tensors.items()}
    model: Any = onnx_exporter().export_onnx(  # an onnx.ModelProto (onnx ships no annotations)
        config, weights, graph=graph, attention=attention, max_steps=max_steps
    )
    labels = {"format": FORMAT, "config": config.to_json(), "graph": graph}
    if graph == "forward":
        labels["attention"] = json.dumps(attention)
    else:
        labels["max_steps"] = str(config.max_len if max_steps is None else max_steps)
    onnx.helper.set_model_props(model, labels)
    onnx.checker.check_model(model, full_check=True)
    data = model.SerializeToString()
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), len(data))


def add_labels(path: str | Path, labels: Mapping[str, str]) -> None:
    """Add metadata_props to an ONNX file, atomically."""
    import onnx

    model = onnx.load(os.fspath(path))
    props = {p.key: p.value for p in model.metadata_props}
    onnx.helper.set_model_props(model, {**props, **labels})
    data = model.SerializeToString()
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), len(data))
