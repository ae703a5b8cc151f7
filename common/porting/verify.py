"""`convert --verify`: proof that a conversion is right, stored with the file it wrote.

After the destination is written, the source (read by its own reader and run by its own runtime)
and the destination (read back from disk and run by its runtime) compute logits on the same
seeded ragged probes; the largest difference must be within the float32 parity bound of the less
precise side (common/spec/tolerances.py: the conversion adds no error of its own, so the bound is
what running the two runtimes costs). The record goes into the destination's metadata as one
JSON text under "provenance" (safetensors header, a Marian folder's model.safetensors header,
ONNX metadata_props; docs/FORMAT.md), with the source file's sha256 and the versions that ran.

The runtimes: our .safetensors -> the float64 oracle; torch, keras, flax checkpoints -> their own
framework; a Marian folder -> transformers' MarianMTModel; a BERT folder -> transformers'
BertModel (its hidden states, pooled by the spec's formula); a Llama, Mistral or Qwen2 folder ->
transformers' AutoModelForCausalLM; an ONNX forward graph -> onnxruntime. The outside models' own code (nn.Transformer wrappers, the tutorials, a --map
model) is the user's, not ours to run: their conversions record the provenance without a
verification, and say why.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import numpy as np

from transformer_rosetta.adapter.backends import (
    NATIVE_BACKENDS,
    native_backend,
    unavailable_reason,
)
from transformer_rosetta.files.outputs import CAUGHT_SIGNALS
from transformer_rosetta.oracle import reference
from transformer_rosetta.porting.hf_folder import INDEX_SUFFIX, digest_files, shard_map
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import dtype_name
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.results import ForwardOutput
from transformer_rosetta.spec.tolerances import atol_for

PROBE_SEED = 0
# (batch, source length, target length): ragged rows, the first probe with a fully padded source
# row (ragged_batch's last row at batch >= 3), lengths clipped to the model's max_len.
PROBE_SHAPES = ((3, 7, 5), (2, 4, 9))

Logits = Callable[[np.ndarray | None, np.ndarray | None], np.ndarray]


class VerificationFailed(Exception):
    """The written model's logits miss the bound; the CLI exits 1 after removing it."""


class VerifyRecord(TypedDict, total=False):
    """provenance["verify"]: verify()'s record, or {"not_run": why} where none ran."""

    passed: bool
    max_abs_logit_diff: float  # a model with a decoder: its logits are compared
    max_abs_output_diff: float  # an encoder-only model: the outputs `compared` names
    compared: str
    bound: float
    sides: list[str]  # the two runners' labels, source first
    probe_seed: int
    probe_shapes: list[list[int | None]]  # [rows, src length, tgt length] per probe
    probe_rows: str
    versions: dict[str, str]
    not_run: str


@dataclass(frozen=True)
class Runner:
    label: str  # what ran, with its version: "numpy float64 oracle", "torch 2.13.0 (float32)"
    dtype: str  # the precision it computes in, for the bound
    logits: Logits  # an encoder-only model's: its encoder_output (and pooled_output), concatenated
    versions: dict[str, str]
    full_rows_only: bool = False  # transformers' Marian attends pads where a row has no key


