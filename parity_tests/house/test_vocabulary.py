"""One vocabulary (docs/DESIGN.md): the three implementations have the same public names, in the
same order, with the same parameter names, except where a framework's idiom asks otherwise.

The modules are parsed, not imported, so this runs without any framework. Every exception is
in the two tables below, each with its reason; anything else that differs fails.
"""

from __future__ import annotations

import ast
import copy

import pytest

from parity_tests.paths import ROOT

IMPLS = ("torch_impl", "tf_impl", "jax_impl")
MODULES = ("model", "decode", "train", "weights", "backend")
# The adapter classes carry their framework's name (TorchModel, KerasModel, FlaxModel): the
# prefix is compared away, the rest of the name must agree.
PREFIX = {"torch_impl": "Torch", "tf_impl": "Keras", "jax_impl": "Flax"}
# torch's forward, Keras's call and NNX's __call__ are the same method.
CALL_NAMES = {"forward": "__call__", "call": "__call__"}
# Parameters that are the framework's own wherever they appear (docs/DESIGN.md, "One vocabulary").
IDIOM_PARAMS = {"self", "cls", "rngs", "dtype", "name", "training", "kwargs", "device"}
# Keras's layer protocol: a Keras layer (model.py) or schedule (train.py) has these, and a torch
# or NNX module has no counterpart. (A backend's `build` is the adapter's and is compared.)
KERAS_PROTOCOL = {"build", "get_config", "from_config"}
KERAS_MODULES = {"model", "train"}

# (implementation, "module.Name" or "module.Class.method") -> why only that implementation has it.
TORCH_STATE_DICT = "torch's native container is the state_dict; these map it to and from canonical"
KERAS_PATHS = "Keras addresses variables by path inside the built model; these map the paths"
ONLY_IN: dict[tuple[str, str], str] = {
    ("tf_impl", "model.repeat_key_value_heads"): "Keras 3.15's ops.dot_product_attention fails "
    "on TensorFlow for one key/value head (multi-query); the heads are repeated first, as Keras's "
    "own GroupedQueryAttention does (torch's SDPA takes enable_gqa, jax.nn's fewer heads)",
    # model.py
    ("torch_impl", "model.LayerCache"): "torch decodes in eager Python: a layer's cache is a "
    "dataclass of buffers that write_cache fills in place; tf.function and jax.jit take a cache "
    "as a nested dict of arrays",
    ("tf_impl", "model.HeadProjection"): "Keras 3.15's TensorFlow ops.add adds a per-head bias "
    "along the wrong axis; this EinsumDense adds it with +",
    ("tf_impl", "model.HeadProjection.__call__"): "the call of that workaround",
    ("jax_impl", "model.Transformer.table"): "NNX keeps a shared table as one nnx.Param on the "
    "Transformer, found by its canonical name and passed down",
    # decode.py: the compiled wrappers are each framework's own way of compiling a step
    ("tf_impl", "decode.step_function"): "tf.function (optionally XLA) of decode_step",
    ("tf_impl", "decode.reorder_function"): "tf.function of reorder_cache",
    ("tf_impl", "decode.prefix_function"): "tf.function of prefix_step",
    ("jax_impl", "decode.encode_rows_compiled"): "jax.jit over the module split once (nnx.split)",
    ("jax_impl", "decode.init_cache_compiled"): "jax.jit over the module split once (nnx.split)",
    ("jax_impl", "decode.decode_step_compiled"): "jax.jit over the module split once (nnx.split)",
    ("jax_impl", "decode.prefix_step_compiled"): "jax.jit over the module split once (nnx.split)",
    # train.py
    ("tf_impl", "train.NoamSchedule"): "Keras optimizers take a LearningRateSchedule object",
    ("tf_impl", "train.NoamSchedule.__init__"): "the Keras schedule's constructor",
    ("tf_impl", "train.NoamSchedule.__call__"): "the Keras schedule's rate at a step",
    ("tf_impl", "train.Adam"): "Keras's Adam, subclassed for the paper's placement of epsilon",
    ("tf_impl", "train.Adam.__init__"): "the Keras optimizer's constructor",
    ("tf_impl", "train.Adam.update_step"): "the Keras optimizer's per-variable update",
    # weights.py: each framework's native checkpoint has its own container
    (
        "torch_impl",
        "weights.native_aliases",
    ): "torch's state_dict lists a tied tensor once per name",
    ("torch_impl", "weights.native_shape"): "nn.Linear stores (out, in): the transposed shape",
    ("torch_impl", "weights.tensor_to_native"): "the per-tensor transpose to nn.Linear's layout",
    ("torch_impl", "weights.tensor_to_canonical"): "the per-tensor transpose back",
    ("torch_impl", "weights.state_dict_from_canonical"): TORCH_STATE_DICT,
    ("torch_impl", "weights.canonical_from_state_dict"): TORCH_STATE_DICT,
    ("torch_impl", "weights.TORCH_DTYPES"): "dtype names to torch dtypes",
    ("torch_impl", "weights.transposing_copy"): "only torch stores kernels transposed, so only "
    "its views need a transposing copy (torch's copy_, faster than numpy's tiles)",
    ("torch_impl", "weights.read_state_dict"): "torch checkpoints are pickles: read with "
    "weights_only, also for other models' checkpoints (common/porting)",
    ("tf_impl", "model.CentredLayerNormalization"): "Keras's LayerNormalization formula cancels "
    "where the features are nearly equal (docs/divergences.json, layer_norm_formula_keras): its "
    "weights, the spec's formula",
    ("tf_impl", "model.CentredLayerNormalization.__call__"): "its call, the spec's formula",
    ("tf_impl", "weights.LEAF_RENAMES"): "Keras's leaf names (gamma, beta, embeddings) to ours",
    ("tf_impl", "weights.new_model"): "Keras creates variables in build(): made and built at once",
    ("tf_impl", "weights.canonical_name"): KERAS_PATHS,
    ("tf_impl", "weights.variables_by_name"): KERAS_PATHS,
    ("tf_impl", "weights.KERAS_SUFFIX"): "Keras's save_weights requires the .weights.h5 suffix",
    ("tf_impl", "weights.native_layout"): "the HDF5 paths Keras's save_weights writes",
    ("tf_impl", "weights.save_native"): "Keras's own save_weights of a live model; torch's "
    "torch.save(state_dict) is all of write_native",
    ("tf_impl", "weights.load_native"): "Keras's own load_weights into a new model",
    ("jax_impl", "weights.x64_scope"): "JAX's float64 is a global switch, scoped here",
    ("jax_impl", "weights.param_paths"): "an nnx.Param's state path is its canonical name",
    ("jax_impl", "weights.from_canonical"): "NNX builds a module with its dtype and rngs, then "
    "loads, in one call",
    ("jax_impl", "weights.save_native"): "Flax's msgpack of a live module's nnx.Param state",
    ("jax_impl", "weights.load_native"): "Flax's msgpack restore into a new module",
    # backend.py
    ("torch_impl", "backend.Backend.read_tensors"): "only torch reads other models' checkpoints "
    "(nn.Transformer, Marian .bin) for common/porting",
    ("torch_impl", "backend.Backend.export_onnx"): "only torch ships an ONNX exporter "
    "(torch_impl/onnx_export.py); its graph serves all three",
    ("tf_impl", "backend.tf_device"): "TensorFlow places work by device name ('/GPU:0')",
    ("jax_impl", "backend.jax_device"): "JAX places arrays on jax.Device objects",
    ("tf_impl", "backend.Model.decode_functions"): "the tf.function traces live with their "
    "functions, so that the tests can count retraces",
    ("tf_impl", "backend.Backend.__init__"): "XLA or not is a tf.function argument",
}

