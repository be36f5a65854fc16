"""In-memory replicas on peers (GEMINI style): a lost node is recovered from another node's RAM.

With ``peer_replica`` on, every rank sends its files of each checkpoint it commits (the bytes the
writer wrote, read back from the first level once durable, plus the sidecar) to its *holder*: the
rank with the same local index on the next node. The holder keeps them in shared memory
(``<replica_dir>/node-N/of-rank-RRRRR/``, by default under ``/dev/shm``: host RAM that outlives
the holder's process, so a restarted holder still has them), verified against the sender's
checksums, and keeps only the newest committed replica per source (plus newer, not yet committed
ones).

Transport: one dedicated gloo process group, created collectively when the engine starts, used
only by the replication thread and by recovery, so background transfers never interleave with
training collectives on the default group. Every rank commits the same checkpoints in the same
order, so each replication is one paired exchange: send to the holder while receiving from the
source, chunk by chunk, every wait bounded by ``persist_timeout_s``.

Recovery (``recover``, a collective at load time): ranks whose node-local copy is gone ask their
holder; the holder sends its replica if it has the manifest's run and sizes, else says why not;
the asking rank verifies every byte against the manifest's checksums and otherwise reads from the
shared file system. Each rank logs which source it used.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, Iterator

import torch
import xxhash

from ..config import check_writable_dir
from ..errors import CheckpointError, ConfigError
from ..files import atomic_write_json, private_dir
from ..format.catalog import read_manifest
from ..format.names import valid_name
from ..telemetry import Telemetry
from .jobs import CheckpointJob
from .worker import QueueWorker

log = logging.getLogger("megatron_ext.engine")

REPLICA_META = "replica.json"
_POLL_S = 0.02


# ---------------------------------------------------------------------------- peer mapping
def resolve_ranks_per_node(configured: int | None, world_size: int) -> int:
    """Ranks per node: the configured value, else torchrun's LOCAL_WORLD_SIZE; at least two nodes."""
    rpn = configured
    if rpn is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None or not local.isdigit():
            raise ConfigError("peer_replica needs ranks_per_node (LOCAL_WORLD_SIZE is not set)")
        rpn = int(local)
    if rpn < 1 or world_size % rpn:
        raise ConfigError(f"ranks_per_node {rpn} does not divide the world size {world_size}")
    if world_size // rpn < 2:
        raise ConfigError(f"peer_replica needs at least two nodes, but the {world_size} rank(s) at {rpn} per "
                          "node are one node: there is no other node to hold the replicas")
    return rpn