@dataclass
class Provenance:
    """Where a converted file came from, and how it was checked."""

    source: str
    source_kind: str
    source_sha256: str
    converter: str
    versions: dict[str, str] = field(default_factory=dict)
    verify: VerifyRecord = field(default_factory=VerifyRecord)
    notes: list[str] = field(default_factory=list)  # what the importer dropped or decided

    @property
    def passed(self) -> bool:
        return bool(self.verify.get("passed", True))

    def to_json(self) -> str:
        return json.dumps(
            {
                "source": {
                    "file": Path(self.source).name,
                    "kind": self.source_kind,
                    "sha256": self.source_sha256,
                },
                "converter": self.converter,
                "versions": self.versions,
                "verify": self.verify,
                **({"notes": self.notes} if self.notes else {}),
            }
        )


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def sha256_of(path: Path, stop: threading.Event | None = None) -> str:
    """A file's sha256. A Hugging Face folder's is one digest over the files it is read from
    (hf_folder.digest_files: the weights, sharded or not, config.json and the small files beside
    them), each as its path in the folder, its size and its bytes, in order of path: a changed
    byte, a renamed file or one more file changes it. A sharded model given by its index is
    digested the same way, over the index and the shards it names (the folder's digest, when the
    folder holds that model alone). Every file is read in chunks of 1 MiB into one buffer,
    never whole; `stop`, once set, ends the reading at the next chunk (DigestCancelled)."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(1 << 20))
    folder = path
    if path.is_dir():
        files = digest_files(path)
    elif path.name.endswith(INDEX_SUFFIX):  # a sharded model by its index: the shards too
        folder = path.parent
        files = sorted([path, *(folder / shard for shard in shard_map(folder, path.name))])
    else:
        files = [path]
    for file in files:
        if file != path or folder != path:  # a folder's file: its name and size first
            name = file.relative_to(folder).as_posix()
            digest.update(f"{name}\0{file.stat().st_size}\0".encode("utf-8", "surrogateescape"))
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                if stop is not None and stop.is_set():
                    raise DigestCancelled(str(file))
                digest.update(buffer[:n])
    return digest.hexdigest()


class DigestCancelled(Exception):
    """sha256_of stopped by its caller before the end of the files."""


class BackgroundDigest:
    """sha256_of(path) computed in a thread while the caller goes on with its work: hashlib
    and the reads release the GIL, so on a machine with a second core a conversion's provenance
    record costs no time of its own (the hash of a multi-gigabyte source takes about as long as
    copying it). Use it as a context manager: leaving the block (an error, an interrupt) stops
    the reading at its next chunk, and the thread is a daemon, so it never holds up an exit."""

    def __init__(self, path: Path) -> None:
        self._stop = threading.Event()
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(path,), name="rosetta-sha256", daemon=True
        )

    def __enter__(self) -> BackgroundDigest:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()

    def _run(self, path: Path) -> None:
        try:
            self._digest = sha256_of(path, self._stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
            self._error = exc

    def result(self) -> str:
        """The digest, once the thread has read every file (what sha256_of would raise, raised
        here)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._digest is not None
        return self._digest


def why_not_runnable(kind: str, graph: str | None = None) -> str | None:
    """Why a side of this kind cannot be run here, or None."""
    if kind == "rosetta":
        return None
    if kind in NATIVE_BACKENDS:
        reason = unavailable_reason(NATIVE_BACKENDS[kind])
        return None if reason is None else f"{kind}: {reason}"
    if kind in ("marian", "bert", "llama"):
        reason = unavailable_reason("torch")
        if reason is None and importlib.util.find_spec("transformers") is None:
            reason = "transformers not installed"
        folder = {"marian": "a Marian", "bert": "a BERT", "llama": "a Llama"}[kind]
        return None if reason is None else f"{folder} folder runs in transformers: {reason}"
    if kind == "onnx":
        if graph not in (None, "forward"):
            return f"a lone {graph} graph computes no logits (the forward graph is verified)"
        reason = unavailable_reason("onnx")
        return None if reason is None else f"onnx: {reason}"
    return f"{kind} is the user's own code, which rosetta does not run"


# The kinds whose runtime cannot take a row with no source token: transformers' Marian attends
# pads where a row has no key, and BertModel's additive mask attends every pad of an all-pad row.
FULL_ROWS_ONLY = ("marian", "bert")


