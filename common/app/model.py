"""The model object of the public API: a weight file loaded into one framework, with what people
do with each kind of model — `forward` for all three, `generate` for the decoders (an
encoder-decoder translates its source, a decoder-only model continues its prompt) and `embed`
for the encoder-only one — and `save` back to the shared format.

It is one class for torch, tf, jax and the numpy oracle: the framework is a constructor argument,
and every method goes through the backend contract (transformer_rosetta.adapter.backends), so
the four give the same results within docs/PARITY.md's bounds. Text goes in and out through the
tokenizer the weight file carries (`rosetta convert` stores an imported folder's tokenizer.json;
transformer_rosetta.weights.tokenizer) or, for a model `rosetta train` wrote, its task's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard, overload

import numpy as np

from transformer_rosetta.adapter.backends import FRAMEWORKS, Model, get_backend
from transformer_rosetta.app.parity import check_device_request, resolve_devices
from transformer_rosetta.app.resources import check_fits, weights_bytes
from transformer_rosetta.app.tasks import Task, get_task
from transformer_rosetta.errors import InputError, InputTypeError, RosettaError
from transformer_rosetta.files.safe_read import brief
from transformer_rosetta.spec.arguments import (
    check_choice,
    check_flag,
    check_int,
    check_path,
    check_text,
)
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import DTYPES
from transformer_rosetta.spec.inputs import check_inputs
from transformer_rosetta.spec.precision import DEFAULT_PRECISION, PRECISIONS
from transformer_rosetta.spec.results import ForwardOutput
from transformer_rosetta.weights.format import (
    META_TASK,
    META_TOKENIZER,
    check_finite,
    load_weights,
    planned_files,
    save_weights,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# One prompt or source: a text, or token ids.
Prompt = str | Sequence[int] | np.ndarray
# What generate returns: text for a text, ids for ids; a list of them for a list of inputs.
Generated = str | list[int] | list[str] | list[list[int]]

# The numpy oracle computes in float64 (it is the reference); the frameworks default to float32.
DEFAULT_DTYPES = {"numpy": "float64"}


@dataclass
class RosettaModel:
    """A model in one framework, on one device, in one dtype (`load` makes it).

    `config` is the model's TransformerConfig, `tokenizer` the `tokenizers.Tokenizer` its file
    carries (None when it has none), `task` the generated task a `rosetta train` model was
    trained on (None otherwise)."""

    config: TransformerConfig
    framework: str
    built: Model
    tokenizer: Tokenizer | None = None
    task: Task | None = None
    path: Path | None = None
    metadata: dict[str, str] | None = None

    @property
    def device(self) -> str:
        return self.built.device

    @property
    def dtype(self) -> str:
        return self.built.dtype

    def __repr__(self) -> str:
        source = f" from {self.path}" if self.path else ""
        return (
            f"RosettaModel({self.config.kind_name}{source}, framework={self.framework!r}, "
            f"device={self.device!r}, dtype={self.dtype!r})"
        )

    # -- every kind ---------------------------------------------------------------------------

    def forward(
        self,
        src: np.ndarray | Sequence[Sequence[int]] | None = None,
        tgt: np.ndarray | Sequence[Sequence[int]] | None = None,
        *,
        attention: bool = False,
        hidden_states: bool = False,
    ) -> ForwardOutput:
        """One eval-mode forward pass on token ids (B, S) and decoder input ids (B, T) (starting
        with BOS); a half of the family takes only its own input. `.named()` of the result gives
        every array under docs/PARITY.md's canonical names."""
        check_flag(attention, "attention")
        check_flag(hidden_states, "hidden_states")
        src_ids = _id_array(src, "src")
        tgt_ids = _id_array(tgt, "tgt")
        src_ids, tgt_ids = check_inputs(self.config, src_ids, tgt_ids)
        return self.built.forward(
            src_ids, tgt_ids, attention=attention, hidden_states=hidden_states
        )

    def save(
        self, path: str | Path, *, force: bool = False, max_shard_size: int | None = None
    ) -> Path:
        """Write the weights in the shared format (with the tokenizer and task the model came
        with). An existing file is kept unless force=True. `max_shard_size` (bytes) writes a
        folder of shards in Hugging Face's layout instead (docs/FORMAT.md, "Sharded files")."""
        from transformer_rosetta.files.outputs import check_output_file, check_output_folder
        from transformer_rosetta.weights.shards import check_shard_size, replaced_files

        check_path(path, "path")
        check_flag(force, "force")
        # The API's words in a refusal: "path: ... exists; pass force=True", not the CLI's --force.
        if max_shard_size is None:
            out = check_output_file(
                path, what="path", force=force, suffix=".safetensors", force_word="force=True"
            )
        else:
            check_shard_size(max_shard_size)
            dtype = self.dtype if self.dtype in DTYPES else "float32"
            planned = planned_files(self.config, dtype, max_shard_size)
            names = replaced_files(path, planned)
            out = check_output_folder(
                path, names, what="path", force=force, force_word="force=True"
            )
        tensors = self.built.export()
        producer = get_backend(self.framework).version()
        metadata = self.metadata or {}
        tokenizer = metadata.get(META_TOKENIZER)
        save_weights(
            out,
            tensors,
            self.config,
            producer,
            task=metadata.get(META_TASK),
            max_shard_size=max_shard_size,
            metadata={META_TOKENIZER: tokenizer} if tokenizer is not None else None,
        )
        return out

    # -- the decoders -------------------------------------------------------------------------

    # The overloads give a type checker generate's result from its input; a 2-D array is a list
    # of rows, which its type cannot tell from a 1-D one.
    @overload
    def generate(
        self,
        inputs: str,
        *,
        max_new_tokens: int = 50,
        beam: int = 1,
        sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        cached: bool = True,
    ) -> str: ...

    @overload
    def generate(
        self,
        inputs: list[str] | tuple[str, ...],
        *,
        max_new_tokens: int = 50,
        beam: int = 1,
        sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        cached: bool = True,
    ) -> list[str]: ...

    @overload
    def generate(
        self,
        inputs: Sequence[int],
        *,
        max_new_tokens: int = 50,
        beam: int = 1,
        sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        cached: bool = True,
    ) -> list[int]: ...

    @overload
    def generate(
        self,
        inputs: Sequence[Sequence[int] | np.ndarray],
        *,
        max_new_tokens: int = 50,
        beam: int = 1,
        sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        cached: bool = True,
    ) -> list[list[int]]: ...

    @overload
    def generate(
        self,
        inputs: np.ndarray,
        *,
        max_new_tokens: int = 50,
        beam: int = 1,
        sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        cached: bool = True,
    ) -> list[int] | list[list[int]]: ...

    @overload
    def generate(
        self,
        inputs: Prompt | Sequence[Prompt],
        *,
        max_new_tokens: int = 50,
        beam: int = 1,
        sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        cached: bool = True,
    ) -> Generated: ...

    def generate(
        self,
        inputs: Prompt | Sequence[Prompt],
        *,
        max_new_tokens: int = 50,
        beam: int = 1,
        sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        cached: bool = True,
    ) -> Generated:
        """Decode: an encoder-decoder translates each source, a decoder-only model continues
        each prompt. Greedy by default; `beam=K` runs beam search (section 6.1: length penalty
        0.6); `sample=True` draws with a seeded temperature / top-k / top-p (the same tokens in
        every framework for the same seed). Returns what it was given: text for text (through
        the model's tokenizer or task), ids for ids; a list for a list of inputs."""
        self._refuse_unless("decoder", "generate", "embed")
        # Every argument first, whatever the model's kind and the strategy (generation.py's one
        # check, the one `rosetta generate` makes): beam=0 is refused under greedy too.
        check_flag(sample, "sample")
        check_int(beam, "beam", minimum=1)
        if sample and beam != 1:
            raise InputError(
                f"beam: sampling draws one sequence per prompt; give beam=1 (the default) or "
                f"sample=False, got beam={brief(beam)}"
            )
        given = [name for name, value in (("top_k", top_k), ("top_p", top_p)) if value is not None]
        is_number = isinstance(temperature, (int, float, np.number)) and not isinstance(
            temperature, (bool, np.bool_)
        )
        if not (is_number and temperature == 1.0):  # 1.0 is the default: no temperature asked
            given.insert(0, "temperature")
        if given and not sample:  # as `rosetta generate` refuses --temperature without --sample
            raise InputError(
                f"{given[0]}: applies to sample=True; pass sample=True or leave it out"
            )
        from transformer_rosetta.app.generation import check_decoding_options

        check_decoding_options(
            max_new_tokens=max_new_tokens,
            strategy="sample" if sample else "beam" if beam > 1 else "greedy",
            beam=beam,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            cached=cached,
        )
        single, items = _as_batch(inputs)
        texts = [isinstance(item, str) for item in items]
        if any(texts) and not all(texts):
            raise InputError("generate: give texts or token ids, not both in one call")
        if self.task is not None and all(texts):
            outputs = self._translate_task(list(map(str, items)), beam=beam, sample=sample)
            return outputs[0] if single else outputs
        prompts = [self._ids_of(item, "generate") for item in items]
        if self.config.kind == "encoder_decoder":
            new = self._translate_ids(prompts, max_new_tokens, beam, sample, cached)
        else:
            from transformer_rosetta.app.generation import generate_ids

            strategy = "sample" if sample else ("beam" if beam > 1 else "greedy")
            new = generate_ids(
                self.built,
                prompts,
                max_new_tokens=max_new_tokens,
                strategy=strategy,
                beam=beam,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                cached=cached,
            )
        if all(texts):  # texts for texts (the mix was refused above), ids for ids
            decoded = [self._text_of(ids) for ids in new]
            return decoded[0] if single else decoded
        return new[0] if single else new

    # -- the encoder-only model -----------------------------------------------------------------

    def embed(
        self, inputs: str | Sequence[str] | np.ndarray, *, batch_size: int = 32
    ) -> np.ndarray:
        """Sentence embeddings (N, d_model): the pooled output the config names (mean pooling
        for all-MiniLM-L6-v2), L2-normalised when the imported model normalises, as
        sentence-transformers' `encode` gives them. Texts go through the file's tokenizer; a 2-D
        id array is taken as tokenised (pad with the config's pad id)."""
        from transformer_rosetta.app.embedding import embed_ids, embed_texts

        self._refuse_unless("encoder_only", "embed", "generate")
        check_int(batch_size, "batch_size", minimum=1)
        if isinstance(inputs, np.ndarray):
            return embed_ids(self.built, inputs)
        if not isinstance(inputs, (str, Sequence)):
            raise InputTypeError(
                f"inputs: give a text, a list of texts, or token ids as one 2-D numpy array; "
                f"got {brief(inputs)}"
            )
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        if not all(isinstance(t, str) for t in texts):
            raise InputError("inputs: give texts, or token ids as one 2-D numpy array")
        return embed_texts(self.built, self._need_tokenizer("embed"), texts, batch_size=batch_size)

    encode = embed  # sentence-transformers' name for it

    # -- helpers ------------------------------------------------------------------------------

    def _refuse_unless(self, kind: str, what: str, instead: str) -> None:
        fits = self.config.has_decoder if kind == "decoder" else self.config.kind == kind
        if not fits:
            raise InputError(
                f"{what}: {self.config.a_model_of_its_kind} cannot {what}; use .{instead}() or "
                ".forward()"
            )

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            where = f"{self.path} carries" if self.path else "this model has"
            raise InputError(
                f"{what}: {where} no tokenizer; convert the model from its folder (with its "
                "tokenizer.json or vocab files) so that the tokenizer travels with it, or give "
                "token ids"
            )
        return self.tokenizer

    def _ids_of(self, item: Prompt | int, what: str) -> list[int]:
        if isinstance(item, str):
            return list(self._need_tokenizer(what).encode(item, add_special_tokens=False).ids)
        ids = np.asarray(item)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise InputError(
                f"{what}: token ids must be one row of integers, got shape {ids.shape}"
            )
        return [int(i) for i in ids]

    def _text_of(self, ids: Sequence[int]) -> str:
        return self._need_tokenizer("generate").decode(list(ids), skip_special_tokens=True)

    def _translate_task(self, texts: list[str], *, beam: int, sample: bool) -> list[str]:
        from transformer_rosetta.app.trainer import translate

        if sample:
            raise InputError("generate: a task model decodes greedily or by beam search")
        assert self.task is not None  # generate calls this only for a model with a task
        return translate(self.built, self.task, texts, beam=beam)

    def _translate_ids(
        self, sources: list[list[int]], max_new_tokens: int, beam: int, sample: bool, cached: bool
    ) -> list[list[int]]:
        from transformer_rosetta.app.trainer import stepper_factory
        from transformer_rosetta.decoding.search import beam_search, greedy_search

        if sample:
            raise InputError("generate: sampling is for decoder-only models; use greedy or beam")
        src = np.full((len(sources), max(map(len, sources))), self.config.pad_id, dtype=np.int64)
        for row, ids in zip(src, sources, strict=True):
            row[: len(ids)] = ids
        bos = np.full((len(sources), 1), self.config.bos_id, dtype=np.int64)
        checked, _ = check_inputs(self.config, src, bos)  # the ids checked as a forward checks them
        assert checked is not None  # check_inputs returns the src it was given, validated
        start = stepper_factory(self.built, cached=cached)
        if beam > 1:
            decoded = beam_search(start, self.config, checked, beam=beam, extra_len=max_new_tokens)
        else:
            decoded = greedy_search(start, self.config, checked, extra_len=max_new_tokens)
        return [[int(t) for t in row] for row in decoded.tokens]


