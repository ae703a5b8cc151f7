"""The adapter every implementation offers, numpy in and numpy out, and the registry that finds them.

Each parity test is written once against `Backend` / `Model` and parametrised over whatever
backends are installed. The registry imports an implementation only when asked for it, so a
missing framework is reported with its reason and never raises ImportError at collection time.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from transformer_rosetta.decoding.search import Stepper
from transformer_rosetta.errors import BackendUnavailable
from transformer_rosetta.files.array_writes import CopyBlock
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.mesh import MeshShape
from transformer_rosetta.spec.precision import DEFAULT_PRECISION, check_precision
from transformer_rosetta.spec.results import ForwardOutput, LossOutput


@runtime_checkable
class Model(Protocol):
    """A built model in one framework, on one device, in one dtype."""

    config: TransformerConfig
    dtype: str  # "float32", "float64" or "bfloat16"
    device: str  # "cpu", "cuda:0", "gpu:0", ...
    precision: str  # float32 products: "highest" or "tf32" (common/spec/precision.py)

    def export(self) -> dict[str, np.ndarray]:
        """Every canonical tensor, in canonical order and in the model's dtype (bit-exact)."""
        ...

    def forward(
        self,
        src: np.ndarray | None,
        tgt_in: np.ndarray | None,
        *,
        attention: bool = False,
        hidden_states: bool = False,
        mode: str = "eager",
    ) -> ForwardOutput:
        """Eval-mode forward. `attention=True` takes the explicit path and returns probabilities;
        `attention=False` takes the framework's fused attention kernel. `mode` is one of the
        backend's `modes` ("eager", "compiled"). A half of the family takes None for the input
        it lacks (transformer_rosetta.spec.inputs.check_inputs). Raises InputError for ids the model cannot
        take.
        """
        ...


@runtime_checkable
class TrainableModel(Protocol):
    """A Model that can also be trained (each impl's train.py, behind its backend).

    Both take the target itself (B, T): the model reads it shifted right behind BOS
    (transformer_rosetta.spec.masks.shift_right) and predicts it; pad targets do not count. Dropout follows the
    config (tests use dropout 0, so that the three frameworks take identical steps).
    """

    def loss_and_grads(self, src: np.ndarray | None, tgt: np.ndarray) -> LossOutput:
        """Label-smoothed loss (transformer_rosetta.oracle.training.label_smoothed_loss) and its gradient for every
        canonical tensor, under canonical names and layouts. A decoder-only model takes src None;
        an encoder-only one cannot train (InputError, transformer_rosetta.spec.inputs.check_trainable)."""
        ...

    def train_steps(
        self,
        batches: list[tuple[np.ndarray | None, np.ndarray]],
        *,
        warmup: int,
        factor: float = 1.0,
    ) -> list[float]:
        """One step of the framework's own Adam (0.9, 0.98, 1e-9, eps placed as in
        transformer_rosetta.oracle.training.adam_step) per (src, tgt) batch, at the Noam rate of that step (steps
        count from 1 for the model's lifetime). Returns each step's loss, taken before its update;
        the model's weights (export()) are updated in place."""
        ...


@runtime_checkable
class DecodingModel(Protocol):
    """A Model that can decode autoregressively (each impl's decode.py, behind its backend).

    The search itself is transformer_rosetta.decoding.search's, written once; the model supplies one step at a time.
    """

    def stepper(
        self, src: np.ndarray, beams: int, max_steps: int, *, cached: bool = True
    ) -> Stepper:
        """Encode src (B, S) once and return a Stepper over B * beams rows (row r decodes source
        r // beams) that takes at most max_steps steps (BOS included). For a decoder-only model
        src is the prompt (B, P): its first P - 1 tokens are prefilled into the cache, and the
        first step feeds its last token (transformer_rosetta.decoding.search.start_tokens).

        cached=True keeps every decoder layer's self-attention keys and values (a buffer of
        max_steps positions, written one position per step) and the cross-attention keys and
        values of the memory (computed once), so a step costs O(1) in the prefix length.
        cached=False runs the decoder over the whole prefix at every step (the baseline the
        benchmark compares against). Both see keys as decoder_key_padding_mask does: position 0
        always, a later position iff its token is not pad_id. Raises InputError for bad src.
        """
        ...


