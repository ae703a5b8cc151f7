"""A user's own importer table, as JSON (`rosetta convert --map MAP.json`): the same `Table` that
the built-in importers are (common/porting/table.py), so a home-made model ports without code.

The file (docs/PORTING.md has a worked example):

    {
      "model": "my translator",                        optional, for messages
      "config": {"norm_position": "pre", ...},         optional: fields the model fixes
      "needs": ["num_heads"],                          optional: fields --config must give
      "sizes": {"d_model": ["emb.weight", 1]},         optional: field <- [source key, axis]
      "layers": {"num_encoder_layers": "enc.{i}."},   optional: field <- key pattern to count
      "prefix": "model.",                              optional: {prefix} when keys have it
      "tensors": [                                     one entry per canonical pattern
        {"canonical": "encoder.layers.{i}.self_attention.query.kernel",
         "source": "enc.{i}.attn.q.weight", "steps": ["transpose", "heads"],
         "copies": [], "fallbacks": [], "when": {"share_embeddings": false},
         "absent": "zeros"},
        ...
      ],
      "buffers": [{"source": "pe", "layout": "interleaved", "steps": ["squeeze:0"],
                   "computed_in": "stored", "learned": ["encoder.position_embedding"]}]
    }

Every problem of the file is found before any weight is read and reported at once, each named
by its place ("tensors[3].steps[1]: unknown step 'tranpose'; allowed: ...").
"""

from __future__ import annotations

import difflib
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from transformer_rosetta.errors import RosettaError
from transformer_rosetta.files.safe_read import (
    MAX_CONFIG_BYTES,
    FileProblem,
    MissingFile,
    brief,
    read_json,
    shown,
)
from transformer_rosetta.porting.table import Buffer, Rule, Table, parse_step
from transformer_rosetta.spec.config import SINUSOID_LAYOUTS, TransformerConfig
from transformer_rosetta.spec.names import canonical_specs

TOP_KEYS = ("model", "config", "needs", "sizes", "layers", "prefix", "tensors", "buffers")
TENSOR_KEYS = ("canonical", "source", "steps", "copies", "fallbacks", "when", "absent")
BUFFER_KEYS = ("source", "layout", "steps", "computed_in", "learned")
COMPUTED_IN = ("stored", "float64")
CONFIG_FIELDS = tuple(f.name for f in fields(TransformerConfig))