def holder_of(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank keeping ``rank``'s replica: same local index, next node (wrapping)."""
    return (rank + ranks_per_node) % world_size


def source_of(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank whose replica ``rank`` keeps."""
    return (rank - ranks_per_node) % world_size


def default_replica_dir(save_dir: str | None) -> str:
    """Host memory named after the job's checkpoint directory, so a restarted job finds it again,
    under a directory of this user's (``/dev/shm/megatron_ext-<uid>``, created 0700): a name
    anyone may take first in ``/dev/shm`` is never used as it is."""
    key = hashlib.sha1(os.path.abspath(save_dir or ".").encode()).hexdigest()[:12]
    return os.path.join(os.path.realpath("/dev/shm"), f"megatron_ext-{os.geteuid()}", f"replicas-{key}")


# ---------------------------------------------------------------------------- transport
@dataclasses.dataclass
class Bundle:
    """What one rank sends in one exchange: JSON metadata, then ``meta["files"]`` read from ``base``."""

    meta: dict
    base: str | None = None


def _chunks(files: list[dict], chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(file index, offset, length) of every chunk, file after file."""
    for i, f in enumerate(files):
        offset = 0
        while offset < f["size"]:
            n = min(chunk_bytes, f["size"] - offset)
            yield i, offset, n
            offset += n


class PeerLink:
    """Paired point-to-point transfers on the replication group: send one bundle, receive one."""

    def __init__(self, group: Any, chunk_bytes: int, timeout_s: float):
        self.group = group
        self.chunk_bytes = chunk_bytes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._send_buf = torch.empty(chunk_bytes, dtype=torch.uint8)
        self._recv_buf = torch.empty(chunk_bytes, dtype=torch.uint8)

    def _pair(self, send_to: int | None, out: torch.Tensor | None, recv_from: int | None,
              into: torch.Tensor | None) -> None:
        import torch.distributed as dist

        works = []
        if out is not None:
            works.append(dist.isend(out, send_to, group=self.group))
        if into is not None:
            works.append(dist.irecv(into, recv_from, group=self.group))
        for work in works:
            work.wait(self.timeout)

    def exchange(self, send_to: int | None, outgoing: Bundle | None, recv_from: int | None,
                 dest: str | None) -> tuple[dict | None, dict[str, tuple[int, str]]]:
        """Send ``outgoing`` to ``send_to`` while receiving into ``dest`` from ``recv_from``.

        Returns the received metadata and, per received file (path relative to ``dest``), its
        size and xxh3-64 as received; judging them is the caller's business.
        """
        sending = send_to is not None
        receiving = recv_from is not None
        out_meta = json.dumps(outgoing.meta if outgoing else {"files": []}).encode() if sending else b""
        lengths_in = torch.zeros(1, dtype=torch.int64)
        self._pair(send_to, torch.tensor([len(out_meta)], dtype=torch.int64) if sending else None,
                   recv_from, lengths_in if receiving else None)
        meta_in = torch.empty(int(lengths_in.item()), dtype=torch.uint8)
        self._pair(send_to, torch.frombuffer(bytearray(out_meta), dtype=torch.uint8) if sending else None,
                   recv_from, meta_in if receiving else None)
        meta = json.loads(bytes(meta_in.numpy())) if receiving else None
        out_files = outgoing.meta["files"] if sending and outgoing else []
        in_files = meta["files"] if meta else []
        received: dict[str, tuple[int, str]] = {}
        sink = _Sink(dest, in_files) if in_files else None
        source = _Source(outgoing.base, out_files) if out_files else None
        try:
            sends = list(_chunks(out_files, self.chunk_bytes))
            recvs = list(_chunks(in_files, self.chunk_bytes))
            for step in range(max(len(sends), len(recvs))):
                out = into = None
                if step < len(sends):
                    i, offset, n = sends[step]
                    source.read(i, offset, memoryview(self._send_buf.numpy())[:n])
                    out = self._send_buf[:n]
                if step < len(recvs):
                    into = self._recv_buf[:recvs[step][2]]
                self._pair(send_to, out, recv_from, into)
                if into is not None:
                    i, offset, n = recvs[step]
                    sink.write(i, memoryview(self._recv_buf.numpy())[:n])
            if sink is not None:
                received = sink.finish()
        finally:
            if sink is not None:
                sink.close()
            if source is not None:
                source.close()
        return meta, received


class _Source:
    """Reads the files of an outgoing bundle in order."""

    def __init__(self, base: str, files: list[dict]):
        self.base, self.files = base, files
        self._index, self._file = -1, None

    def read(self, index: int, offset: int, view: memoryview) -> None:
        if index != self._index:
            self.close()
            path = os.path.join(self.base, self.files[index]["rel"])
            self._file, self._index = open(path, "rb", buffering=0), index
        self._file.seek(offset)
        got = 0
        while got < len(view):
            n = self._file.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{self._file.name} shrank while being sent to a peer")
            got += n

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Sink:
    """Writes the files of an incoming bundle under ``dest`` (a private directory), checksumming on the way."""

    def __init__(self, dest: str, files: list[dict]):
        for f in files:  # names come from a peer: only <checkpoint>/<basename>, as a validated manifest has them
            parts = f["rel"].split("/") if isinstance(f.get("rel"), str) else []
            if len(parts) != 2 or not all(valid_name(p) for p in parts):
                raise CheckpointError(f"a peer sent a replica file named {f.get('rel')!r}; refused")
        self.dest, self.files = dest, files
        self._hashes = [xxhash.xxh3_64() for _ in files]
        self._sizes = [0] * len(files)
        self._index, self._file = -1, None
        for f in files:
            self._open(f["rel"]).close()  # empty files exist too

    def _open(self, rel: str):
        """A file of the bundle, for writing: its directory checked private, the file never through a link."""
        path = os.path.join(self.dest, rel)
        private_dir(os.path.dirname(path), "replica_dir", root=self.dest)
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                         "wb")

    def write(self, index: int, data: memoryview) -> None:
        if index != self._index:
            self.close()
            self._file, self._index = self._open(self.files[index]["rel"]), index
        self._file.write(data)
        self._hashes[index].update(data)
        self._sizes[index] += len(data)

    def finish(self) -> dict[str, tuple[int, str]]:
        self.close()
        return {f["rel"]: (self._sizes[i], self._hashes[i].hexdigest()) for i, f in enumerate(self.files)}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def mismatch(expected: list[dict], received: dict[str, tuple[int, str]]) -> str | None:
    """Why ``received`` is not exactly the ``expected`` files (rel, size, xxh3_64), or None."""
    if sorted(received) != sorted(f["rel"] for f in expected):
        return f"it holds {sorted(received)}, not {sorted(f['rel'] for f in expected)}"
    for f in expected:
        size, digest = received[f["rel"]]
        if size != f["size"]:
            return f"{f['rel']} has {size} bytes, expected {f['size']}"
        if digest != f["xxh3_64"]:
            return f"{f['rel']} fails its checksum"
    return None


# ---------------------------------------------------------------------------- holder's store
class ReplicaStore:
    """The replicas this rank holds for its source rank: ``<node_dir>/of-rank-RRRRR/<checkpoint>/``.

    Every directory from ``node_dir`` down is checked private (``files.private_dir``) before each
    use, so a symbolic link or another user's directory put there later is refused, not followed.
    """

    def __init__(self, node_dir: str, source: int):
        self.node_dir = node_dir
        self.base = os.path.join(node_dir, f"of-rank-{source:05d}")
        self.incoming = os.path.join(self.base, ".incoming")

    def _private(self, path: str, create: bool = True) -> str | None:
        return private_dir(path, "replica_dir", root=self.node_dir, create=create)

    def begin(self) -> str:
        self._private(self.base)
        shutil.rmtree(self.incoming, ignore_errors=True)
        return self._private(self.incoming)

    def keep(self, meta: dict) -> None:
        """Make a fully received and verified replica the held one for its checkpoint."""
        ckpt = meta["checkpoint"]
        staged = self._private(os.path.join(self.incoming, ckpt))
        atomic_write_json(os.path.join(staged, REPLICA_META), dict(meta, received_at=time.time()))
        final = os.path.join(self._private(self.base), ckpt)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staged, final)

    def held(self, checkpoint: str) -> dict | None:
        directory = self._private(os.path.join(self.base, checkpoint), create=False)
        if directory is None:
            return None
        try:
            fd = os.open(os.path.join(directory, REPLICA_META), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def offer(self, checkpoint: str, manifest: dict | None, source: int) -> Bundle:
        """The held replica of ``source``'s files of ``manifest`` if present whole, else why not."""
        def refuse(reason: str) -> Bundle:
            return Bundle({"unusable": reason, "files": []})

        if manifest is None:
            return refuse(f"the holder finds no committed {checkpoint}")
        try:
            held = self.held(checkpoint)
        except CheckpointError as exc:  # not private any more: the source reads from storage instead
            return refuse(str(exc))
        if held is None:
            return refuse(f"no replica of {checkpoint} is held")
        if held.get("run_id") != manifest["run_id"]:
            return refuse(f"the replica of {checkpoint} is of run {held.get('run_id')}, the manifest's is "
                          f"{manifest['run_id']}")
        files = _expected_files(manifest, source)
        for f in files:
            path = os.path.join(self.base, f["rel"])
            if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) != f["size"]:
                return refuse(f"the replica of {f['rel']} is missing or has the wrong size")
        return Bundle({"checkpoint": checkpoint, "run_id": manifest["run_id"], "files": files}, self.base)

    def prune(self, root: str) -> None:
        """Keep the newest committed replica and any newer ones; delete the rest."""
        if self._private(self.base, create=False) is None:
            return
        held = []
        for name in os.listdir(self.base):
            meta = self.held(name) if not name.startswith(".") else None
            if meta is not None:
                held.append((name, meta))

        def order(meta: dict) -> tuple:
            return (meta.get("version") if isinstance(meta.get("version"), int) else -1, meta.get("received_at", 0))

        committed = []
        for name, meta in held:
            try:
                manifest = read_manifest(os.path.join(root, name))
            except CheckpointError:
                manifest = None
            if manifest is not None and manifest.get("run_id") == meta.get("run_id"):
                committed.append(meta)
        if not committed:
            return
        newest = max(committed, key=order)
        for name, meta in held:
            if meta is not newest and order(meta) <= order(newest):
                shutil.rmtree(os.path.join(self.base, name), ignore_errors=True)

    def clear(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def _expected_files(manifest: dict, rank: int) -> list[dict]:
    """The files ``rank`` wrote in ``manifest``: tensor file then sidecar, with sizes and checksums."""
    files = []
    for entry in manifest["files"].values():
        if entry["rank"] == rank:
            files.append({"rel": entry["tensor_file"], "size": entry["size"], "xxh3_64": entry["xxh3_64"]})
            files.append({"rel": entry["state_file"], "size": entry["state_size"],
                          "xxh3_64": entry["state_xxh3_64"]})
    return files


# ---------------------------------------------------------------------------- replication thread
@dataclasses.dataclass
class _Prune:
    """Queued when a checkpoint commits: older replicas held may go now."""

    root: str


class PeerReplicator(QueueWorker):
    """For each committed-to-be checkpoint, in commit order: send ours to the holder, keep the source's."""

    def __init__(self, link: PeerLink, store: ReplicaStore, holder: int, source: int, run_id: str,
                 first_level: str, level_root: Callable[[CheckpointJob], str], telemetry: Telemetry,
                 timeout_s: float, fail: Callable[..., bool], check: Callable[[], None]):
        self.link, self.store, self.holder, self.source, self.run_id = link, store, holder, source, run_id
        self.first_level, self.level_root = first_level, level_root
        self.telemetry, self.timeout_s, self.fail, self.check = telemetry, timeout_s, fail, check
        self._cond = threading.Condition()
        self._pending: list[CheckpointJob | _Prune] = []
        self._dead = False
        self.start("datastates-replicator")

    def submit(self, item: CheckpointJob | _Prune) -> None:
        with self._cond:
            self._pending.append(item)
        super().submit(item)

    def pending(self) -> set[str]:
        with self._cond:
            return {item.checkpoint for item in self._pending if isinstance(item, CheckpointJob)}

    def wait_idle(self, deadline: float) -> None:
        with self._cond:
            while self._pending:
                self.check()
                if time.monotonic() > deadline:
                    raise CheckpointError(f"replication to the peer did not finish in time "
                                          f"({len(self._pending)} item(s) pending)")
                self._cond.wait(_POLL_S * 5)
        self.check()

    def handle(self, item: CheckpointJob | _Prune) -> None:
        try:
            if self._dead:
                pass
            elif isinstance(item, _Prune):
                self.store.prune(item.root)
            else:
                self._replicate(item)
        except BaseException as exc:
            self._dead = True
            what = "pruning the replicas" if isinstance(item, _Prune) else f"replication of {item.checkpoint}"
            self.fail(CheckpointError(f"{what} with the peers failed: {type(exc).__name__}: {exc}"))
        finally:
            with self._cond:
                self._pending.remove(item)
                self._cond.notify_all()

    def _replicate(self, job: CheckpointJob) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not job.durable_on(self.first_level) and job.error is None:
            self.check()
            if time.monotonic() > deadline:
                raise CheckpointError(f"{job.checkpoint} did not become durable in time")
            time.sleep(_POLL_S)
        started = time.monotonic()
        outgoing = None
        if job.error is None:  # an abandoned checkpoint still takes part, sending nothing
            files = []
            for f in job.files:
                files.append({"rel": f.tensor_rel, "size": f.layout.size, "xxh3_64": f.file_xxh3})
                files.append({"rel": f.sidecar_rel, "size": len(f.sidecar), "xxh3_64": f.sidecar_xxh3})
            meta = {"checkpoint": job.checkpoint, "version": job.version, "run_id": job.tag, "files": files}
            outgoing = Bundle(meta, self.level_root(job))
        meta, received = self.link.exchange(self.holder, outgoing, self.source, self.store.begin())
        if meta.get("checkpoint") not in (None, job.checkpoint):
            raise CheckpointError(f"rank {self.source} sent {meta['checkpoint']} while this rank replicates "
                                  f"{job.checkpoint}: ranks must commit checkpoints in the same order")
        if meta["files"]:
            problem = mismatch(meta["files"], received)
            if problem:
                raise CheckpointError(f"the replica of rank {self.source}'s {job.checkpoint} is damaged: {problem}")
            self.store.keep(meta)
        self.store.prune(job.root)
        sent = sum(f["size"] for f in (outgoing.meta["files"] if outgoing else []))
        self.telemetry.emit("replica", job.checkpoint, "peer", sent, time.monotonic() - started, holder=self.holder)


# ---------------------------------------------------------------------------- the engine's facade
class PeerReplicas:
    """Replication of this rank's checkpoints to its holder, and recovery from it at load time."""

    def __init__(self, rank: int, world_size: int, ranks_per_node: int | None, replica_dir: str,
                 chunk_bytes: int, timeout_s: float, first_level: str, level_root: Callable[[CheckpointJob], str],
                 run_id: str, telemetry: Telemetry, fail: Callable[..., bool], check: Callable[[], None]):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
            raise ConfigError("peer_replica needs torch.distributed initialised with every rank of the job")
        self.rank, self.world_size, self.run_id = rank, world_size, run_id
        self.ranks_per_node = resolve_ranks_per_node(ranks_per_node, world_size)
        self.holder = holder_of(rank, world_size, self.ranks_per_node)
        self.source = source_of(rank, world_size, self.ranks_per_node)
        self.timeout_s = timeout_s
        self.node_dir = os.path.join(replica_dir, f"node-{rank // self.ranks_per_node:05d}")
        check_writable_dir(self.node_dir, "replica_dir", private=True)  # host memory only this user reads
        self.restored = os.path.join(self.node_dir, f"restored-rank-{rank:05d}")
        self._restored_key: tuple[str, str] | None = None  # (checkpoint, run id) last asked for
        self._restored_files: dict[str, str] = {}
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.link = PeerLink(self.group, chunk_bytes, timeout_s)
        self.store = ReplicaStore(self.node_dir, self.source)
        self.replicator = PeerReplicator(self.link, self.store, self.holder, self.source, run_id, first_level,
                                         level_root, telemetry, timeout_s, fail, check)

    def submit(self, job: CheckpointJob) -> None:
        """Replicate ``job`` once durable on the first level; prune older replicas once it commits."""
        self.replicator.submit(job)
        job.on_committed.append(lambda manifest: self.replicator.submit(_Prune(job.root)))

    def pending(self) -> set[str]:
        return self.replicator.pending()

    def wait(self, deadline: float) -> None:
        self.replicator.wait_idle(deadline)

    def recover(self, checkpoint: str, manifest: dict | None, local_complete: bool) -> dict[str, str]:
        """Collective: fetch this rank's files from its holder unless the node-local copy is whole.

        Returns file name -> directory holding the verified peer copy (empty: read from storage).
        Every rank calls it the same number of times; the outcome for a checkpoint is kept and reused.
        """
        import torch.distributed as dist

        self.wait(time.monotonic() + self.timeout_s)
        mine = _expected_files(manifest, self.rank) if manifest is not None else []
        key = (checkpoint, manifest["run_id"]) if manifest is not None else None
        fetched = key is not None and key == self._restored_key
        need = bool(mine) and not local_complete and not fetched
        needs: list = [None] * self.world_size
        dist.all_gather_object(needs, need, group=self.group)
        send_to = self.source if needs[self.source] else None
        outgoing = self.store.offer(checkpoint, manifest, self.source) if send_to is not None else None
        if need:
            shutil.rmtree(self.restored, ignore_errors=True)
            private_dir(self.restored, "replica_dir", root=self.node_dir)
        started = time.monotonic()
        meta, received = self.link.exchange(send_to, outgoing, self.holder if need else None,
                                            self.restored if need else None)
        if fetched:
            return self._restored_files
        if not need:
            if mine and local_complete:
                log.warning("[datastates] rank %d reads its files of %s from its node-local level", self.rank,
                            checkpoint)
            return {}
        problem = meta.get("unusable") or mismatch(mine, received)
        self._restored_key, self._restored_files = key, {}
        if problem:
            shutil.rmtree(self.restored, ignore_errors=True)
            log.warning("[datastates] rank %d: the replica held by rank %d is unusable (%s); recovering rank %d "
                        "from the shared file system", self.rank, self.holder, problem, self.rank)
            return {}
        nbytes = sum(f["size"] for f in mine)
        log.warning("[datastates] recovered rank %d from peer memory (rank %d): %s, %.1f MB in %.2fs",
                    self.rank, self.holder, checkpoint, nbytes / 1e6, time.monotonic() - started)
        self._restored_files = {e["name"]: self.restored for e in manifest["files"].values() if e["rank"] == self.rank}
        return self._restored_files

    def close(self, clean_end: bool) -> None:
        """Stop the thread; at a normal end of the job also free the host memory the replicas use."""
        self.replicator.stop(5)
        if clean_end:
            self.store.clear()
            shutil.rmtree(self.restored, ignore_errors=True)
            for directory in (self.node_dir, os.path.dirname(self.node_dir)):
                try:
                    os.rmdir(directory)
                except OSError:
                    pass  # other ranks' replicas are still there


__all__ = ["PeerReplicas", "holder_of", "source_of", "resolve_ranks_per_node", "default_replica_dir"]