@runtime_checkable
class Backend(Protocol):
    """One framework's implementation."""

    name: str  # registry key: "numpy", "torch", "tf", "jax"

    # Read-only for a type checker, so a backend's own tuple (("float64",)) satisfies them.
    @property
    def dtypes(self) -> tuple[str, ...]:
        """Compute dtypes it supports."""
        ...

    @property
    def modes(self) -> tuple[str, ...]:
        """The "eager" mode and, where the framework compiles, "compiled"."""
        ...

    def version(self) -> str:
        """Framework and version, e.g. 'torch 2.13.0'; written as the producer of files."""
        ...

    def devices(self) -> list[str]:
        """Devices this framework sees here: always 'cpu', plus each accelerator."""
        ...

    def build(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        *,
        dtype: str = "float32",
        device: str = "cpu",
        precision: str = DEFAULT_PRECISION,
    ) -> Model:
        """A model holding `weights` (canonical names, any float dtype) cast to `dtype`, on
        `device`, whose float32 products run in `precision` in every call it makes."""
        ...


@runtime_checkable
class NativeCheckpoints(Protocol):
    """A backend that reads and writes its framework's own checkpoint: torch (.pt/.bin,
    torch.save of the model's state_dict), tf (Keras's .weights.h5) and jax (msgpack of the
    nnx.Param state). `rosetta convert` goes through these two methods, so it imports no
    framework itself.

    Both stream (docs/PORTING.md, "Memory"): neither builds a model nor holds a second copy of
    the weights, so a conversion costs about one tensor of memory beyond its input's.
    """

    native_suffixes: tuple[str, ...]  # file name endings of the native checkpoint, e.g. (".pt",)
    # The copy that puts a block of load_native's transposed views into C order (a torch
    # kernel's), where the framework's beats numpy's tiles; None where every view is contiguous.
    transposing_copy: CopyBlock | None

    def save_native(
        self, path: str | Path, config: TransformerConfig, weights: Mapping[str, np.ndarray]
    ) -> None:
        """Write the native checkpoint of a model for `config` holding canonical `weights` (any
        float dtype, one per file, stored as given: bit-exact). Validates names, shapes and dtype
        first (WeightFileError listing every problem) and writes atomically: whatever fails,
        `path` is left as it was and no partial file remains.

        `weights` may be read-only arrays mapped from a file, or a Mapping that computes each
        on access: each is read a few times, one at a time, and written without a copy where
        the format stores it as it is (a copy of that one tensor where it does not)."""
        ...

    def load_native(self, path: str | Path, config: TransformerConfig) -> dict[str, np.ndarray]:
        """Canonical tensors, in canonical order and the stored dtype (bit-exact), from a native
        checkpoint for `config`. One WeightFileError lists every problem: missing, unexpected
        and wrong-shaped tensors, or a file that is not this format, truncated or corrupt. Never
        runs code from the file (torch: weights_only loading).

        The arrays are read-only views of the file, mapped, where its format keeps a tensor's
        bytes as they are (every checkpoint these backends write): reading costs no memory of
        its own, and the OS pages the bytes in as they are used. A torch kernel, stored
        transposed, is a transposed view (not C-contiguous)."""
        ...


@runtime_checkable
class NativeBackend(Backend, NativeCheckpoints, Protocol):
    """A backend that also reads and writes its framework's own checkpoint (torch, tf, jax)."""


@runtime_checkable
class TensorReader(Protocol):
    """A backend that reads any checkpoint of its framework, not only its own model's: the
    importers of other models (common/porting) read .pt/.bin state_dicts through it, so that
    they import no framework themselves."""

    def read_tensors(self, path: str | Path) -> dict[str, np.ndarray]:
        """Every tensor of the file, as numpy (bfloat16 as ml_dtypes.bfloat16). Never runs code
        from the file (torch: weights_only loading); WeightFileError naming what is wrong."""
        ...


@runtime_checkable
class OnnxExporter(Protocol):
    """A backend whose framework exports its model's graphs to ONNX: the "onnx" backend runs
    them and `rosetta export` writes them (common/porting/onnx_file.py)."""

    def export_onnx(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        *,
        graph: str = "forward",
        attention: bool = False,
        max_steps: int | None = None,
    ) -> object:
        """The onnx.ModelProto of one graph (transformer_rosetta.spec.names.ONNX_GRAPHS) of a
        float32 model holding `weights`."""
        ...


