"""The layering of ../shared/STYLE.md: imports point down, the vocabulary imports no torch."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "remat"

# 1 vocabulary, 2 engine, 3 front ends, 4 tools
LAYERS = {
    "_errors": 1, "_policy": 1, "_spec": 1,
    "_state": 2, "_rng": 2, "_modes": 2, "_selective": 2, "_outputs": 2, "_region": 2,
    "_reach": 2, "_reentrant": 2,
    "_trace_marks": 2,
    "_checkpoint": 3, "_functional": 3, "_marks": 3, "nn": 3, "ops": 3, "ms": 3, "_graph": 3,
    "memory": 4, "_profile": 4, "_estimate": 4, "models": 4, "data": 4, "_demo": 4, "_bench": 4,
    "_cli_demo": 4, "_cli_bench": 4, "_cli_profile": 4, "cli": 4, "__main__": 4, "__init__": 5,
}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if module.startswith("remat.") else module
    return LAYERS[top]


def remat_imports(path: pathlib.Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("remat"):
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "remat" else [node.module]
            found += [(n, node.lineno) for n in names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("remat")]
    return found


def test_every_module_has_a_layer():
    tops = {p.relative_to(SRC).parts[0].removesuffix(".py") for p in SRC.rglob("*.py")}
    assert tops - set(LAYERS) == set()


def test_imports_point_down():
    upward = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("")
        own = layer_of("remat." + ".".join(rel.parts))
        for name, line in remat_imports(path):
            if name.count(".") and layer_of(name) > own:
                upward.append(f"{rel}:{line} imports {name} (layer {layer_of(name)} > {own})")
    assert upward == []


def test_vocabulary_imports_no_torch():
    for name in ("_errors", "_policy", "_spec"):
        tree = ast.parse((SRC / f"{name}.py").read_text())
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not any(m.split(".")[0] == "torch" for m in modules), name


def test_import_remat_is_light():
    code = (
        "import sys, remat; "
        "print(sorted(m for m in ('rich', 'matplotlib', 'torch._dynamo', 'torch._inductor') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
