"""What every `rosetta` command shares: exit codes, UsageError and the parser class, argument
types, the model arguments (--preset/--config/--weights/--seed) and the model they name, id files,
and the --device check."""

from __future__ import annotations

import os

# Set before any command imports TensorFlow; every command module imports this one first.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import sys  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from typing import NoReturn  # noqa: E402

import numpy as np  # noqa: E402

from transformer_rosetta.adapter.backends import (  # noqa: E402
    FRAMEWORKS,
    RUNTIMES,
    Model,
    get_backend,
    unavailable_reason,
)
from transformer_rosetta.app.resources import check_fits, weights_bytes  # noqa: E402
from transformer_rosetta.errors import InputError, RosettaError  # noqa: E402
from transformer_rosetta.files.outputs import shown  # noqa: E402
from transformer_rosetta.spec.arguments import SEED_MAX as SEED_MAX  # noqa: E402 (tools/docs)
from transformer_rosetta.spec.arguments import check_seed  # noqa: E402
from transformer_rosetta.spec.config import (  # noqa: E402
    PRESETS,
    TransformerConfig,
    is_inline_json,
    preset,
)
from transformer_rosetta.spec.inputs import INPUT_STACKS  # noqa: E402
from transformer_rosetta.spec.mesh import MeshShape, parse_mesh  # noqa: E402
from transformer_rosetta.spec.precision import DEFAULT_PRECISION, PRECISIONS  # noqa: E402
from transformer_rosetta.weights.format import (  # noqa: E402
    WeightFile,
    describe_nonfinite,
    load_weights,
    nonfinite_counts,
)
from transformer_rosetta.weights.init import init_weights  # noqa: E402

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(RosettaError):
    """Bad command-line arguments."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit 2, like every other bad input."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def warn(message: str) -> None:
    """One line on stderr that does not stop the command."""
    print(f"rosetta: warning: {message}", file=sys.stderr)


# -- argument types ---------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seed_int(text: str) -> int:
    """An argparse type: a seed from 0 to SEED_MAX (2**32 - 1), checked by the API's own check
    (transformer_rosetta.spec.arguments.check_seed), so that --seed and seed= take the same."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    try:
        return check_seed(value, "--seed")
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--seed: ")) from None


def size_arg(text: str) -> int:
    """An argparse type: a size in bytes, "2GB", "200MB", "500KB" or a plain count (KB to TB
    are powers of 10, as huggingface_hub reads them; KiB to TiB powers of 2)."""
    from transformer_rosetta.weights.shards import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def mesh_arg(text: str) -> MeshShape:
    """An argparse type: a device mesh, `data=2,model=2` (transformer_rosetta.spec.mesh)."""
    try:
        return parse_mesh(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--mesh {text!r}: ")) from None


MAX_REPEATS = 1000  # a benchmark's rounds: beyond this a run is a hang, not a measurement


def repeats_int(text: str) -> int:
    """An argparse type: 1 to MAX_REPEATS timed rounds."""
    value = positive_int(text)
    if value > MAX_REPEATS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_REPEATS}, got {value}")
    return value


def _names_arg(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(map(repr, unknown)) or 'list'}; choose from {','.join(known)}"
        )
    return names


def frameworks_arg(text: str) -> list[str]:
    """An argparse type: a comma-separated list of known frameworks."""
    return _names_arg(text, FRAMEWORKS, "framework")


def runtimes_arg(text: str) -> list[str]:
    """An argparse type: a comma-separated list of frameworks and exported runtimes (onnx)."""
    return _names_arg(text, RUNTIMES, "framework")


# -- the model a command runs -----------------------------------------------------------------