# "module.function" -> (parameters that only some implementations take, why).
NNX_SHARED_TABLE = "NNX keeps a shared table as one nnx.Param on the Transformer and passes it "
NNX_SHARED_TABLE += "down as `table`; torch and Keras share one embedding layer object instead"
PARAMS_DIFFER: dict[str, tuple[frozenset[str], str]] = {
    "model.rotary_positions": (
        frozenset({"start"}),
        "tf computes the rows in the graph from a tensor start, so a compiled step does not retrace",
    ),
    "model.Stack.rotary": (
        frozenset({"max_steps"}),
        "torch and JAX slice a float64 rotary table at a start held on the device (traced under "
        "jit) and need its length, while Keras computes the rows in the graph",
    ),
    "model.sinusoidal_positions": (
        frozenset({"start"}),
        "tf computes the rows in the graph from a tensor start, so a compiled step does not retrace",
    ),
    "model.fused_attention": (
        frozenset({"dropout_p"}),
        "torch's SDPA applies attention dropout inside the kernel; the Keras and JAX kernels have "
        "none, and training with attention dropout takes the explicit path",
    ),
    "model.Stack.__init__": (frozenset({"embedding"}), NNX_SHARED_TABLE),
    "model.Encoder.__init__": (frozenset({"embedding"}), NNX_SHARED_TABLE),
    "model.Decoder.__init__": (frozenset({"embedding"}), NNX_SHARED_TABLE),
    "model.Encoder.__call__": (frozenset({"table"}), NNX_SHARED_TABLE),
    "model.Decoder.__call__": (frozenset({"table"}), NNX_SHARED_TABLE),
    "model.Stack.embed": (
        frozenset({"table", "max_steps"}),
        NNX_SHARED_TABLE + "; max_steps: torch and JAX slice a float64 sinusoid table at a start "
        "held on the device (traced under jit) and need its length, while Keras computes rows in "
        "the graph",
    ),
    "train.canonical_grads": (
        frozenset({"grads"}),
        "torch's autograd leaves each gradient on its Parameter's .grad; tf and jax return them",
    ),
    "train.make_optimizer": (
        frozenset({"warmup", "factor", "previous"}),
        "torch writes each step's Noam rate into the optimizer (train_step); Keras takes the "
        "schedule as an argument; an nnx.Optimizer's schedule is static, so a new schedule is a "
        "new optimizer that carries the `previous` moments over",
    ),
    "train.train_step": (
        frozenset({"step", "warmup", "factor"}),
        "torch sets the step's rate itself from the model's lifetime step count",
    ),
    "backend.to_numpy": (
        frozenset({"exact"}),
        "numpy cannot view torch's bfloat16: exact=True goes through ml_dtypes instead of float32",
    ),
    "backend.Model.__init__": (frozenset({"jit_compile"}), "XLA or not is a tf.function argument"),
}


