"""The import contract of docs/design.md ("Layers"), checked on the source.

Serial, no MPI, no torch needed: every module under domainpar/ is parsed (not
imported) and each import it makes, at the top or inside a function (a lazy
import counts: it runs sooner or later), is checked against the floor order
below. A module may import its own floor and the floors beneath it, never one
above. ``domainpar/comm/`` never imports torch, directly or through a domainpar
module that does. ``importlib.import_module`` with a literal name counts as an
import; a name computed at run time cannot be seen here (``domainpar/__init__``
loads its torch names that way, which is why it has a floor of its own).

Also: the MPI launch environment is defined once (domainpar/launch.py) and
tests/run_mpi.py and the Makefile's MPI_RUN_ENV agree with it; the map's floor
table is the order enforced here; nothing points to a map outside the repository.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "domainpar"

# The floors, lowest first (docs/design.md, "Layers"). Names are the first
# component below ``domainpar``; "__init__" is the package itself (the public face).
FLOORS = (
    ("launch", "progress"),     # standalone helpers: the standard library only
    ("comm",),                  # MPI and arrays, no torch
    ("autograd",),              # one Function per communication primitive
    ("tensor",),                # DomainTensor, the dispatch table
    ("ops", "points"),         # the op families' rules; point sets (partition, search)
    ("nn", "balance"),          # DomainParallel; dynamic load balancing
    ("io",),                    # HDF5 blocks, datasets, checkpoints
    ("__init__",),              # ``import domainpar``: re-exports (lazily up to io)
    ("coupling", "testing"),    # the C/Fortran API's Python side; public test helpers
    ("bench", "plan", "demo"),  # the command families
    ("cli",),                   # the command line, the top floor
)
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}
TORCH = ("torch", "functorch", "torchvision")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(anchor: str, level: int, name: str | None) -> str:
    """The absolute name of ``from <.. * level><name>`` written in package ``anchor``."""
    if not level:
        return name or ""
    parts = anchor.split(".")
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _literal_import_module(node: ast.Call, module: str, package: str) -> str | None:
    """The module named by ``importlib.import_module("literal"[, __name__])``."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called != "import_module" or not node.args:
        return None
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    text = first.value
    if not text.startswith("."):
        return text
    anchor = module if len(node.args) > 1 and getattr(node.args[1], "id", "") == "__name__" \
        else package
    level = len(text) - len(text.lstrip("."))
    return _resolve(anchor, level, text.lstrip(".") or None)


@cache
def imports_of(module: str) -> tuple[tuple[str, int], ...]:
    """(imported module, line) for every import in ``module``'s source."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.level, node.module)
            for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules() else base, node.lineno))
        elif isinstance(node, ast.Call):
            name = _literal_import_module(node, module, package)
            if name:
                found.append((name, node.lineno))
    return tuple(dict.fromkeys(found))  # one entry per name and line


def floor_name(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_floor():
    """A new top-level module or subpackage needs its place in the map (and here)."""
    unplaced = sorted({floor_name(m) for m in modules()} - set(FLOOR))
    assert not unplaced, f"domainpar/{unplaced} not in the layer order of docs/design.md"


def upward_imports() -> list[str]:
    problems = []
    for module in modules():
        own = FLOOR[floor_name(module)]
        for target, line in imports_of(module):
            if target.split(".")[0] != "domainpar":
                continue
            if FLOOR.get(floor_name(target), len(FLOORS)) > own:
                problems.append(f"{modules()[module].relative_to(ROOT)}:{line}: {module} "
                                f"(floor {own}) imports {target} "
                                f"(floor {FLOOR.get(floor_name(target), '?')})")
    return problems


def test_no_layer_imports_one_above_it():
    problems = upward_imports()
    assert not problems, "imports running up the layers:\n" + "\n".join(problems)


def torch_paths(start: str) -> list[list[str]]:
    """Chains start -> ... -> a module importing torch, through domainpar modules."""
    paths, seen, todo = [], {start}, [[start]]
    while todo:
        chain = todo.pop()
        for target, _ in imports_of(chain[-1]):
            if target.split(".")[0] in TORCH:
                paths.append(chain + [target])
            elif target in modules() and target not in seen:
                seen.add(target)
                todo.append(chain + [target])
    return paths


def test_comm_never_imports_torch():
    comm = [m for m in modules() if floor_name(m) == "comm"]
    assert comm
    problems = [" -> ".join(chain) for m in comm for chain in torch_paths(m)]
    assert not problems, "comm/ reaches torch:\n" + "\n".join(problems)


def test_launch_is_standard_library_only():
    """tests/run_mpi.py loads domainpar/launch.py from its file, without
    domainpar, mpi4py or torch."""
    outside = [(name, line) for name, line in imports_of("domainpar.launch")
               if name.split(".")[0] not in sys.stdlib_module_names]
    assert not outside, outside


def _run_mpi_module():
    spec = importlib.util.spec_from_file_location("_run_mpi", ROOT / "tests" / "run_mpi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _makefile_env() -> tuple[dict[str, str], dict[str, str]]:
    """MPI_RUN_ENV's VAR=value pairs, and the variables the Makefile exports."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    line = re.search(r"^MPI_RUN_ENV\s*:=(.*)$", text, re.M)
    assert line, "Makefile: MPI_RUN_ENV not found"
    env = dict(pair.split("=", 1) for pair in line.group(1).split())
    exported = dict(re.findall(r"^export (\w+) \??= *(\S+)$", text, re.M))
    return env, exported


def test_launch_environment_defined_once():
    """domainpar/launch.py's LAUNCH_ENV is what tests/run_mpi.py gives its jobs
    and what the Makefile's mpiexec calls get (MPI_RUN_ENV or an export)."""
    from domainpar.launch import LAUNCH_ENV, mpiexec_env
    child = _run_mpi_module().CHILD_ENV
    assert {k: child[k] for k in LAUNCH_ENV if k in child} == LAUNCH_ENV
    assert set(child) - set(LAUNCH_ENV) == {"PYTHONUNBUFFERED"}  # the runner's own addition
    make_env, exported = _makefile_env()
    assert all(LAUNCH_ENV.get(k) == v for k, v in make_env.items()), make_env
    assert {k: {**exported, **make_env}.get(k) for k in LAUNCH_ENV} == LAUNCH_ENV
    env = mpiexec_env({"OMP_NUM_THREADS": "4"})
    assert env == {**LAUNCH_ENV, "OMP_NUM_THREADS": "4"}  # the caller's values win


def test_design_map_lists_the_floors_enforced_here():
    """docs/design.md's floor table is FLOORS: the map and this test change together."""
    text = (ROOT / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, re.M)
    listed = tuple(tuple(re.sub(r"domainpar/(__init__)\.py", r"\1", name).strip("`/ ")
                         for name in cell.split(",")) for _, cell in rows)
    assert [int(n) for n, _ in rows] == list(range(len(FLOORS)))
    assert listed == FLOORS


def test_no_reference_to_a_design_map_outside_the_repository():
    old = "DESIGN" + ".md"  # the map's old name, outside the repository (../shared/)
    files = [p for top in ("domainpar", "tests", "examples") for p in (ROOT / top).rglob("*.py")]
    stale = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(files) + [ROOT / "README.md"]
             for n, line in enumerate(p.read_text().splitlines(), 1) if old in line]
    assert not stale, f"point these to docs/design.md: {stale}"