@runtime_checkable
class MeshEngine(Protocol):
    """A framework's own distributed engine running the model on a device mesh
    (transformer_rosetta.spec.mesh.MeshShape: data replicas x model shards): the module
    `<impl>/distributed.py` of torch (DDP, FSDP2), tf (keras.distribution on Keras's JAX backend)
    and jax (jax.sharding). Each needs its process set up before its framework is imported
    (transformer_rosetta.app.distributed.mesh_environment), so the application runs it in a
    process of its own."""

    def train_on_mesh(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        batches: Sequence[tuple[np.ndarray | None, np.ndarray]],
        mesh: MeshShape,
        *,
        dtype: str = "float32",
        warmup: int,
        factor: float = 1.0,
    ) -> tuple[list[float], dict[str, np.ndarray]]:
        """Adam steps on the mesh over GLOBAL batches: (each step's global loss, the final
        canonical weights, gathered whole), as the one-device model's train_steps gives them."""
        ...

    def forward_on_mesh(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        src: np.ndarray | None,
        tgt_in: np.ndarray | None,
        mesh: MeshShape,
        *,
        dtype: str = "float32",
    ) -> ForwardOutput:
        """The forward with the parameters sharded over mesh.model and the batch over
        mesh.data, attention maps included."""
        ...


# The backend that offers each capability beyond Backend: only torch's checkpoints are pickles
# that need its own weights_only loader, and only torch ships an ONNX exporter.
TENSOR_READER = "torch"
ONNX_EXPORTER = "torch"


def native_backend(kind: str) -> NativeBackend:
    """The backend whose native checkpoint `kind` (a NATIVE_BACKENDS key) is."""
    backend = get_backend(NATIVE_BACKENDS[kind])
    if not isinstance(backend, NativeBackend):
        raise BackendUnavailable(f"{backend.name}: reads and writes no native checkpoint")
    return backend


def tensor_reader() -> TensorReader:
    """The reader of other models' .pt/.bin checkpoints. BackendUnavailable says why not."""
    backend = get_backend(TENSOR_READER)
    if not isinstance(backend, TensorReader):
        raise BackendUnavailable(f"{backend.name}: reads no outside .pt/.bin checkpoint")
    return backend


def onnx_exporter() -> OnnxExporter:
    """The exporter of every ONNX graph. BackendUnavailable says why not."""
    backend = get_backend(ONNX_EXPORTER)
    if not isinstance(backend, OnnxExporter):
        raise BackendUnavailable(f"{backend.name}: exports no ONNX graph")
    return backend


def mesh_engine(name: str) -> MeshEngine:
    """Framework `name`'s distributed engine, `<impl>/distributed.py` (imported here: call it in
    a process set up by transformer_rosetta.app.distributed.mesh_environment). BackendUnavailable
    says why not."""
    reason = unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailable(f"{name}: {reason}")
    info = REGISTRY[name]
    if info.mesh_module is None:
        raise BackendUnavailable(f"{name}: runs on one device only (no distributed engine)")
    with native_stderr_silenced():
        module = importlib.import_module(info.mesh_module)
    if not isinstance(module, MeshEngine):
        raise BackendUnavailable(f"{name}: {info.mesh_module} offers no train_on_mesh")
    return module


def check_build_request(
    backend: Backend, dtype: str, device: str, precision: str = DEFAULT_PRECISION
) -> None:
    """The checks every Backend.build makes first, with one wording: a ValueError naming what
    this backend offers."""
    check_precision(precision)
    if dtype not in backend.dtypes:
        raise ValueError(
            f"dtype: {backend.name} does not compute in {dtype!r}; it offers {', '.join(backend.dtypes)}"
        )
    devices = backend.devices()
    if device not in devices:
        raise ValueError(
            f"device: {device!r} is not visible to {backend.name}; it sees {', '.join(devices)}"
        )


def check_mode(modes: tuple[str, ...], mode: str) -> None:
    """The check every Model.forward makes on `mode`."""
    if mode not in modes:
        raise ValueError(f"mode: unknown {mode!r}; allowed: {', '.join(modes)}")


