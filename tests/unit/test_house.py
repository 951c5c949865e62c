"""The layout's rules, checked on the code's own imports (DESIGN.md section 2, README "How
it works"): which layer may never import which, no import circles, no module that has
grown past one concern's size, and one owner thread for the delivery core."""

from __future__ import annotations

import ast
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from servicebus.core.owner import WrongThread

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "servicebus"
MAX_LINES = 450

# Each layer: the modules (files or folders under servicebus/) it is made of.
PARTS = {
    "Face": ["__init__.py", "bus.py", "busstate.py", "aio.py", "lifecycle.py"],
    "Engine": ["engine/"],
    "Core": ["core/"],
    "Wire": ["wire/"],
    "Store": ["store/"],
    "Records": ["model/"],
    "Handling": ["handling/"],
    "Hooks": ["hooks/"],
    "Ops": ["ops/"],
    "Audit": ["audit/"],
    "Testing": ["testing/"],
    "Outbox": ["sql/", "sql.py"],
    "Gateway": ["gateway/"],
    "Console": ["console/"],
    "Serving": ["aioserve.py"],  # the HTTP fronts' loop on a thread (gateway, console)
    "Errors": ["errors.py"],
}
# (from, to, why): no module of the first layer may import one of the second, directly or
# through modules that belong to no layer.
NEVER = [
    ("Core", "Engine", "the core is driven, it drives nothing"),
    ("Core", "Store", "the state machine sees the store only through its ports"),
    ("Core", "Handling", "the core hands off; it does not run handlers"),
    ("Wire", "Engine", "the wire format knows no loop"),
    ("Wire", "Store", "the wire format knows no disk"),
    ("Store", "Engine", "storage knows nothing of the loop"),
    ("Store", "Wire", "storage does not decode frames"),
    ("Handling", "Engine", "handler threads do not reach into the loop"),
    ("Handling", "Core", "handler threads do not touch the core's state"),
    ("Hooks", "Engine", "observers never drive the loop"),
    ("Hooks", "Face", "observers never reach into the bus"),
    ("Audit", "Engine", "the pipeline reads journals, never runs a bus"),
    ("Audit", "Face", "the pipeline reads journals, never runs a bus"),
    ("Ops", "Engine", "offline tools never start a bus"),
    ("Face", "Ops", "the bus does not import the operators' tools"),
    ("Gateway", "Engine", "the gateway is a client of the bus's public API"),
    ("Gateway", "Core", "the gateway is a client of the bus's public API"),
    ("Gateway", "Store", "the gateway keeps its state in the bus's kv, through the API"),
    ("Face", "Gateway", "the bus does not depend on its HTTP front"),
    ("Console", "Engine", "the console reads and acts through the admin endpoint and the ops"),
    ("Console", "Core", "the console reads and acts through the admin endpoint and the ops"),
    ("Console", "Store", "the console reads and acts through the admin endpoint and the ops"),
    ("Face", "Console", "the bus does not depend on its console"),
    ("Serving", "Face", "a loop on a thread knows nothing of what it serves"),
]
# Third-party imports a layer must never make: the sans-IO layers know no sockets or disk.
NEVER_EXTERNAL = [
    ("Core", "zmq"), ("Core", "plyvel"), ("Wire", "zmq"), ("Wire", "plyvel"),
    ("Records", "zmq"), ("Records", "plyvel"), ("Handling", "zmq"), ("Hooks", "zmq"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every module ``name`` imports, anywhere in it (function bodies and TYPE_CHECKING
    blocks too: a type-only import is still a tie between two layers)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            for alias in node.names:  # "from pkg import module"
                if f"{module}.{alias.name}" in MODULES:
                    found.add(f"{module}.{alias.name}")
    # A module importing servicebus.x.y also runs servicebus.x's __init__.
    for module in list(found):
        while "." in module:
            module = module.rpartition(".")[0]
            if module in MODULES and module != "servicebus":
                found.add(module)
    return {m for m in found if m != name}


def _part(name: str) -> str | None:
    rel = MODULES[name].relative_to(PACKAGE).as_posix()
    best, length = None, -1
    for part, places in PARTS.items():
        for place in places:
            if (rel.startswith(place) if place.endswith("/") else rel == place) and len(place) > length:
                best, length = part, len(place)
    return best


GRAPH = {name: {m for m in _imports(name) if m in MODULES} for name in MODULES}
EXTERNAL = {name: {m.split(".")[0] for m in _imports(name) if not m.startswith("servicebus")}
            for name in MODULES}


def _reach(start: str) -> set[str]:
    """Modules ``start`` imports, following modules that belong to no layer."""
    seen, todo = set(), list(GRAPH[start])
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if _part(name) is None:
            todo.extend(GRAPH[name])
    return seen


@pytest.mark.parametrize("source,target,why", NEVER, ids=[f"{a}->{b}" for a, b, _ in NEVER])
def test_a_layer_never_imports_what_the_design_forbids(source, target, why):
    broken = sorted(f"{name} -> {other}" for name in MODULES if _part(name) == source
                    for other in _reach(name) if _part(other) == target)
    assert not broken, f"{source} must never import {target} ({why}): {broken}"


def test_the_sans_io_layers_import_neither_zmq_nor_plyvel():
    broken = sorted(f"{name} imports {lib}" for part, lib in NEVER_EXTERNAL
                    for name in MODULES if _part(name) == part and lib in EXTERNAL[name])
    assert not broken


def test_every_module_belongs_to_a_layer_but_the_fork_guard():
    assert sorted(name for name in MODULES if _part(name) is None) == ["servicebus.forks"]


def test_no_modules_import_each_other_in_a_circle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(name: str) -> None:  # Tarjan's strongly connected components
        index[name] = low[name] = counter[0]
        counter[0] += 1
        stack.append(name)
        on_stack.add(name)
        for other in GRAPH[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in on_stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == name:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for name in sorted(MODULES):
        if name not in index:
            visit(name)
    # A package's __init__ importing its own modules, which import siblings through the
    # package, is how packages are made, not a circle between concerns.
    circles = [c for c in circles if not _only_package_faces(c)]
    assert not circles, f"import circles: {circles}"


def _only_package_faces(group: list[str]) -> bool:
    """A circle whose only back edge is a module importing its own package's __init__."""
    inits = [m for m in group if MODULES[m].name == "__init__.py"]
    if not inits:
        return False
    rest = [m for m in group if m not in inits]
    sub = {m: {o for o in GRAPH[m] if o in rest} for m in rest}
    seen: set[str] = set()

    def cyclic(node: str, path: set[str]) -> bool:
        if node in path:
            return True
        if node in seen:
            return False
        seen.add(node)
        return any(cyclic(o, path | {node}) for o in sub[node])
    return not any(cyclic(m, set()) for m in rest)


def test_no_module_has_grown_past_one_concern():
    big = sorted((len(path.read_text().splitlines()), name) for name, path in MODULES.items()
                 if len(path.read_text().splitlines()) > MAX_LINES)
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_a_core_touched_by_any_thread_but_its_engine_raises(make_bus):
    bus = make_bus("owner")
    core = bus._engine.core
    with pytest.raises(WrongThread, match="only the engine thread"):
        core.idle()
    with pytest.raises(WrongThread):
        core.s.counters["sent"]
    got: list[BaseException] = []

    def elsewhere() -> None:
        try:
            core.snapshot(0.0)
        except BaseException as exc:  # noqa: BLE001
            got.append(exc)
    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert got and isinstance(got[0], WrongThread)
    assert bus.status().running  # the engine's own calls go on


def test_without_the_debug_flag_a_core_checks_nothing(monkeypatch):
    from servicebus.core.machine import Core
    from servicebus.testing import Network

    monkeypatch.delenv("SERVICEBUS_CHECK_THREADS")
    node = Network().node("plain")
    assert type(node.core) is Core
    node.core.bind_owner()
    done: list[bool] = []
    thread = threading.Thread(target=lambda: done.append(node.core.idle()))
    thread.start()
    thread.join()
    assert done == [True]


def test_layers_map_every_part_to_code_that_exists():
    names = defaultdict(list)
    for name in MODULES:
        names[_part(name)].append(name)
    assert all(names[part] for part in PARTS if part != "Outbox" or (PACKAGE / "sql").exists()
               or (PACKAGE / "sql.py").exists())
