"""ONNX Runtime behind the adapter, as backend "onnx": a fifth runtime for `rosetta parity`.

It is not a sixth implementation. Its graphs are the torch implementation's, exported by torch's
own exporter (torch_impl/onnx_export.py): what parity checks here is the exported graph, run by
onnxruntime's kernels, against the float64 oracle. The graphs are made when first needed: the
explicit-attention forward, the fused one, and, for decoding, the encoder and the cached
decoder step, which the shared search (common/decoding/search.py) drives like any other cache.

float32 only: ONNX's LayerNormalization keeps its statistics in float32 (stash_type 1, the only
one onnxruntime 1.30's CPU kernel and onnx's reference evaluator compute), so a float64 graph
is float32 in every norm: measured 1.5e-8 from torch's float64 model, where 1e-14 is float64's
parity (docs/PORTING.md, "ONNX").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from transformer_rosetta.adapter.backends import (
    ONNX_EXPORTER,
    check_build_request,
    check_mode,
    get_backend,
    onnx_exporter,
)
from transformer_rosetta.decoding.search import (
    check_row_ids,
    check_step_budget,
    check_stepper_request,
)
from transformer_rosetta.errors import InputError
from transformer_rosetta.files.os_names import library_path
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_inputs
from transformer_rosetta.spec.names import canonical_shapes, onnx_cache_names
from transformer_rosetta.spec.precision import DEFAULT_PRECISION, check_precision
from transformer_rosetta.spec.results import ATTENTION_OUTPUTS, ForwardOutput, attention_layers


class OnnxSession(Protocol):
    """What is used of an onnxruntime.InferenceSession (onnxruntime ships no annotations)."""

    def run(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, np.ndarray]
    ) -> list[np.ndarray]:
        """The named outputs (all of them for None), in the graph's order."""
        ...


def session(model: object, device: str = "cpu", precision: str = DEFAULT_PRECISION) -> OnnxSession:
    """An onnxruntime InferenceSession of an onnx.ModelProto (or its bytes, or a file path) on
    `device`; on a GPU, float32 products stay float32 unless `precision` is "tf32"."""
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the optimiser's notes are not the user's
    # A provider's name, or its name with its options.
    providers: list[str | tuple[str, dict[str, str]]]
    if device.startswith("cuda"):
        tf32 = "1" if check_precision(precision) == "tf32" else "0"
        index = device.partition(":")[2] or "0"
        providers = [("CUDAExecutionProvider", {"device_id": index, "use_tf32": tf32})]
    else:
        providers = ["CPUExecutionProvider"]
    if isinstance(model, (str, os.PathLike)):  # onnxruntime takes a name as UTF-8 only
        with library_path(model) as name:
            return ort.InferenceSession(name, options, providers=providers)
    return ort.InferenceSession(model, options, providers=providers)


class OnnxStepper:
    """transformer_rosetta.decoding.search.Stepper over the "encoder" and "decoder_step" graphs: the cache
    goes out of one run as present.* and back into the next as past.*."""

    def __init__(self, model: OnnxModel, src: np.ndarray, beams: int, max_steps: int) -> None:
        self.config, self.max_steps, self.steps = model.config, max_steps, 0
        rows = np.repeat(src, beams, axis=0)  # row r decodes source r // beams
        self.rows = rows.shape[0]
        self.step_session = model.graph_session("decoder_step", max_steps)
        present = model.graph_session("encoder", max_steps).run(None, {"src": rows})
        self.cache = dict(zip(onnx_cache_names(self.config, "past"), present, strict=True))

    def step(self, tokens: np.ndarray) -> np.ndarray:
        check_step_budget(self.steps, self.max_steps)
        tokens = check_row_ids(tokens, "tokens", self.rows, self.config.tgt_vocab_size)
        logits, *present = self.step_session.run(None, {"tokens": tokens, **self.cache})
        self.cache = dict(zip(self.cache, present, strict=True))
        self.steps += 1
        return logits

    def reorder(self, rows: np.ndarray) -> None:
        rows = check_row_ids(rows, "rows", self.rows, self.rows)
        self.cache = {
            name: value if name.endswith(".index") else value[rows]
            for name, value in self.cache.items()
        }


