"""The shape of the project (issues 10, 26): no import cycle, every module states its job and
none is over 600 lines, and packages that load only what they promise."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "broker", "facts", "netkit", "workload_manager", "scheduler", "certs", "plane")
MAX_LINES = 600  # a bound on size; the split a module needs is by job, not by lines


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `line` (anywhere in the module)."""

    source: str
    target: str
    line: int


def modules_of(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of `packages` under `root` by dotted name; a package is its `__init__`."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every import in the module, top level, `if TYPE_CHECKING:` and functions alike: a lazy
    import that dodges a cycle at run time is still a cycle in the design."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            targets = []
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    targets.append(submodule)
                elif base in modules:
                    targets.append(base)
        else:
            continue
        edges += [Edge(name, t, node.lineno) for t in targets if t != name]
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit): components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def import_cycles(root: Path, packages: Iterable[str]) -> list[str]:
    """One line per cycle: its modules, then each import inside it with its line."""
    modules = modules_of(root, packages)
    edges = [e for name, path in modules.items() for e in imports_of(name, path, modules)]
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for edge in edges:
        graph[edge.source].add(edge.target)
    report = []
    for component in strongly_connected(graph):
        members = set(component)
        inside = sorted(
            {f"{e.source}:{e.line} -> {e.target}" for e in edges if {e.source, e.target} <= members}
        )
        report.append(f"cycle {' <-> '.join(component)}: {'; '.join(inside)}")
    return report


# The layers, bottom first (docs/architecture.md, "The map"): a module may import only from
# its own layer and those before it. `agent.X` is the sub-package (or module) agent/X.
LAYERS = (
    "certs",
    "scheduler",
    "netkit",
    "workload_manager",
    "facts",
    "broker",
    "plane",
    "agent.core",
    "agent.mock",
    "agent.engines",
    "agent.config",
    "agent.cluster",
    "agent.artifacts",
    "agent.serving",
    "agent.plane_link",
    "agent.metrics",
    "agent.apis",
    "agent.app",
    "agent.cli",
    "agent",  # __init__ and __main__: `python -m agent`
)

# The pure cores: decisions without I/O, tested in memory. Nothing they load, directly or
# through our other modules, may be an event loop, a web framework or a database driver.
PURE_CORES = (
    "netkit.backoff",
    "workload_manager.relay",
    "workload_manager.jsonrpc",
    "workload_manager.outbox",
    "facts.membership",
    "broker.anti_entropy",
    "facts.probing",
    "facts.record_deltas",
    "facts.signed_set",
    "facts.artifacts",
    "facts.artifact_fetch",
    "facts.kept",
    "facts.wire",
    "facts.key_limits",
    "broker.channel",
    "broker.restarts",
    "scheduler.rank",
    "scheduler.place",
    "scheduler.replicas",
    "scheduler.reconcile",
    "scheduler.prefix",
    "scheduler.scale",
    "plane.placement.decide",
    "agent.serving.wait_line",
    "agent.serving.lifecycle",
    "agent.serving.usage",
    "agent.serving.rate_limit",
)
IMPURE = frozenset({"asyncio", "aiohttp", "sqlite3", "aiosqlite", "psycopg", "psycopg_pool"})


def layer_of(module: str, layers: tuple[str, ...]) -> str:
    """The longest layer name that is `module` or a package holding it."""
    held = [layer for layer in layers if module == layer or module.startswith(layer + ".")]
    assert held, f"{module} is in no layer: add it to LAYERS"
    return max(held, key=len)


def upward_imports(root: Path, packages: Iterable[str], layers: tuple[str, ...]) -> list[str]:
    """Every import of a module from a layer after its own, with its line."""
    modules = modules_of(root, packages)
    rank = {layer: i for i, layer in enumerate(layers)}
    found = []
    for name, path in modules.items():
        for edge in imports_of(name, path, modules):
            source, target = layer_of(edge.source, layers), layer_of(edge.target, layers)
            if rank[target] > rank[source]:
                found.append(f"{edge.source}:{edge.line} -> {edge.target} ({source} < {target})")
    return sorted(found)


