"""A contract the three implementations share is described once: the same docstring, word for
word, in each (in the spirit of transformers' utils/check_copies.py).

A definition (a top-level function or class, or a method, by its qualified name: torch's
`forward`, Keras's `call` and NNX's `__call__` are one method) that two or more implementations
have is one contract, so its docstring is the same text in each, and a diff of two files shows
only code. What a framework does its own way is said next to that code, in an `# idiom:` comment,
never in the shared docstring. A docstring that must differ goes in ALLOWED_TO_DIFFER, with its
reason.

The modules are parsed, not imported, so this runs without any framework.
"""

from __future__ import annotations

import ast
import copy
import difflib

import pytest

from parity_tests.paths import ROOT

IMPLS = ("torch_impl", "tf_impl", "jax_impl")
# The modules held to one docstring per contract. decode.py, train.py, weights.py and backend.py
# describe their shared functions each in its own words still; add a module here once it is
# aligned.
MODULES = ("model", "precision", "distributed")
# torch's forward, Keras's call and NNX's __call__ are the same method.
CALL_NAMES = {"forward": "__call__", "call": "__call__"}

# ("module.Qualified.name") -> why its docstring differs between the implementations. Empty: every
# shared contract has one description.
ALLOWED_TO_DIFFER: dict[str, str] = {}


def docstrings(tree: ast.Module) -> dict[str, str | None]:
    """Every top-level function and class and every method of a top-level class, by qualified
    name, with its docstring (None where it has none)."""
    found: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = ast.get_docstring(node)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = CALL_NAMES.get(item.name, item.name)
                    found[f"{node.name}.{name}"] = ast.get_docstring(item)
    return found


def drifts(trees: dict[str, dict[str, ast.Module]]) -> list[str]:
    """One message per implementation whose docstring of a shared definition differs from the
    others' (ALLOWED_TO_DIFFER aside), naming the definition and showing the diff against the
    text most of its holders have (the first holder's on a tie)."""
    problems = []
    for module in MODULES:
        docs = {impl: docstrings(trees[impl][module]) for impl in IMPLS if module in trees[impl]}
        names = [name for impl in docs for name in docs[impl]]
        for name in dict.fromkeys(names):  # first-seen order, each once
            holders = [impl for impl in docs if name in docs[impl]]
            if len(holders) < 2 or f"{module}.{name}" in ALLOWED_TO_DIFFER:
                continue
            texts = [docs[impl][name] for impl in holders]
            want = max(texts, key=texts.count)  # the majority's text; max keeps the first on ties
            first = holders[texts.index(want)]
            for impl in holders:
                got = docs[impl][name]
                if got == want:
                    continue
                diff = difflib.unified_diff(
                    (want or "<no docstring>").splitlines(),
                    (got or "<no docstring>").splitlines(),
                    f"{first}/{module}.py {name}",
                    f"{impl}/{module}.py {name}",
                    lineterm="",
                )
                head = f"{module}.{name}: the docstring in {impl} differs from {first}'s"
                problems.append(head + "\n" + "\n".join(diff))
    return problems


@pytest.fixture(scope="module")
def trees() -> dict[str, dict[str, ast.Module]]:
    return {
        impl: {m: ast.parse((ROOT / impl / f"{m}.py").read_text()) for m in MODULES}
        for impl in IMPLS
    }


def test_every_shared_contract_has_one_docstring(trees):
    problems = drifts(trees)
    assert problems == [], "\n\n".join(problems)


def test_the_check_covers_the_shared_contracts(trees):
    """The check compares something: the model's main contracts are shared and documented."""
    shared = set.intersection(*(set(docstrings(trees[impl]["model"])) for impl in IMPLS))
    for name in ("Transformer", "Transformer.__call__", "Decoder.__call__", "write_cache", "pool"):
        assert name in shared, name
        assert docstrings(trees["torch_impl"]["model"])[name], f"{name} has no docstring"
    assert "matmul_precision" in set.intersection(
        *(set(docstrings(trees[impl]["precision"])) for impl in IMPLS)
    )


def test_every_allowed_difference_names_a_shared_definition_and_says_why(trees):
    """A stale entry would hide nothing today and let a real drift in tomorrow."""
    for key, reason in ALLOWED_TO_DIFFER.items():
        module, _, name = key.partition(".")
        holders = [impl for impl in IMPLS if name in docstrings(trees[impl][module])]
        assert len(holders) >= 2, f"{key} is not shared"
        assert reason.strip(), key


def with_docstring(tree: ast.Module, name: str, text: str) -> ast.Module:
    """A copy of tree with the docstring of the definition `name` ("Class.method" or a
    top-level name) replaced by text."""
    tree = copy.deepcopy(tree)
    owner, _, method = name.rpartition(".")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        if owner and isinstance(node, ast.ClassDef) and node.name == owner:
            node = next(
                item
                for item in node.body
                if isinstance(item, ast.FunctionDef)
                and CALL_NAMES.get(item.name, item.name) == method
            )
        elif owner or node.name != name:
            continue
        node.body[0] = ast.Expr(ast.Constant(text))
        return tree
    raise KeyError(name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["Decoder", "MultiHeadAttention.__call__", "write_cache"])
def test_a_docstring_changed_in_one_implementation_alone_fails(trees, impl, name):
    changed = {i: dict(t) for i, t in trees.items()}
    original = docstrings(trees[impl]["model"])[name] or ""
    changed[impl]["model"] = with_docstring(trees[impl]["model"], name, original + " Drifted.")
    problems = drifts(changed)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"model.{name}: the docstring in {impl} differs"), problems[0]
    assert "+" in problems[0] and "Drifted." in problems[0], problems[0]
