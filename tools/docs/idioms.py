"""The concepts of docs/ROSETTA.md and the excerpts of each, cut from the three implementations.

An excerpt is found by name, through `ast`, so that no comment in the implementations marks it:
`CUTS` names, per concept and framework, one or more consecutive definitions of an
implementation's file by qualified name ("MultiHeadAttention.forward", "layer_norm"), shown
whole (decorators, the comment lines right above it, signature, docstring), or one function's
statements after its docstring (`body`). A slice from the middle of a function, which no name
reaches, is marked in the function itself:

    def forward(self, x):
        ...
        # rosetta: dropout
        ...the code shown...
        # rosetta: end
        ...

A slice without `# rosetta: end` runs to the end of its function, so no marker stands after a
`return`; a marker outside a function is an error (name the definition in CUTS instead).

A concept may have several excerpts in one framework, shown in file order (files in the order of
`IMPL_FILES`); each framework must have at least one for every concept. The files are parsed,
not imported, so no framework is. docs/ROSETTA.md and docs/rosetta.html are built from
`excerpts()` (`python -m tools.docs`), so the pages cannot drift from the code that the parity
tests run.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tools.docs.checkout import ROOT

# (key, column heading, package), in the order every page shows them.
FRAMEWORKS = (
    ("torch", "PyTorch", "torch_impl"),
    ("tf", "Keras 3", "tf_impl"),
    ("jax", "Flax NNX", "jax_impl"),
)
IMPL_FILES = (
    "model.py",
    "precision.py",
    "decode.py",
    "train.py",
    "weights.py",
    "distributed.py",
    "backend.py",
)

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
        "rms_norm",
        "RMSNorm",
        "Llama's norm (Zhang & Sennrich 2019): no mean, no bias, float32 statistics. Each "
        "framework has one (`nn.RMSNorm`, `keras.layers.RMSNormalization`, `nnx.RMSNorm`), and "
        "each multiplies the gain in float32 and rounds once, where Hugging Face's Llama rounds "
        "the normalised x to bfloat16 first and then multiplies: the same function in float32, "
        "one bfloat16 rounding apart (the catalogue measures it). So torch and Flax write the "
        "three lines themselves, and Keras subclasses its layer, calls its op without a gain and "
        "multiplies after the rounding.",
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
        "rotary",
        "Rotary positions",
        "RoFormer (Su et al. 2021): the queries and keys of every self-attention turn by "
        "pos * rope_theta^(-2i/d_k), in Hugging Face's half-split pairs or Meta's interleaved "
        "ones. torch and JAX compute float64 (cos, sin) tables once and slice them at the step's "
        "start; Keras computes the rows in the graph from a tensor start, as it does the "
        "sinusoids. torch's heads come before the positions, Keras's and Flax's after, so the "
        "tables broadcast differently.",
    ),
    Concept(
        "kv_heads",
        "Grouped-query attention",
        "num_kv_heads < num_heads (Ainslie et al. 2023): the key and value projections have g "
        "heads, each read by h / g query heads, and the decode cache keeps g. torch's SDPA takes "
        "fewer key/value heads with `enable_gqa`, `jax.nn.dot_product_attention` takes them as "
        "they are; Keras 3.15's `ops.dot_product_attention` fails on TensorFlow for one key/value "
        "head, so Keras repeats them first, as its own `GroupedQueryAttention` does.",
    ),
    Concept(
        "gated_feed_forward",
        "The gated feed-forward (SwiGLU)",
        "Shazeer 2020: (act(x W_gate) * x W_1) W_2, three projections where the paper has two. "
        "The same three lines in every framework; the gate is an optional third layer, absent "
        "(None) in an ungated model so that the checkpoint names do not change.",
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
        "distribution",
        "Distribution",
        "Each framework's own engine on a `data` x `model` mesh (`spec/mesh.py`). torch runs one "
        "process per device: DDP replicates the model over `data`, FSDP2's `fully_shard` shards "
        "every parameter over `model` and all-gathers each layer before it runs. JAX and Keras "
        "run one program over all devices: JAX puts `NamedSharding`s on the batch and on the "
        "parameters, Keras names the same Megatron-style splits in a `LayoutMap` (on its JAX "
        "backend), and XLA inserts the collectives. The loss stays the one-device loss: a "
        "replica's token sum over the GLOBAL token count, since a mean of per-replica means is "
        "another loss on a ragged batch (the divergence catalogue measures it).",
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
class Cut:
    """Where one excerpt is: `names`, the qualified names of consecutive definitions in `file`
    (one of IMPL_FILES), shown whole; or, with `body`, the statements of the one function named,
    after its docstring. A nested function's name goes through its enclosing function's
    ("KerasModel.train_steps.compiled")."""

    file: str
    names: tuple[str, ...]
    body: bool = False


def whole(file: str, *names: str) -> Cut:
    """Consecutive definitions of `file`, each whole: one excerpt from the first to the last."""
    return Cut(file, names)


def body(file: str, name: str) -> Cut:
    """The function `name` of `file` without its signature and docstring."""
    return Cut(file, (name,), body=True)


# The four mask helpers stand together in every model.py, in this order.
_MASKS = ("key_padding_mask", "decoder_key_padding_mask", "causal_mask", "decoder_self_mask")

# concept key -> framework key -> the excerpts named by definition; the slices marked in the
# files join them. A concept that a framework shows through marked slices alone is left out.
CUTS: dict[str, dict[str, tuple[Cut, ...]]] = {
    "distribution": {
        "torch": (whole("distributed.py", "_shard"), whole("distributed.py", "_distribute")),
        "tf": (whole("distributed.py", "layout_map", "distribution"),),
        "jax": (
            whole("distributed.py", "make_mesh"),
            whole("distributed.py", "tensor_parallel_axes", "annotate_tensor_parallel"),
        ),
    },
    "parameters": {
        "torch": (whole("model.py", "Transformer._init_weights"),),
        "tf": (whole("model.py", "MultiHeadAttention.build"),),
        "jax": (body("model.py", "_embedding_param"),),
    },
    "heads": {
        "torch": (whole("model.py", "MultiHeadAttention._split_heads"),),
        "tf": (whole("model.py", "HeadProjection"),),
        "jax": (body("model.py", "MultiHeadAttention.keys_values"),),
    },
    "attention": {
        framework: (body("model.py", "explicit_attention"), body("model.py", "fused_attention"))
        for framework in ("torch", "tf", "jax")
    },
    "masks": {framework: (whole("model.py", *_MASKS),) for framework in ("torch", "tf", "jax")},
    "dropout": {"torch": (body("train.py", "_training"),)},
    "layer_norm": {
        framework: (whole("model.py", "layer_norm"),) for framework in ("torch", "tf", "jax")
    },
    "residual": {
        framework: (body("model.py", "residual"),) for framework in ("torch", "tf", "jax")
    },
    "rms_norm": {
        framework: (whole("model.py", "RMSNorm"),) for framework in ("torch", "tf", "jax")
    },
    "rotary": {
        framework: (body("model.py", "rotary_positions"), body("model.py", "rotate"))
        for framework in ("torch", "tf", "jax")
    },
    "kv_heads": {
        "torch": (whole("model.py", "MultiHeadAttention.keys_values"),),
        "tf": (
            whole("model.py", "repeat_key_value_heads"),
            whole("model.py", "MultiHeadAttention.keys_values"),
        ),
        "jax": (whole("model.py", "MultiHeadAttention.keys_values"),),
    },
    "gated_feed_forward": {
        framework: (
            body("model.py", "FeedForward.__init__"),
            whole("model.py", f"FeedForward.{call}"),
        )
        for framework, call in (("torch", "forward"), ("tf", "call"), ("jax", "__call__"))
    },
    "cache": {
        framework: (body("model.py", "write_cache"),) for framework in ("torch", "tf", "jax")
    },
    "compilation": {
        "tf": (whole("backend.py", "KerasModel.train_steps.compiled"),),
        "jax": (whole("train.py", "_compiled_train_step"),),
    },
    "gradients": {"jax": (body("train.py", "_loss_fn"),)},
    "optimizer": {
        "torch": (body("train.py", "make_optimizer"),),
        "tf": (whole("train.py", "Adam.update_step"),),
        "jax": (body("train.py", "_noam_adam"),),
    },
    "device": {
        "torch": (body("precision.py", "matmul_precision"),),
        "tf": (whole("precision.py", "matmul_precision"), whole("backend.py", "tf_device")),
        "jax": (
            whole("precision.py", "matmul_precision"),
            whole("backend.py", "jax_device"),
            body("backend.py", "_to_device"),
        ),
    },
}


@dataclass(frozen=True)
class Excerpt:
    """The code of one excerpt, dedented, with where it came from."""

    path: str  # relative to the repository root, with forward slashes
    first_line: int  # 1-based line of the first line shown
    code: str


@dataclass(frozen=True)
class _Definition:
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    siblings: list[ast.stmt]  # the statement list that holds it
    index: int  # its place in that list


class _Source:
    """One implementation file, read and parsed once."""

    def __init__(self, path: Path, root: Path) -> None:
        text = path.read_text()
        self.rel = path.relative_to(root).as_posix()
        self.lines = text.splitlines()
        self.definitions: dict[str, _Definition] = {}
        self.functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        self._collect(ast.parse(text, filename=self.rel).body, "")

    def _collect(self, statements: list[ast.stmt], prefix: str) -> None:
        for index, node in enumerate(statements):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + node.name
                self.definitions[name] = _Definition(node, statements, index)
                if not isinstance(node, ast.ClassDef):
                    self.functions.append(node)
                self._collect(node.body, name + ".")
            else:  # a definition under `if`, `with`, `try`... keeps its scope's prefix
                for block in _blocks(node):
                    self._collect(block, prefix)

    def excerpt(self, first: int, last: int) -> Excerpt:
        """Lines first..last (1-based, inclusive), dedented, blank lines at either end dropped."""
        while first < last and not self.lines[first - 1].strip():
            first += 1
        code = textwrap.dedent("\n".join(self.lines[first - 1 : last])).strip("\n")
        return Excerpt(self.rel, first, code)

    def _comments_above(self, line: int) -> int:
        """The first of the comment lines directly above `line` (no blank line between), which
        belong to the definition there; `line` itself when there are none."""
        while (
            line > 1
            and self.lines[line - 2].strip().startswith("#")
            and not _MARKER.match(self.lines[line - 2])
        ):
            line -= 1
        return line

    def cut(self, key: str, cut: Cut) -> Excerpt:
        """The excerpt `cut` names; ValueError naming the concept, file and name otherwise."""
        found = []
        for name in cut.names:
            if name not in self.definitions:
                raise ValueError(
                    f"{key}: {self.rel} has no definition {name!r} (tools/docs/idioms.py CUTS)"
                )
            found.append(self.definitions[name])
        first = found[0]
        if cut.body:
            node = first.node
            if isinstance(node, ast.ClassDef) or len(found) > 1:
                raise ValueError(f"{key}: body() names one function, not {cut.names} in {self.rel}")
            statements = node.body
            if _is_docstring(statements[0]):
                start = statements[0].end_lineno or statements[0].lineno
                statements = statements[1:]
                if not statements:
                    raise ValueError(f"{key}: {cut.names[0]} in {self.rel} is a docstring only")
            elif statements[0].lineno == node.lineno:
                raise ValueError(f"{key}: {cut.names[0]} in {self.rel} is one line: name it whole")
            else:  # from the line after the signature: comments and blank lines above the first
                start = statements[0].lineno - 1
                while (
                    self.lines[start - 1].strip().startswith("#")
                    or not self.lines[start - 1].strip()
                ):
                    start -= 1
            return self.excerpt(start + 1, node.end_lineno or node.lineno)
        for before, after in zip(found, found[1:], strict=False):
            if after.siblings is not before.siblings or after.index != before.index + 1:
                raise ValueError(
                    f"{key}: {', '.join(cut.names)} are not consecutive definitions in {self.rel}"
                )
        node = first.node
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = found[-1].node.end_lineno or found[-1].node.lineno
        return self.excerpt(self._comments_above(start), end)

    def _function_at(self, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The innermost function whose lines (signature to last statement) hold `line`."""
        holding = [f for f in self.functions if f.lineno <= line <= (f.end_lineno or f.lineno)]
        return max(holding, key=lambda f: f.lineno, default=None)

    def slices(self, known: set[str]) -> list[tuple[str, Excerpt]]:
        """Every (concept key, excerpt) marked with `# rosetta:` comments, in file order. Raises
        ValueError naming the file and line of a bad marker."""
        found: list[tuple[str, Excerpt]] = []
        rel = self.rel
        # The open slice: its concept, its marker's line, and the function it is in.
        opened: tuple[str, int, ast.FunctionDef | ast.AsyncFunctionDef] | None = None
        for number, line in enumerate(self.lines, start=1):
            match = _MARKER.match(line)
            if not match:
                continue
            key, here = match["key"], self._function_at(number)
            if opened is not None and here is not opened[2]:
                end = opened[2].end_lineno or opened[2].lineno
                if number <= end:  # in a function nested in the open slice's
                    raise ValueError(f"{rel}:{number}: '{key}' opens inside '{opened[0]}'")
                if key == END:
                    raise ValueError(
                        f"{rel}:{number}: '# rosetta: end' stands outside the function that "
                        f"'{opened[0]}' opened in: a slice without it runs to the function's end"
                    )
                found.append(self._slice(*opened[:2], end))
                opened = None
            if key == END:
                if opened is None:
                    raise ValueError(f"{rel}:{number}: '# rosetta: end' without an opening marker")
                found.append(self._slice(*opened[:2], number - 1))
                opened = None
            elif opened is not None:
                raise ValueError(
                    f"{rel}:{number}: '{key}' opens inside '{opened[0]}' (close it first)"
                )
            elif key not in known:
                raise ValueError(
                    f"{rel}:{number}: unknown concept '{key}'; known: {', '.join(sorted(known))}"
                )
            elif here is None:
                raise ValueError(
                    f"{rel}:{number}: '{key}' is not inside a function: name whole definitions "
                    "in tools/docs/idioms.py CUTS instead"
                )
            else:
                opened = (key, number, here)
        if opened is not None:  # runs to its function's end
            found.append(self._slice(*opened[:2], opened[2].end_lineno or opened[2].lineno))
        return found

    def _slice(self, key: str, marker: int, last: int) -> tuple[str, Excerpt]:
        """The slice that the marker on line `marker` opens, to line `last`."""
        excerpt = self.excerpt(marker + 1, last)
        if not excerpt.code.strip():
            raise ValueError(f"{self.rel}:{marker}: the excerpt '{key}' is empty")
        return key, excerpt


