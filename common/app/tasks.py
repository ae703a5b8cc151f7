"""Small translation-like tasks generated in code (no downloads), for `rosetta train` and the demo.

A task is a pair of tokenizers, a sampler of (source, target) text pairs, a fixed test set kept
out of training, and the model and schedule that learn it. The one task so far:

- "numbers": a number written in digits -> the same number in English words, 0 to 999,999
  ("40213" -> "forty thousand two hundred thirteen", "71" -> "seventy-one"). Characters in,
  words out, and the alignment is non-monotone ("13" -> "thirteen", "80" -> "eighty"), so the
  cross-attention has something to show.
- "numbers-lm": the same pairs for a decoder-only language model (GPT-style): one sequence
  "0 4 0 2 1 3 = forty thousand two hundred thirteen" in one vocabulary, the digits zero-padded
  to six so that every prompt ("<s> 0 4 0 2 1 3 =") has one length. Trained on next-token
  prediction over the whole sequence, it translates by continuing the prompt.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

from transformer_rosetta.errors import InputError
from transformer_rosetta.spec.config import TransformerConfig

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIALS = (PAD, BOS, EOS)  # first in every vocabulary (Tokenizer.vocab)
# Their ids, which a task's config() declares as its pad_id, bos_id and eos_id: derived from the
# vocabulary's order, never written as numbers elsewhere.
PAD_ID, BOS_ID, EOS_ID = (SPECIALS.index(token) for token in (PAD, BOS, EOS))


@dataclass(frozen=True)
class Tokenizer:
    """Text <-> ids over a fixed vocabulary: pad, BOS and EOS first, then the symbols.
    kind "chars" reads one symbol per character; kind "words" reads words and hyphens."""

    symbols: tuple[str, ...]
    kind: str  # "chars" or "words"

    @property
    def vocab(self) -> tuple[str, ...]:
        return SPECIALS + self.symbols

    @property
    def size(self) -> int:
        return len(self.vocab)

    def split(self, text: str) -> list[str]:
        if self.kind == "chars":
            return list(text)
        return re.findall(r"[^\s-]+|-", text)

    def encode(self, text: str, *, what: str = "text") -> list[int]:
        """Ids of `text` (no BOS or EOS). InputError names every symbol it does not know."""
        index = {s: i for i, s in enumerate(self.vocab)}
        pieces = self.split(text)
        unknown = sorted({p for p in pieces if p not in index or p in SPECIALS})
        if unknown:
            allowed = "".join(self.symbols) if self.kind == "chars" else " ".join(self.symbols)
            raise InputError(
                f"{what}: {', '.join(repr(u) for u in unknown)} not in the tokenizer; "
                f"allowed: {allowed!r}"
            )
        if not pieces:
            raise InputError(f"{what}: empty")
        return [index[p] for p in pieces]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of ids, stopping at EOS and skipping pad and BOS."""
        out = []
        for i in ids:
            token = self.vocab[int(i)]
            if token == EOS:
                break
            if token not in SPECIALS:
                out.append(token)
        if self.kind == "chars":
            return "".join(out)
        return " ".join(out).replace(" - ", "-")


