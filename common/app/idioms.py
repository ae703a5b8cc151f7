"""The concepts of docs/ROSETTA.md and the excerpts of each, taken from the three implementations.

An excerpt is the code between two marker comments in an implementation's source:

    # rosetta: layer_norm
    ...the code shown...
    # rosetta: end

A concept may have several excerpts in one framework (in file order, files in the order of
`IMPL_FILES`); each framework must have at least one for every concept. Markers are read as
text, so no framework is imported. docs/ROSETTA.md and docs/rosetta.html are built from
`excerpts()` (`python -m transformer_rosetta.app.docs`), so the pages cannot drift from the code that the
parity tests run.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from transformer_rosetta.app.checkout import checkout_or_cwd

ROOT = checkout_or_cwd()

# (key, column heading, package), in the order every page shows them.
FRAMEWORKS = (
    ("torch", "PyTorch", "torch_impl"),
    ("tf", "Keras 3", "tf_impl"),
    ("jax", "Flax NNX", "jax_impl"),
)
IMPL_FILES = ("model.py", "decode.py", "train.py", "weights.py", "backend.py")

_MARKER = re.compile(r"^\s*# rosetta: (?P<key>[a-z_]+)\s*$")
END = "end"


@dataclass(frozen=True)
class Concept:
    """One row of the side-by-side page: the excerpts of all three, then why they differ."""

    key: str
    title: str
    why: str


CONCEPTS: tuple[Concept, ...] = (
    Concept(
        "parameters",
        "Parameter creation and initialisation",
        "torch creates parameters in `__init__` and initialises them in one pass over modules; "
        "Keras creates them in `build()` once the input shape is known; Flax NNX creates them "
        "eagerly in `__init__` from an explicit `rngs` stream. The initial values never matter "
        "for parity: every framework loads the same safetensors file.",
    ),
    Concept(
        "heads",
        "Head layout and projections",
        "The file keeps heads as an axis (`[d_model, h, d_k]`, section 3.2.2). Keras `EinsumDense` "
        "and Flax `LinearGeneral` hold that shape natively; torch's `nn.Linear` holds the merged, "
        "transposed `[h*d_k, d_model]` and splits heads with a view.",
    ),
    Concept(
        "attention",
        "The attention kernel and fully masked rows",
        "Eq. (1). Each framework's fused kernel disagrees on a query with no allowed key (zero, "
        "NaN or a uniform average), so every implementation zeroes those rows itself, with a "
        "finite fill instead of -inf.",
    ),
    Concept(
        "masks",
        "Masks",
        "All three use boolean masks where True means attend: only pad keys are masked, and the "
        "decoder adds the causal mask of section 3.2.3. The shapes broadcast over heads.",
    ),
    Concept(
        "dropout",
        "Dropout and train mode",
        "torch and Flax NNX keep train mode as module state (`model.train()` / `eval()`; in NNX "
        "each `nnx.Dropout` holds a `deterministic` flag that those calls set); Keras passes "
        "`training=` down every call. Flax draws dropout noise from an explicit `rngs` stream. "
        "No two frameworks share dropout masks, so training parity is checked at dropout 0.",
    ),
    Concept(
        "layer_norm",
        "LayerNorm",
        "Every default differs (torch eps 1e-5, Keras 1e-3, Flax 1e-6 with the fast variance), so "
        "each is built from the config's `layer_norm_eps`, and Flax's `use_fast_variance` is off.",
    ),
    Concept(
        "residual",
        "Residual wiring (post/pre)",
        "Section 3.1 and 5.4: post-norm LN(x + F(x)) or pre-norm x + F(LN(x)), the same two "
        "lines in every framework; the sublayer is passed in as a function.",
    ),
    Concept(
        "embeddings",
        "Embeddings, scaling and tying",
        "Section 3.4: the token embedding is multiplied by sqrt(d_model) before positions are "
        "added, and the tied output reuses the target table transposed, unscaled. torch makes "
        "the output Linear's weight the embedding's Parameter; Keras shares one `Embedding` "
        "layer and multiplies by its table; Flax keeps one `nnx.Param` per table and looks it "
        "up by role.",
    ),
    Concept(
        "positions",
        "Positions",
        "Eq. (5), in the interleaved or concatenated layout the config names. torch builds a "
        "float64 table once (a non-persistent buffer) and casts it; Keras computes the rows in "
        "the graph, from a tensor start so a compiled decode step does not retrace; JAX builds "
        "them in float64 NumPy at trace time, where they become constants.",
    ),
    Concept(
        "cache",
        "The decode cache write",
        "torch writes the step's key and value into preallocated buffers in place "
        "(`index_copy_`); Keras and JAX arrays are immutable, so each step returns updated "
        "buffers (`slice_update`, `dynamic_update_slice`), which XLA can perform in place.",
    ),
    Concept(
        "compilation",
        "Compilation (eager, tf.function/XLA, jit)",
        "torch runs eagerly (`inference_mode` for the forward). Keras traces the training step "
        "into a `tf.function` that XLA compiles. JAX compiles a pure function of arrays with "
        "`jax.jit`: the Flax model is split into a static graph and its state, the graph is "
        "closed over, and the old arrays are donated to the new ones.",
    ),
    Concept(
        "gradients",
        "Gradients",
        "torch records the graph as it runs and `backward()` fills `.grad`; TensorFlow records on "
        "a `GradientTape`; JAX transforms the loss function itself (`value_and_grad`).",
    ),
    Concept(
        "optimizer",
        "The optimizer and its epsilon",
        "Kingma & Ba's Algorithm 1 with eps on sqrt(v_hat), at the Noam rate of section 5.3. "
        "torch and optax already place eps there; Keras adds it before the bias correction, so "
        "its `update_step` is overridden.",
    ),
    Concept(
        "checkpoints",
        "Checkpoints",
        "One safetensors file; each framework maps canonical names to its own: torch a "
        "`state_dict`, Keras variable paths, Flax NNX state paths. Only torch transposes.",
    ),
    Concept(
        "device",
        "Device and precision",
        "torch moves the module and each tensor explicitly (`.to(device)`); TensorFlow places "
        "work inside a `tf.device` scope; JAX commits arrays to a `jax.Device` "
        "(`jax.device_put`). Each pins float32 matmul precision around every call, since TF32 "
        "is the GPU default in JAX and in torch's cuDNN, and Keras has no switch of its own.",
    ),
)


@dataclass(frozen=True)
class Excerpt:
    """The code between one pair of markers, dedented, with where it came from."""

    path: str  # relative to the repository root, with forward slashes
    first_line: int  # 1-based line of the first line shown
    code: str


def _regions(path: Path, root: Path) -> list[tuple[str, Excerpt]]:
    """Every (concept key, excerpt) in one file, in file order."""
    found: list[tuple[str, Excerpt]] = []
    lines = path.read_text().splitlines()
    rel = path.relative_to(root).as_posix()
    open_key, start = None, 0
    for number, line in enumerate(lines, start=1):
        match = _MARKER.match(line)
        if not match:
            continue
        key = match["key"]
        if key == END:
            if open_key is None:
                raise ValueError(f"{rel}:{number}: '# rosetta: end' without an opening marker")
            code = textwrap.dedent("\n".join(lines[start : number - 1])).strip("\n")
            if not code.strip():
                raise ValueError(f"{rel}:{start}: the excerpt '{open_key}' is empty")
            found.append((open_key, Excerpt(rel, start + 1, code)))
            open_key = None
        elif open_key is not None:
            raise ValueError(f"{rel}:{number}: '{key}' opens inside '{open_key}' (close it first)")
        elif key not in {c.key for c in CONCEPTS}:
            known = ", ".join(c.key for c in CONCEPTS)
            raise ValueError(f"{rel}:{number}: unknown concept '{key}'; known: {known}")
        else:
            open_key, start = key, number
    if open_key is not None:
        raise ValueError(f"{rel}:{start}: '{open_key}' is never closed with '# rosetta: end'")
    return found


def excerpts(root: Path = ROOT) -> dict[str, dict[str, list[Excerpt]]]:
    """concept key -> framework key -> its excerpts, for every concept and framework. Raises
    ValueError naming the file and line of a bad marker, or the concept a framework lacks."""
    table: dict[str, dict[str, list[Excerpt]]] = {
        c.key: {f: [] for f, _, _ in FRAMEWORKS} for c in CONCEPTS
    }
    for framework, _, package in FRAMEWORKS:
        for name in IMPL_FILES:
            path = root / package / name
            if path.exists():
                for key, excerpt in _regions(path, root):
                    table[key][framework].append(excerpt)
    missing = [f"{c}/{f}" for c, panes in table.items() for f, found in panes.items() if not found]
    if missing:
        raise ValueError(f"no excerpt marked for {', '.join(missing)}")
    return table
