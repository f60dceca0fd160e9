"""consumer/'s import structure (issue 37): floors point down, and nothing imports in a circle.

``FLOORS`` lists consumer/'s parts from the top floor down; README.md's layout paragraph lists the same (checked
below). A part is a subpackage, a top-level module, or, for ``ops`` (the commands at the top, the instruments that
every wing reports through near the bottom), a module of ``ops``. A module may import from its own floor or any
floor below it, never from one above. And no two modules, nor two parts, may import each other, however
indirectly. Every import counts: those under ``if TYPE_CHECKING`` (a type is a dependency too, and a circle hidden
there is still one), and those inside functions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kinference.consumer"

FLOORS: tuple[tuple[str, ...], ...] = (
    ("__init__", "ops", "ops.cli", "ops.supervisor", "ops.topics"),  # the commands; the two packages' docstrings
    ("service",),  # wires the path to delivery, owns start and stop
    ("path",),  # the request path: hands each answered request down to delivery
    ("delivery", "accelerator"),  # answers to the broker; the device process and the workers' links to it
    ("ops.tracing", "ops.logs", "ops.lag", "ops.endpoints"),  # instruments that read a Request
    ("ledger",),  # the ground floor: the Request, the ledgers, the byte budget, the commit side of both modes
    ("ops.metrics", "wire", "brokers"),  # what the ledger counts with; value formats; local brokers
    ("config",),
    ("types",),
)
"""consumer/'s parts, the top floor first."""


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """consumer/'s modules, by name below ``kinference.consumer`` (``path.source``; a package by its own name,
    ``path``; the package itself as ``__init__``)."""
    found = {}
    for file in sorted((root / "consumer").rglob("*.py")):
        parts = file.relative_to(root / "consumer").with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name or "__init__"] = file
    return found


def imports(file: Path, modules: set[str]) -> set[str]:
    """The consumer/ modules that ``file`` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            # ``from package import module``: that module; ``from module import name``: that module (``_owner``).
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                found.add(_owner(name.removeprefix(PACKAGE).lstrip(".") or "__init__", modules))
    return found


def _owner(name: str, modules: set[str]) -> str:
    """The module ``name`` is, or is in (``path.source.Source`` -> ``path.source``)."""
    while name not in modules:
        name = name.rpartition(".")[0] or "__init__"
    return name


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    return {module: imports(file, set(files)) - {module} for module, file in files.items()}


def part_of(module: str) -> str:
    """The part of ``FLOORS`` a module belongs to: the longest that names it or a package above it."""
    parts = [part for floor in FLOORS for part in floor if module == part or module.startswith(part + ".")]
    if not parts:
        raise LookupError(f"{module} is on no floor: add its part to FLOORS (and to README.md's layout)")
    return max(parts, key=len)


def floor_of(part: str) -> int:
    """0 for the top floor."""
    return next(index for index, floor in enumerate(FLOORS) if part in floor)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every node ``start`` imports, directly or through others."""
    found: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in found:
                found.add(target)
                todo.append(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of more than one node that import each other (a strongly connected component), sorted."""
    reach = {node: reachable(graph, node) for node in graph}
    found: list[list[str]] = []
    for node in sorted(graph):
        component = sorted({node} | {other for other in reach[node] if node in reach.get(other, ())})
        if len(component) > 1 and component not in found:
            found.append(component)
    return found


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        part = part_of(module)
        parts.setdefault(part, set()).update(part_of(target) for target in targets)
        parts[part].discard(part)
    return parts


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import from a floor up to a higher one, as ``module -> module``."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if floor_of(part_of(target)) < floor_of(part_of(module)))


# --- the rules, on consumer/ as it is


def test_every_module_of_consumer_is_on_a_floor_and_every_part_of_the_floors_exists():
    modules = module_files()
    for module in modules:
        part_of(module)  # raises for a module on no floor
    parts = [part for floor in FLOORS for part in floor]
    assert len(parts) == len(set(parts)), "a part is on two floors"
    assert [part for part in parts if part not in modules] == [], "FLOORS names a part consumer/ does not have"


def test_no_module_of_consumer_imports_from_a_floor_above_its_own():
    assert upward(import_graph()) == []


def test_no_two_modules_of_consumer_import_each_other_however_indirectly():
    assert circles(import_graph()) == []


def test_no_two_parts_of_consumer_import_each_other_however_indirectly():
    assert circles(part_graph(import_graph())) == []


def test_the_request_path_and_delivery_depend_on_each_other_in_one_direction_only():
    """The path hands answered requests to delivery: delivery (and the ledger below both) never imports the path."""
    parts = part_graph(import_graph())
    assert "path" not in parts["delivery"] and "path" not in parts["ledger"] and "delivery" not in parts["ledger"]


def test_readme_lists_the_floors_of_this_test():
    """README.md's layout paragraph names the floors, top first, each a line ``- `part`, `part`: what they are``."""
    readme = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"^Its floors, the top first:\n\n(.*?)\n\n", readme, re.M | re.S)
    listed = tuple(tuple(re.findall(r"`([\w.]+)`", line.partition(":")[0])) for line in block.splitlines())
    assert listed == FLOORS


