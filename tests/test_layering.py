"""The package's layering, checked from the source: the engine knows nothing of Megatron or
DeepSpeed, the read side and the format import nothing of the save pipeline, adapters import the
engine and never the reverse, and no module imports itself through a cycle.

Static (every import statement, including those inside functions), plus one interpreter run for
what importing the read path really loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_ext"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, type_checking: bool = False) -> set[str]:
    """Absolute names of the modules ``path`` imports at run time (``if TYPE_CHECKING:`` blocks
    excluded, unless ``type_checking``); ``from X import y`` counts X.y when that is a module, else X."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def walk(node):
        if (not type_checking and isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                and node.test.id == "TYPE_CHECKING"):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if (REPO / Path(*sub.split("."))).with_suffix(".py").exists()
                          or (REPO / Path(*sub.split("."))).is_dir() else module)
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(ast.parse(path.read_text(), str(path)))
    return found


MODULES = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _ours(imported: set[str]) -> set[str]:
    return {m for m in imported if m in MODULES}


def _importers(prefix: str, of: str) -> list[str]:
    return sorted(f"{m} imports {dep}" for m, deps in MODULES.items() if m.startswith(prefix)
                  for dep in deps if dep == of or dep.startswith(of + "."))


@pytest.mark.parametrize("outsider", ["megatron", "deepspeed", "megatron_ext.megatron", "megatron_ext.deepspeed_adapter",
                                      "megatron_ext.bench", "megatron_ext.testing", "megatron_ext.cli"])
def test_the_engine_knows_nothing_of_its_users(outsider):
    assert _importers("megatron_ext.engine", outsider) == []


@pytest.mark.parametrize("room", ["megatron_ext.engine.format", "megatron_ext.engine.read", "megatron_ext.engine.errors",
                                  "megatron_ext.engine.files", "megatron_ext.engine.config",
                                  "megatron_ext.engine.host_cache", "megatron_ext.engine.device"])
def test_the_read_side_and_the_format_import_nothing_of_the_save_pipeline(room):
    assert _importers(room, "megatron_ext.engine.save") == []
    assert _importers(room, "megatron_ext.engine.engine") == []


def test_the_deepspeed_adapter_imports_nothing_of_the_megatron_adapter():
    """What both adapters need (Transformer Engine's extra state) sits beside them, not in ``megatron/``."""
    assert _importers("megatron_ext.deepspeed_adapter", "megatron_ext.megatron") == []
    top_level = _imports(REPO / "datastates.py")  # the module DeepSpeed imports by that name
    assert "megatron_ext.deepspeed_adapter" in top_level
    assert [m for m in top_level if m.startswith("megatron_ext.megatron")] == []


def test_the_format_imports_nothing_of_the_read_side():
    assert _importers("megatron_ext.engine.format", "megatron_ext.engine.read") == []


def test_product_code_imports_no_test_code():
    product = [m for m in MODULES if not m.startswith("megatron_ext.testing")]
    assert [f"{m} imports {d}" for m in product for d in MODULES[m] if d.startswith("megatron_ext.testing")
            and not m.startswith(("megatron_ext.bench", "megatron_ext.cli"))] == []


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    """Over the module graph; a package's ``__init__`` counts as importing nothing it only re-exports lazily."""
    graph = {m: sorted(_ours(deps) - {m}) for m, deps in MODULES.items()}
    assert _cycles(graph) == []


def test_no_import_cycles_in_the_save_pipeline_even_for_type_checking():
    """A stage names only the stages after it, even in annotations: an ``if TYPE_CHECKING:`` import
    that closes a circle (the committer and the skips once named each other) hides a two-way
    dependency from the test above."""
    save = "megatron_ext.engine.save"
    typed = {m: _imports(p, type_checking=True) for p in (PACKAGE / "engine" / "save").rglob("*.py")
             for m in [_module_name(p)]}
    graph = {m: sorted(d for d in deps if d in typed and d != m) for m, deps in typed.items() if m.startswith(save)}
    assert _cycles(graph) == []


#: The save side's rooms, each above the ones before it: a room imports only rooms earlier in this
#: list (annotations included), so control flows one way, from the training thread's calls down to
#: the job. ``pipeline`` and ``offline_writer`` assemble the rooms; nothing below imports them.
SAVE_ROOMS = ["job", "context", "flow", "replicas", "lifecycle", "commit", "overload", "pipeline", "offline_writer"]


def _save_room(module: str) -> str | None:
    prefix = "megatron_ext.engine.save."
    return module[len(prefix):].split(".")[0] if module.startswith(prefix) else None


def test_the_save_rooms_import_only_the_rooms_below_them():
    """``flow`` knows neither ``commit`` nor ``overload``; ``job`` imports nothing else of save/; a
    stage reaches the one above it only through what it was handed at construction (a callable, or
    a ``Protocol`` such as ``flow.snapshot.SkipSettling``)."""
    rooms = {p.stem if p.parent.name == "save" else p.parent.name for p in (PACKAGE / "engine" / "save").rglob("*.py")
             if p.name != "__init__.py" or p.parent.name != "save"}
    assert rooms == set(SAVE_ROOMS), f"save/ has rooms {sorted(rooms)}; SAVE_ROOMS names {SAVE_ROOMS}"
    back = []
    for p in (PACKAGE / "engine" / "save").rglob("*.py"):
        here = _save_room(_module_name(p))
        for dep in _imports(p, type_checking=True):
            there = _save_room(dep)
            if here and there and there != here and SAVE_ROOMS.index(there) > SAVE_ROOMS.index(here):
                back.append(f"{_module_name(p)} ({here}) imports {dep} ({there})")
    assert back == []


def test_importing_the_read_path_loads_no_save_module():
    """What ``python -X importtime`` would list: the read side, the Megatron load and the offline
    tools import the engine's read room, never its save pipeline."""
    code = ("import sys; import megatron_ext.engine.read.committed, megatron_ext.engine.read.verify, "
            "megatron_ext.engine.read.inspect; from megatron_ext.engine import CheckpointError, open_committed; "
            "print('\\n'.join(m for m in sys.modules if m.startswith(('megatron_ext.engine.save', "
            "'megatron_ext.engine.engine'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