def runner(kind: str, path: Path, config: TransformerConfig) -> Runner:
    """The runtime of one side, reading `path` as written on disk."""
    if kind == "rosetta":
        from transformer_rosetta.weights.format import load_weights

        # Mapped from the file; reference.forward computes in float64 from them, call by call.
        weights = load_weights(path).tensors
        return Runner(
            "numpy float64 oracle",
            "float64",
            lambda src, tgt: compared(reference.forward(weights, config, src, tgt)),
            {"numpy": np.__version__},
        )
    if kind in NATIVE_BACKENDS:
        backend = native_backend(kind)
        tensors = backend.load_native(path, config)
        dtype = dtype_name(next(iter(tensors.values())).dtype)
        dtype = dtype if dtype in backend.dtypes else "float32"
        model = backend.build(config, tensors, dtype=dtype)
        framework = backend.version()
        return Runner(
            f"{framework} ({dtype})",
            dtype,
            lambda src, tgt: compared(model.forward(src, tgt)),
            dict(re.findall(r"([a-z_]+) ([0-9][^\s,/()]*)", framework)),
        )
    if kind == "marian":
        from transformer_rosetta.porting import transformers_models

        marian = transformers_models.load_marian(path)
        version = package_version("transformers")

        def marian_logits(src: np.ndarray | None, tgt: np.ndarray | None) -> np.ndarray:
            # A Marian model is an encoder-decoder: the probes give it both inputs.
            assert src is not None and tgt is not None
            return transformers_models.marian_logits(marian, src, tgt)

        return Runner(
            f"transformers {version} MarianMTModel (float32)",
            "float32",
            marian_logits,
            {"transformers": version, "torch": package_version("torch")},
            full_rows_only=kind in FULL_ROWS_ONLY,
        )
    if kind == "bert":
        from transformer_rosetta.porting import transformers_models

        bert = transformers_models.load_bert(path)
        version = package_version("transformers")

        def bert_outputs(src: np.ndarray | None, _tgt: np.ndarray | None) -> np.ndarray:
            # BERT is encoder-only: the probes give it src (and tgt None).
            assert src is not None
            hidden = transformers_models.bert_hidden_states(bert, src, config.pad_id)
            # The pooled vector by the spec's own formula: BertModel has none of its own.
            pooled = reference.pool(config, hidden, src)
            return compared(ForwardOutput(None, hidden, pooled_output=pooled))

        return Runner(
            f"transformers {version} BertModel (float32)",
            "float32",
            bert_outputs,
            {"transformers": version, "torch": package_version("torch")},
            full_rows_only=kind in FULL_ROWS_ONLY,
        )
    if kind == "llama":
        from transformer_rosetta.porting import transformers_models

        causal_lm = transformers_models.load_causal_lm(path)
        version = package_version("transformers")
        architecture = type(causal_lm).__name__

        def llama_logits(_src: np.ndarray | None, tgt: np.ndarray | None) -> np.ndarray:
            # A decoder-only model: the probes give it tgt (and src None).
            assert tgt is not None
            return transformers_models.causal_lm_logits(causal_lm, tgt, config.pad_id)

        return Runner(
            f"transformers {version} {architecture} (float32)",
            "float32",
            llama_logits,
            {"transformers": version, "torch": package_version("torch")},
        )
    if kind == "onnx":
        from transformer_rosetta.adapter.onnx_backend import session

        run = session(str(path)).run
        version = package_version("onnxruntime")

        def onnx_logits(src: np.ndarray | None, tgt: np.ndarray | None) -> np.ndarray:
            # ONNX export covers the encoder-decoder only: the probes give it both inputs.
            assert src is not None and tgt is not None
            return run(["logits"], {"src": src, "tgt_in": tgt})[0]

        return Runner(
            f"onnxruntime {version} (float32)",
            "float32",
            onnx_logits,
            {"onnxruntime": version},
        )
    raise ValueError(f"no runner for {kind!r}")


def compared(out: ForwardOutput) -> np.ndarray:
    """What verification compares: the logits; an encoder-only model's encoder output, with its
    pooled vector when it pools (flattened and joined: one largest difference over both)."""
    if out.logits is not None:
        return out.logits
    # No logits: an encoder-only model, whose output is its encoder's.
    assert out.encoder_output is not None
    parts = [out.encoder_output] + ([] if out.pooled_output is None else [out.pooled_output])
    return np.concatenate([np.ravel(p) for p in parts])


def compared_names(config: TransformerConfig) -> str:
    """The outputs `compared` joins, as the record and its readers name them."""
    if config.has_decoder:
        return "logits"
    return "encoder_output" + (", pooled_output" if config.pooling != "none" else "")