def impure_loads(root: Path, packages: Iterable[str], cores: Iterable[str]) -> list[str]:
    """For each core, what it loads (itself or through our modules) of `IMPURE`."""
    modules = modules_of(root, packages)
    found = []
    for core in cores:
        seen, todo = {core}, [core]
        while todo:
            name = todo.pop()
            for node in ast.walk(ast.parse(modules[name].read_text())):
                if isinstance(node, ast.Import):
                    loaded = {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    loaded = {node.module.split(".")[0]}
                else:
                    continue
                found += [f"{core}: {name} imports {m}" for m in sorted(loaded & IMPURE)]
            for edge in imports_of(name, modules[name], modules):
                if edge.target not in seen:
                    seen.add(edge.target)
                    todo.append(edge.target)
    return found


def test_no_import_goes_up_a_layer() -> None:
    upward = upward_imports(ROOT, PACKAGES, LAYERS)
    assert not upward, "imports from a later layer:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_import_that_goes_up(tmp_path: Path) -> None:
    # The control for the test above: two layers, the lower one importing the upper.
    (tmp_path / "low").mkdir()
    (tmp_path / "high").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("")
    (tmp_path / "high" / "__init__.py").write_text("")
    (tmp_path / "low" / "base.py").write_text("def f():\n    from high import top\n")
    (tmp_path / "high" / "top.py").write_text("from low import base\n")
    assert upward_imports(tmp_path, ["low", "high"], ("low", "high")) == [
        "low.base:2 -> high.top (low < high)"
    ]
    (tmp_path / "low" / "base.py").write_text("X = 1\n")
    assert upward_imports(tmp_path, ["low", "high"], ("low", "high")) == []


def test_the_pure_cores_load_no_event_loop_web_framework_or_database() -> None:
    loads = impure_loads(ROOT, PACKAGES, PURE_CORES)
    assert not loads, "pure cores loading I/O:\n" + "\n".join(loads)


def test_the_purity_check_follows_our_imports(tmp_path: Path) -> None:
    # The control: a core that is pure itself but imports a module of ours that loads aiohttp.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "core.py").write_text("import enum\nfrom pkg.helper import X\n")
    (tmp_path / "pkg" / "helper.py").write_text("import aiohttp\nX = 1\n")
    assert impure_loads(tmp_path, ["pkg"], ["pkg.core"]) == ["pkg.core: pkg.helper imports aiohttp"]
    (tmp_path / "pkg" / "helper.py").write_text("X = 1\n")
    assert impure_loads(tmp_path, ["pkg"], ["pkg.core"]) == []


def test_no_import_cycle() -> None:
    cycles = import_cycles(ROOT, PACKAGES)
    assert not cycles, "import cycles (TYPE_CHECKING and lazy imports count):\n" + "\n".join(cycles)


def test_the_cycle_finder_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    # The control for the test above: a finder that saw nothing would pass it forever.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .base import Base\n")
    (package / "base.py").write_text("class Base: ...\n")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"
    )
    (package / "c.py").write_text("import pkg.base\nfrom . import a\n")
    cycles = import_cycles(tmp_path, ["pkg"])
    assert cycles == ["cycle pkg.a <-> pkg.b: pkg.a:2 -> pkg.b; pkg.b:3 -> pkg.a"]
    (package / "b.py").write_text("import pkg.base\n")
    assert import_cycles(tmp_path, ["pkg"]) == []


MAX_MODULES = 25  # modules in one package folder: past it, the folder holds more than one job


def test_no_package_folder_holds_more_than_25_modules() -> None:
    crowded = []
    for package in PACKAGES:
        for folder in sorted({p.parent for p in (ROOT / package).rglob("*.py")}):
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_MODULES:
                crowded.append(f"{folder.relative_to(ROOT)}: {count} modules")
    assert not crowded, f"folders over {MAX_MODULES} modules:\n" + "\n".join(crowded)


def test_every_module_states_its_job_and_none_is_over_600_lines() -> None:
    too_long, unstated = [], []
    for folder in (*PACKAGES, "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            lines = len(text.splitlines())
            if lines > MAX_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
            if text.strip() and not ast.get_docstring(ast.parse(text)):
                unstated.append(str(path.relative_to(ROOT)))
    assert not too_long, f"modules over {MAX_LINES} lines:\n" + "\n".join(too_long)
    assert not unstated, "modules with no docstring saying their job:\n" + "\n".join(unstated)


def _loaded_after(statement: str, roots: tuple[str, ...]) -> str:
    listing = f"sorted(m for m in sys.modules if m.split('.')[0] in {roots!r})"
    code = f"{statement}; import sys; print({listing})"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("statement", "roots"),
    [
        ("import agent.app.daemon", ("psycopg", "psycopg_pool")),
        ("import certs", ("aiohttp",)),
    ],
)
def test_packages_load_only_what_they_promise(statement: str, roots: tuple[str, ...]) -> None:
    loaded = _loaded_after(statement, roots)
    assert loaded == "[]", f"`{statement}` loads {loaded[:400]}"


def test_the_import_probe_sees_what_is_loaded() -> None:
    # The control: the same probe names a package that is loaded.
    assert "'aiohttp'" in _loaded_after("import aiohttp", ("aiohttp",))
