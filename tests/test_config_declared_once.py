"""``EngineConfig`` is the one declaration of the configuration: every field has a flag and a
DeepSpeed key made from it, the flags' help states the field's default and unit, and the two
generated tables of the docs (the keys in docs/ENGINE.md, the flags in docs/MEGATRON.md) are rendered
from the fields, so the docs cannot drift from the code.

``python tests/test_config_declared_once.py`` rewrites the generated tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_ext.engine.config import (  # noqa: E402
    FLAG_ELSEWHERE, NO_FLAG, UNIT, EngineConfig, default_text, engine_flags, flag_name)
from megatron_ext.megatron.args import add_datastates_args, engine_config_from_args, flag_table_markdown  # noqa: E402

ENGINE_DOC = REPO / "docs" / "ENGINE.md"
MEGATRON_DOC = REPO / "docs" / "MEGATRON.md"
FIELDS = dataclasses.fields(EngineConfig)


def _tables() -> dict[Path, dict[str, str]]:
    """Each document's generated tables by marker name, as the code renders them now."""
    from megatron_ext.engine.config import config_table_markdown

    return {ENGINE_DOC: {"engine config keys": config_table_markdown()},
            MEGATRON_DOC: {"megatron flags": flag_table_markdown()}}


def _begin(name: str) -> str:
    return f"<!-- generated: {name} (python tests/test_config_declared_once.py rewrites it) -->\n"


_END = "<!-- end of generated table -->"


def _render(doc: Path, text: str) -> str:
    """``text`` (of ``doc``) with each generated table replaced by what the code renders now."""
    for name, table in _tables()[doc].items():
        begin = _begin(name)
        assert text.count(begin) == 1, f"{doc.name} lacks the marker {begin.strip()}"
        head, rest = text.split(begin, 1)
        assert _END in rest, f"{doc.name}'s generated table {name!r} has no end marker {_END}"
        text = head + begin + table + _END + rest.split(_END, 1)[1]
    return text


@pytest.mark.parametrize("doc", [ENGINE_DOC, MEGATRON_DOC], ids=lambda d: d.name)
def test_doc_tables_are_rendered_from_the_fields(doc):
    text = doc.read_text()
    assert _render(doc, text) == text, (f"{doc.name}'s generated table differs from EngineConfig's fields; "
                                        "run `python tests/test_config_declared_once.py` to render it again")


def _parser() -> argparse.ArgumentParser:
    parser = add_datastates_args(argparse.ArgumentParser())
    parser.add_argument("--save")
    return parser


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_field_has_a_flag_and_a_deepspeed_key(field, tmp_path):
    """A DeepSpeed key is the field's name (``from_dict``); the flag is generated, or is the framework's own
    (``save_dir``: ``--save``), or the metadata says why there is none."""
    assert field.name in {f.name for f in FIELDS}
    EngineConfig.from_dict({field.name: field.default}, probe=False)  # the key is accepted as is
    flags = [f for f in engine_flags() if f.key == field.name]
    if field.metadata[NO_FLAG] or field.metadata[FLAG_ELSEWHERE]:
        assert not flags and (field.metadata[NO_FLAG] or field.metadata[FLAG_ELSEWHERE] == "--save")
        return
    assert flags and flags[0].options[0] == flag_name(field.name)
    parser = _parser()
    assert flag_name(field.name) in parser._option_string_actions, f"Megatron-LM's parser lacks {flag_name(field.name)}"
    help_text = flags[0].kwargs["help"]
    assert f"default: {default_text(field)}" in help_text
    if field.metadata[UNIT]:
        assert f"({field.metadata[UNIT]};" in help_text
    assert engine_config_from_args(parser.parse_args(["--save", str(tmp_path)])).get(field.name) in (
        None, "auto"), "an absent flag must leave the engine's default"


@pytest.mark.parametrize("argv, key, value", [
    (["--datastates-timeout", "5"], "persist_timeout_s", 5.0),  # the earlier spelling
    (["--datastates-persist-timeout-s", "5"], "persist_timeout_s", 5.0),
    (["--datastates-flush-in-process"], "flush_process", False),  # the earlier spelling
    (["--no-datastates-flush-process"], "flush_process", False),
    (["--datastates-chunk-size-mb", "4"], "chunk_size_mb", 4.0),
    (["--datastates-peer-replica"], "peer_replica", True),
    (["--datastates-on-failure", "continue"], "on_failure", "continue"),
    (["--datastates-o-direct", "false"], "o_direct", False),
    (["--datastates-safe-classes", "collections.Counter", "collections.OrderedDict"], "safe_classes",
     ["collections.Counter", "collections.OrderedDict"]),
    (["--datastates-host-cache-size", "0.5"], "host_cache_size", 0.5),
    (["--datastates-host-cache-size", "auto"], "host_cache_size", "auto"),
])
def test_flags_old_and_new_reach_their_key(argv, key, value, tmp_path):
    cfg = engine_config_from_args(_parser().parse_args(["--save", str(tmp_path), *argv]))
    assert cfg[key] == value


def test_units_are_named_binary():
    """GiB and MiB, never GB or MB, in what the fields declare (error messages keep their wording)."""
    for field in FIELDS:
        assert field.metadata[UNIT] in (None, "GiB", "MiB", "seconds"), field.name
        assert not re.search(r"\b[GM]B\b", field.metadata["help"]), field.name


def test_constructing_reads_nothing_and_check_node_does(monkeypatch):
    """Construction has no side effects; ``check_node`` reads the memory and imports the classes."""
    from megatron_ext.engine import config as config_module

    calls = []
    monkeypatch.setattr(config_module, "_physical_memory_bytes", lambda: calls.append("ram") or None)
    config = EngineConfig(safe_classes=("collections.Counter",))
    assert calls == []
    assert config.check_node() is config and calls == ["ram"]


if __name__ == "__main__":
    for doc, tables in _tables().items():
        doc.write_text(_render(doc, doc.read_text()))
        print(f"rendered {', '.join(tables)} into {doc}")
