"""`convert --verify`: proof that a conversion is right, stored with the file it wrote.

After the destination is written, the source (read by its own reader and run by its own runtime)
and the destination (read back from disk and run by its runtime) compute logits on the same
seeded ragged probes; the largest difference must be within what running the two runtimes costs on
this model (the conversion adds no error of its own): `verification_bound`, the parity bound of the
less precise side (common/spec/tolerances.py) or, where it is more, the rounding error that the
model's own size and output scale give (docs/PARITY.md, "The verification bound"). The record
goes into the destination's metadata as one JSON text under "provenance" (safetensors header, a
Marian folder's model.safetensors header, ONNX metadata_props; docs/FORMAT.md), with the source
file's sha256 and the versions that ran.

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
import math
import re
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
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

# Unit roundoff u = 2^-p of each precision a runner computes in (p: the significand's bits).
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8}
# The verification bound's safety factor over its rounding estimate u * sqrt(N) (docs/PARITY.md,
# "The verification bound"): that estimate is about sqrt(3) standard deviations of each compared
# output's error (a sum of many independent roundings), so twice it is about 3.5 of them.
BOUND_SAFETY = 2.0

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
    scale: float  # the largest |source output| on the probes, which the bound follows
    score_range: float  # the widest range of one query's attention scores (score_ranges)
    rounding_widths: int  # N: the inner widths whose roundings the bound adds (rounding_widths)
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
    # Each probe's score ranges (score_ranges: one per attention), where the runtime shows its
    # attention probabilities (the oracle); None where it does not.
    score_ranges: list[list[float]] | None = None


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
        # With the config the file holds, as any reader of it will run it: a config written
        # wrong (a norm's eps, the rotary layout, the tying) is a wrong file.
        written = load_weights(path)
        weights, file_config = written.tensors, written.config
        ranges: list[list[float]] = []

        def oracle_outputs(src: np.ndarray | None, tgt: np.ndarray | None) -> np.ndarray:
            out = reference.forward(weights, file_config, src, tgt)
            ranges.append(score_ranges(out))
            return compared(out)

        return Runner(
            "numpy float64 oracle",
            "float64",
            oracle_outputs,
            {"numpy": np.__version__},
            score_ranges=ranges,
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


def score_ranges(out: ForwardOutput) -> list[float]:
    """Each attention's widest range of scores over one query's keys, max - min, in the order
    encoder self-attentions, decoder self-attentions, cross-attentions (one per layer):
    log(p_max / p_min) over the keys a row attends (a masked key's probability is exactly 0, and
    scores and log-probabilities differ by one constant per row). 0.0 for a map with no row."""
    ranges = []
    for maps in (out.encoder_self_attention, out.decoder_self_attention, out.cross_attention):
        for probs in maps or []:
            attended = probs > 0
            rows = attended.any(axis=-1)
            logs = np.log(np.where(attended, probs, 1.0))
            top = np.where(attended, logs, -np.inf).max(axis=-1)
            bottom = np.where(attended, logs, np.inf).min(axis=-1)
            ranges.append(float((top - bottom)[rows].max()) if rows.any() else 0.0)
    return ranges


def attention_count(config: TransformerConfig) -> int:
    """The model's attentions: one per encoder layer, one or two (with an encoder) per decoder
    layer."""
    per_decoder_layer = 2 if config.has_encoder else 1
    return config.num_encoder_layers + config.num_decoder_layers * per_decoder_layer


def rounding_widths(config: TransformerConfig, length: int, scores: Sequence[float] = ()) -> int:
    """N: the inner widths of the roundings between the input and the compared output, summed,
    so that the output's relative rounding error is about u * sqrt(N) (docs/PARITY.md, "The
    verification bound"). Each sublayer costs its norm (a mean and a variance over d_model) and
    the matmuls on its way from input to output: an attention its input projection (d_model), its
    scores (d_k, times S^2: a score's rounding is relative to the scores' size S = max(1, R), R
    the attention's score range from `scores`, one per attention as score_ranges orders them, 1
    for those not given; the softmax hands an absolute score error on as the same relative error of
    its probability), its context (a sum over at most `length` keys) and its output projection
    (h * d_k); a feed-forward its first projection (d_model, twice when gated: the gate's and the
    value's errors are independent) and its second (d_ff). The output adds the final norm and,
    with a decoder, the logits' projection."""
    d, d_k = config.d_model, config.head_dim
    attentions = attention_count(config)
    sizes = [max(1.0, r) for r in scores]
    sizes += [1.0] * (attentions - len(sizes))  # those whose range is not known
    attention = 2 * d + length + config.num_heads * d_k  # and its scores, below
    feed_forward = d + d * (2 if config.gated_feed_forward else 1) + config.d_ff
    layers = config.num_encoder_layers + config.num_decoder_layers
    output = d + (d if config.has_decoder else 0)
    score_widths = math.ceil(d_k * sum(size**2 for size in sizes))
    return attentions * attention + score_widths + layers * feed_forward + output


def output_scale(outputs: list[np.ndarray]) -> float:
    """The largest finite |value| of a side's compared outputs (0.0 where none is finite: a
    non-finite output fails the comparison itself)."""
    finite = [np.abs(a[np.isfinite(a)]) for a in outputs]
    return max((float(a.max()) for a in finite if a.size), default=0.0)


def verification_bound(
    config: TransformerConfig,
    scale: float,
    dtypes: tuple[str, str],
    length: int,
    scores: Sequence[float] = (),
) -> float:
    """The largest difference two runtimes computing in `dtypes` may show on outputs of size up to
    `scale` (the source's largest |output|) and attentions whose scores span `scores` (one
    range per attention, score_ranges; none known: each taken as 1), when the conversion between
    them is right.

    The parity bound of the less precise side (common/spec/tolerances.py), set on models whose
    outputs are O(1), or, where it is more, the rounding error this model's computation makes:
    BOUND_SAFETY * sqrt(u_1^2 + u_2^2) * scale * sqrt(N), N = rounding_widths (docs/PARITY.md,
    "The verification bound", derives it: each side's error is about u * sqrt(N) relative to the
    outputs' scale, and the two sides' errors are independent). A fixed bound would refuse a
    correct import whose logits are in the tens, as real checkpoints' are. The derived value is
    rounded up to one significant digit, as every message prints it (`:.0e`), so that a printed
    difference over its printed bound is over the bound itself."""
    floor = max(atol_for(dtype, config) for dtype in dtypes)
    try:
        roundoff = math.hypot(*(UNIT_ROUNDOFF[dtype] for dtype in dtypes))
    except KeyError as missing:
        raise ValueError(f"no unit roundoff is set for dtype {missing}") from None
    widths = rounding_widths(config, length, scores)
    derived = BOUND_SAFETY * roundoff * scale * math.sqrt(widths)
    if not derived > floor:  # O(1) outputs: the tier's bound, as every parity test holds
        return floor
    exponent = math.floor(math.log10(derived))
    digit = math.ceil(derived / 10.0**exponent * (1 - 1e-12))  # 3.2e-5 -> 4e-5 (1e-12: 3e-5 stays)
    return float(f"{digit}e{exponent}")


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
    left_ranges = left.score_ranges
    del left  # the source's model, and the weights it holds: gone before the destination's
    _collect_garbage()
    right = runner(destination[0], destination[1], config)
    # The bound follows the source's outputs (what the conversion must reproduce): a broken
    # destination, whose outputs may be far larger, cannot widen it.
    scale = output_scale(expected)
    length = max(a.shape[1] for batch in batches for a in batch if a is not None)
    worst = 0.0
    shapes: list[list[int | None]] = []
    for (src, tgt), want in zip(batches, expected, strict=True):
        got = np.asarray(right.logits(src, tgt), np.float64)
        # A NaN or an Inf on either side, or outputs of another shape, miss any bound: the
        # difference is then infinite (a max that skips NaN, as np.nanmax does, would pass it).
        diff = np.abs(want - got) if got.shape == want.shape else np.array([math.inf])
        worst = max(worst, float(diff.max()) if np.isfinite(diff).all() else math.inf)
        given = src if src is not None else tgt
        # Every model has a stack, and ragged_batch gives each stack's input.
        assert given is not None
        shapes.append([given.shape[0], *(None if a is None else a.shape[1] for a in (src, tgt))])
    # The scores' range from the oracle's attention maps: the source's where it is the oracle,
    # else the written file's (a side that shows none, transformers' or onnxruntime's, neither).
    ranges = left_ranges if left_ranges is not None else right.score_ranges
    # Each attention's widest range over the probes.
    scores = [max(per_probe) for per_probe in zip(*ranges, strict=True)] if ranges else []
    bound = verification_bound(config, scale, (left_dtype, right.dtype), length, scores)
    record = VerifyRecord(passed=bool(worst <= bound))
    if config.has_decoder:
        record["max_abs_logit_diff"] = worst
    else:
        record["max_abs_output_diff"] = worst
        record["compared"] = compared_names(config)
    return {
        **record,
        "bound": bound,
        "scale": scale,
        "score_range": max(scores, default=0.0),
        "rounding_widths": rounding_widths(config, length, scores),
        "sides": [left_label, right.label],
        "probe_seed": PROBE_SEED,
        "probe_shapes": shapes,
        "probe_rows": "ragged_batch"
        + (" without fully padded source rows" if full_rows_only else ""),
        "versions": {**left_versions, **right.versions},
    }
