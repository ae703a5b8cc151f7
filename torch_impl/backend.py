"""The PyTorch model behind the adapter (common/adapter/backends.py), numpy in and numpy out."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from transformer_rosetta.adapter.backends import check_build_request, check_mode
from transformer_rosetta.decoding.search import (
    check_row_ids,
    check_step_budget,
    check_stepper_request,
    prompt_prefix,
)
from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_inputs, check_trainable
from transformer_rosetta.spec.masks import shift_right
from transformer_rosetta.spec.precision import DEFAULT_PRECISION
from transformer_rosetta.spec.results import ForwardOutput, LossOutput
from transformer_rosetta.torch_impl import decode, train
from transformer_rosetta.torch_impl.model import Transformer
from transformer_rosetta.torch_impl.precision import matmul_precision
from transformer_rosetta.torch_impl.weights import (
    TORCH_DTYPES,
    _from_numpy,
    _numpy_view,
    export_canonical,
    load_canonical,
    read_native,
    read_state_dict,
    transposing_copy,
    write_native,
)
from transformer_rosetta.weights.format import check_tensors


def _to_torch(a: np.ndarray) -> torch.Tensor:
    """numpy -> torch without rounding, sharing memory where `a` is contiguous (a read-only array
    mapped from a weight file too); torch cannot read ml_dtypes' bfloat16, so its bits pass."""
    return _from_numpy(np.ascontiguousarray(a))


def to_numpy(
    x: torch.Tensor,
    *,
    exact: bool = False,  # idiom: numpy cannot view torch's bfloat16; exact: ml_dtypes
) -> np.ndarray:
    """torch -> a numpy copy. bfloat16 becomes float32 (results) or ml_dtypes.bfloat16 (exact)."""
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        if exact:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        x = x.float()
    return x.numpy().copy()


