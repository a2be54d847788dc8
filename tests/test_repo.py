"""The repository's own promises: CI runs the README's test command; no import circles;
the test runner keeps xdist groups together."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("worker", "schemas")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:`` (annotations only: not an import at run time)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    return skipped


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """Product modules ``path`` imports anywhere (module level or inside a function)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    paths = {
        module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }
    modules = set(paths)
    # a module's own packages are imported before it anyway: not an edge of the graph
    return {
        name: {found for found in imported_modules(path, modules) if not_above(found, name)}
        for name, path in paths.items()
    }


def not_above(imported: str, name: str) -> bool:
    return imported != name and not name.startswith(imported + ".")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (as a path that returns to its start), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for child in sorted(graph[node]):
            if cycle := visit(child, [*path, node]):
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start, []):
            return cycle
    return None


def test_product_modules_import_no_circle() -> None:
    graph = import_graph()
    assert "worker.cli.output" in graph["worker.cli.demo"]  # the graph sees real imports
    assert (
        "worker.service.worker" in graph["worker.cli.main"]
    )  # including lazy ones inside functions
    assert find_cycle(graph) is None, find_cycle(graph)


def test_find_cycle_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    """The README opens with two commands; CI runs the second (the test suite) as written."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert commands[0].endswith("chatstream demo")
    assert commands[1].endswith("-m pytest")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert commands[1] in ci
    assert any("tests/test_repo.py" in line for line in ci)  # the comment that cites this test


def matrix_tests() -> list[str]:
    """The test paths and node ids ``.ci/matrix`` hands every other cell (its arrays)."""
    found: list[str] = []
    for line in (ROOT / ".ci" / "matrix").read_text(encoding="utf-8").splitlines():
        words = line.replace("(", " ").replace(")", " ").replace('"', " ").split()
        found.extend(word for word in words if word.startswith("tests/"))
    return found


def test_the_matrix_names_only_tests_that_exist() -> None:
    """A cell given a path that is gone runs no test at all (pytest stops at the missing
    file), so a renamed or retired test file would silently empty the matrix."""
    tests = matrix_tests()
    assert len(tests) > 10, tests
    for test in tests:
        path, _, name = test.partition("::")
        assert (ROOT / path).exists(), test
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), test


GROUPED = """
import os

import pytest

pytestmark = pytest.mark.xdist_group("one")


@pytest.mark.parametrize("n", range(6))
def test_grouped(n: int) -> None:
    with open(os.environ["WORKERS_FILE"], "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_xdist_groups_keep_their_tests_on_one_process(tmp_path: Path) -> None:
    """The suite relies on ``xdist_group`` to run the worker-process tests one at a time
    (decision 37); some pytest and pytest-xdist versions drop the group without a word
    (pytest-xdist#1386)."""
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    workers = tmp_path / "workers.txt"
    env = {**os.environ, "WORKERS_FILE": str(workers)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3"]
    command += ["--dist", "loadgroup", "-c", os.devnull, "--rootdir", str(tmp_path)]
    done = subprocess.run(
        command, check=False, cwd=tmp_path, env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stdout.decode()[-2000:]
    ran_on = workers.read_text().split()
    assert len(ran_on) == 6 and len(set(ran_on)) == 1, ran_on


# -- the layering: which room may import which (docs/decisions.md, "Layout") ---------------

SHARED = {
    "settings",
    "urls",
    "errors",
    "logs",
    "retry",
    "aio",
    "speedups",
    "embedded_server",
    "telemetry",
    "telemetry_sdk",
    "internals",
}
ALLOWED = {  # besides the shared modules and schemas, which every room may import
    "protocol": set(),
    "upstream": {"protocol"},
    "store": {"protocol"},
    "client": {"store"},
    "service": {"protocol", "upstream", "store"},
    "gateway": {"protocol", "store", "client"},
    "dashboard": {"protocol", "store", "client", "gateway"},  # the gateway's streams and keys
    "testing": set(),
    "cli": {
        "protocol",
        "upstream",
        "store",
        "client",
        "service",
        "gateway",
        "dashboard",
        "testing",
    },
}
IO_MODULES = {"asyncio", "socket", "ssl", "redis", "httpx", "httpcore", "starlette", "uvicorn"}


def room_of(module: str) -> str:
    """``worker.store.queue`` -> ``store``; the shared modules -> ``shared``."""
    if module.startswith("schemas"):
        return "schemas"
    part = module.split(".")[1] if "." in module else "package"
    return "shared" if part in SHARED else part


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imported in graph.items():
        room = room_of(module)
        if room in ("shared", "schemas"):
            allowed = {"shared", "schemas", "package"} if room == "shared" else {"schemas"}
        else:
            allowed = ALLOWED.get(room, set()) | {"shared", "schemas", "package", room}
        wrong += [
            f"{module} ({room}) imports {found} ({room_of(found)})"
            for found in sorted(imported)
            if room_of(found) not in allowed
        ]
    return wrong


def test_each_room_imports_only_the_rooms_it_may() -> None:
    wrong = layering_violations(import_graph())
    assert not wrong, "\n".join(wrong)


def test_every_room_has_a_rule() -> None:
    rooms = {room_of(module) for module in import_graph()} - {"shared", "schemas", "package"}
    assert rooms == set(ALLOWED), rooms ^ set(ALLOWED)


def test_the_protocol_does_no_io() -> None:
    """``protocol`` is pure: no sockets, no event loop, no Redis or HTTP client."""
    for path in (ROOT / "worker" / "protocol").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}  # fmt: skip
        names |= {node.module for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module}  # fmt: skip
        roots = {name.split(".")[0] for name in names}
        assert not roots & IO_MODULES, (path.name, roots & IO_MODULES)


def test_the_layering_rules_catch_a_wrong_import() -> None:
    graph = {
        "worker.store.queue": {"worker.upstream.gate", "worker.store.keys", "worker.settings"},
        "worker.gateway.core": {"worker.service.worker", "worker.client"},
        "worker.dashboard.app": {"worker.gateway.hub", "worker.service.worker"},
        "worker.service.pipeline": {"worker.cli.output", "worker.testing.mock_upstream"},
        "worker.settings": {"worker.store.keys", "worker.errors"},
        "schemas.jobs": {"worker.errors"},
        "worker.cli.demo": {"worker.testing.mock_upstream", "worker.service.worker"},
    }
    assert layering_violations(graph) == [
        "worker.store.queue (store) imports worker.upstream.gate (upstream)",
        "worker.gateway.core (gateway) imports worker.service.worker (service)",
        "worker.dashboard.app (dashboard) imports worker.service.worker (service)",
        "worker.service.pipeline (service) imports worker.cli.output (cli)",
        "worker.service.pipeline (service) imports worker.testing.mock_upstream (testing)",
        "worker.settings (shared) imports worker.store.keys (store)",
        "schemas.jobs (schemas) imports worker.errors (shared)",
    ]
    assert not layering_violations({"worker.settings": {"schemas.requests"}})