def parse(impl: str, module: str) -> ast.Module:
    return ast.parse((ROOT / impl / f"{module}.py").read_text())


def public(name: str) -> bool:
    return not name.startswith("_") or name in ("__init__", "__call__")


def params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return [n for n in names if n not in IDIOM_PARAMS]


def vocabulary(impl: str, module: str, tree: ast.Module) -> list[tuple[str, list[str] | None]]:
    """The public names of one module in order, as "module.Name" / "module.Class.method", each
    with its parameter names (None for constants and classes)."""
    out: list[tuple[str, list[str] | None]] = []

    def unprefixed(name: str) -> str:
        prefix = PREFIX[impl]
        return name[len(prefix) :] if name.startswith(prefix) and name != prefix else name

    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and public(node.name):
            out.append((f"{module}.{node.name}", params(node)))
        elif isinstance(node, ast.ClassDef) and public(node.name):
            cls = f"{module}.{unprefixed(node.name)}"
            out.append((cls, None))
            for item in node.body:
                if not isinstance(item, ast.FunctionDef) or not public(item.name):
                    continue
                keras = impl == "tf_impl" and module in KERAS_MODULES
                if keras and item.name in KERAS_PROTOCOL:
                    continue
                method = CALL_NAMES.get(item.name, item.name)
                out.append((f"{cls}.{method}", params(item)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and public(t.id) and t.id[0].isupper():
                    out.append((f"{module}.{t.id}", None))
    return out


def differences(trees: dict[str, dict[str, ast.Module]]) -> list[str]:
    """Every way the implementations' vocabularies differ, the exception tables aside."""
    problems = []
    for module in MODULES:
        vocab = {
            impl: [
                (n, p)
                for n, p in vocabulary(impl, module, trees[impl][module])
                if (impl, n) not in ONLY_IN
            ]
            for impl in IMPLS
        }
        orders = {impl: [n for n, _ in v] for impl, v in vocab.items()}
        reference = orders["torch_impl"]
        for impl in IMPLS[1:]:
            if orders[impl] != reference:
                missing = [n for n in reference if n not in orders[impl]]
                extra = [n for n in orders[impl] if n not in reference]
                problems.append(
                    f"{impl}/{module}.py names differ from torch_impl: missing {missing}, "
                    f"extra {extra}" + ("" if missing or extra else ", same names in another order")
                )
        signatures = {impl: dict(v) for impl, v in vocab.items()}
        for name in reference:
            given = {impl: signatures[impl].get(name) for impl in IMPLS if name in signatures[impl]}
            adjusted = {}
            for impl, p in given.items():
                if p is None:
                    continue
                allowed = PARAMS_DIFFER.get(name, (frozenset(), ""))[0]
                adjusted[impl] = [x for x in p if x not in allowed]
            if len({tuple(p) for p in adjusted.values()}) > 1:
                problems.append(f"{name}: parameters differ: {adjusted}")
    return problems


@pytest.fixture(scope="module")
def trees() -> dict[str, dict[str, ast.Module]]:
    return {impl: {m: parse(impl, m) for m in MODULES} for impl in IMPLS}


def test_the_three_implementations_share_one_vocabulary(trees):
    problems = differences(trees)
    assert problems == [], "\n".join(problems)


def test_every_exception_names_something_that_exists(trees):
    """A stale exception would hide nothing today and let a real difference in tomorrow."""
    names = {
        (impl, n) for impl in IMPLS for m in MODULES for n, _ in vocabulary(impl, m, trees[impl][m])
    }
    stale = [key for key in ONLY_IN if key not in names]
    stale += [key for key in PARAMS_DIFFER if ("torch_impl", key) not in names]
    assert stale == []
    # A parameter exception names a parameter that some implementation really has.
    taken = {
        (n, x)
        for impl in IMPLS
        for m in MODULES
        for n, p in vocabulary(impl, m, trees[impl][m])
        for x in p or []
    }
    unused = [
        (n, x) for n, (extra, _) in PARAMS_DIFFER.items() for x in extra if (n, x) not in taken
    ]
    assert unused == []
    assert all(reason for reason in ONLY_IN.values())
    assert all(reason for _, reason in PARAMS_DIFFER.values())


def renamed(tree: ast.Module, old: str, new: str) -> ast.Module:
    tree = copy.deepcopy(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == old:
            node.name = new
        if isinstance(node, ast.arg) and node.arg == old:
            node.arg = new
    return tree


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("model", "decode", "decode_target"),  # a method
        ("model", "key_padding_mask", "padding_mask"),  # a function
        ("model", "return_attention", "need_weights"),  # a parameter
        ("decode", "init_cache", "make_cache"),
        ("train", "label_smoothed_loss", "smoothed_cross_entropy"),
    ],
)
def test_a_rename_in_one_implementation_alone_fails(trees, impl, module, old, new):
    changed = {i: dict(t) for i, t in trees.items()}
    changed[impl][module] = renamed(trees[impl][module], old, new)
    assert changed[impl][module] is not trees[impl][module]
    problems = differences(changed)
    assert problems, f"renaming {old} to {new} in {impl}/{module}.py went unnoticed"
    assert any(new in p or old in p for p in problems), problems


def idiom_marked(lines: list[str], first: int, last: int) -> bool:
    """A `# idiom:` comment on lines first..last (1-based) or on the two lines above them."""
    return any("# idiom:" in line for line in lines[max(first - 3, 0) : last])


def definitions(tree: ast.Module) -> dict[str, tuple[ast.AST, ast.ClassDef | None]]:
    """Every top-level and method definition by its vocabulary name (module prefix aside)."""
    found: dict[str, tuple[ast.AST, ast.ClassDef | None]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = (node, None)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{CALL_NAMES.get(item.name, item.name)}"] = (item, node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    found[t.id] = (node, None)
    return found


def header_end(node: ast.AST) -> int:
    """The last line of a definition's header: its signature, or the whole statement."""
    body = getattr(node, "body", None)
    return body[0].lineno - 1 if body else node.end_lineno


def test_every_difference_is_marked_idiom_where_it_stands(trees):
    """The exceptions above are not only listed here: the code says `# idiom:` at each one."""
    unmarked = []
    for impl, name in ONLY_IN:
        module, _, rest = name.partition(".")
        lines = (ROOT / impl / f"{module}.py").read_text().splitlines()
        found = definitions(trees[impl][module])
        key = next(
            k
            for k in found
            if k.split(".")[-1] == rest.split(".")[-1]
            and k.removeprefix(PREFIX[impl]).endswith(rest.removeprefix(PREFIX[impl]))
        )
        node, owner = found[key]
        marked = idiom_marked(lines, node.lineno, header_end(node))
        if not marked and owner is not None:  # a method of a class marked as a whole
            marked = idiom_marked(lines, owner.lineno, owner.lineno)
        if not marked:
            unmarked.append((impl, name))
    for name, (extra, _) in PARAMS_DIFFER.items():
        module, _, rest = name.partition(".")
        nodes = {}
        for impl in IMPLS:
            found = definitions(trees[impl][module])
            nodes[impl] = next(
                n for k, (n, _) in found.items() if k.removeprefix(PREFIX[impl]) == rest
            )
        for param in sorted(extra):
            args = {
                impl: {a.arg: a for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs}
                for impl, n in nodes.items()
            }
            holders = [impl for impl in IMPLS if param in args[impl]]
            # The side that differs from the majority says why: on the parameter, or on the
            # definition's first line (where it lacks the parameter, or for a group of them).
            minority = (
                holders
                if len(holders) <= len(IMPLS) / 2
                else [impl for impl in IMPLS if impl not in holders]
            )
            for impl in minority:
                lines = (ROOT / impl / f"{module}.py").read_text().splitlines()
                first = nodes[impl].lineno
                line = args[impl][param].lineno if param in args[impl] else first
                if not (idiom_marked(lines, line, line) or idiom_marked(lines, first, first)):
                    unmarked.append((impl, f"{name}({param})"))
    assert unmarked == [], f"differences without an `# idiom:` comment where they stand: {unmarked}"
