"""Transformer Rosetta: one Transformer ("Attention Is All You Need", its decoder-only and
encoder-only halves) written identically in PyTorch, Keras 3 and Flax NNX, with a NumPy float64
oracle, one safetensors weight format and parity tests.

The public API is what this module names in `__all__`; everything else is internal and may move.

    import transformer_rosetta as tr
    model = tr.load("minilm.safetensors", framework="jax")
    model.embed(["a sentence"])                 # (1, 384), as sentence-transformers gives it
    gpt = tr.load("gpt2.safetensors", framework="torch")
    gpt.generate([5, 17, 42], max_new_tokens=12)  # greedy, as transformers' generate
    tr.parity(preset="tiny").passed             # every framework against the oracle

The folders of the repository map onto this package (pyproject's package-dir): common/ is
`transformer_rosetta`, torch_impl/, tf_impl/ and jax_impl/ are its subpackages of the same names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# One version source: pyproject.toml reads it from here (dynamic version).
__version__ = "0.2.0"

# The public names, each with the module that defines it. They load on first use (PEP 562), so
# `import transformer_rosetta.spec.config` or an implementation's model does not pull in the
# application (scipy, the porting tables); the block below re-exports them explicitly (`X as X`,
# as flax writes them) for type checkers and readers. parity_tests/app/test_public_api.py checks that
# the two lists agree and snapshots __all__ and every signature.
if TYPE_CHECKING:
    from transformer_rosetta.app.model import RosettaModel as RosettaModel
    from transformer_rosetta.app.model import load as load
    from transformer_rosetta.app.parity import ParityReport as ParityReport
    from transformer_rosetta.app.parity import parity as parity
    from transformer_rosetta.decoding.sampling import sample_search as sample_search
    from transformer_rosetta.decoding.search import Decoded as Decoded
    from transformer_rosetta.decoding.search import beam_search as beam_search
    from transformer_rosetta.decoding.search import greedy_search as greedy_search
    from transformer_rosetta.errors import BackendUnavailable as BackendUnavailable
    from transformer_rosetta.errors import ConfigError as ConfigError
    from transformer_rosetta.errors import InputError as InputError
    from transformer_rosetta.errors import RosettaError as RosettaError
    from transformer_rosetta.errors import WeightFileError as WeightFileError
    from transformer_rosetta.porting.convert import Converted as Converted
    from transformer_rosetta.porting.convert import ConvertError as ConvertError
    from transformer_rosetta.porting.convert import convert as convert
    from transformer_rosetta.spec.config import PRESETS as PRESETS
    from transformer_rosetta.spec.config import TransformerConfig as TransformerConfig
    from transformer_rosetta.spec.config import preset as preset
    from transformer_rosetta.spec.results import ForwardOutput as ForwardOutput
    from transformer_rosetta.weights.format import WeightFile as WeightFile
    from transformer_rosetta.weights.format import load_weights as load_weights
    from transformer_rosetta.weights.format import save_weights as save_weights
    from transformer_rosetta.weights.init import init_weights as init_weights

_EXPORTS: dict[str, str] = {
    "load": "transformer_rosetta.app.model",
    "RosettaModel": "transformer_rosetta.app.model",
    "parity": "transformer_rosetta.app.parity",
    "ParityReport": "transformer_rosetta.app.parity",
    "beam_search": "transformer_rosetta.decoding.search",
    "Decoded": "transformer_rosetta.decoding.search",
    "greedy_search": "transformer_rosetta.decoding.search",
    "sample_search": "transformer_rosetta.decoding.sampling",
    "BackendUnavailable": "transformer_rosetta.errors",
    "ConfigError": "transformer_rosetta.errors",
    "InputError": "transformer_rosetta.errors",
    "RosettaError": "transformer_rosetta.errors",
    "WeightFileError": "transformer_rosetta.errors",
    "convert": "transformer_rosetta.porting.convert",
    "Converted": "transformer_rosetta.porting.convert",
    "ConvertError": "transformer_rosetta.porting.convert",
    "preset": "transformer_rosetta.spec.config",
    "PRESETS": "transformer_rosetta.spec.config",
    "TransformerConfig": "transformer_rosetta.spec.config",
    "ForwardOutput": "transformer_rosetta.spec.results",
    "load_weights": "transformer_rosetta.weights.format",
    "save_weights": "transformer_rosetta.weights.format",
    "WeightFile": "transformer_rosetta.weights.format",
    "init_weights": "transformer_rosetta.weights.init",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'transformer_rosetta' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