def difference_text(record: Mapping[str, object]) -> str | None:
    """'max |logit difference| 1.3e-15' from a verification record, or None without one."""
    if "max_abs_logit_diff" in record:
        return f"max |logit difference| {record['max_abs_logit_diff']:.2g}"
    if "max_abs_output_diff" in record:
        return f"max |{record['compared']} difference| {record['max_abs_output_diff']:.2g}"
    return None


def probes(
    config: TransformerConfig, full_rows_only: bool
) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
    """The seeded ragged batches both sides run (a half gets None for the input it lacks)."""
    out = []
    for batch, src_len, tgt_len in PROBE_SHAPES:
        src, tgt = ragged_batch(
            config, batch, min(src_len, config.max_len), min(tgt_len, config.max_len), PROBE_SEED
        )
        if full_rows_only and src is not None:
            keep = (src != config.pad_id).any(axis=1)
            src, tgt = src[keep], (None if tgt is None else tgt[keep])
        out.append((src, tgt))
    return out


def _collect_garbage() -> None:
    """gc.collect(), for a model held in reference cycles (a Keras model is), with the signals
    that stop a command only noted while it runs and acted on after: a handler that raised
    inside a library's gc callback (JAX registers one) would raise where Python prints the
    exception and goes on, and the command would not stop."""
    if threading.current_thread() is not threading.main_thread():
        gc.collect()
        _release_freed_memory()
        return
    noted: list[int] = []
    handlers = {
        signum: signal.signal(signum, lambda signum, _frame: noted.append(signum))
        for signum in (*CAUGHT_SIGNALS, signal.SIGINT)
    }
    try:
        gc.collect()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if noted:  # now, in this frame, as if it had just arrived
        handler = handlers[noted[0]]
        if callable(handler):
            handler(noted[0], None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(noted[0])
    _release_freed_memory()


def _release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim, where the C library is
    glibc): a framework's freed buffers (JAX's) stay in the process's heap otherwise, and the
    next model would be built on top of them."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        return
    trim(0)


def verify(
    config: TransformerConfig, source: tuple[str, Path], destination: tuple[str, Path]
) -> VerifyRecord:
    """Run both sides on the probes; the record stored under provenance["verify"].

    One side at a time, so that the two models are never in memory together: the source runs on
    every probe and only its outputs (a few small arrays) are kept; its model is freed; then the
    destination is read and run and compared with them."""
    full_rows_only = source[0] in FULL_ROWS_ONLY or destination[0] in FULL_ROWS_ONLY
    batches = probes(config, full_rows_only)
    left = runner(source[0], source[1], config)
    expected = [np.asarray(left.logits(src, tgt), np.float64) for src, tgt in batches]
    left_label, left_dtype, left_versions = left.label, left.dtype, left.versions
    del left  # the source's model, and the weights it holds: gone before the destination's
    _collect_garbage()
    right = runner(destination[0], destination[1], config)
    bound = max(atol_for(left_dtype, config), atol_for(right.dtype, config))
    worst = 0.0
    shapes: list[list[int | None]] = []
    for (src, tgt), want in zip(batches, expected, strict=True):
        diff = np.abs(want - right.logits(src, tgt))
        worst = max(worst, float(diff.max()) if np.isfinite(diff).all() else float("inf"))
        given = src if src is not None else tgt
        # Every model has a stack, and ragged_batch gives each stack's input.
        assert given is not None
        shapes.append([given.shape[0], *(None if a is None else a.shape[1] for a in (src, tgt))])
    record = VerifyRecord(passed=bool(worst <= bound))
    if config.has_decoder:
        record["max_abs_logit_diff"] = worst
    else:
        record["max_abs_output_diff"] = worst
        record["compared"] = compared_names(config)
    return {
        **record,
        "bound": bound,
        "sides": [left_label, right.label],
        "probe_seed": PROBE_SEED,
        "probe_shapes": shapes,
        "probe_rows": "ragged_batch"
        + (" without fully padded source rows" if full_rows_only else ""),
        "versions": {**left_versions, **right.versions},
    }