class MapError(RosettaError):
    """A --map file that is not a valid importer table; every problem, each named by its place."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path, self.problems = path, list(problems)
        super().__init__(f"{path}: " + "; ".join(self.problems))


def canonical_patterns() -> list[str]:
    """Every canonical name any config can have, with layer indices written {i}."""
    variants = [
        TransformerConfig(
            share_embeddings=s,
            tie_output=t,
            position_kind=p,
            final_norm=True,
            output_bias=True,
            num_encoder_layers=1,
            num_decoder_layers=1,
        )
        for s, t, p in (
            (True, True, "learned"),
            (False, False, "learned"),
            (False, True, "sinusoidal"),
        )
    ]
    names = {
        re.sub(r"\.layers\.0\.", ".layers.{i}.", spec.name)
        for c in variants
        for spec in canonical_specs(c)
    }
    return sorted(names)


def load_map(path: str | Path) -> Table:
    """The Table a --map file describes; MapError naming every problem of the file."""
    label = shown(path)
    try:
        data = read_json(path, "a map file", MAX_CONFIG_BYTES)
    except MissingFile:
        raise MapError(label, ["no such map file"]) from None
    except FileProblem as exc:
        raise MapError(label, [exc.problem]) from None
    problems: list[str] = []
    table = _table(data, problems)
    if problems or table is None:
        raise MapError(label, problems)
    return table


def _table(data: Any, problems: list[str]) -> Table | None:
    if not isinstance(data, dict):
        problems.append(f"a map must be a JSON object, got {brief(data)}")
        return None
    _unknown(data, TOP_KEYS, "", problems)
    config = _object(data, "config", problems)
    for name in config:
        if name not in CONFIG_FIELDS:
            problems.append(f"config.{name}: unknown config field{_near(name, CONFIG_FIELDS)}")
    needs = _strings(data, "needs", problems)
    for name in needs:
        if name not in CONFIG_FIELDS:
            problems.append(f"needs: {brief(name)} is no config field{_near(name, CONFIG_FIELDS)}")
    sizes = {}
    for name, where in _object(data, "sizes", problems).items():
        ok = isinstance(where, list) and len(where) == 2 and isinstance(where[0], str)
        if not ok or not isinstance(where[1], int) or isinstance(where[1], bool) or where[1] < 0:
            problems.append(f"sizes.{name}: must be [source key, axis], got {brief(where)}")
        elif name not in CONFIG_FIELDS:
            problems.append(f"sizes.{name}: unknown config field{_near(name, CONFIG_FIELDS)}")
        else:
            sizes[name] = (where[0], where[1])
    layers = {}
    for name, key in _object(data, "layers", problems).items():
        if name not in ("num_encoder_layers", "num_decoder_layers"):
            problems.append(f"layers.{name}: must be num_encoder_layers or num_decoder_layers")
        elif not isinstance(key, str) or ("{i}" not in key and "{_i}" not in key):
            problems.append(f"layers.{name}: must be a key pattern holding {{i}}, got {brief(key)}")
        else:
            layers[name] = key
    prefix = data.get("prefix", "")
    if not isinstance(prefix, str):
        problems.append(f"prefix: must be a string, got {brief(prefix)}")
        prefix = ""
    rules = _rules(data, problems)
    buffers = _buffers(data, problems)
    model = data.get("model", "the --map model")
    return Table(
        kind="map",
        model=model if isinstance(model, str) else "the --map model",
        rules=tuple(rules),
        fixed=config,
        needs=tuple(needs),
        sizes=sizes,
        layer_counts=layers,
        buffers=tuple(buffers),
        optional_prefix=prefix,
    )


def _rules(data: dict, problems: list[str]) -> list[Rule]:
    entries = data.get("tensors")
    if not isinstance(entries, list) or not entries:
        problems.append("tensors: must be a non-empty list of {canonical, source, steps} entries")
        return []
    known = canonical_patterns()
    rules = []
    for n, entry in enumerate(entries):
        where = f"tensors[{n}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: must be an object, got {brief(entry)}")
            continue
        _unknown(entry, TENSOR_KEYS, f"{where}.", problems)
        canonical, source = entry.get("canonical"), entry.get("source")
        if not isinstance(canonical, str) or canonical not in known:
            near = _near(canonical, known) if isinstance(canonical, str) else ""
            problems.append(f"{where}.canonical: {brief(canonical)} is no canonical name{near}")
        if not isinstance(source, str) or not source:
            problems.append(f"{where}.source: must be a source key, got {brief(source)}")
        steps = _steps(entry, where, problems)
        when = entry.get("when", {})
        if not isinstance(when, dict) or any(k not in CONFIG_FIELDS for k in when):
            problems.append(f"{where}.when: must map config fields to values, got {brief(when)}")
            when = {}
        absent = entry.get("absent")
        if absent not in (None, "zeros"):
            problems.append(f'{where}.absent: must be "zeros" or left out, got {brief(absent)}')
        rules.append(
            Rule(
                str(canonical),
                str(source),
                tuple(steps),
                tuple(_strings(entry, "copies", problems, where)),
                tuple(_strings(entry, "fallbacks", problems, where)),
                tuple(when.items()),
                absent == "zeros",
            )
        )
    return rules


def _buffers(data: dict, problems: list[str]) -> list[Buffer]:
    entries = data.get("buffers", [])
    if not isinstance(entries, list):
        problems.append(f"buffers: must be a list, got {brief(entries)}")
        return []
    out = []
    for n, entry in enumerate(entries):
        where = f"buffers[{n}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: must be an object, got {brief(entry)}")
            continue
        _unknown(entry, BUFFER_KEYS, f"{where}.", problems)
        source, layout = entry.get("source"), entry.get("layout", "interleaved")
        computed_in = entry.get("computed_in", "stored")
        if not isinstance(source, str) or not source:
            problems.append(f"{where}.source: must be a source key, got {brief(source)}")
        if layout not in SINUSOID_LAYOUTS:
            problems.append(f"{where}.layout: must be one of {', '.join(SINUSOID_LAYOUTS)}")
        if computed_in not in COMPUTED_IN:
            problems.append(f"{where}.computed_in: must be one of {', '.join(COMPUTED_IN)}")
        steps = _steps(entry, where, problems)
        learned = _strings(entry, "learned", problems, where)
        for name in learned:
            if name not in ("encoder.position_embedding", "decoder.position_embedding"):
                problems.append(f"{where}.learned: {brief(name)} is no position table name")
        out.append(Buffer(str(source), str(layout), tuple(steps), str(computed_in), tuple(learned)))
    return out


def _steps(entry: dict, where: str, problems: list[str]) -> list[str]:
    steps = entry.get("steps", [])
    if not isinstance(steps, list):
        problems.append(f"{where}.steps: must be a list, got {brief(steps)}")
        return []
    for k, step in enumerate(steps):
        try:
            parse_step(step)
        except ValueError as exc:
            problems.append(f"{where}.steps[{k}]: {exc}")
    return [s for s in steps if isinstance(s, str)]


def _object(data: dict, key: str, problems: list[str]) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        problems.append(f"{key}: must be a JSON object, got {brief(value)}")
        return {}
    return value


def _strings(data: dict, key: str, problems: list[str], where: str = "") -> list[str]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(
            f"{where + '.' if where else ''}{key}: must be a list of strings, got {brief(value)}"
        )
        return []
    return value


def _unknown(data: dict, allowed: tuple[str, ...], where: str, problems: list[str]) -> None:
    for key in data:
        if key not in allowed:
            problems.append(
                f"{where}{key}: unknown key{_near(str(key), allowed)}; allowed: {', '.join(allowed)}"
            )


def _near(name: str, choices: Any) -> str:
    near = difflib.get_close_matches(str(name)[:64], list(choices), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""