# --- the rules catch what they are for: a small consumer/ of files written here


def write(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = root / "consumer" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def test_a_circle_through_a_type_checking_import_and_one_inside_a_function_are_found(tmp_path):
    root = write(tmp_path, {
        "__init__.py": "",
        "path/__init__.py": "",
        "path/source.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from kinference.consumer.delivery.publisher import Publisher\n",
        "delivery/__init__.py": "",
        "delivery/publisher.py": "def f():\n    from kinference.consumer.path import source\n",
        "types.py": "import kinference.consumer.path.source\n",
    })
    graph = import_graph(root)
    assert graph["types"] == {"path.source"} and graph["delivery.publisher"] == {"path.source"}
    assert circles(graph) == [["delivery.publisher", "path.source"]]
    assert circles(part_graph(graph)) == [["delivery", "path"]]
    assert upward(graph) == ["delivery.publisher -> path.source", "types -> path.source"]


def test_a_circle_between_parts_is_found_where_no_two_modules_form_one(tmp_path):
    root = write(tmp_path, {
        "__init__.py": "",
        "ledger/__init__.py": "",
        "ledger/commit.py": "from kinference.consumer.wire.oip import ServedModel\n",
        "ledger/budget.py": "",
        "wire/__init__.py": "",
        "wire/oip.py": "from kinference.consumer.ledger.budget import ByteBudget\n",
    })
    graph = import_graph(root)
    assert circles(graph) == []
    assert circles(part_graph(graph)) == [["ledger", "wire"]]
    assert upward(graph) == ["wire.oip -> ledger.budget"]


def test_a_module_on_no_floor_is_named(tmp_path):
    with pytest.raises(LookupError, match=r"attic\.old is on no floor"):
        part_of("attic.old")


REQUEST_WRITERS = {"path.request", "path.runner", "path.admission", "path.batcher", "path.pools", "path.stages",
                   "path.results", "path.generations"}
"""Issue 37: the modules that may write a ``Request``: its decoder, and the two runners (a batch model's admission,
batcher and stages; a generative model's ``generations``). Every other step reads it, and says what it found as a
value of its own (the delivery's outcome, ``answers.Delivery.error``; the byte budget's own count)."""


def _a_request(node: ast.expr) -> bool:
    """By this codebase's naming: a ``Request`` is held in a name that says so (``request``, ``requests[0]``,
    ``micro_batch.requests[i]``); other objects with fields of the same names (a ``Delivery``'s ``error``) are not."""
    return "request" in ast.unparse(node).lower()


def request_writes(file: Path, fields: set[str]) -> list[str]:
    """Where ``file`` assigns a ``Request`` field (``request.payload = ...``), or calls ``fail`` on a request
    (``request.fail(...)``, ``requests[0].fail(...)``): ``line: source``."""
    source = file.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            written = [t for t in flat if isinstance(t, ast.Attribute) and t.attr in fields and _a_request(t.value)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fail" \
                and _a_request(node.func.value):
            written = [node.func]
        else:
            continue
        found += [f"{t.lineno}: {ast.get_source_segment(source, t)}" for t in written]
    return found


def test_nothing_outside_the_decoder_and_the_runners_writes_a_request():
    from dataclasses import fields

    from kinference.consumer.ledger.request import Request

    names = {field.name for field in fields(Request)}
    files = module_files()
    assert set(files) >= REQUEST_WRITERS, sorted(REQUEST_WRITERS - set(files))
    writes = {name: found for name, file in files.items() if name not in REQUEST_WRITERS
              and (found := request_writes(file, names))}
    assert not writes, f"Request written outside its decoder and runners: {writes}"
    # The check sees what it is for: the decoder and the stages do write requests.
    assert request_writes(files["path.request"], names) and request_writes(files["path.stages"], names)
