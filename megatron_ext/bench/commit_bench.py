"""``megatron-ext bench commit``: what one commit costs at 8 to 4,096 ranks, simulated on one machine.

Each configuration (N ranks, T tensors per rank) commits a few checkpoints through the real
``Committer`` and ``CommitChannel``, ranks sharing an in-process store, on a real directory:

* rank 0 and ``--sampled`` other ranks run a real committer thread each: they write their rank
  reports, post their status, and (rank 0) merge, write the manifest and decide;
* the remaining ranks post the same status (built by the same functions from the same kind of
  report) without a thread of their own: a thread per simulated rank would measure this
  machine's scheduler, not the protocol. They write no report files; theirs cost every rank the
  same as a sampled rank's, in parallel on a real cluster. Where their group's leader
  (``CommitGroups``) is one of them, it forwards the group before the sampled ranks are durable,
  as the leaders of groups other than rank 0's would in parallel; rank 0 forwards its own group.

``--fan-in``: ranks per group (default: the engine's, the square root of the world size; the world
size or more: the flat protocol, every rank posting to rank 0).

The configurations alternate over ``--repeats`` rounds (default 3, the order reversed every other
round). Reported per configuration (each round: medians over its checkpoints; the figure: the
median over the rounds, with each round's under ``<figure>_by_round`` and their max - min under
``<figure>_spread``):

* ``commit_latency_s``: from the moment the last ranks (0 and the sampled ones, whose reports
  are written then) become durable to the last of them seeing the commit; the other ranks have
  posted before;
* ``metadata_ops_per_rank``: file-system calls (open, stat, listdir, mkdir, rename, unlink, ...)
  a sampled rank other than 0 makes per checkpoint, counted by wrapping ``os``, those on ``/proc``
  (the telemetry's CPU reading: no storage behind it) left out; rank 0's are ``metadata_ops_rank0``;
* ``rank0_cpu_s``: CPU time of rank 0's committer thread per commit;
* ``manifest_bytes``: the manifest's size; ``store_ops_per_rank``: store calls of a sampled rank
  (not a group's leader); ``store_ops_per_leader``: those of a sampled group leader other than 0
  (None if none is sampled).

Not modelled: network latency to the store server and its fan-out of one notification per
waiting rank (on a TCPStore server, one socket write each).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import functools
import json
import os
import shutil
import statistics
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from megatron_ext.arg_types import POSITIVE_INT
from megatron_ext.bench.common import DEFAULT_REPEATS, figures_over_rounds, round_order, working_dir
from megatron_ext.engine.format.catalog import read_manifest
from megatron_ext.engine.format.manifest import MANIFEST_SHARES, encode_json, summarize_heads
from megatron_ext.engine.format.names import LEVEL_SHARED, REPORTS, report_name
from megatron_ext.engine.format.report import durable_share
from megatron_ext.engine.save.commit.committer import Committer, job_key, job_report
from megatron_ext.engine.save.commit.coordination import CommitChannel, CommitGroups
from megatron_ext.engine.save.context import SaveContext
from megatron_ext.engine.save.job.jobs import CheckpointJob
from megatron_ext.engine.save.job.signal import CommitSignal
from megatron_ext.engine.telemetry import Telemetry

NAME = "commit"
HELP = "one commit's latency, file-system calls and rank 0 CPU at 8 to 4,096 simulated ranks"

RANKS = (8, 64, 512, 4096)
TENSORS = (50, 640)
_COUNTED = ("open", "stat", "lstat", "listdir", "scandir", "mkdir", "rename", "replace", "unlink", "rmdir",
            "access")


def _progress(msg: str) -> None:
    print(f"[bench commit] {msg}", file=sys.stderr, flush=True)


class SimulatedFile:
    """One rank's file as the committer sees it once durable: names, sizes, checksums, T tensors."""

    def __init__(self, checkpoint: str, rank: int, tag: str, tensors: int):
        self.name = f"rank{rank:05d}"
        base = f"{checkpoint}/{self.name}.{tag}"
        now = time.monotonic()
        self.submitted_at = self.snapshot_at = now
        self.durable_at: dict[str, float] = {}
        self.sidecar = b"x" * 4096
        self.nbytes = 0
        entries, offset = {}, 8 + 64 * tensors
        for i in range(tensors):
            size = 4096 * 4096 * 2 if i % 4 else 4096 * 2  # weights and biases of a 70B-like shard
            name = f"decoder.layers.{i // 8}.mlp.linear_fc{i % 8}.weight"
            entries[name] = {"dtype": "BF16", "shape": [size // 2], "offsets": [offset, offset + size],
                             "xxh3_64": f"{(rank * 1_000_003 + i) & 0xFFFFFFFFFFFFFFFF:016x}"}
            offset += size
            self.nbytes += size
        self._report = {"name": self.name, "tensor_file": base + ".safetensors", "state_file": base + ".state.json",
                        "size": offset, "state_size": len(self.sidecar), "xxh3_64": f"{rank:016x}",
                        "state_xxh3_64": f"{rank + 1:016x}", "tensors": entries}

    def report(self) -> dict:
        return self._report


class OpCounter:
    """Counts file-system calls per thread while installed (wraps ``os`` functions and ``open``)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._saved: dict[str, Any] = {}

    def _wrap(self, fn):
        counts = self.counts

        def counted(*args, **kwargs):
            path = args[0] if args else None
            if not (isinstance(path, str) and path.startswith("/proc/")):  # the kernel's, no storage
                ident = threading.get_ident()
                counts[ident] = counts.get(ident, 0) + 1
            return fn(*args, **kwargs)

        return counted

    def __enter__(self) -> "OpCounter":
        for name in _COUNTED:
            self._saved[name] = getattr(os, name)
            setattr(os, name, self._wrap(self._saved[name]))
        self._saved["builtins.open"] = builtins.open
        builtins.open = self._wrap(builtins.open)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            if name == "builtins.open":
                builtins.open = fn
            else:
                setattr(os, name, fn)

    def take(self, ident: int | None) -> int:
        return self.counts.pop(ident, 0) if ident is not None else 0


class CountingStore:
    """A store wrapper that counts calls per thread (the protocol's O(1) per rank, made visible)."""

    def __init__(self, store: Any):
        self.store = store
        self.counts: dict[int, int] = {}

    def __getattr__(self, name: str):
        fn = getattr(self.store, name)

        def counted(*args, **kwargs):
            ident = threading.get_ident()
            self.counts[ident] = self.counts.get(ident, 0) + 1
            return fn(*args, **kwargs)

        return counted


def _one_configuration(root: str, ranks: int, tensors: int, checkpoints: int, sampled: int,
                       timeout_s: float, fan_in: int | None = None) -> dict:
    run_id = "0c0ffee00000"
    store = CountingStore(dist.PrefixStore(f"datastates/{run_id}/", dist.HashStore()))
    real = list(range(min(ranks, sampled + 1)))  # rank 0 and the sampled ones
    groups = CommitGroups.of(ranks, fan_in)
    # Groups whose leader has no thread (none in a flat commit: rank 0 leads its one group); none of
    # their ranks has one either, the sampled ranks coming first.
    light_groups = [g for g in range(groups.count) if groups.ranks(g).start not in real]
    errors: list[BaseException] = []

    def fail(exc: BaseException, job: CheckpointJob | None = None) -> bool:
        errors.append(exc)
        return True

    def context(rank: int) -> SaveContext:
        return SaveContext(rank=rank, world_size=ranks, run_id=run_id, fail=fail, check=lambda: None,
                           timeout_s=timeout_s, telemetry=Telemetry(None, rank),
                           local_dir=None, o_direct=False, chunk_bytes=1 << 20)

    committers = {r: Committer(context(r), may_remove=lambda root: True, channel=CommitChannel(store, store, r, ranks, groups),
                               signal=CommitSignal())
                  for r in real}
    light = CommitChannel(store, store, 1, ranks, groups)  # posts (and forwards) for the ranks without a thread
    rows = []
    with OpCounter() as ops:
        for i in range(1, checkpoints + 1):
            checkpoint = f"iter_{i:07d}"
            os.makedirs(os.path.join(root, checkpoint), exist_ok=True)
            jobs = {}
            for r in real:
                job = CheckpointJob(checkpoint=checkpoint, root=root, version=i, tag=run_id,
                                    files=[SimulatedFile(checkpoint, r, run_id, tensors)])
                job.request_commit(lambda: i)
                jobs[r] = job
                committers[r].track(job)
            idents = {r: committers[r]._thread.ident for r in real}
            for r in real:
                ops.take(idents[r])
                store.counts.pop(idents[r], None)
            key = job_key(jobs[0])
            for r in range(len(real), ranks):  # the ranks without a thread post what a real one would
                light.rank = r
                report = job_report(CheckpointJob(checkpoint=checkpoint, root=root, version=i, tag=run_id,
                                                   files=[SimulatedFile(checkpoint, r, run_id, tensors)]), r, ranks)
                data = encode_json(report)
                rel = f"{checkpoint}/{REPORTS}/{report_name(r, run_id)}"
                light.post_durable(key, *durable_share(report, data, rel))
            for g in light_groups:  # in parallel on a cluster, before rank 0's own group is complete
                light.rank = groups.ranks(g).start
                if not light.forward(key, timeout_s, MANIFEST_SHARES, functools.partial(summarize_heads, checkpoint)):
                    raise RuntimeError(f"group {g} of checkpoint {checkpoint} was not complete")
            # They post before the threaded ranks are durable: an in-process store wakes every waiter at
            # every post, a TCPStore server only the waiter of the key set, so rank 0 waiting through
            # 4,096 posts would measure this simulation, not the protocol.
            clock = time.pthread_getcpuclockid(idents[0])
            cpu0 = time.clock_gettime(clock)
            last = time.monotonic()
            for r in real:
                _mark_durable(jobs[r], committers[r])
            for r in real:
                if not jobs[r].settled.wait(timeout_s + 60):
                    raise RuntimeError(f"rank {r} did not see checkpoint {checkpoint} committed")
            if errors:
                raise RuntimeError(f"commit failed: {errors[0]}") from errors[0]
            seen = max(jobs[r].committed_at for r in real)
            cpu = time.clock_gettime(clock) - cpu0
            other = [r for r in real if r != 0 and not groups.leads(r)]
            leaders = [r for r in real if r != 0 and groups.leads(r)]
            rows.append({
                "commit_latency_s": seen - last,
                "rank0_cpu_s": cpu,
                "metadata_ops_per_rank": (statistics.mean(ops.take(idents[r]) for r in other + leaders)
                                          if other + leaders else 0),
                "metadata_ops_rank0": ops.take(idents[0]),
                "store_ops_per_rank": statistics.mean(store.counts.pop(idents[r], 0) for r in other) if other else 0,
                "store_ops_per_leader": (statistics.mean(store.counts.pop(idents[r], 0) for r in leaders)
                                         if leaders else None),
                "manifest_bytes": os.path.getsize(os.path.join(root, checkpoint, "manifest.json")),
            })
    read_manifest(os.path.join(root, checkpoint))  # what was committed is a valid checkpoint manifest
    for committer in committers.values():
        committer.stop(10)
    result = {"ranks": ranks, "tensors_per_rank": tensors, "sampled_ranks": len(real), "fan_in": groups.fan_in,
              "groups": groups.count}
    for field in rows[0]:
        result[field] = None if rows[0][field] is None else statistics.median(row[field] for row in rows)
    return result


def _mark_durable(job: CheckpointJob, committer: Committer) -> None:
    for f in job.files:
        job.mark_durable(f, LEVEL_SHARED)
    committer.poke()


def run(ranks: tuple[int, ...] = RANKS, tensors: tuple[int, ...] = TENSORS, checkpoints: int = 3, sampled: int = 7,
        workdir: str | None = None, timeout_s: float = 300.0, fan_in: int | None = None,
        repeats: int = DEFAULT_REPEATS) -> dict:
    configurations = [(n, t) for t in tensors for n in ranks]
    by_round: dict[tuple[int, int], list[dict]] = {c: [] for c in configurations}
    load_before = list(os.getloadavg())
    with working_dir(workdir, "megatron-ext-bench-commit-") as base:
        for rnd in range(repeats):
            for n, t in round_order(configurations, rnd):
                root = os.path.join(base, f"n{n}-t{t}")
                shutil.rmtree(root, ignore_errors=True)
                os.makedirs(root)
                started = time.monotonic()
                row = _one_configuration(root, n, t, checkpoints, sampled, timeout_s, fan_in)
                _progress(f"round {rnd + 1}/{repeats} N={n} T={t} groups {row['groups']}x{row['fan_in']}: latency "
                          f"{row['commit_latency_s'] * 1e3:.1f} ms, {row['metadata_ops_per_rank']:.0f} fs ops/rank, "
                          f"rank 0 cpu {row['rank0_cpu_s'] * 1e3:.1f} ms, manifest {row['manifest_bytes'] / 1e6:.2f} MB "
                          f"({time.monotonic() - started:.0f}s)")
                by_round[(n, t)].append(row)
                shutil.rmtree(root, ignore_errors=True)
    results = [{**{k: rows[0][k] for k in CONFIGURATION}, **figures_over_rounds(rows, FIGURES)}
               for rows in by_round.values()]
    return {"results": results, "targets": _targets(results), "repeats": repeats,
            "load_average_before": load_before, "load_average_after": list(os.getloadavg())}


#: What names a configuration (the same in every round) and what is measured in each.
CONFIGURATION = ("ranks", "tensors_per_rank", "sampled_ranks", "fan_in", "groups")
FIGURES = ("commit_latency_s", "rank0_cpu_s", "metadata_ops_per_rank", "metadata_ops_rank0", "store_ops_per_rank",
           "store_ops_per_leader", "manifest_bytes")


def _targets(results: list[dict]) -> dict:
    """The issue's targets, checked on what was measured (None where a configuration was not run)."""
    def row(n: int, t: int) -> dict | None:
        return next((r for r in results if r["ranks"] == n and r["tensors_per_rank"] == t), None)

    out = {}
    for t in sorted({r["tensors_per_rank"] for r in results}):
        small, large = row(min(RANKS), t), row(max(RANKS), t)
        if small and large:
            out[f"latency_ratio_4096_vs_8_t{t}"] = large["commit_latency_s"] / max(small["commit_latency_s"], 1e-9)
            out[f"metadata_ops_ratio_4096_vs_8_t{t}"] = (large["metadata_ops_per_rank"]
                                                         / max(small["metadata_ops_per_rank"], 1e-9))
    big = row(max(RANKS), max(TENSORS))
    out["rank0_cpu_s_4096_t640"] = big["rank0_cpu_s"] if big else None
    return out


def plot(results: list[dict], out_dir: str, baseline: list[dict] | None = None) -> list[str]:
    """Latency, file-system calls per rank and rank 0 CPU over the world size, one line per T.

    ``baseline``: the same keys measured on another version (the file-polling commit), drawn
    as series of their own in the same figures.
    """
    from megatron_ext.bench import plots

    ranks = sorted({r["ranks"] for r in results + (baseline or [])})
    series_of: dict[str, list[dict]] = {}
    for label, rows in (("store", results), ("file polling (before)", baseline or [])):
        for r in rows:
            series_of.setdefault(f"{label}, T={r['tensors_per_rank']}", []).append(r)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for key, title, ylabel, scale in (("commit_latency_s", "commit latency", "ms", 1e3),
                                      ("metadata_ops_per_rank", "file-system calls per rank and checkpoint", "calls", 1),
                                      ("rank0_cpu_s", "rank 0 CPU per commit", "ms", 1e3)):
        series = {name: [next((r[key] * scale for r in rows if r["ranks"] == n), None) for n in ranks]
                  for name, rows in series_of.items()}
        paths.append(plots.lines(os.path.join(out_dir, f"commit_{key}.png"), title, list(range(len(ranks))), series,
                                 "simulated ranks", ylabel, xlabels=[str(n) for n in ranks], log=True))
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench commit``."""
    p.add_argument("--ranks", type=POSITIVE_INT, nargs="+", default=[8, 64, 512, 4096])
    p.add_argument("--tensors", type=POSITIVE_INT, nargs="+", default=[50, 640], help="tensors per rank")
    p.add_argument("--checkpoints", type=POSITIVE_INT, default=3, help="commits per configuration (median)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=DEFAULT_REPEATS,
                   help=f"rounds of every configuration, order reversed every other (default {DEFAULT_REPEATS})")
    p.add_argument("--sampled", type=POSITIVE_INT, default=7, help="ranks besides 0 with a committer thread")
    p.add_argument("--fan-in", type=POSITIVE_INT, default=None,
                   help="ranks per commit group (default: the engine's; the world size or more: flat)")
    p.add_argument("--plot", default=None, metavar="DIR", help="write commit_*.png figures there")
    p.add_argument("--baseline", default=None, metavar="JSON",
                   help="another run's --json output (e.g. an older version's) drawn beside this one")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")


def main(args: Any) -> int:
    with contextlib.redirect_stdout(sys.stderr):
        result = run(tuple(args.ranks), tuple(args.tensors), args.checkpoints, args.sampled, args.dir,
                     fan_in=args.fan_in, repeats=getattr(args, "repeats", DEFAULT_REPEATS))
        if args.plot:
            baseline = None
            if args.baseline:
                with open(args.baseline) as f:
                    loaded = json.load(f)
                baseline = loaded["results"] if isinstance(loaded, dict) else loaded
            result["plots"] = plot(result["results"], args.plot, baseline)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{'ranks':>6} {'tensors':>7} {'latency ms':>10} {'fs ops/rank':>11} {'rank0 cpu ms':>12} "
              f"{'manifest MB':>11}")
        for r in result["results"]:
            print(f"{r['ranks']:>6} {r['tensors_per_rank']:>7} {r['commit_latency_s'] * 1e3:>10.1f} "
                  f"{r['metadata_ops_per_rank']:>11.1f} {r['rank0_cpu_s'] * 1e3:>12.1f} {r['manifest_bytes'] / 1e6:>11.3f}")
        print(json.dumps(result["targets"]))
    return 0
