"""Names the library's registries declare, read from their source without importing them (no torch, no diffusers):
the choices and --help of the CLI. Each registry stays the one place its names are written; this reads them
there, as `cli` reads each command's help (the tests check every reading against the imported registry).

    family_names()    adapters.FAMILIES' keys, in order (the `name=` of each `Family(...)` it lists)
    backend_names()   attention.backends.BACKENDS' keys, in order (the first argument of each entry)
    stage_keys()      adapters.stage_specs.STAGE_KEYS
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


@functools.cache
def _module(relative: str) -> ast.Module:
    return ast.parse((PACKAGE / relative).read_text(), relative)


def _assigned(relative: str, name: str) -> ast.expr:
    """The expression assigned to the module-level `name` of the module at `relative`."""
    for node in _module(relative).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node.value
    raise LookupError(f"dit_accel/{relative} assigns no {name}")


def _imported_from(relative: str, name: str) -> str:
    """The sibling module (path relative to the package) `name` is imported from in the module at `relative`."""
    folder = Path(relative).parent
    for node in _module(relative).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and any(a.name == name for a in node.names):
            return str(folder / f"{node.module or name}.py")  # `from .families import X`, `from . import wan`
    raise LookupError(f"dit_accel/{relative} imports no {name} from its package")


def _registry_entries(relative: str, name: str) -> list[ast.expr]:
    """The entries of a registry written `{x.name: x for x in (ENTRY, ...)}`."""
    registry = _assigned(relative, name)
    if not isinstance(registry, ast.DictComp) or not isinstance(registry.generators[0].iter, ast.Tuple):
        raise LookupError(f"dit_accel/{relative}: {name} is not written as {{x.name: x for x in (...)}}")
    return registry.generators[0].iter.elts


def _keyword(call: ast.expr, name: str) -> str:
    value = next(k.value for k in call.keywords if k.arg == name)
    return ast.literal_eval(value)


@functools.cache
def family_names() -> tuple[str, ...]:
    """adapters.FAMILIES' keys in its order: each entry a module's `FAMILY` (`minimax_h3.FAMILY`) or a tuple of
    families spread into it (`*GENERIC_FAMILIES`), each family a `Family(name=...)`."""
    init = "adapters/__init__.py"
    names = []
    for entry in _registry_entries(init, "FAMILIES"):
        if isinstance(entry, ast.Starred):
            module = _imported_from(init, entry.value.id)
            calls = _assigned(module, entry.value.id).elts
        else:
            calls = [_assigned(_imported_from(init, entry.value.id), entry.attr)]
        names += [_keyword(call, "name") for call in calls]
    return tuple(names)


@functools.cache
def backend_names() -> tuple[str, ...]:
    """attention.backends.BACKENDS' keys in its order: each entry's first argument, its name."""
    return tuple(ast.literal_eval(call.args[0]) for call in _registry_entries("attention/backends.py", "BACKENDS"))


@functools.cache
def stage_keys() -> tuple[str, ...]:
    return ast.literal_eval(_assigned("adapters/stage_specs.py", "STAGE_KEYS"))