def _as_batch(inputs: Prompt | Sequence[Prompt]) -> tuple[bool, list[Prompt | int]]:
    """(single, items): one text or one row of ids is a batch of one, and comes back unwrapped.
    An int among other items stays one (generate refuses it: _ids_of)."""
    if isinstance(inputs, str):
        return True, [inputs]
    if isinstance(inputs, np.ndarray):
        return (True, [inputs]) if inputs.ndim == 1 else (False, list(inputs))
    if not isinstance(inputs, Sequence):
        raise InputTypeError(
            f"inputs: give a text, token ids, or a list of them; got {brief(inputs)}"
        )
    items = list(inputs)
    if _all_ids(items):
        return True, [items]
    return False, items


def _all_ids(items: list[Prompt | int]) -> TypeGuard[list[int]]:
    """Whether items is one row of token ids (python or numpy integers), not a list of inputs."""
    return bool(items) and all(isinstance(i, (int, np.integer)) for i in items)


def _id_array(ids: object, name: str) -> np.ndarray | None:
    """Token ids (B, L) as an array, its dtype as given: check_inputs refuses floats by name
    (a cast to int64 here would turn 1.5 into 1 silently) and a ragged or textual list is an
    InputError naming the input, not numpy's own ValueError."""
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)):
        raise InputTypeError(f"{name}: must be token ids (B, L), got text {brief(ids)}")
    try:
        return np.asarray(ids)
    except (TypeError, ValueError):
        raise InputError(
            f"{name}: must be token ids of shape [batch, length], rows of one length"
        ) from None


