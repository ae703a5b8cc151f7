"""Generates the docs' tables and pages from the code, so no doc can drift from it.

`python -m tools.docs` (run from the checkout: tools/docs/__main__.py) rewrites every block
between `<!-- BEGIN GENERATED: key -->` and `<!-- END GENERATED: key -->` in docs/FORMAT.md,
PARITY.md, PORTING.md, RELIABILITY.md and ROSETTA.md, and docs/rosetta.html whole;
`python -m tools.docs --check` exits 1 if any is stale, naming it (the test suite runs the
check). `--measure [parity|divergences]` first re-measures the numbers the tables show.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.docs.checkout import ROOT
from transformer_rosetta.files.outputs import atomic_write, text_writer
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import canonical_specs
from transformer_rosetta.weights.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    META_CONFIG,
    META_FORMAT,
    META_PRODUCER,
    META_PROVENANCE,
    META_TASK,
    META_VERSION,
    SAFETENSORS_DTYPES,
)

DOC = ROOT / "docs" / "FORMAT.md"

# A config whose sizes are all different numbers, so each number in a shape names one size.
_PROBE: dict[str, Any] = dict(
    src_vocab_size=11,
    tgt_vocab_size=13,
    d_model=14,
    num_heads=2,
    d_ff=9,
    max_len=17,
    num_encoder_layers=1,
    num_decoder_layers=1,
    position_kind="learned",
)
_SYMBOLS = {
    11: "src_vocab",
    13: "tgt_vocab",
    14: "d_model",
    2: "h",
    7: "d_k",
    9: "d_ff",
    17: "max_len",
    3: "type_vocab",
    1: "g",
}
# Every tensor is present or absent according to one switch; the probe turns all of them on.
_MAXIMAL: dict[str, Any] = dict(
    share_embeddings=False,
    tie_output=False,
    output_bias=True,
    final_norm=True,
    attention_bias=True,
    attention_output_bias=True,
    gated_feed_forward=True,
    feed_forward_bias=True,
    # Not a switch: grouped-query attention with g = 1 key/value head of h = 2, so that the key
    # and value kernels show their own head axis, g.
    num_kv_heads=1,
)
# The parts of the maximal probe that today's decoders add, set back to the paper's, for the
# importers of models that have none of them.
_PAPER_PARTS: dict[str, Any] = dict(
    attention_output_bias=None, gated_feed_forward=False, num_kv_heads=None
)
# BERT's embedding additions, on for the names tables only (the importers' tables have none).
_EMBEDDING_EXTRAS: dict[str, Any] = dict(type_vocab_size=3, embedding_norm=True)
_SWITCHES = {
    "share_embeddings": True,
    "tie_output": True,
    "output_bias": False,
    "final_norm": False,
    "attention_bias": False,
    "attention_output_bias": False,
    "gated_feed_forward": False,
    "feed_forward_bias": False,
    "norm_kind": "rms_norm",
    "position_kind": "sinusoidal",
    "type_vocab_size": 0,
    "embedding_norm": False,
    "num_encoder_layers": 0,
    "num_decoder_layers": 0,
}
# How a switch reads in "present when", where it is not `field = its maximal value`; and what
# else flipping it needs to stay a valid config (an encoder-only model has no output bias).
_PRESENT = {
    "type_vocab_size": "type_vocab_size >= 1",
    "attention_output_bias": ("attention_output_bias = true (or null, with attention_bias = true)"),
    "norm_kind": 'norm_kind is not "rms_norm"',
    "num_encoder_layers": "an encoder (num_encoder_layers >= 1)",
    "num_decoder_layers": "a decoder (num_decoder_layers >= 1)",
}
_ALSO = {"num_decoder_layers": {"output_bias": False}}


def _template(name: str) -> str:
    """Layer 0's name with its index as {i}, in any framework's spelling (".0.", "/0/", "[0]")."""
    return re.sub(r"layers(\.|/|\[)0(\.|/|\])", r"layers\1{i}\2", name)


def _names(**changes: Any) -> dict[str, tuple[int, ...]]:
    config = TransformerConfig(**{**_PROBE, **_MAXIMAL, **_EMBEDDING_EXTRAS, **changes})
    return {s.name: s.shape for s in canonical_specs(config)}


def names_table() -> str:
    """Every canonical name (layer index as {i}), its shape in symbols, and when it is present."""
    base = _names()
    conditions: dict[str, list[str]] = {n: [] for n in base}
    gained: dict[str, tuple[tuple[int, ...], str]] = {}
    for switch, flipped in _SWITCHES.items():
        # One shared embedding needs one vocabulary: its shape shows as [src_vocab, d_model].
        same_vocab = (
            {"tgt_vocab_size": _PROBE["src_vocab_size"]} if switch == "share_embeddings" else {}
        )
        other = _names(**{switch: flipped}, **same_vocab, **_ALSO.get(switch, {}))
        maximal = {**_MAXIMAL, **_EMBEDDING_EXTRAS}.get(switch, "learned")
        present = _PRESENT.get(switch, f"{switch} = {_json(maximal)}")
        for n in base.keys() - other.keys():
            conditions[n].append(present)
        for n in other.keys() - base.keys():
            gained[n] = (other[n], f"{switch} = {_json(flipped)}")
    rows = [(n, shape, cond) for n, (shape, cond) in gained.items()]
    rows += [(n, shape, " and ".join(conditions[n]) or "always") for n, shape in base.items()]
    lines = ["| name | shape | present when |", "|---|---|---|"]
    for name, shape, condition in rows:
        symbolic = "[" + ", ".join(_SYMBOLS[d] for d in shape) + "]"
        lines.append(f"| `{_template(name)}` | `{symbolic}` | {condition} |")
    return "\n".join(lines)


def metadata_table() -> str:
    lines = ["| key | value |", "|---|---|"]
    lines.append(f'| `{META_FORMAT}` | `"{FORMAT_NAME}"` |')
    lines.append(
        f'| `{META_VERSION}` | `"{FORMAT_VERSION}"` (this reader\'s version, a decimal string) |'
    )
    lines.append(
        f"| `{META_CONFIG}` | the config as JSON: every field of `TransformerConfig` as written (a "
        "reader fills a field that an older file lacks with its default: the version rule) |"
    )
    lines.append(f'| `{META_PRODUCER}` | who wrote the file, e.g. `"torch 2.13.0"` (informative) |')
    lines.append(
        f"| `{META_TASK}` | optional: the generated task (`common/app/tasks.py`) a trained model "
        "belongs to, whose tokenizer `rosetta translate` uses |"
    )
    lines.append(
        f"| `{META_PROVENANCE}` | optional: JSON, written by `rosetta convert`: where the file came "
        "from and how the conversion was checked (below) |"
    )
    return "\n".join(lines)


def dtype_table() -> str:
    lines = ["| safetensors dtype | numpy dtype |", "|---|---|"]
    lines += [f"| `{code}` | `{name}` |" for code, name in SAFETENSORS_DTYPES.items()]
    return "\n".join(lines)


def config_table() -> str:
    """Every config field with its default (the paper's base model) and what it allows."""
    from dataclasses import fields

    from transformer_rosetta.spec.config import _CHOICES, _COUNT_FIELDS

    lines = ["| field | default | allowed |", "|---|---|---|"]
    for f in fields(TransformerConfig):
        allowed = _ALLOWED.get(f.name) or {
            int: "integer in [0, vocab)"
            if f.name.endswith("_id")
            else "integer >= 0"
            if f.name in _COUNT_FIELDS
            else "integer >= 1",
            float: "number in [0, 1)" if f.name != "layer_norm_eps" else "number in (0, 1)",
            bool: "true / false",
            type(None): "integer >= 1, or null (d_model / num_heads)",
        }.get(type(f.default), "")
        if f.name in _CHOICES:
            allowed = " / ".join(f"`{c}`" for c in _CHOICES[f.name])
        lines.append(f"| `{f.name}` | `{_json(f.default)}` | {allowed} |")
    return "\n".join(lines)


# The fields whose allowed values their type does not tell.
_ALLOWED = {
    "num_kv_heads": "integer >= 1 that divides num_heads, or null (num_heads)",
    "attention_output_bias": "true / false, or null (as attention_bias)",
    "rope_theta": "number in (1, 1e12)",
    "pad_id": "integer in [0, vocab), or tgt_vocab_size: no pad token (decoder-only)",
}

_JSON_BOOLS: dict[object, str] = {True: "true", False: "false"}


def _json(value: object) -> str:
    if value is None:
        return "null"
    return _JSON_BOOLS.get(value, f'"{value}"') if isinstance(value, (bool, str)) else str(value)


def native_names_table() -> str:
    """Canonical name -> each framework's own name, and the torch shape (the only framework whose
    layout differs: nn.Linear stores [out, in], and attention heads are merged into one axis)."""
    import importlib

    from transformer_rosetta.adapter.backends import native_stderr_silenced

    with native_stderr_silenced():
        maps = {
            label: importlib.import_module(f"transformer_rosetta.{pkg}.weights").native_name_map
            for label, pkg in (
                ("PyTorch state_dict", "torch_impl"),
                ("Keras variable path", "tf_impl"),
                ("Flax NNX state path", "jax_impl"),
            )
        }
        from transformer_rosetta.torch_impl.weights import native_shape
    configs = [
        TransformerConfig(**{**_PROBE, **_MAXIMAL, **_EMBEDDING_EXTRAS}),
        TransformerConfig(**{**_PROBE, "tgt_vocab_size": _PROBE["src_vocab_size"]}),  # shared
    ]
    rows: dict[str, list[str]] = {}
    for config in configs:
        names = {label: m(config) for label, m in maps.items()}
        for spec in canonical_specs(config):
            key = _template(spec.name)
            if key in rows:
                continue
            torch_shape = "[" + ", ".join(_SYMBOLS.get(d, str(d)) for d in native_shape(spec)) + "]"
            if spec.role == "bias" and len(spec.shape) == 2:
                torch_shape = "[h*d_k] (heads merged)"
            elif spec.role == "kernel" and len(spec.shape) == 3:
                # Written with h*d_k, not d_model: with key_dim set the two differ.
                if spec.shape[0] == config.d_model:  # query/key/value: (d_model, h, d_k)
                    torch_shape = "[h*d_k, d_model] (heads merged, transposed)"
                else:  # output: (h, d_k, d_model)
                    torch_shape = "[d_model, h*d_k] (heads merged, transposed)"
            elif spec.role == "kernel":
                torch_shape += " (transposed)"
            rows[key] = [_template(names[label][spec.name]) for label in maps] + [torch_shape]
    header = "| canonical | " + " | ".join(maps) + " | torch shape |"
    lines = [header, "|---" * (len(maps) + 2) + "|"]
    lines += [f"| `{k}` | " + " | ".join(f"`{v}`" for v in vals) + " |" for k, vals in rows.items()]
    return "\n".join(lines)


GENERATORS: dict[str, Callable[[], str]] = {
    "native_names": native_names_table,
    "names": names_table,
    "metadata": metadata_table,
    "dtypes": dtype_table,
    "config": config_table,
}

# -- docs/PARITY.md: the tolerance table, regenerated from `rosetta parity --json` reports -------

PARITY_DOC = DOC.parent / "PARITY.md"
MEASUREMENTS = DOC.parent / "parity_measurements.json"
# (dtype, preset) runs of `rosetta parity --json` behind the table: each dtype on the tiny preset,
# and float32 on the paper's base model as well.
MEASURED_RUNS = (
    ("float64", "tiny"),
    ("float32", "tiny"),
    ("float32", "base"),
    ("bfloat16", "tiny"),
)


def measure_parity() -> list[dict]:
    """`rosetta parity --dtype D --preset P --json` for each of MEASURED_RUNS (seed 0)."""
    import contextlib
    import io
    import json

    from transformer_rosetta.app.cli.main import main as rosetta

    reports = []
    for dtype, name in MEASURED_RUNS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rosetta(["parity", "--dtype", dtype, "--preset", name, "--json"])
        reports.append({**json.loads(out.getvalue()), "preset": name})
    return reports


def parity_table(reports: list[dict] | None = None) -> str:
    """Per measured run: the bound, and per framework the largest difference from the oracle over
    every compared quantity, and the largest between any two frameworks."""
    import json

    if reports is None:
        reports = json.loads(MEASUREMENTS.read_text()) if MEASUREMENTS.exists() else []
    order = ("torch", "tf", "jax")
    frameworks = sorted(
        {r["framework"] for rep in reports for r in rep["runs"]},
        key=lambda f: order.index(f) if f in order else len(order),
    )
    header = "| dtype | model | bound (max abs) | " + " | ".join(
        f"{f} vs oracle" for f in frameworks
    )
    lines = [header + " | largest pair |", "|---" * (len(frameworks) + 4) + "|"]
    for rep in reports:
        comparisons = rep["comparisons"]
        cells = []
        for f in frameworks:
            worst = [c["max_abs"] for c in comparisons if c["left"] == f and c["right"] == "numpy"]
            cells.append(f"{max(worst):.1e}" if worst else "not run")
        pairs = [c["max_abs"] for c in comparisons if c["right"] != "numpy"]
        bound = comparisons[0]["tolerance"] if comparisons else float("nan")
        model = f"{rep['preset']} (batch {rep['batch']}, {rep['src_len']}/{rep['tgt_len']} tokens)"
        pair = f"{max(pairs):.1e}" if pairs else "-"
        lines.append(
            f"| {rep['dtype']} | {model} | {bound:g} | " + " | ".join(cells) + f" | {pair} |"
        )
    return "\n".join(lines)


PARITY_GENERATORS: dict[str, Callable[[], str]] = {"tolerances": parity_table}

# -- docs/PORTING.md: the outside formats' name maps, printed from common/porting/-----------------

PORTING_DOC = DOC.parent / "PORTING.md"


def _port_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| source name | canonical name | transform |", "|---|---|---|"]
    for source, canonical, transform in rows:
        if ".layers.1." in source or ".layers.1." in canonical:
            continue  # one layer shows the pattern; {i} stands for every layer
        names = ", ".join(f"`{_template(n.strip())}`" for n in canonical.split(","))
        lines.append(f"| `{_template(source)}` | {names} | {transform} |")
    return "\n".join(lines)


def nn_transformer_table() -> str:
    """torch.nn.Transformer (+ the user's embeddings and output Linear), untied, with final norms."""
    from transformer_rosetta.porting.nn_transformer import mapping_table

    config = TransformerConfig(
        **{
            **_PROBE,
            **_MAXIMAL,
            **_PAPER_PARTS,
            "num_encoder_layers": 2,
            "num_decoder_layers": 2,
        }
    )
    return _port_table(mapping_table(config))


def marian_table() -> str:
    """A Marian model as transformers 5 builds it: shared, tied, post-norm, final_logits_bias."""
    from transformer_rosetta.porting.marian import mapping_table

    config = TransformerConfig(
        **{
            **_PROBE,
            "num_encoder_layers": 2,
            "num_decoder_layers": 2,
            "position_kind": "sinusoidal",
            "tgt_vocab_size": _PROBE["src_vocab_size"],
            "sinusoid_layout": "concatenated",
            "output_bias": True,
            "bos_id": 0,
            "layer_norm_eps": 1e-5,
        }
    )
    return _port_table(mapping_table(config))


def bert_table() -> str:
    """A BERT encoder as transformers' BertModel saves it: what config.json maps to, what the
    model's code fixes, then the name map (keys may also start with `bert.`)."""
    from transformer_rosetta.porting.bert import HF_FIELD, TABLE, mapping_table

    lines = ["| config.json key | our field |", "|---|---|"]
    lines += [f"| `{key}` | `{ours}` |" for ours, key in HF_FIELD.items()]
    lines += [f"| (BertModel's code) | `{name}: {_json(v)}` |" for name, v in TABLE.fixed.items()]
    config = TransformerConfig(**{**_PROBE, **TABLE.fixed, "type_vocab_size": 2})
    return "\n".join(lines) + "\n\n" + _port_table(mapping_table(config, patterns=True))


def llama_table(kind: str) -> str:
    """A Llama-family folder (`--from llama`: Llama with its optional biases, untied) or Meta's
    original layout (`--from meta-llama`: no biases), at a d_model of 16 (rotary positions need
    an even head size)."""
    from transformer_rosetta.porting import llama, meta_llama

    biases = kind == "llama"
    config = TransformerConfig(
        **{
            **_PROBE,
            **llama.FIXED,
            "d_model": 16,
            "src_vocab_size": _PROBE["tgt_vocab_size"],
            "tie_output": False,
            "attention_bias": biases,
            "feed_forward_bias": biases,
        }
    )
    return _port_table((llama if biases else meta_llama).mapping_table(config))


def tutorial_table(kind: str) -> str:
    """What an importer table of common/porting/tutorials.py or gpt.py fixes (with why), what
    --config must or may give, then its name map with the layer index as {i} (or Keras's {_i})."""
    from transformer_rosetta.porting.gpt import TABLES as GPT_TABLES
    from transformer_rosetta.porting.table import rows
    from transformer_rosetta.porting.tutorials import TABLES

    table = {**TABLES, **GPT_TABLES}[kind]
    # Sinusoidal unless the table fixes the kind (the GPTs' learned positions).
    fields = {**_PROBE, "position_kind": "sinusoidal", **table.defaults, **table.fixed}
    if kind == "tf-tutorial-v2":
        fields["key_dim"] = _PROBE["d_model"]  # key_dim=d_model, as the tutorial passes it
    config = TransformerConfig(**fields)
    lines = ["| config field | value | why |", "|---|---|---|"]
    for name, value in table.fixed.items():
        why = table.why.get(name, "")
        lines.append(f"| `{name}` | `{_json(value)}` | {why} |")
    lines.append("")
    needs = ", ".join(f"`{n}`" for n in table.needs) or "nothing"
    defaults = ", ".join(f"`{k}` {_json(v)}" for k, v in table.defaults.items()) or "none"
    told = ", ".join(f"`{n}`" for n in (*table.sizes, *table.layer_counts))
    flags = ", ".join(
        f"`{n}` (true when `{k.replace('{prefix}', '')}` is present)"
        for n, k in table.flags.items()
    )
    lines.append(
        f"`--config` must give {needs}; it may change the text's defaults ({defaults}). The "
        f"file's shapes tell {told}." + (f" Its keys tell {flags}." if flags else "")
    )
    lines.append("")
    lines.append(_port_table(rows(table, config, patterns=True)))
    return "\n".join(lines)


PORTING_GENERATORS: dict[str, Callable[[], str]] = {
    "nn_transformer": nn_transformer_table,
    "marian": marian_table,
    "bert": bert_table,
    "llama": functools.partial(llama_table, "llama"),
    "meta_llama": functools.partial(llama_table, "meta-llama"),
    **{
        kind.replace("-", "_"): functools.partial(tutorial_table, kind)
        for kind in (
            "annotated",
            "pytorch-tutorial",
            "tf-tutorial-v1",
            "tf-tutorial-v2",
            "keras-prenorm",
            "mingpt",
            "nanogpt",
            "gpt2",
            "encoder-gpt",
        )
    },
}
RELIABILITY_DOC = DOC.with_name("RELIABILITY.md")


def limits_table() -> str:
    """Every bound on what a user's file or option may make the program do, from the constants
    that enforce it, with the reason each constant's comment gives."""
    from transformer_rosetta.app import resources
    from transformer_rosetta.app.cli.args import MAX_REPEATS, SEED_MAX
    from transformer_rosetta.files import outputs, safe_read

    rows = [
        ("config JSON size", f"{safe_read.MAX_CONFIG_BYTES:,} bytes", "`MAX_CONFIG_BYTES`"),
        ("JSON nesting depth (configs, weight-file headers)", str(safe_read.MAX_JSON_DEPTH),
         "`MAX_JSON_DEPTH`"),
        ("digits of a JSON integer", str(safe_read.MAX_INT_DIGITS), "`MAX_INT_DIGITS`"),
        ("weight-file header size", f"{safe_read.MAX_HEADER_BYTES:,} bytes", "`MAX_HEADER_BYTES`"),
        ("token-id array (`.npy`, each array of an `.npz`)", f"{safe_read.MAX_NPY_BYTES:,} bytes",
         "`MAX_NPY_BYTES`"),
        ("`.npy` header size", f"{safe_read.MAX_NPY_HEADER_BYTES:,} bytes",
         "`MAX_NPY_HEADER_BYTES`"),
        ("names listed in one message", f"{safe_read.MAX_LISTED}, then \"and N more\"",
         "`MAX_LISTED`"),
        ("share of available memory a request may plan on", f"{resources.USABLE_FRACTION:.0%}",
         "`USABLE_FRACTION`"),
        ("seeds", f"0 to {SEED_MAX:,}", "`SEED_MAX`"),
        ("benchmark rounds (`bench --repeats`)", f"{MAX_REPEATS:,}", "`MAX_REPEATS`"),
        ("signals that clean up before exiting",
         ", ".join(["SIGINT", *(s.name for s in outputs.CAUGHT_SIGNALS)]), "`CAUGHT_SIGNALS`"),
    ]  # fmt: skip
    lines = ["| limit | value | constant |", "|---|---|---|"]
    lines += [f"| {what} | {value} | {name} |" for what, value, name in rows]
    return "\n".join(lines)


RELIABILITY_GENERATORS: dict[str, Callable[[], str]] = {"limits": limits_table}

# -- docs/ROSETTA.md and docs/rosetta.html: the idioms side by side, and the divergences ------------

ROSETTA_DOC = DOC.with_name("ROSETTA.md")
ROSETTA_PAGE = DOC.with_name("rosetta.html")


def rosetta_concepts() -> str:
    """One section per concept of tools/docs/idioms.py, its three excerpts side by side."""
    from tools.docs.rosetta_page import concepts_markdown

    return concepts_markdown()


def rosetta_divergences() -> str:
    """The divergence catalogue, from docs/divergences.json (`--measure divergences`)."""
    from tools.docs.divergences import catalogue_table

    return catalogue_table()


def rosetta_html() -> str:
    """docs/rosetta.html, whole: the same excerpts and catalogue as ROSETTA.md, in three columns."""
    from tools.docs.rosetta_page import html_page

    return html_page()


ROSETTA_GENERATORS: dict[str, Callable[[], str]] = {
    "concepts": rosetta_concepts,
    "divergences": rosetta_divergences,
}
DOCUMENTS = {
    DOC: GENERATORS,
    PARITY_DOC: PARITY_GENERATORS,
    PORTING_DOC: PORTING_GENERATORS,
    RELIABILITY_DOC: RELIABILITY_GENERATORS,
    ROSETTA_DOC: ROSETTA_GENERATORS,
}
# Files generated whole rather than in blocks.
WHOLE_FILES: dict[Path, Callable[[], str]] = {ROSETTA_PAGE: rosetta_html}
MEASURE_KINDS = ("parity", "divergences")
# What regenerates every generated doc, as the stale messages name it.
COMMAND = "python -m tools.docs"


def render(text: str, generators: dict[str, Callable[[], str]] = GENERATORS) -> str:
    """`text` with every generated block replaced by its generator's current output."""
    for key, generate in generators.items():
        pattern = re.compile(
            rf"(<!-- BEGIN GENERATED: {re.escape(key)} -->\n).*?(<!-- END GENERATED: {re.escape(key)} -->)",
            re.S,
        )
        if not pattern.search(text):
            raise ValueError(f"no generated block named {key!r}")
        text = pattern.sub(_filled_with(generate), text)
    return text


def _filled_with(generate: Callable[[], str]) -> Callable[[re.Match[str]], str]:
    """A replacement for a generated block: its BEGIN line, generate()'s text, its END line."""
    return lambda m: m.group(1) + generate() + "\n" + m.group(2)


def _measure_kinds(argv: list[str]) -> list[str]:
    """What `--measure [parity|divergences]` asks for: the one named, or both."""
    if "--measure" not in argv:
        return []
    at = argv.index("--measure")
    named = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("--") else None
    if named is None:
        return list(MEASURE_KINDS)
    if named not in MEASURE_KINDS:
        raise SystemExit(f"--measure: unknown {named!r}; give {' or '.join(MEASURE_KINDS)}")
    return [named]


def main(argv: list[str]) -> int:
    """`--check`: exit 1 if a generated doc is stale. `--measure [parity|divergences]` (both when
    none is named) first measures: parity runs `rosetta parity --json` for each dtype into
    docs/parity_measurements.json; divergences runs tools/docs/divergences.py into
    docs/divergences.json."""
    kinds = _measure_kinds(argv)
    if "parity" in kinds:
        import json

        text = json.dumps(measure_parity(), indent=1)
        atomic_write(MEASUREMENTS, lambda tmp: Path(tmp).write_text(text))
        print(f"wrote {MEASUREMENTS}")
    if "divergences" in kinds:
        from tools.docs.divergences import write_measurements

        print(f"wrote {write_measurements()}")
    stale = []
    fresh_texts = {
        doc: render(doc.read_text(), generators) for doc, generators in DOCUMENTS.items()
    }
    fresh_texts.update({path: generate() for path, generate in WHOLE_FILES.items()})
    for doc, fresh in fresh_texts.items():
        current = doc.read_text() if doc.exists() else None
        if fresh != current:
            stale.append(doc)
            if "--check" not in argv:
                atomic_write(doc, text_writer(fresh))
                print(f"wrote {doc}")
    if "--check" in argv and stale:
        print(f"stale: {', '.join(map(str, stale))}: run {COMMAND}", file=sys.stderr)
        return 1
    return 0
