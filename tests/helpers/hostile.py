"""The hostile-checkpoint suite's library (``tests/security``): genuine checkpoints to tamper with,
re-sealing after a tamper (so only the attack, not a checksum, is what a reader must catch), and an
audit hook that records every file opened, removed or renamed and every process started."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
import xxhash

from megatron_ext.engine import CheckpointEngine
from megatron_ext.engine.format.digest import PIECEWISE_FROM_VERSION, FileDigest, cuts_of

from helpers.procs import REPO, child_env, python_command

SMALL = {"host_cache_size": 0.001, "chunk_size_mb": 0.004, "snapshot_timeout_s": 30.0, "persist_timeout_s": 30.0}
SPAWN_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                "pty.spawn")
CHANGE_EVENTS = ("os.remove", "os.rmdir", "os.rename", "shutil.rmtree", "os.truncate", "os.chmod")


def genuine_state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(1000, generator=g), "b": torch.randint(0, 100, (7, 3), generator=g, dtype=torch.int64),
            "h": torch.randn(5, generator=g).to(torch.bfloat16), "step": i, "lr": 0.5 / (i + 1),
            "names": ["a", "b"], "pair": (i, "x")}


def name_of(i: int) -> str:
    return f"iter_{i:07d}"  # Megatron's layout, so export and convert take these too


C1, C2 = name_of(1), name_of(2)


def save_genuine(root: Path, steps: list[int], **config: Any) -> str:
    """Committed checkpoints ``iter_000000<i>`` (one file, ``rank00000``) under ``root``; returns the run id."""
    with CheckpointEngine({"save_dir": str(root), **SMALL, **config}, rank=0, world_size=1) as engine:
        for i in steps:
            engine.save(genuine_state(i), name_of(i), version=i)
            engine.commit(name_of(i))
        engine.wait_persisted()
        return engine.run_id


def manifest_path(root: Path, checkpoint: str) -> Path:
    return root / checkpoint / "manifest.json"


def read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))


def files_of(root: Path, checkpoint: str, name: str = "rank00000") -> tuple[Path, Path]:
    entry = read_json(manifest_path(root, checkpoint))["files"][name]
    return root / entry["tensor_file"], root / entry["state_file"]


def report_path(root: Path, checkpoint: str, rank: int = 0) -> Path:
    """A format-2 checkpoint's rank report: that rank's tensor index, named in the manifest."""
    return root / read_json(manifest_path(root, checkpoint))["reports"][str(rank)]["file"]


def reseal(root: Path, checkpoint: str) -> None:
    """Recompute the manifest's sizes and checksums from the files as they are now (an attacker who
    writes the manifest too): whatever a reader rejects afterwards, it rejects for the attack itself.
    In format 2 the rank reports (which repeat each file's entry and hold its tensors) are resealed
    first, then the manifest's entries and its report sizes and checksums."""
    path = manifest_path(root, checkpoint)
    doc = read_json(path)
    reports = {}
    for rank, listed in (doc.get("reports") or {}).items() if isinstance(doc.get("reports"), dict) else ():
        report = root / listed["file"]
        if report.parent == root / checkpoint / ".reports" and report.is_file() and not report.is_symlink():
            reports[rank] = (report, read_json(report))
    for entry in doc["files"].values():
        copies = [entry]
        if "tensors" not in entry:
            report = reports.get(str(entry["rank"]))
            copies += [e for e in (report[1]["files"] if report else []) if e.get("name") == entry["name"]]
        tensors = next((c["tensors"] for c in copies if "tensors" in c), {})
        tensor, state = root / entry["tensor_file"], root / entry["state_file"]
        if tensor.is_file() and not tensor.is_symlink():
            data = tensor.read_bytes()
            digest = xxhash.xxh3_64_hexdigest(data)
            if doc.get("format_version", 0) >= PIECEWISE_FROM_VERSION:  # of its pieces' digests
                offsets = [m.get("offsets") for m in tensors.values() if isinstance(m, dict)]
                pieces = FileDigest(cuts_of(8 + int.from_bytes(data[:8], "little"),
                                            [o for o in offsets if isinstance(o, list) and len(o) == 2
                                             and all(type(x) is int for x in o)]))
                pieces.update(data)
                digest = pieces.hexdigest()
            for c in copies:
                c["size"], c["xxh3_64"] = len(data), digest
            for meta in tensors.values():
                begin, end = meta["offsets"]
                if 0 <= begin <= end <= len(data):
                    meta["xxh3_64"] = xxhash.xxh3_64_hexdigest(data[begin:end])
        if state.is_file() and not state.is_symlink():
            data = state.read_bytes()
            for c in copies:
                c["state_size"], c["state_xxh3_64"] = len(data), xxhash.xxh3_64_hexdigest(data)
    for rank, (report, report_doc) in reports.items():
        write_json(report, report_doc)
        seal_report(root, checkpoint, int(rank), doc)
    write_json(path, doc)


def seal_report(root: Path, checkpoint: str, rank: int = 0, doc: dict | None = None) -> None:
    """Make the manifest's size and checksum of ``rank``'s report match its bytes as they are now
    (written to the manifest unless ``doc``, the manifest being edited, is given)."""
    path = manifest_path(root, checkpoint)
    manifest = doc if doc is not None else read_json(path)
    listed = manifest["reports"][str(rank)]
    data = (root / listed["file"]).read_bytes()
    listed["size"], listed["xxh3_64"] = len(data), xxhash.xxh3_64_hexdigest(data)
    if doc is None:
        write_json(path, manifest)


def rewrite_sidecar(root: Path, checkpoint: str, change) -> None:
    """Apply ``change(state_doc)`` to the sidecar's JSON, then reseal."""
    _, state_file = files_of(root, checkpoint)
    doc = read_json(state_file)
    change(doc["state"])
    write_json(state_file, doc)
    reseal(root, checkpoint)


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(python_command("-m", "megatron_ext", *args), capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO), env=child_env())


