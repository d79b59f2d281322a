"""The plugin package's layers: no module imports one above it, so a change low down never drags Airflow glue in
and the import graph has no cycles. Where a new module goes: a Slurm/Triton text format or other pure half of a
hook -> ``utils/``; a pipeline rule or a task body -> ``pipeline/``; Airflow glue -> the role folders; any path
under the storage root -> ``layout``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "hybridflow"

# Lowest first. A module may import its own layer or any below it, never one above.
LAYERS: list[tuple[str, ...]] = [
    ("hybridflow", "hybridflow.exceptions", "hybridflow.paths", "hybridflow.layout", "hybridflow.atomic"),
    ("hybridflow.utils",),
    ("hybridflow.config",),
    ("hybridflow.hooks",),
    ("hybridflow.triggers",),
    ("hybridflow.notifiers",),
    ("hybridflow.pipeline",),
    ("hybridflow.ui",),
    ("hybridflow.sensors", "hybridflow.operators"),
    ("hybridflow.dag_defaults", "hybridflow.params", "hybridflow.timetables", "hybridflow.provider"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of a module: its longest matching entry (``hybridflow.utils.slurm`` -> ``hybridflow.utils``)."""
    best, depth = -1, -1
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    if best < 0 or (depth == 0 and module != "hybridflow"):
        raise AssertionError(f"{module} has no layer: add it to LAYERS in {Path(__file__).name}")
    return best


def imports_of(path: Path) -> set[str]:
    """Every hybridflow module ``path`` imports, lazy and TYPE_CHECKING imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hybridflow"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("hybridflow")}
    return found


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_the_table_sees_the_package():
    assert {"hybridflow.config", "hybridflow.pipeline.nightly", "hybridflow.utils.slurm"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_one_above_it(module):
    own = layer_of(module)
    above = sorted(dep for dep in imports_of(MODULES[module]) if layer_of(dep) > own)
    assert not above, f"{module} (layer {own}) imports {above} from a higher layer; move the shared code down"


def test_config_depends_only_on_the_layers_below_it():
    deps = imports_of(MODULES["hybridflow.config"])
    assert all(layer_of(dep) < layer_of("hybridflow.config") for dep in deps), deps


def test_the_package_has_no_import_cycle():
    graph = {name: {dep for dep in imports_of(path) if dep in MODULES and dep != name}
             for name, path in MODULES.items()}
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join((*trail[trail.index(name):], name)))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, (*trail, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


@pytest.mark.parametrize(("module", "layer"), [
    ("hybridflow.utils.slurm", 1), ("hybridflow.config", 2), ("hybridflow.hooks.slurm", 3),
    ("hybridflow.pipeline.report", 6), ("hybridflow.operators.triton", 8), ("hybridflow.params", 9),
])
def test_layer_of_reads_the_table(module, layer):
    assert layer_of(module) == layer


def test_an_unplaced_module_is_named():
    with pytest.raises(AssertionError, match="hybridflow.newthing has no layer"):
        layer_of("hybridflow.newthing")
