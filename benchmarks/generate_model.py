"""A model of any size in the shared format, generated tensor by tensor in bounded memory.

    .venv/bin/python -m transformer_rosetta.benchmarks.generate_model OUT
        [--preset tiny|base|big | --gb 3 | --layers 25] [--seed 0] [--max-shard-size 1GB]

The conversion benchmark (bench_convert.py) needs models larger than any preset: `--gb G` is the
big preset's layer (d_model 1024, 16 heads, d_ff 4096: Table 3 of the paper) stacked until the
float32 weights pass G * 10^9 bytes, as many decoder layers as encoder layers. Such a model must
not be built in memory to be written, or the benchmark would measure its own generator: the
weights are a lazy Mapping (GeneratedWeights) whose every tensor is drawn from (seed, its name)
when it is asked for, so a writer that takes one tensor at a time (save_weights, which writes a
Hugging Face-style sharded folder when given max_shard_size) holds one tensor at a time.

The values have init_weights' scales (weights/init.py: xavier kernels, embeddings N(0,
d_model^-0.5), biases and LayerNorm gains perturbed by N(0, 0.1^2) as its "perturbed" scheme), so
the model runs like a freshly initialised one; they are drawn as float32 normals (numpy's PCG64,
one generator per tensor seeded by (seed, crc32 of the name), as init_weights seeds), which is
several times cheaper than init_weights' float64 draws and gives the same bits on every machine.
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from transformer_rosetta.app.cli.args import Parser, UsageError, positive_int, seed_int, size_arg
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.spec.config import PRESETS, TransformerConfig, preset
from transformer_rosetta.spec.names import TensorSpec, canonical_specs
from transformer_rosetta.weights.format import save_weights

PROG = "python -m transformer_rosetta.benchmarks.generate_model"
PRODUCER = "transformer_rosetta.benchmarks.generate_model"
GB = 10**9  # decimal, as the sizes of model files are quoted (big: 857 MB)
FLOAT32_BYTES = 4


def model_bytes(config: TransformerConfig, itemsize: int = FLOAT32_BYTES) -> int:
    """Bytes of the weights of `config` (a tied matrix once), without the file's header."""
    return sum(math.prod(s.shape) for s in canonical_specs(config)) * itemsize


def largest_tensor_bytes(config: TransformerConfig, itemsize: int = FLOAT32_BYTES) -> int:
    """Bytes of the largest single tensor: what a writer holding one tensor at a time holds."""
    return max(math.prod(s.shape) for s in canonical_specs(config)) * itemsize


def stacked_config(gb: float, like: str = "big") -> TransformerConfig:
    """The `like` preset with the fewest layers (as many in the decoder as in the encoder) whose
    float32 weights take at least `gb` * 10^9 bytes."""
    base = preset(like)
    # The weights grow by the same bytes with every pair of layers: fixed + layers * pair.
    one = model_bytes(base.replace(num_encoder_layers=1, num_decoder_layers=1))
    pair = model_bytes(base.replace(num_encoder_layers=2, num_decoder_layers=2)) - one
    layers = max(1, math.ceil((gb * GB - (one - pair)) / pair))
    config = base.replace(num_encoder_layers=layers, num_decoder_layers=layers)
    assert model_bytes(config) >= gb * GB and (layers == 1 or model_bytes(config) - pair < gb * GB)
    return config


def _scale(spec: TensorSpec, config: TransformerConfig) -> float:
    """init_weights' standard deviation for a tensor of `spec`'s role."""
    if spec.role == "kernel":
        return math.sqrt(2.0 / (spec.fan_in + spec.fan_out))  # xavier's variance
    if spec.role == "embedding":
        return config.d_model**-0.5  # unit variance after the sqrt(d_model) scale (section 3.4)
    return 0.1  # biases and LayerNorm gains: the "perturbed" scheme's spread


def generate_tensor(spec: TensorSpec, config: TransformerConfig, seed: int) -> np.ndarray:
    """One float32 tensor, from (seed, spec.name) alone: the same bits on every machine, whatever
    else is generated before it."""
    rng = np.random.default_rng([int(seed), zlib.crc32(spec.name.encode())])
    values = rng.standard_normal(spec.shape, dtype=np.float32)
    values *= np.float32(_scale(spec, config))  # in place: one tensor's memory, not two
    if spec.role == "scale":
        values += np.float32(1.0)
    return values


class GeneratedWeights(Mapping[str, np.ndarray]):
    """Every canonical tensor of `config`, in canonical order, generated when it is looked up and
    not kept: iterating holds the names only, and each lookup draws the tensor afresh (the same
    bits every time)."""

    def __init__(self, config: TransformerConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed
        self.specs = {s.name: s for s in canonical_specs(config)}

    def __getitem__(self, name: str) -> np.ndarray:
        return generate_tensor(self.specs[name], self.config, self.seed)

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def write_model(
    path: str | Path,
    config: TransformerConfig,
    seed: int = 0,
    *,
    max_shard_size: int | None = None,
) -> None:
    """Write the generated weights of `config` to `path`: one .safetensors file, or with
    `max_shard_size` (bytes) a Hugging Face-style sharded folder, through save_weights, which
    asks for one tensor at a time."""
    save_weights(
        path, GeneratedWeights(config, seed), config, PRODUCER, max_shard_size=max_shard_size
    )


def run(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the .safetensors file, or with --max-shard-size the folder")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--preset", choices=list(PRESETS), help="a preset's model (default big)")
    which.add_argument(
        "--gb",
        type=float,
        help="the big preset's layers stacked until the weights pass GB * 10^9 bytes",
    )
    which.add_argument(
        "--layers",
        type=positive_int,
        help="the big preset with N encoder and N decoder layers",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="the values' seed (0)")
    p.add_argument(
        "--max-shard-size",
        type=size_arg,
        metavar="SIZE",
        help="write a sharded folder of shards of at most SIZE (1GB, 500MB, bytes)",
    )
    args = p.parse_args(None if argv is None else list(argv))
    if args.gb is not None and not args.gb > 0:
        raise UsageError(f"--gb: must be > 0, got {args.gb}")
    out = Path(args.out)
    if out.exists() or out.is_symlink():
        raise UsageError(f"{out}: exists; give a new name")
    if args.gb is not None:
        config = stacked_config(args.gb)
    elif args.layers is not None:
        config = preset("big").replace(
            num_encoder_layers=args.layers, num_decoder_layers=args.layers
        )
    else:
        config = preset(args.preset or "big")
    write_model(out, config, args.seed, max_shard_size=args.max_shard_size)
    layers = f"{config.num_encoder_layers}+{config.num_decoder_layers} layers"
    print(f"wrote {out}: {model_bytes(config):,} bytes of float32 weights, {layers}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(argv)
    except RosettaError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