class OnnxModel:
    """Exported graphs of one model, each run by onnxruntime; float32 on one device."""

    def __init__(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        device: str,
        precision: str,
    ) -> None:
        self.config, self.dtype, self.device, self.precision = config, "float32", device, precision
        self.weights = {n: np.asarray(weights[n], np.float32) for n in canonical_shapes(config)}
        self.sessions: dict[tuple[str, bool, int | None], OnnxSession] = {}

    def graph_session(
        self, graph: str, max_steps: int | None = None, *, attention: bool = False
    ) -> OnnxSession:
        """The session of one exported graph, exported on first use (a few seconds each)."""
        key = (graph, attention, max_steps)
        if key not in self.sessions:
            exported = onnx_exporter().export_onnx(
                self.config, self.weights, graph=graph, attention=attention, max_steps=max_steps
            )
            self.sessions[key] = session(exported, self.device, self.precision)
        return self.sessions[key]

    def export(self) -> dict[str, np.ndarray]:
        return {name: t.copy() for name, t in self.weights.items()}

    def forward(
        self,
        src: np.ndarray | None,
        tgt_in: np.ndarray | None,
        *,
        attention: bool = False,
        hidden_states: bool = False,
        mode: str = "eager",
    ) -> ForwardOutput:
        check_mode(OnnxBackend.modes, mode)
        if hidden_states:
            raise ValueError("hidden_states: the exported graphs output no hidden states")
        src, tgt_in = check_inputs(self.config, src, tgt_in)
        # build() takes only encoder-decoder models, which check_inputs has given both inputs.
        assert src is not None and tgt_in is not None
        for name, ids in (("src", src), ("tgt_in", tgt_in)):
            if ids.shape[1] > self.config.max_len:  # sinusoids past max_len: torch only
                raise InputError(
                    f"{name}: length {ids.shape[1]} is past max_len {self.config.max_len}; the "
                    "exported graph holds max_len positions"
                )
        run = self.graph_session("forward", attention=attention).run
        logits, memory, *maps = run(None, {"src": src, "tgt_in": tgt_in})
        out: dict[str, Any] = {"logits": logits, "encoder_output": memory}
        if attention:  # the maps come in ATTENTION_OUTPUTS' order, each group's layers in turn
            for _, field, _ in ATTENTION_OUTPUTS:
                n = attention_layers(self.config, field)
                out[field], maps = maps[:n], maps[n:]
        return ForwardOutput.from_model(out, np.asarray, attention=attention, hidden_states=False)

    def stepper(
        self, src: np.ndarray, beams: int, max_steps: int, *, cached: bool = True
    ) -> OnnxStepper:
        src = check_stepper_request(self.config, src, beams, max_steps)
        if not cached:
            raise ValueError("cached: the ONNX decoder step always reads the cache")
        return OnnxStepper(self, src, beams, max_steps)


class OnnxBackend:
    name = "onnx"
    dtypes = ("float32",)
    modes = ("eager",)

    def version(self) -> str:
        return f"onnxruntime {ort.__version__} ({get_backend(ONNX_EXPORTER).version()}'s exporter)"

    def devices(self) -> list[str]:
        found = ["cpu"]
        if "CUDAExecutionProvider" in ort.get_available_providers():
            found.append("cuda:0")
        return found

    def build(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        *,
        dtype: str = "float32",
        device: str = "cpu",
        precision: str = DEFAULT_PRECISION,
    ) -> OnnxModel:
        check_build_request(self, dtype, device, precision)
        if config.kind != "encoder_decoder":  # the graphs are the encoder-decoder's
            raise InputError(
                f"onnx: the exported graphs are the encoder-decoder's; this model is "
                f"{config.kind_name}"
            )
        return OnnxModel(config, weights, device, precision)