def add_model_arguments(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    """--preset, --config, --weights and --seed, read back by config_and_weights."""
    which = p.add_argument_group("model")
    which.add_argument(
        "--preset",
        choices=list(PRESETS),
        help=f"a built-in config{f' (default: {default_preset})' if default_preset else ''}",
    )
    which.add_argument(
        "--config",
        metavar="FILE.json",
        help="your own config as JSON: a file, or the JSON itself when it starts with { "
        """(--config '{"num_heads": 2}')""",
    )
    which.add_argument(
        "--weights",
        metavar="FILE.safetensors",
        help="weights in the shared format (its config is used; a --preset/--config "
        "given too must match it)",
    )
    which.add_argument(
        "--seed", type=seed_int, default=0, help="seed for random weights and inputs (default 0)"
    )


def config_and_weights(
    args: argparse.Namespace, default_preset: str | None
) -> tuple[TransformerConfig, dict[str, np.ndarray], str]:
    """The model to run: from --weights (whose config wins, and must match --preset/--config if
    one is given too), else random weights from --seed for --preset/--config."""
    asked: TransformerConfig | None = None
    if getattr(args, "preset", None) and getattr(args, "config", None):
        raise UsageError("give --preset or --config, not both")
    if getattr(args, "config", None):
        asked = TransformerConfig.from_file(args.config)
    elif getattr(args, "preset", None):
        asked = preset(args.preset)
    if getattr(args, "weights", None):
        wf: WeightFile = load_weights(args.weights, config=asked)
        found = nonfinite_counts(wf.tensors)
        if found:
            warn(f"{shown(args.weights)}: {describe_nonfinite(found)}; outputs will not be finite")
        return wf.config, wf.tensors, f"{args.weights} ({wf.dtype}, by {wf.producer})"
    if asked is None:
        if default_preset is None:
            raise UsageError("give --weights FILE, or --preset/--config for random weights")
        asked = preset(default_preset)
    check_fits(weights_bytes(asked), "random float64 weights for this config")
    # The "perturbed" scheme: random biases and gains, so that a dropped bias cannot hide.
    weights = init_weights(asked, seed=args.seed, scheme="perturbed", dtype="float64")
    name = (
        ("--config's JSON" if is_inline_json(args.config) else args.config)
        if args.config
        else f"preset {args.preset or default_preset}"
    )
    return asked, weights, f"{name}, random weights from seed {args.seed}"


# -- inputs and devices -----------------------------------------------------------------------


def load_ids(path: str, name: str) -> np.ndarray:
    """An integer id array [batch, length] from a .npy file, with a one-line error for anything
    else; the header is checked before any data is read (transformer_rosetta.files.safe_read)."""
    from transformer_rosetta.files.safe_read import read_ids

    return read_ids(path, name)


def refuse_absent_half(
    config: TransformerConfig, given: dict[str, bool], option: str, instead: str
) -> None:
    """A one-line UsageError when an input of the half the model lacks is given. `given` maps
    "src"/"tgt" to whether it was; in `option` "{key}" stands for that input and in `instead`
    "{other}" for the one the model takes: ("--{key}", "give --{other} only")."""
    for key, stack in INPUT_STACKS:
        if given.get(key) and not getattr(config, f"has_{stack}"):
            other = next(k for k, _ in INPUT_STACKS if k != key)
            name = option.replace("{key}", key)
            instead = instead.replace("{other}", other)  # not format(): a path may hold braces
            raise UsageError(
                f"{name}: {config.a_model_of_its_kind} has no {stack} and takes no {key}; {instead}"
            )


def load_inputs(
    path: str, config: TransformerConfig | None = None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(src, tgt) from an .npz with keys `src` and `tgt` (decoder input ids, starting with BOS),
    each member's header checked before it is read (transformer_rosetta.files.safe_read). A half of the family
    reads only its own key, and a file that holds the other is refused, so that an array the
    model would ignore cannot pass for compared; the absent one is None. No config: both keys,
    as an encoder-decoder reads them."""
    import zipfile

    from transformer_rosetta.files.safe_read import read_ids_npz

    if config is None:
        src, tgt = read_ids_npz(path, "--inputs", ("src", "tgt"))
        return src, tgt
    keys = tuple(key for key, stack in INPUT_STACKS if getattr(config, f"has_{stack}"))
    # First: read_ids_npz checks that the path is a regular file and names any problem.
    arrays = dict(zip(keys, read_ids_npz(path, "--inputs", keys), strict=True))
    with zipfile.ZipFile(path) as archive:
        held = {name.removesuffix(".npy") for name in archive.namelist()}
    held_by = {key: key in held for key, _ in INPUT_STACKS}
    refuse_absent_half(config, held_by, "--inputs", shown(path) + " holds one: save only {other}")
    return arrays.get("src"), arrays.get("tgt")


DEVICE_HELP = (
    "auto (the default: the framework's first GPU if it sees one, else the cpu), cpu, gpu (its "
    "first GPU), or a device's own name: cuda:N or gpu:N (its N-th GPU), mps"
)


def device_arg(text: str) -> str:
    """An argparse type: a --device request (transformer_rosetta.app.parity.resolve_devices), checked for its
    form here, by the API's own check (check_device_request); whether the framework sees that
    device is checked once the framework is known."""
    from transformer_rosetta.app.parity import check_device_request

    try:
        return check_device_request(text, "--device")
    except InputError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; give {DEVICE_HELP}") from None


def add_device_argument(p: argparse.ArgumentParser, *, every: bool = False) -> None:
    """--device, default auto. every=True also offers "all": every device of each framework."""
    p.add_argument(
        "--device",
        type=device_arg,
        default="auto",
        metavar="DEVICE",
        help=DEVICE_HELP + ("; or all: every device each framework sees" if every else ""),
    )


def device_for(framework: str, request: str) -> str:
    """The one device of `framework` that a --device request names; a one-line UsageError,
    before any work, when the framework does not see it (transformer_rosetta.app.model)."""
    from transformer_rosetta.app.model import resolve_device

    try:
        return resolve_device(framework, request, prefix="--")
    except InputError as exc:
        raise UsageError(str(exc)) from None


def build_for(
    args: argparse.Namespace, config: TransformerConfig, weights: Mapping[str, np.ndarray]
) -> Model:
    """The model a command's --framework, --dtype, --device and --precision name (each checked
    before the build, one-line UsageError): transformer_rosetta.app.model.build_model."""
    from transformer_rosetta.app.model import build_model

    try:
        return build_model(
            args.framework,
            config,
            weights,
            dtype=getattr(args, "dtype", None),
            device=getattr(args, "device", "auto"),
            precision=getattr(args, "precision", DEFAULT_PRECISION),
            prefix="--",
        )
    except InputError as exc:
        raise UsageError(str(exc)) from None


PRECISION_HELP = (
    "float32 products: highest (full float32, the default) or tf32 (TF32 tensor cores where the "
    "GPU has them; the same as highest on a CPU); bfloat16 is --dtype bfloat16"
)


def add_precision_argument(p: argparse.ArgumentParser) -> None:
    """--precision highest|tf32 (common/spec/precision.py)."""
    p.add_argument(
        "--precision", choices=PRECISIONS, default=DEFAULT_PRECISION, help=PRECISION_HELP
    )


def check_devices_visible(frameworks: Sequence[str], device: str) -> None:
    """A --device no requested framework sees is bad input (exit 2), as in `rosetta forward`;
    with some frameworks on it, the others are skipped with the reason."""
    if device in ("cpu", "auto", "all"):
        return
    from transformer_rosetta.app.parity import resolve_devices

    runnable = [f for f in frameworks if f != "numpy" and unavailable_reason(f) is None]
    if runnable and not any(resolve_devices(f, get_backend(f).devices(), device) for f in runnable):
        what = {"gpu": "no GPU", "mps": "no MPS device"}.get(device, "no such device")
        raise UsageError(f"--device {device}: {what} is visible to {', '.join(runnable)}")