def resolve_device(framework: str, request: str, *, prefix: str = "") -> str:
    """The one device of `framework` that a device request names (auto, cpu, gpu, cuda:N, gpu:N,
    mps: transformer_rosetta.app.parity.resolve_devices); an InputError in one line, naming the
    devices it does see, before any work. `prefix` is "--" when the request came as an option."""
    if request == "all":
        raise InputError(f"{prefix}device all runs every device only in `rosetta parity`; name one")
    seen = get_backend(framework).devices()
    found = resolve_devices(framework, seen, request)
    if not found:
        raise InputError(
            f"{prefix}device {request}: {framework} sees no such device (it sees {', '.join(seen)})"
        )
    return found[0]


def build_model(
    framework: str,
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    *,
    dtype: str | None = None,
    device: str = "auto",
    precision: str = DEFAULT_PRECISION,
    prefix: str = "",
) -> Model:
    """`weights` in one framework: in `dtype` (default: float64 for the oracle, float32 for the
    frameworks), on the device the request names. Every check (the dtype, the device) comes
    before the build; each refusal is one line."""
    backend = get_backend(framework)
    dtype = dtype or DEFAULT_DTYPES.get(framework, "float32")
    if dtype not in backend.dtypes:
        raise InputError(
            f"{prefix}dtype: {framework} does not compute in {dtype}; it offers "
            f"{', '.join(backend.dtypes)}"
        )
    chosen = resolve_device(framework, device, prefix=prefix)
    # The position tables (rotary, sinusoidal: max_len rows) are built with the model and no
    # tensor of the file bounds them: a header's max_len of 10^12 is refused here, not by the
    # allocator's traceback.
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    check_fits(weights_bytes(config, itemsize), f"a {framework} model of this config")
    return backend.build(config, weights, dtype=dtype, device=chosen, precision=precision)


