"""One vocabulary (docs/DESIGN.md): the three implementations have the same public names, in the
same order, with the same parameter names, except where a framework's idiom asks otherwise.

The modules are parsed, not imported, so this runs without any framework. Every exception is
in the two tables below, each with its reason; anything else that differs fails.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("torch_impl", "tf_impl", "jax_impl")
MODULES = ("model", "decode", "train", "weights", "backend")
# The adapter classes carry their framework's name (TorchModel, KerasModel, FlaxModel): the
# prefix is compared away, the rest of the name must agree.
PREFIX = {"torch_impl": "Torch", "tf_impl": "Keras", "jax_impl": "Flax"}
# torch's forward, Keras's call and NNX's __call__ are the same method.
CALL_NAMES = {"forward": "__call__", "call": "__call__"}
# Parameters that are the framework's own wherever they appear (docs/DESIGN.md, "One vocabulary").
IDIOM_PARAMS = {"self", "cls", "rngs", "dtype", "name", "training", "kwargs", "device"}
# Keras's layer protocol: a Keras layer has these and a torch or NNX module has no counterpart.
KERAS_PROTOCOL = {"build", "get_config", "from_config"}

# (implementation, "module.Name" or "module.Class.method") -> why only that implementation has it.
ONLY_IN: dict[tuple[str, str], str] = {}

# (implementation, "module.function") -> (its extra or missing parameters, why).
PARAMS_DIFFER: dict[tuple[str, str], tuple[frozenset[str], str]] = {}


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
                if impl == "tf_impl" and item.name in KERAS_PROTOCOL:
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
            given = {
                impl: signatures[impl].get(name) for impl in IMPLS if name in signatures[impl]
            }
            adjusted = {}
            for impl, p in given.items():
                if p is None:
                    continue
                allowed = PARAMS_DIFFER.get((impl, name), (frozenset(), ""))[0]
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
    stale = [key for key in list(ONLY_IN) + list(PARAMS_DIFFER) if key not in names]
    assert stale == []
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
