"""The package rules of docs/architecture.md, checked on the import statements and in a fresh interpreter;
and that document's floors and "may import" column, drawn from the same import statements."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cakemp

PACKAGE = Path(cakemp.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
# package -> the cakemp packages it must never import (front and device are siblings joined by ipc).
NEVER = {
    "checkpoint": {"model", "compute", "device", "front", "setup", "master", "ipc", "wire", "demo"},
    "wire": {"model", "compute", "device", "front", "setup", "master", "ipc", "checkpoint", "demo"},
    "ipc": {"model", "compute", "device", "front", "setup", "master", "demo"},
    "model": {"compute", "device", "front", "setup", "master", "ipc", "wire", "demo"},
    "compute": {"device", "front", "setup", "master", "ipc", "demo"},
    "device": {"front", "setup", "master", "demo", "model"},
    "setup": {"model", "compute", "device", "front", "master", "ipc", "demo"},
    "front": {"model", "compute", "device", "master", "demo"},
    "master": {"device", "front", "setup", "demo"},
}


def units() -> dict[str, str]:
    """cakemp's packages and top-level modules (not __init__.py: the package itself), each name -> how
    docs/architecture.md writes it: {"front": "front/", "cli": "cli.py", ...}."""
    return {path.stem: path.name if path.is_file() else f"{path.name}/"
            for path in PACKAGE.iterdir() if path.name != "__init__.py"
            and (path.suffix == ".py" or (path / "__init__.py").is_file())}


def cakemp_imports(path: Path) -> set[str]:
    """The top-level cakemp packages (or modules) an import statement in `path` names, in either form:
    `import cakemp.wire.codec`, `from cakemp.wire import codec`, `from cakemp import log`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [f"cakemp.{a.name}" for a in node.names] if node.module == "cakemp" else [node.module or ""]
        else:
            modules = []
        names |= {m.split(".")[1] for m in modules if m.startswith("cakemp.")}
    return names & set(units())  # `from cakemp import __version__` names no unit


def imports() -> dict[str, set[str]]:
    """Each unit -> the other units its modules import."""
    graph: dict[str, set[str]] = {}
    for name, written in units().items():
        paths = (PACKAGE / name).rglob("*.py") if written.endswith("/") else [PACKAGE / written]
        graph[name] = set().union(*map(cakemp_imports, paths)) - {name}
    return graph


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each unit's floor: 1 if it imports no other unit, else 1 + the highest floor of those it imports."""
    floor: dict[str, int] = {}
    while len(floor) < len(graph):
        ready = {name: 1 + max((floor[d] for d in deps), default=0)
                 for name, deps in graph.items() if name not in floor and deps <= floor.keys()}
        assert ready, f"an import cycle among {sorted(graph.keys() - floor.keys())}"
        floor |= ready
    return floor


def doc_rows() -> dict[str, dict[str, str]]:
    """The rows of docs/architecture.md's tables that have a "may import" column: the unit a row's first
    cell names (`front/`, `cli.py`) -> its cells by column heading. A unit in two rows is an error."""
    rows: dict[str, dict[str, str]] = {}
    table: list[list[str]] = []
    for line in [*ARCHITECTURE.read_text().splitlines(), ""]:
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if table and "may import" in table[0]:
            for cells in table[2:]:  # past the heading and the |---| line
                name = cells[0].strip("`").removesuffix("/").removesuffix(".py")
                assert name not in rows, f"docs/architecture.md: {cells[0]} has two rows"
                rows[name] = dict(zip(table[0], cells))
        table = []
    return rows


def listed(cell: str) -> set[str]:
    """The units a "may import" cell names: `errors, op`; `—` for none."""
    names = {n.strip(" `").removesuffix("/").removesuffix(".py") for n in cell.split(",")}
    return names - {"—"}


def test_no_package_imports_what_its_rule_forbids():
    """No module of a package in NEVER has an import statement naming a package it must not use."""
    broken = [f"{path.relative_to(PACKAGE)} imports cakemp.{name}"
              for package, forbidden in NEVER.items() for path in (PACKAGE / package).rglob("*.py")
              for name in cakemp_imports(path) & forbidden]
    assert broken == []