def load(
    path: str | Path,
    framework: str = "torch",
    *,
    device: str = "auto",
    dtype: str | None = None,
    precision: str = DEFAULT_PRECISION,
    allow_nonfinite: bool = False,
) -> RosettaModel:
    """Load a shared-format weight file into one framework ("numpy", "torch", "tf", "jax").

    device: "auto" (the framework's first GPU when it sees one, else the CPU), "cpu", "gpu",
    "cuda:N"/"gpu:N", "mps". dtype: "float32" (the frameworks' default), "float64" (the
    oracle's), "bfloat16". Weights holding NaN or Inf are refused unless allow_nonfinite.
    Raises RosettaError (WeightFileError, BackendUnavailable, InputError) with one line."""
    check_path(path, "path")
    check_text(framework, "framework")
    if framework not in FRAMEWORKS:
        raise InputError(
            f"framework: unknown framework {framework!r}; known: {', '.join(FRAMEWORKS)}"
        )
    check_device_request(device)
    if dtype is not None:
        check_text(dtype, "dtype")
    check_choice(precision, "precision", PRECISIONS)
    check_flag(allow_nonfinite, "allow_nonfinite")
    wf = load_weights(path)
    check_finite(path, wf.tensors, allow_nonfinite)
    built = build_model(
        framework, wf.config, wf.tensors, dtype=dtype, device=device, precision=precision
    )
    return RosettaModel(
        config=wf.config,
        framework=framework,
        built=built,
        tokenizer=_stored_tokenizer(path),
        task=_stored_task(wf.metadata, wf.config),
        path=Path(path),
        metadata=dict(wf.metadata),
    )


def _stored_tokenizer(path: str | Path) -> Tokenizer | None:
    from transformer_rosetta.weights.tokenizer import read_tokenizer

    return read_tokenizer(path)


def _stored_task(metadata: dict[str, str], config: TransformerConfig) -> Task | None:
    """The task a `rosetta train` file names, when its model is that task's."""
    name = metadata.get(META_TASK)
    if name is None:
        return None
    try:
        task = get_task(name)
    except RosettaError:
        return None
    return task if task.config() == config else None