def batch_ids(rows: list[list[int]], *, eos: bool, width: int = 0) -> np.ndarray:
    """Right-padded (B, L) int64 ids (PAD_ID), EOS_ID appended to each row when `eos`; L is at
    least `width` (a fixed width keeps compiled training steps from retracing per batch)."""
    rows = [r + [EOS_ID] if eos else r for r in rows]
    out = np.full((len(rows), max(width, *(len(r) for r in rows))), PAD_ID, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


# -- the "numbers" task ----------------------------------------------------------------------

ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()  # 20, 30, ..., 90


def number_to_words(n: int) -> str:
    """American English without "and": 105 -> "one hundred five", 71 -> "seventy-one"."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10 - 2] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        rest = "" if n % 100 == 0 else " " + number_to_words(n % 100)
        return f"{ONES[n // 100]} hundred{rest}"
    rest = "" if n % 1000 == 0 else " " + number_to_words(n % 1000)
    return f"{number_to_words(n // 1000)} thousand{rest}"


def sample_number(rng: np.random.Generator, max_digits: int) -> int:
    """A number whose digit count is uniform in 1..max_digits (so short numbers are not rare)."""
    digits = int(rng.integers(1, max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10**digits))


@dataclass(frozen=True)
class Task:
    """A generated task: tokenizers, a sampler, a held-out test set and how to learn it."""

    name: str
    description: str
    source: Tokenizer
    target: Tokenizer
    sample: Callable[[np.random.Generator], tuple[str, str]]
    sample_test: Callable[[np.random.Generator], tuple[str, str]]  # the held-out test's draws
    check_source: Callable[[str], None]  # InputError for text the task does not define
    reference: Callable[[str], str]  # the right translation of a valid source text
    source_width: int  # the longest source and target (EOS included) the sampler makes
    target_width: int
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 256
    layers: int = 2
    batch_size: int = 64
    steps: int = 3000  # the default for `rosetta train` and the demo
    warmup: int = 200
    lr_factor: float = 2.0
    test_size: int = 500
    test_seed: int = 20170612  # the paper's arXiv date: any fixed number would do

    def config(self) -> TransformerConfig:
        """The model for this task: the paper's architecture at a small size, separate source
        and target vocabularies, output tied to the target embedding, no dropout (the sampler
        never repeats a batch, so there is little to overfit)."""
        return TransformerConfig(
            src_vocab_size=self.source.size,
            tgt_vocab_size=self.target.size,
            d_model=self.d_model,
            num_heads=self.num_heads,
            d_ff=self.d_ff,
            num_encoder_layers=self.layers,
            num_decoder_layers=self.layers,
            max_len=64,
            dropout=0.0,
            share_embeddings=False,
            tie_output=True,
            pad_id=PAD_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
        )

    def test_pairs(self) -> list[tuple[str, str]]:
        """The held-out test set: test_size distinct pairs, the same every time."""
        rng = np.random.default_rng(self.test_seed)
        pairs: dict[str, str] = {}
        while len(pairs) < self.test_size:
            src, tgt = self.sample_test(rng)
            pairs.setdefault(src, tgt)
        return list(pairs.items())

    def train_batches(self, seed: int) -> TrainStream:
        return TrainStream(self, seed)

    def encode_sources(self, texts: list[str]) -> np.ndarray:
        """(B, S) source ids; InputError for text the task cannot read."""
        rows = [self.source.encode(t, what="input") for t in texts]
        for text in texts:
            self.check_source(text)
        return batch_ids(rows, eos=False)

    def target_ids(self, texts: list[str]) -> np.ndarray:
        """(B, T) target ids, each ending in EOS."""
        return batch_ids([self.target.encode(t, what="target") for t in texts], eos=True)


# One training batch: (src (B, S), tgt (B, T)), src None for a decoder-only model (which reads
# its whole sequence as the target).
Batch = tuple[np.ndarray | None, np.ndarray]


class TrainStream:
    """An endless stream of training batches (src, tgt) that never contains a test source."""

    def __init__(self, task: Task, seed: int) -> None:
        self.task = task
        self.rng = np.random.default_rng(seed)
        self.held_out = {src for src, _ in task.test_pairs()}

    def next_batch(self) -> Batch:
        """(src (B, S), tgt (B, T)): target ids end in EOS, both right-padded."""
        t = self.task
        pairs: list[tuple[str, str]] = []
        while len(pairs) < t.batch_size:
            src, tgt = t.sample(self.rng)
            if src not in self.held_out:
                pairs.append((src, tgt))
        src_ids = batch_ids([t.source.encode(s) for s, _ in pairs], eos=False, width=t.source_width)
        tgt_ids = batch_ids([t.target.encode(g) for _, g in pairs], eos=True, width=t.target_width)
        return src_ids, tgt_ids


NUMBER_DIGITS = 6


def sample_numbers(rng: np.random.Generator) -> tuple[str, str]:
    n = sample_number(rng, NUMBER_DIGITS)
    return str(n), number_to_words(n)


def sample_test_numbers(rng: np.random.Generator) -> tuple[str, str]:
    """Test numbers have 4 to 6 digits: each is new as a whole, but made of parts that training
    shows (40213 = "forty" "thousand" + 213), so exact match measures composition. 0 to 999 are
    all left to training: a held-out "7" could never be learnt from anything else."""
    digits = int(rng.integers(4, NUMBER_DIGITS + 1))
    n = int(rng.integers(10 ** (digits - 1), 10**digits))
    return str(n), number_to_words(n)


def check_number(text: str) -> None:
    if len(text) > NUMBER_DIGITS:
        raise InputError(
            f"input: {text!r} has {len(text)} digits; the numbers task covers 0 to 999999"
        )
    if len(text) > 1 and text.startswith("0"):
        raise InputError(f"input: {text!r} has a leading zero; write it as {str(int(text))!r}")


TASKS: dict[str, Task] = {
    "numbers": Task(
        name="numbers",
        description="a number in digits -> English words, 0 to 999999 ('71' -> 'seventy-one')",
        source=Tokenizer(tuple("0123456789"), "chars"),
        target=Tokenizer(tuple(ONES + TENS + ["hundred", "thousand", "-"]), "words"),
        sample=sample_numbers,
        sample_test=sample_test_numbers,
        check_source=check_number,
        reference=lambda text: number_to_words(int(text)),
        source_width=NUMBER_DIGITS,
        target_width=12,  # 777777: "seven hundred seventy - seven thousand ..." is 11 tokens, + EOS
    ),
}


SEPARATOR = "="  # between source and target in a LanguageModelTask's sequence


@dataclass(frozen=True)
class LanguageModelTask(Task):
    """A task's pairs as one sequence for a decoder-only model (num_encoder_layers 0): the
    source's symbols, SEPARATOR, the target's words, EOS. The model reads it behind BOS and
    predicts every next token; it translates by continuing the prompt BOS + source + SEPARATOR
    (common/decoding/search.py: the prompt is prefilled, then greedy or beam search).

    `target` is the one vocabulary of the sequence (decode reads the generated words with it);
    `source` still checks and splits the source text."""

    def config(self) -> TransformerConfig:
        """The encoder-decoder's sizes as a decoder-only model: one vocabulary, the output tied to
        its embedding, the task's layer count in the one stack."""
        return (
            super()
            .config()
            .replace(
                src_vocab_size=self.target.size,
                num_encoder_layers=0,
                num_decoder_layers=self.layers,
            )
        )

    def prompt_ids(self, text: str) -> list[int]:
        """The source's symbols, zero-padded on the left to source_width, then SEPARATOR."""
        self.check_source(text)
        self.source.encode(text, what="input")  # names any symbol the task does not know
        padded = text.rjust(self.source_width, "0")
        return self.target.encode(" ".join(padded) + f" {SEPARATOR}", what="input")

    def encode_sources(self, texts: list[str]) -> np.ndarray:
        """(B, P) prompts, BOS first; every row the same length, as a batch of prompts must be."""
        return batch_ids([[BOS_ID, *self.prompt_ids(t)] for t in texts], eos=False)

    def train_batches(self, seed: int) -> LanguageModelStream:
        return LanguageModelStream(self, seed)


class LanguageModelStream(TrainStream):
    """Training batches (None, sequence) for a LanguageModelTask: no source, the whole sequence
    as the target (the decoder reads it shifted right behind BOS)."""

    task: LanguageModelTask  # its prompt_ids make each sequence's start

    def __init__(self, task: LanguageModelTask, seed: int) -> None:
        super().__init__(task, seed)

    def next_batch(self) -> tuple[None, np.ndarray]:
        t = self.task
        rows: list[list[int]] = []
        while len(rows) < t.batch_size:
            src, tgt = t.sample(self.rng)
            if src not in self.held_out:
                rows.append(t.prompt_ids(src) + t.target.encode(tgt))
        width = t.source_width + 1 + t.target_width
        return None, batch_ids(rows, eos=True, width=width)


TASKS["numbers-lm"] = LanguageModelTask(
    **{
        **{f.name: getattr(TASKS["numbers"], f.name) for f in fields(Task)},
        "name": "numbers-lm",
        "description": "the numbers task for a decoder-only LM: '0 0 0 0 7 1 =' -> 'seventy-one'",
        "target": Tokenizer(
            tuple("0123456789") + (SEPARATOR,) + TASKS["numbers"].target.symbols, "words"
        ),
    }
)


def get_task(name: str) -> Task:
    """The task called `name`; InputError listing the known ones otherwise."""
    if name not in TASKS:
        raise InputError(f"task: unknown {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]