def _blocks(node: ast.stmt) -> Iterator[list[ast.stmt]]:
    """The statement lists inside a compound statement (an `except` or `case` clause's too)."""
    for _, value in ast.iter_fields(node):
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            yield value
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, (ast.ExceptHandler, ast.match_case)):
                    yield item.body


def _is_docstring(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


Cuts = Mapping[str, Mapping[str, tuple[Cut, ...]]]


def _sources(root: Path, package: str) -> dict[str, _Source]:
    """An implementation's IMPL_FILES that exist, parsed, by file name."""
    return {
        name: _Source(root / package / name, root)
        for name in IMPL_FILES
        if (root / package / name).exists()
    }


def named(root: Path = ROOT, cuts: Cuts = CUTS) -> list[tuple[str, str, Excerpt]]:
    """(concept key, framework key, excerpt) for every definition that `cuts` names. Raises
    ValueError naming the concept, file and name of one that is not there."""
    keys = {c.key for c in CONCEPTS}
    unknown = sorted(set(cuts) - keys)
    if unknown:
        raise ValueError(f"CUTS names unknown concepts: {', '.join(unknown)}")
    found = []
    for framework, _, package in FRAMEWORKS:
        sources = _sources(root, package)
        for key, panes in cuts.items():
            for cut in panes.get(framework, ()):
                if cut.file not in sources:
                    raise ValueError(
                        f"{key}: no file {package}/{cut.file} (tools/docs/idioms.py CUTS)"
                    )
                found.append((key, framework, sources[cut.file].cut(key, cut)))
    return found


def marked(root: Path = ROOT) -> list[tuple[str, str, Excerpt]]:
    """(concept key, framework key, excerpt) for every slice marked with `# rosetta:` comments.
    Raises ValueError naming the file and line of a bad marker."""
    keys = {c.key for c in CONCEPTS}
    return [
        (key, framework, excerpt)
        for framework, _, package in FRAMEWORKS
        for source in _sources(root, package).values()
        for key, excerpt in source.slices(keys)
    ]


def excerpts(root: Path = ROOT, cuts: Cuts = CUTS) -> dict[str, dict[str, list[Excerpt]]]:
    """concept key -> framework key -> its excerpts in file order (files in IMPL_FILES order),
    for every concept and framework: the definitions `cuts` names and the slices marked in the
    files. Raises ValueError as named() and marked() do, or naming the concept a framework
    lacks."""
    table: dict[str, dict[str, list[Excerpt]]] = {
        c.key: {f: [] for f, _, _ in FRAMEWORKS} for c in CONCEPTS
    }
    for key, framework, excerpt in named(root, cuts) + marked(root):
        table[key][framework].append(excerpt)
    order = {
        f"{package}/{name}": i for _, _, package in FRAMEWORKS for i, name in enumerate(IMPL_FILES)
    }
    for panes in table.values():
        for found in panes.values():
            found.sort(key=lambda e: (order[e.path], e.first_line))
    missing = [f"{c}/{f}" for c, panes in table.items() for f, found in panes.items() if not found]
    if missing:
        raise ValueError(f"no excerpt for {', '.join(missing)}")
    return table
