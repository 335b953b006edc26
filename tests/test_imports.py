"""The house's import rules, read from the source (every import, those inside functions
included): no two modules import each other, however indirectly; each package imports only
the packages below it; the model and its attention import only torch and the standard
library, so `GPTModel` can be lifted into any training loop."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gptmini"

LAYERS = [
    "core",        # what a reader reads: the book's attention, GPTConfig, GPTModel
    "attention",   # the book's module, context, masks, positions, kernels
    "model",       # GPTConfig, the mixer and feed-forward tables, blocks, GPTModel, FLOPs
    "variants",    # beyond the book, by family: MLA, Gated DeltaNet (named by the tables)
    "tokenizer",
    "threads",
    "runtime",     # the machine: device, precision, peak FLOP/s
    "chat",        # chat templates, rendering, the assistant's mask, chat records
    "finetune",    # LoRA, the class head, vocabulary growth
    "convert",     # Hugging Face layouts <-> GPTModel
    "checkpoint",  # the format; a path to a model and tokenizer
    "data",
    "generate",    # sampling, the loop, the engine, the generate.py command
    "analysis",    # inspection, head roles, plots, evaluation
    "train",
    "serve",
    "testing",     # the conformance kit, the device parity check
]
"""Lowest first: a package may import the packages before it, never one after it."""

ONLY_TORCH = ("core", "attention", "model", "variants")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Every module `path` imports, with the line, wherever the import statement is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from gptmini.attention import masks` imports the module gptmini.attention.masks
            # (the package's __init__ runs first, as it does for any submodule's import)
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            submodules = [name for name in names if name in MODULES]
            found += [(name, node.lineno) for name in submodules]
            if len(submodules) < len(names):
                found.append((node.module, node.lineno))
    return found


def internal_edges() -> dict[str, set[str]]:
    return {name: {m for m, _ in imports_of(path) if m in MODULES and m != name}
            for name, path in MODULES.items()}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gptmini"


def test_every_package_has_a_layer():
    packages = {layer_of(m) for m in MODULES} - {"gptmini", "__main__"}
    assert packages <= set(LAYERS), f"place {sorted(packages - set(LAYERS))} in LAYERS"


def test_no_import_circle_lazy_imports_included():
    edges = internal_edges()
    # Tarjan's strongly connected components: any with two or more modules is a circle.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other: {circles}"


def test_packages_import_only_the_packages_below_them():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for name, path in MODULES.items():
        here = layer_of(name)
        if here not in rank:
            continue
        for module, line in imports_of(path):
            there = layer_of(module) if module in MODULES else None
            if there in rank and rank[there] > rank[here]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here}) imports "
                              f"{module} ({there})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("package", ONLY_TORCH)
def test_model_and_attention_import_only_torch(package):
    stdlib = sys.stdlib_module_names
    foreign = []
    for name, path in MODULES.items():
        if layer_of(name) != package:
            continue
        for module, line in imports_of(path):
            top = module.split(".")[0]
            inside = module in MODULES and layer_of(module) in ONLY_TORCH
            if not (top in stdlib or top == "torch" or inside):
                foreign.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not foreign, "\n".join(foreign)


def test_the_rules_catch_what_they_forbid(tmp_path):
    """The reader itself: an import inside a function counts, and so does a module imported
    by name from its package."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from gptmini.attention import masks, MultiHeadAttention\n"
                      "    import lightning\n")
    found = dict(imports_of(source))
    assert {"gptmini.attention.masks", "gptmini.attention", "lightning"} <= set(found)
    assert found["lightning"] == 3
