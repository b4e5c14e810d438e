"""The package's layers hold (every import runs down the order `LAYERS`, as docs/design.md states it), and there are
no import cycles in dit_accel (with `kernels/`, installed as `dit_accel.kernels`), read from the source.

Every import statement counts, wherever it is: at module level, inside a function (a deferred import
still ties the two modules together), under `if TYPE_CHECKING:`. An import names the module it loads:
`from a.b import c` is `a.b.c` when that is a module, else `a.b` (a package's `__init__` is a module).
Imports built at run time (`importlib.import_module`) are not seen.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The layers, top first: a module imports its own layer or those below, never one above (docs/design.md says what
# each holds). "dit_accel" is the package's root: its public API, above the library it exposes.
LAYERS = (
    ("dit_accel", "__main__", "cli", "commands"),
    ("pipelines", "profiling", "planning"),
    ("patching",),
    ("loading",),
    ("adapters",),
    ("attention",),
    ("seams",),
    ("device", "timing", "run_dir", "headroom", "report_io", "errors", "cache", "quiet", "version", "declared"),
    ("kernels",),
)
SHARED_BY_COMMANDS = "dit_accel.commands.options"  # the one command module the others import
# Source folder -> the package name it installs as (setup.py maps `kernels/` to `dit_accel.kernels`).
PACKAGES = {ROOT / "dit_accel": "dit_accel", ROOT / "kernels": "dit_accel.kernels"}


def modules_in(folder: Path, package: str) -> dict[str, Path]:
    """Every module under `folder` by its dotted name; a package's `__init__.py` is the package."""
    modules = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports, anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: up from the module's package (a package's __init__ is its own package)
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return (found & known) - {name}


def import_graph(packages: dict[Path, str]) -> dict[str, set[str]]:
    """module -> the modules it imports, over every module of `packages` (source folder -> package name)."""
    modules = {name: path for folder, package in packages.items() for name, path in modules_in(folder, package).items()}
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles of `graph`, each as the modules along it, first module repeated at the end; at least one
    for every group of modules that import each other (a depth-first search's back edges)."""
    cycles, state, path = [], {}, []  # state: 1 while on the current path, 2 once done

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def check_no_import_cycles(packages: dict[Path, str]) -> dict[str, set[str]]:
    """The import graph of `packages`; an AssertionError listing each cycle's modules if it has any."""
    graph = import_graph(packages)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)
    return graph


def test_the_package_has_no_import_cycle():
    graph = check_no_import_cycles(PACKAGES)
    assert {"dit_accel", "dit_accel.profiling.session", "dit_accel.kernels.fp8_attention.interface"} <= set(graph)
    assert "dit_accel.profiling.results" in graph["dit_accel.profiling.session"]  # edges are seen


def layer_of(module: str) -> int:
    """The index in LAYERS of the package (or top-level module) `module` belongs to."""
    parts = module.split(".")
    part = "dit_accel" if len(parts) == 1 else parts[1]
    return next(i for i, names in enumerate(LAYERS) if part in names)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs up the layers, and every command module importing another (one command running
    another's code), as "importer -> imported"."""
    found = [f"{module} -> {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
             if layer_of(target) < layer_of(module)]
    found += [f"{module} -> {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
              if module.startswith("dit_accel.commands.") and target.startswith("dit_accel.commands.")
              and target != SHARED_BY_COMMANDS]
    return found


def test_every_import_runs_down_the_layers_with_no_exception():
    graph = import_graph(PACKAGES)
    assert all(layer_of(module) is not None for module in graph)  # every package has its layer
    assert upward_imports(graph) == []


def test_the_layer_check_sees_an_import_up_a_layer_and_a_command_running_another():
    graph = {"dit_accel.attention.routing": {"dit_accel.patching.apply"}, "dit_accel.patching.apply": set(),
             "dit_accel.commands.plan": {"dit_accel.commands.profile_block", "dit_accel.commands.options"},
             "dit_accel.commands.profile_block": set(), "dit_accel.commands.options": set()}
    assert upward_imports(graph) == ["dit_accel.attention.routing -> dit_accel.patching.apply",
                                     "dit_accel.commands.plan -> dit_accel.commands.profile_block"]


def test_the_checker_finds_a_cycle_through_relative_deferred_and_package_imports(tmp_path):
    """A package whose modules import each other the ways dit_accel's do; the same check must fail on it."""
    files = {
        "__init__.py": "",
        "a.py": "from .sub import b\n",  # a submodule, through its package
        "sub/__init__.py": "from .b import VALUE\n",  # a package's __init__ is a module of its own
        "sub/b.py": "VALUE = 1\n\n\ndef later():\n    from .. import c\n    return c\n",  # in a function
        "c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import pkg.a\n",  # for types only
        "d.py": "from .sub import VALUE\n",  # a name, not a module: the package that holds it
    }
    for relative, text in files.items():
        (tmp_path / "pkg" / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / relative).write_text(text)
    packages = {tmp_path / "pkg": "pkg"}
    assert import_graph(packages) == {"pkg": set(), "pkg.a": {"pkg.sub.b"}, "pkg.sub": {"pkg.sub.b"},
                                      "pkg.sub.b": {"pkg.c"}, "pkg.c": {"pkg.a"}, "pkg.d": {"pkg.sub"}}
    with pytest.raises(AssertionError, match=r"import cycles:\s+pkg\.a -> pkg\.sub\.b -> pkg\.c -> pkg\.a\n"):
        check_no_import_cycles(packages)
    (tmp_path / "pkg" / "c.py").write_text("VALUE = 2\n")  # the cycle broken
    check_no_import_cycles(packages)
