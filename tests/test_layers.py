"""The layering of ../shared/STYLE.md: imports point down, the vocabulary imports no torch,
and no package reaches into another's private modules or names."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "remat"

# 1 vocabulary, 2 engine, 3 front ends, 4 tools, 5 the package's re-exports. Keys are
# paths under src/remat (a folder or a module, no suffix); the longest match decides, so a
# folder states its layer once and a file inside it may state its own.
LAYERS = {
    "_vocab": 1,
    "_engine": 2,
    "_front": 3, "nn": 3, "ops": 3, "ms": 3, "_graph": 3, "parallel": 3,
    "memory": 4, "models": 4, "data": 4, "cli": 4, "__main__": 4,
    "planner": 4, "planner/_solve": 1,
    "__init__": 5,
}


def layer_of(module: str) -> int:
    parts = module.split(".")[1:] if module.startswith("remat.") else module.split(".")
    for n in range(len(parts), 0, -1):
        key = "/".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(f"no layer for {module}: add its folder or file to LAYERS")


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
    modules = [".".join(p.relative_to(SRC).with_suffix("").parts) for p in SRC.rglob("*.py")]
    assert [m for m in modules if not _has_layer(m)] == []


def _has_layer(module: str) -> bool:
    try:
        layer_of(module)
    except KeyError:
        return False
    return True


def upward_imports(src: pathlib.Path) -> list[str]:
    upward = []
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).with_suffix("")
        own = layer_of("remat." + ".".join(rel.parts))
        for name, line in remat_imports(path):
            if name.count(".") and layer_of(name) > own:
                upward.append(f"{rel}:{line} imports {name} (layer {layer_of(name)} > {own})")
    return upward


def test_imports_point_down():
    assert upward_imports(SRC) == []


def test_an_upward_import_is_caught(tmp_path):
    (tmp_path / "_engine").mkdir()
    (tmp_path / "_engine" / "region.py").write_text("from remat._engine import state\n")
    assert upward_imports(tmp_path) == []
    (tmp_path / "_engine" / "region.py").write_text("from remat._front.checkpoint import checkpoint\n")
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "profile.py").write_text("import remat.cli.demo\n")
    assert sorted(upward_imports(tmp_path)) == [
        "_engine/region:1 imports remat._front.checkpoint (layer 3 > 2)",
    ]
    (tmp_path / "_engine" / "x.py").write_text("from remat.cli import main\n")
    assert len(upward_imports(tmp_path)) == 2


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_imports(files: dict[str, pathlib.Path]) -> list[str]:
    """Imports of another package's private modules or names, for ``{package: folder}``.

    A package is a folder under ``src/remat`` (``_engine``, ``memory``, ...), a module at its
    root, or a folder outside it (``benchmarks``). Below a package's own name, a module or a
    name that starts with one underscore is private to it: ``remat.memory._step`` and
    ``remat.planner._plan._fit`` are, ``remat._engine.region`` and ``remat.memory.internal``
    (a package's deliberate internal API) are not.
    """
    found = []
    for package, folder in files.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            own = rel.parts[0].removesuffix(".py") if package == "remat" else package
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "remat":
                    targets = [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names if a.name.split(".")[0] == "remat"]
                else:
                    continue
                for target in targets:
                    parts = target.split(".")[1:]
                    if parts and parts[0] != own and any(map(_private, parts[1:])):
                        found.append(f"{package}/{rel.with_suffix('')}:{node.lineno} imports {target}")
    return found


def test_no_package_imports_another_packages_private_names():
    assert private_imports({"remat": SRC, "benchmarks": ROOT / "benchmarks",
                            "examples": ROOT / "examples"}) == []


def test_a_private_import_across_packages_is_caught(tmp_path):
    src, bench = tmp_path / "remat", tmp_path / "bench"
    (src / "planner").mkdir(parents=True)
    bench.mkdir()
    (src / "planner" / "_plan.py").write_text(
        "from remat.planner._trace import find_blocks\n"  # its own package: fine
        "from remat._engine import region\n"              # a layer's package, public module: fine
        "from remat.memory.internal import Step\n"         # the deliberate internal API: fine
    )
    (src / "nn.py").write_text("from remat._front.marks import apply\n")
    (bench / "run.py").write_text("import remat.planner\n")
    assert private_imports({"remat": src, "bench": bench}) == []
    (src / "planner" / "_plan.py").write_text(
        "from remat.memory._step import Step\n"
        "from remat.memory.estimate import _build_in\n"
        "from remat.memory import _step\n"
    )
    (src / "nn.py").write_text("import remat._graph._compare\n")
    (bench / "run.py").write_text("def f():\n    from remat.planner._plan import plan\n")
    assert private_imports({"remat": src, "bench": bench}) == [
        "remat/nn:1 imports remat._graph._compare",
        "remat/planner/_plan:1 imports remat.memory._step.Step",
        "remat/planner/_plan:2 imports remat.memory.estimate._build_in",
        "remat/planner/_plan:3 imports remat.memory._step",
        "bench/run:2 imports remat.planner._plan.plan",
    ]


def test_vocabulary_imports_no_torch():
    vocabulary = [p for p in SRC.rglob("*.py")
                  if layer_of(".".join(p.relative_to(SRC).with_suffix("").parts)) == 1]
    assert len(vocabulary) >= 3
    for path in vocabulary:
        name = path.relative_to(SRC)
        tree = ast.parse(path.read_text())
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not any(m.split(".")[0] == "torch" for m in modules), name


def test_import_remat_is_light():
    code = (
        "import sys, remat; "
        "print(sorted(m for m in ('rich', 'matplotlib', 'scipy', 'torch._dynamo', 'torch._inductor') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