def cli_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``megatron-ext ARGS`` through ``megatron_ext.cli.main`` in this process (same code, no interpreter start)."""
    from megatron_ext import cli

    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as exc:  # argparse and explicit exits
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["megatron-ext", *args], code, out.out, out.err)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A refused command: non-zero exit, exactly one line on stderr naming the problem, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------- audit hook
class Audit:
    """Records audit events while ``recording``: files opened, files changed, processes started."""

    def __init__(self):
        self.events: list[tuple[str, tuple]] = []
        self.recording = False
        self._lock = threading.Lock()

    def __call__(self, event: str, args: tuple) -> None:
        if self.recording and (event == "open" or event.startswith(SPAWN_EVENTS) or event in CHANGE_EVENTS):
            with self._lock:
                self.events.append((event, args))

    @contextlib.contextmanager
    def watch(self) -> Iterator["Audit"]:
        self.events.clear()
        self.recording = True
        try:
            yield self
        finally:
            self.recording = False

    def opened(self) -> list[str]:
        return [os.path.abspath(os.fsdecode(args[0])) for event, args in self.events
                if event == "open" and isinstance(args[0], (str, bytes, os.PathLike))]

    def spawned(self) -> list[tuple[str, tuple]]:
        return [(e, a) for e, a in self.events if e.startswith(SPAWN_EVENTS)]

    def changed(self) -> list[tuple[str, tuple]]:
        return [(e, a) for e, a in self.events if e in CHANGE_EVENTS]

    def assert_confined(self, inside: Path, under: Path) -> None:
        """No process started, nothing removed or renamed, and no file under ``under`` opened outside ``inside``."""
        assert not self.spawned(), self.spawned()
        assert not self.changed(), self.changed()
        inside_s, under_s = str(inside.resolve()), str(under.resolve())
        outside = [p for p in self.opened() if p.startswith(under_s + os.sep) and not p.startswith(inside_s + os.sep)]
        assert not outside, f"opened outside {inside}: {outside}"


def copy_checkpoint(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True)


# ------------------------------------------------------------------------------- Megatron-shaped checkpoints
#: The one sharded tensor of ``save_megatron_like``: its key, shard id and the tensor's name in the file.
SHARD_KEY = "decoder.weight"
SHARD_ID = f"{SHARD_KEY}@0,0"
SHARD_TENSOR = f"shards/tensors/{SHARD_ID}"


def megatron_like_state() -> dict:
    """One rank's state in the Megatron layout (checkpoint_layout.rank_state): one (4, 6) shard,
    the non-sharded ``common`` and rank 0's ``meta``, enough for ``export`` and ``convert`` to
    reach the shards."""
    import argparse

    from megatron_ext.megatron import checkpoint_layout as layout

    weight = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    meta = {"key": SHARD_KEY, "global_shape": [4, 6], "global_offset": [0, 0], "local_shape": [4, 6],
            "dtype": "float32", "axis_fragmentations": [1, 1], "prepend_axis_num": 0}
    parallel = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
    run = layout.run_meta(2, 0, None, argparse.Namespace(), parallel)
    return layout.rank_state({"tensors": {SHARD_ID: weight}, "objects": {}, "meta": {SHARD_ID: meta}},
                             common={}, meta=run)


def save_megatron_like(root: Path) -> None:
    """``iter_0000002`` in a Megatron save directory, written by the engine as the adapter writes it."""
    from megatron_ext.megatron import checkpoint_layout as layout

    with CheckpointEngine({"save_dir": str(root), **SMALL}, rank=0, world_size=1) as engine:
        engine.save(megatron_like_state(), C2, layout.rank_file_name(0), version=2,
                    extra=layout.rank_extra([], {"world_size": 1, "tp": 1, "pp": 1, "dp": 1,
                                                 "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}))
        engine.commit(C2, on_committed=layout.tracker_writer(str(root), 2, 0))
        engine.wait_persisted()