def test_front_and_setup_load_no_device_model_or_torch():
    """A fresh interpreter that imports cakemp.front and cakemp.setup has loaded no cakemp.device,
    cakemp.model or cakemp.compute module, and no torch, diffusers or transformers (the image
    components' admission, flags and file location included)."""
    code = ("import sys, cakemp.front, cakemp.setup, cakemp.checkpoint.config, cakemp.front.component_admission; "
            "print(' '.join(sorted(m for m in sys.modules if m in ('torch', 'diffusers', 'transformers') or "
            "m.startswith(('cakemp.device', 'cakemp.model', 'cakemp.compute')))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_no_function_in_the_package_is_over_60_lines():
    """Every function and method of cakemp, from its def to its last line (docstring included), is at
    most 60 lines: past that, a newcomer reads several steps in one body."""
    long = [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60]
    assert long == []


def test_architecture_draws_the_floors_the_imports_make():
    """docs/architecture.md's floors block is the one the import statements give: each package and
    module one floor above the highest of what it imports (so nothing imports upward or in a circle)."""
    written, floor = units(), floors(imports())
    drawn = [f"floor {n}   " + "  ".join(sorted(written[name] for name in floor if floor[name] == n))
             for n in range(max(floor.values()), 0, -1)]
    in_doc = [line.strip() for line in ARCHITECTURE.read_text().splitlines() if line.strip().startswith("floor ")]
    assert in_doc == drawn, "docs/architecture.md's floors block should read:\n" + "\n".join(drawn)


def test_architecture_may_import_is_what_each_unit_imports():
    """Every cakemp package and top-level module has one row in docs/architecture.md's tables, and its
    "may import" cell names exactly the packages and modules it imports: a new import, or one dropped,
    changes the document too."""
    rows, graph = doc_rows(), imports()
    differ = [f"{name}: no row" for name in sorted(graph.keys() - rows.keys())]
    differ += [f"{name}: a row, but no such package or module" for name in sorted(rows.keys() - graph.keys())]
    for name in sorted(graph.keys() & rows.keys()):
        cell = listed(rows[name]["may import"])
        if graph[name] - cell:
            differ.append(f"{name}: imports {', '.join(sorted(graph[name] - cell))}, not in its may-import cell")
        if cell - graph[name]:
            differ.append(f"{name}: its may-import cell lists {', '.join(sorted(cell - graph[name]))}, never imported")
    assert not differ, "docs/architecture.md's tables differ from the imports:\n" + "\n".join(differ)


def test_architecture_names_each_subpackage_in_its_row():
    """A package's sub-packages (model/weights/, model/image/, ...) are each named, as `name/`, in what
    its row in docs/architecture.md says it owns."""
    rows = doc_rows()
    unnamed = [f"{sub.relative_to(PACKAGE)}/" for package in PACKAGE.iterdir() if package.name in rows
               for sub in package.iterdir() if (sub / "__init__.py").is_file()
               and f"`{sub.name}/`" not in rows[package.name]["owns"]]
    assert not unnamed, "not named in their package's row of docs/architecture.md: " + ", ".join(unnamed)


# A variant (text or image, a container, a quantized format) is picked by one row of a table
# (READERS, FORMATS, ARCHS, CONTAINERS); everywhere else the code names the protocol, never the union.
# What telling apart looks like:
VARIANT_TYPES = {"Checkpoint", "GgufCheckpoint", "BlockRunner", "ComponentRunner", "LayerAdmission", "Admission",
                 "ComponentAdmission", "GptqParts", "MlxParts", "Gptq", "MlxAffine", "Fp8",
                 "GptqWeight", "MlxWeight", "ResidentExperts", "OffloadedExperts"}  # isinstance(x, T), type(x) is T
VARIANT_SIGNALS = {"is_gguf", "serves_images"}  # read or called


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _listed_types(node: ast.AST) -> list[str]:
    """The names isinstance's second argument lists: T, (A, B) or A | B."""
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _listed_types(element)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _listed_types(node.left) + _listed_types(node.right)
    return [name] if (name := _name(node)) else []


def container_rows() -> set[str]:
    """The names of checkpoint/files.py's Container rows (GGUF, DIRECTORY, ...)."""
    tree = ast.parse((PACKAGE / "checkpoint" / "files.py").read_text())
    return {target.id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and _name(node.value.func) == "Container" for target in node.targets if isinstance(target, ast.Name)}


def variant_branches(path: Path, rows: set[str]) -> set[str]:
    """How the module at `path` tells variants apart: "isinstance T", "is T" (a type or a Container row
    compared), "serves_images", "is_gguf", "prefill_chunk is None" (or is not)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and _name(node.func) == "isinstance" and len(node.args) == 2:
            found |= {f"isinstance {name}" for name in _listed_types(node.args[1]) if name in VARIANT_TYPES}
        elif isinstance(node, ast.Name | ast.Attribute) and _name(node) in VARIANT_SIGNALS:
            found.add(_name(node))
        elif isinstance(node, ast.Compare) and all(isinstance(op, ast.Is | ast.IsNot | ast.Eq | ast.NotEq)
                                                   for op in node.ops):
            names = {_name(operand) for operand in (node.left, *node.comparators)}
            found |= {f"is {name}" for name in names & (VARIANT_TYPES | rows)}
            if any(isinstance(o, ast.Constant) and o.value is None for o in (node.left, *node.comparators)) \
                    and any(name and name.endswith("prefill_chunk") for name in names):
                found.add("prefill_chunk is None")
    return found


def test_variants_are_told_apart_only_where_they_are_picked():
    """No module branches on a variant (an isinstance on a reader, runner, admission or quantization
    type, a Container row compared, is_gguf, serves_images, prefill_chunk is None): each is picked by
    one row of its table (READERS, FORMATS, ARCHS, CONTAINERS) or named by its protocol."""
    rows = container_rows()
    found = [f"{path.relative_to(PACKAGE)}: {', '.join(sorted(kinds))}" for path in sorted(PACKAGE.rglob("*.py"))
             if (kinds := variant_branches(path, rows))]
    assert not found, "variant branches outside the tables that pick them:\n" + "\n".join(found)