@dataclass(frozen=True)
class BackendInfo:
    name: str
    module: str  # the implementation's backend module
    cls: str
    requires: tuple[str, ...]  # top-level packages that must be importable
    extra: str  # pip extra that installs them
    label: str = field(default="")
    # A runtime of graphs exported from an implementation (onnx), not an implementation: it
    # runs in `rosetta parity`, and is left out of FRAMEWORKS, which tests train and save with.
    exported: bool = False
    mesh_module: str | None = None  # the framework's distributed engine (MeshEngine)


REGISTRY: dict[str, BackendInfo] = {
    "numpy": BackendInfo(
        "numpy",
        "transformer_rosetta.adapter.reference_backend",
        "NumpyBackend",
        ("numpy",),
        "",
        "NumPy float64 oracle",
    ),
    "torch": BackendInfo(
        "torch",
        "transformer_rosetta.torch_impl.backend",
        "TorchBackend",
        ("torch",),
        "torch",
        "PyTorch",
        mesh_module="transformer_rosetta.torch_impl.distributed",
    ),
    "tf": BackendInfo(
        "tf",
        "transformer_rosetta.tf_impl.backend",
        "KerasBackend",
        ("tensorflow", "keras"),
        "tf",
        "Keras 3 / TensorFlow",
        mesh_module="transformer_rosetta.tf_impl.distributed",
    ),
    "jax": BackendInfo(
        "jax",
        "transformer_rosetta.jax_impl.backend",
        "FlaxBackend",
        ("jax", "flax"),
        "jax",
        "Flax NNX / JAX",
        mesh_module="transformer_rosetta.jax_impl.distributed",
    ),
    "onnx": BackendInfo(
        "onnx",
        "transformer_rosetta.adapter.onnx_backend",
        "OnnxBackend",
        ("torch", "onnx", "onnxscript", "onnxruntime"),
        "onnx",
        "ONNX Runtime (torch's exported graph)",
        exported=True,
    ),
}
FRAMEWORKS = tuple(name for name, info in REGISTRY.items() if not info.exported)
RUNTIMES = tuple(REGISTRY)
# A native checkpoint's kind (`rosetta convert --from/--to`) -> the backend that reads it.
NATIVE_BACKENDS = {
    "torch": "torch",
    "keras": "tf",
    "flax": "jax",
}  # what `rosetta parity --frameworks` can run: FRAMEWORKS and onnx


def unavailable_reason(name: str) -> str | None:
    """Why backend `name` cannot run here, or None when it can. Imports nothing heavy."""
    if name not in REGISTRY:
        return f"unknown framework {name!r}; known: {', '.join(REGISTRY)}"
    info = REGISTRY[name]
    missing = [pkg for pkg in info.requires if importlib.util.find_spec(pkg) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed (pip install 'transformer-rosetta[{info.extra}]')"
        )
    try:
        spec = importlib.util.find_spec(info.module)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return f"{info.module} is not implemented yet"
    return None


def available_backends() -> dict[str, str | None]:
    """{name: None if usable, else the reason it is not}, for every registered backend."""
    return {name: unavailable_reason(name) for name in REGISTRY}


_INSTANCES: dict[str, Backend] = {}


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Hide what C++ libraries write straight to file descriptor 2 while a framework loads.

    TensorFlow 2.21 logs through absl before Python can configure it ("All log messages before
    absl::InitializeLog()", "Could not find cuda drivers", "failed call to cuInit"), ignoring
    TF_CPP_MIN_LOG_LEVEL. Python exceptions are unaffected: they surface after the block.
    Set ROSETTA_VERBOSE=1 to see everything.
    """
    if os.environ.get("ROSETTA_VERBOSE"):
        yield
        return
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # stderr is closed (`2>&-`): there is nothing to hide
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def get_backend(name: str) -> Backend:
    """The backend called `name`, imported on first use. BackendUnavailable says why not."""
    if name in _INSTANCES:
        return _INSTANCES[name]
    reason = unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailable(f"{name}: {reason}")
    info = REGISTRY[name]
    with native_stderr_silenced():
        module = importlib.import_module(info.module)
        backend = getattr(module, info.cls)()
        backend.devices()  # the first device query initialises the runtime, which logs too
    _INSTANCES[name] = backend
    return backend