class TorchStepper:
    """transformer_rosetta.decoding.search.Stepper over torch_impl/decode.py: the key/value cache (cached=True) or the
    decoder re-run over the whole prefix (cached=False). Rows are src rows repeated `beams` times.
    A decoder-only model's src is the prompt (B, P): the cache is prefilled with its first P - 1
    tokens, or the uncached prefix starts as them, and there is no memory."""

    def __init__(
        self, model: TorchModel, src: np.ndarray, beams: int, max_steps: int, cached: bool
    ) -> None:
        self.module, self.config = model.module, model.config
        self.max_steps, self.steps = max_steps, 0
        self.rows, self.device = src.shape[0] * beams, torch.device(model.device)
        self.precision = model.precision
        with torch.inference_mode(), matmul_precision(self.precision):
            src_t = torch.from_numpy(src).to(self.device)
            if cached:
                self.cache: decode.Cache | None = decode.init_cache(
                    self.module, src_t, beams, max_steps
                )
            elif self.config.has_encoder:
                self.cache = None
                self.memory, self.src = decode.encode_rows(self.module, src_t, beams)
                self.prefix = torch.zeros(self.rows, 0, dtype=torch.int64, device=self.device)
            else:
                self.cache, self.memory, self.src = None, None, None
                self.prefix = torch.from_numpy(prompt_prefix(src, beams)).to(self.device)

    def _row_ids(self, ids: np.ndarray, name: str, high: int) -> torch.Tensor:
        """ids as an (N,) int64 tensor on the model's device, each in [0, high)."""
        return torch.from_numpy(check_row_ids(ids, name, self.rows, high)).to(self.device)

    def _logits(self, tokens: np.ndarray) -> torch.Tensor:
        """One step's logits (N, V), left on the device; call under inference_mode."""
        check_step_budget(self.steps, self.max_steps)
        tokens_t = self._row_ids(tokens, "tokens", self.config.tgt_vocab_size)
        with matmul_precision(self.precision):
            if self.cache is not None:
                logits, self.cache = decode.decode_step(self.module, tokens_t, self.cache)
            else:
                self.prefix = torch.cat([self.prefix, tokens_t[:, None]], dim=1)  # (N, t)
                logits = decode.prefix_step(self.module, self.prefix, self.memory, self.src)
        self.steps += 1
        return logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return to_numpy(self._logits(tokens))  # (N, V): float32 or float64

    def step_top(self, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """transformer_rosetta.decoding.search.TopStepper: only (N, k) values and ids leave the device."""
        with torch.inference_mode():
            values, ids = decode.top_k_log_probs(self._logits(tokens), k)
            return to_numpy(values), ids.cpu().numpy()

    def reorder(self, rows: np.ndarray) -> None:
        rows_t = self._row_ids(rows, "rows", self.rows)
        with torch.inference_mode():
            if self.cache is not None:
                self.cache = decode.reorder_cache(self.cache, rows_t)
            else:
                self.prefix, self.memory, self.src = (
                    None if t is None else t.index_select(0, rows_t)  # no memory: decoder-only
                    for t in (self.prefix, self.memory, self.src)
                )


class TorchModel:
    """A built Transformer on one device in one dtype, always in eval mode."""

    def __init__(
        self,
        config: TransformerConfig,
        module: Transformer,
        dtype: str,
        device: str,
        precision: str = DEFAULT_PRECISION,
    ) -> None:
        self.config = config
        self.module = module.eval()
        self.dtype = dtype
        self.device = device
        self.precision = precision  # every call runs under matmul_precision(precision)
        # Training state (train.py): Adam's moments, made on the first step, and the number of
        # steps taken over the model's lifetime, which the Noam schedule counts from 1.
        self.optimizer: torch.optim.Adam | None = None
        self.steps_taken = 0

    def export(self) -> dict[str, np.ndarray]:
        return {n: to_numpy(t, exact=True) for n, t in export_canonical(self.module).items()}

    def _ids(self, ids: np.ndarray | None) -> torch.Tensor | None:
        """Validated ids on the model's device; None (the input a half of the family lacks)."""
        return None if ids is None else torch.from_numpy(ids).to(self.device)

    def forward(
        self,
        src: np.ndarray | None,
        tgt_in: np.ndarray | None,
        *,
        attention: bool = False,
        hidden_states: bool = False,
        mode: str = "eager",
    ) -> ForwardOutput:
        """src None for a decoder-only model, tgt_in None for an encoder-only one."""
        check_mode(TorchBackend.modes, mode)
        src, tgt_in = check_inputs(self.config, src, tgt_in)
        # rosetta: compilation
        with torch.inference_mode(), matmul_precision(self.precision):
            out = self.module(self._ids(src), self._ids(tgt_in), return_attention=attention)
        # rosetta: end
        return ForwardOutput.from_model(
            out, to_numpy, attention=attention, hidden_states=hidden_states
        )

    def stepper(
        self, src: np.ndarray, beams: int, max_steps: int, *, cached: bool = True
    ) -> TorchStepper:
        """A Stepper over src (B, S); a decoder-only model's src is the prompt (B, P)."""
        src = check_stepper_request(self.config, src, beams, max_steps)
        return TorchStepper(self, src, beams, max_steps, cached)

    def _batch(
        self, src: np.ndarray | None, tgt: np.ndarray
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Validated (src, tgt_in, tgt) ids on the model's device: the decoder reads tgt shifted
        right behind BOS (teacher forcing). src is None for a decoder-only model."""
        src, tgt = check_inputs(self.config, src, tgt)
        tgt_in = shift_right(tgt, self.config.bos_id)
        return tuple(self._ids(a) for a in (src, tgt_in, tgt))

    def loss_and_grads(self, src: np.ndarray | None, tgt: np.ndarray) -> LossOutput:
        check_trainable(self.config)
        with matmul_precision(self.precision):
            loss, accuracy, tokens, grads = train.loss_and_grads(
                self.module, *self._batch(src, tgt)
            )
        return LossOutput(
            loss=float(loss),
            accuracy=float(accuracy),
            tokens=tokens,
            grads={name: to_numpy(g) for name, g in grads.items()},
        )

    def train_steps(
        self,
        batches: list[tuple[np.ndarray | None, np.ndarray]],
        *,
        warmup: int,
        factor: float = 1.0,
    ) -> list[float]:
        check_trainable(self.config)
        if self.optimizer is None:
            self.optimizer = train.make_optimizer(self.module)
        losses = []
        with matmul_precision(self.precision):
            for src, tgt in batches:
                self.steps_taken += 1
                losses.append(
                    train.train_step(
                        self.module,
                        self.optimizer,
                        *self._batch(src, tgt),
                        step=self.steps_taken,
                        warmup=warmup,
                        factor=factor,
                    )
                )
        # One transfer at the end: the steps queue on the device without waiting for the host.
        return [float(loss) for loss in losses]


class TorchBackend:
    name = "torch"
    dtypes = ("float32", "float64", "bfloat16")
    modes = ("eager",)
    native_suffixes = (".pt", ".bin")
    # idiom: torch stores kernels (out, in), so load_native's kernels are transposed views
    transposing_copy = staticmethod(transposing_copy)

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def devices(self) -> list[str]:
        found = ["cpu"]
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if torch.backends.mps.is_available():
            found.append("mps")
        return found

    def build(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        *,
        dtype: str = "float32",
        device: str = "cpu",
        precision: str = DEFAULT_PRECISION,
    ) -> TorchModel:
        """On a GPU, parity needs full float32 matmuls (docs/DESIGN.md, "Devices"): the model sets
        its precision around every call (precision.matmul_precision) rather than trust torch's
        default, which has changed between releases."""
        check_build_request(self, dtype, device, precision)
        # rosetta: device
        module = Transformer(config).to(device=device, dtype=TORCH_DTYPES[dtype])
        # rosetta: end
        load_canonical(module, weights)  # one tensor at a time: `weights` may be mapped
        return TorchModel(config, module, dtype, device, precision)

    def save_native(
        self, path: str | Path, config: TransformerConfig, weights: Mapping[str, np.ndarray]
    ) -> None:
        """torch.save(model.state_dict()) for canonical `weights`, bit-exact, written atomically.
        Tied tensors appear under each of their state_dict keys, as torch itself saves them.
        Streams: no module is built, and `weights` (maybe mapped from a file) are not copied
        into memory (weights.write_native)."""
        check_tensors(path, config, weights)
        write_native(path, config, weights)

    def load_native(self, path: str | Path, config: TransformerConfig) -> dict[str, np.ndarray]:
        """Canonical tensors from a Transformer(config) state_dict file (weights_only loading):
        read-only views of the mapped file, a kernel's transposed (not contiguous)."""
        return {n: _numpy_view(t) for n, t in read_native(path, config).items()}

    # idiom: only torch reads other models' .pt/.bin checkpoints (common/porting imports them)
    def read_tensors(self, path: str | Path) -> dict[str, np.ndarray]:
        """Every tensor of any .pt/.bin state_dict, as numpy (bfloat16 as ml_dtypes.bfloat16),
        for the importers of other models' checkpoints (common/porting). weights_only loading:
        a pickle that holds anything but tensors is refused without running. Read-only views
        of the file, mapped where torch.save's format allows (weights.read_state_dict)."""
        state = read_state_dict(path)
        out, problems = {}, []
        for key, t in state.items():
            try:
                out[key] = _numpy_view(t)
            except (TypeError, RuntimeError):
                problems.append(f"{key}: numpy cannot hold dtype {t.dtype}")
        if problems:
            raise WeightFileError(str(path), problems)
        return out

    # idiom: torch's exporter makes the ONNX graphs (torch_impl/onnx_export.py says why)
    def export_onnx(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        *,
        graph: str = "forward",
        attention: bool = False,
        max_steps: int | None = None,
    ) -> object:
        """The onnx.ModelProto of one graph (transformer_rosetta.spec.names.ONNX_GRAPHS) of a float32 model
        holding `weights`, traced on the CPU. Needs the onnx extra (onnx, onnxscript)."""
        from transformer_rosetta.torch_impl.onnx_export import export_graph

        model = self.build(config, weights, dtype="float32")
        return export_graph(model.module, graph, attention=attention, max_steps=max_steps)
