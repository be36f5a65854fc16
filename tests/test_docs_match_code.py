"""The documents say what the code does: each check here reads a fact from the code and looks for it
in the document that states it, so a change to one side that forgets the other fails here.

The facts are the ones readers act on: which module holds which concern (docs/ARCHITECTURE.md),
the commit store's keys (docs/FORMAT.md), the patch series' hook points (docs/MEGATRON.md) and the replica
directory's default (docs/ENGINE.md), and every ``module.name`` a document or docstring points to.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "megatron_ext"
MEGATRON_DOC = (REPO / "docs" / "MEGATRON.md").read_text()
ENGINE_DOC = (REPO / "docs" / "ENGINE.md").read_text()
ARCHITECTURE = (REPO / "docs" / "ARCHITECTURE.md").read_text()
FORMAT = (REPO / "docs" / "FORMAT.md").read_text()


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")


def _defined_names(path: Path) -> set[str]:
    """Top-level functions, classes and assignments of a module, and the methods of its classes."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
                names.update(t.attr for t in ast.walk(node) if isinstance(t, ast.Attribute)
                             and isinstance(t.ctx, ast.Store) and isinstance(t.value, ast.Name) and t.value.id == "self")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize("folder", ["engine", "engine/save", "engine/save/job", "engine/save/flow", "engine/save/commit",
                                    "engine/save/lifecycle", "engine/save/replicas", "engine/read", "engine/format",
                                    "megatron"])
def test_architecture_names_every_module(folder):
    """ARCHITECTURE's tables are how a newcomer finds a concern's module: none may be missing."""
    missing = [p.name for p in _modules(PACKAGE / folder)
               if f"`{p.name}`" not in ARCHITECTURE and f"`{folder.split('/')[-1]}/{p.name}`" not in ARCHITECTURE
               and not re.search(rf"`[^`]*\b{re.escape(p.name)}`", ARCHITECTURE)]
    assert not missing, f"docs/ARCHITECTURE.md does not name megatron_ext/{folder}/ modules {missing}"


def test_format_names_exactly_the_commit_store_keys():
    """FORMAT.md's commit protocol lists the keys a rank posts under; a key it names that the code
    never uses (such as a ``durable`` key) misleads whoever debugs a stuck commit from the store."""
    from megatron_ext.engine.save.commit import coordination

    source = (PACKAGE / "engine" / "save" / "commit" / "coordination.py").read_text()
    used = set(coordination._KEYS) | {"skip"} | {f"share.{m}" for m in re.findall(r'"share\.(\w+)"', source)}
    status = FORMAT.split("3. **Status.**", 1)[1].split("5. **Decision.**", 1)[0]
    named = set(re.findall(r"`((?:share\.)?[a-z]+)`", status))
    store_words = named & (used | {"durable", "heads", "done"})
    assert used <= named, f"docs/FORMAT.md's commit protocol does not name store keys {sorted(used - named)}"
    assert store_words <= used, f"docs/FORMAT.md names store keys the code does not use: {sorted(store_words - used)}"


def test_megatron_doc_lists_one_hook_point_per_patch():
    patches = sorted((REPO / "patches").glob("000*.patch"))
    after = MEGATRON_DOC.split("The series (`patches/000N-*.patch`, one hook point each)", 1)[1]
    series = after.split("\n\n", 1)[1].split("\n\n", 1)[0]
    items = re.findall(r"^(\d+)\. `", series, flags=re.M)
    assert [int(i) for i in items] == list(range(1, len(patches) + 1)), (
        f"docs/MEGATRON.md lists hook points {items} for {len(patches)} patches")
    for patch in patches:
        touched = {Path(f).name for f in re.findall(r"^diff --git a/(\S+)", patch.read_text(), flags=re.M)}
        assert any(f"`{name}`" in series for name in touched), f"docs/MEGATRON.md's series does not name what {patch.name} touches"


def test_replica_directory_default_is_stated_as_the_code_makes_it():
    source = (PACKAGE / "engine" / "save" / "replicas" / "replica.py").read_text()
    assert 'f"megatron_ext-{os.geteuid()}", f"replicas-{key}"' in source, "the default replica directory changed"
    stated = re.findall(r"/dev/shm/megatron_ext-[^`)\s]*", ENGINE_DOC)
    assert stated, "docs/ENGINE.md states no default replica directory"
    wrong = [s for s in stated if not s.startswith("/dev/shm/megatron_ext-<uid>/replicas-")]
    assert not wrong, f"docs/ENGINE.md states replica directory defaults {wrong}; the code makes /dev/shm/megatron_ext-<uid>/replicas-<hash>"


_FILE_SUFFIXES = {"py", "json", "md", "txt", "pt", "sh", "patch", "safetensors", "tmp"}
#: Stems of ours that are also names of objects the documents talk about (the stdlib's ``signal``,
#: Megatron-LM's ``args``).
_NOT_OUR_MODULES = {"signal", "args"}
#: ``engine.destroy()`` is DeepSpeed's engine (docs/DEEPSPEED.md), not ``megatron_ext.engine.engine``.
_OTHERS_NAMES = {("engine", "destroy")}


def _dotted_references(text: str) -> set[tuple[str, str]]:
    return set(re.findall(r"`{1,2}([a-z_]+)\.([A-Za-z_]+)(?:\(\))?`{1,2}", text))


def test_every_module_attribute_a_document_or_docstring_names_exists():
    """``module.name`` in docs/ and in the package's docstrings must name something that module
    defines (a renamed function leaves such pointers behind)."""
    by_stem: dict[str, list[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        by_stem.setdefault(path.stem, []).append(path)
    texts = {p: p.read_text() for p in (REPO / "docs").glob("*.md")}
    texts.update({p: p.read_text() for p in PACKAGE.rglob("*.py")})
    wrong = []
    for path, text in texts.items():
        for module, name in _dotted_references(text):
            if (module not in by_stem or module in _NOT_OUR_MODULES or name in _FILE_SUFFIXES
                    or (module, name) in _OTHERS_NAMES):
                continue
            if not any(name in _defined_names(p) for p in by_stem[module]):
                wrong.append(f"{path.relative_to(REPO)}: {module}.{name}")
    assert not wrong, "references to names their module does not define:\n" + "\n".join(sorted(wrong))
