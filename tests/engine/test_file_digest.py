"""Format 3: a tensor file's xxh3-64 is made of its pieces' digests (its header's and its tensors'), so
each byte is hashed once when written. Every path that checks a whole file (verify, a whole-file
load, the copy to the shared level) catches a changed byte the tensors' own digests cannot see (the
header's padding), and format 2 checkpoints (a digest of the whole file's bytes) still load and verify."""

from __future__ import annotations

import json
import random

import pytest
import xxhash

from megatron_ext.engine import CheckpointError
from megatron_ext.engine.format.digest import FileDigest, combine, cuts_of, tensor_file_digest, valid_cuts
from megatron_ext.engine.format.manifest import encode_json
from megatron_ext.engine.format.tensor_file import read_header
from megatron_ext.engine.read.verify import verify_checkpoint

from helpers.states import TINY, assert_same
from test_manifest_v2 import _report, _save, _state


def test_fed_in_any_runs_the_digest_is_its_pieces_digests():
    data = bytes(random.Random(0).getrandbits(8) for _ in range(10_000))
    cuts = [4096, 4096 + 40, 4096 + 40, 9000]  # a repeated cut: an empty tensor
    cuts = sorted(set(cuts))
    pieces = [(0, 4096), (4096, 4136), (4136, 9000), (9000, 10_000)]
    want = combine(xxhash.xxh3_64_intdigest(data[a:b]) for a, b in pieces)
    for seed in range(5):
        rng = random.Random(seed)
        digest = FileDigest(cuts)
        done = 0
        while done < len(data):
            n = rng.randint(1, 3000)
            digest.update(data[done:done + n])
            done += n
        assert digest.hexdigest() == want
        assert [(a, b) for a, b, _ in digest.pieces] == pieces
    plain = FileDigest(None)
    plain.update(data)
    assert plain.hexdigest() == xxhash.xxh3_64_hexdigest(data) != want


def test_cuts_from_a_peer_are_checked():
    assert valid_cuts([4096, 4100, 5000], 5000) and valid_cuts([], 0)
    for bad in ([4096, 4096], [0], [5001], [4096.0], "4096", [True]):
        assert not valid_cuts(bad, 5000)
    assert not valid_cuts([1], "5000")
    assert cuts_of(4096, [(4096, 4096), (4096, 4200), (4200, 4300)]) == [4096, 4200, 4300]


def _tensor_file(root, checkpoint="c1"):
    manifest = json.loads((root / checkpoint / "manifest.json").read_bytes())
    entry = manifest["files"]["f"]
    return root / entry["tensor_file"], entry


def _header_padding_offset(path) -> int:
    with open(path, "rb") as f:
        raw = f.read(4096)
    offset = raw.rindex(b"}") + 1  # JSON ends; spaces pad it to the data start
    assert raw[offset:offset + 1] == b" "
    return offset


def test_the_files_digest_is_made_of_its_header_and_tensor_digests(make_engine, tmp_path):
    _save(make_engine, _state(5))
    root = tmp_path / "ckpt"
    path, entry = _tensor_file(root)
    tensors = json.loads(_report(root).read_bytes())["files"][0]["tensors"]
    data = path.read_bytes()
    with open(path, "rb") as f:
        header = read_header(f.fileno(), len(data))
    for meta in tensors.values():
        begin, end = meta["offsets"]
        assert meta["xxh3_64"] == xxhash.xxh3_64_hexdigest(data[begin:end])
    listed = [(*m["offsets"], m["xxh3_64"]) for m in tensors.values()]
    assert entry["xxh3_64"] == tensor_file_digest(xxhash.xxh3_64_intdigest(data[:header.data_start]), listed)
    assert entry["xxh3_64"] != xxhash.xxh3_64_hexdigest(data)  # not the format 2 digest
    digest = FileDigest(cuts_of(header.data_start, [tuple(m["offsets"]) for m in tensors.values()]))
    digest.update(data)
    assert digest.hexdigest() == entry["xxh3_64"]


def test_a_changed_header_byte_fails_verify_and_a_whole_file_load(make_engine, tmp_path):
    state = _state(5)
    engine = _save(make_engine, state)
    root = tmp_path / "ckpt"
    assert verify_checkpoint(str(root), "c1") == []
    assert_same(engine.load("c1", "f"), state)
    path, _ = _tensor_file(root)
    offset = _header_padding_offset(path)
    with open(path, "r+b") as f:  # still a valid header, every tensor intact: only the file's digest sees it
        f.seek(offset)
        f.write(b"\t")
    (problem,) = verify_checkpoint(str(root), "c1")
    assert problem.path.endswith(".safetensors") and "checksum mismatch (xxh3-64): the bytes changed" in problem.what
    with pytest.raises(CheckpointError, match=f"{path} fails its checksum"):
        engine.load("c1", "f")


def test_the_copy_to_the_shared_level_checks_the_pieces(make_engine, tmp_path):
    state = _state(5)
    engine = _save(make_engine, state, local_dir=str(tmp_path / "local"))
    assert verify_checkpoint(str(tmp_path / "ckpt"), "c1") == []
    assert_same(engine.load("c1", "f", level="shared"), state)


def _to_v2(ckpt_dir) -> None:
    """Rewrite a format-3 checkpoint as format 2 wrote it: each tensor file's digest of its bytes."""
    path = ckpt_dir / "manifest.json"
    doc = json.loads(path.read_bytes())
    for entry in doc["files"].values():
        entry["xxh3_64"] = xxhash.xxh3_64_hexdigest((ckpt_dir.parent / entry["tensor_file"]).read_bytes())
    for rank, listed in doc["reports"].items():
        report_path = ckpt_dir.parent / listed["file"]
        report = json.loads(report_path.read_bytes())
        report["format_version"] = 2
        for f in report["files"]:
            f["xxh3_64"] = doc["files"][f["name"]]["xxh3_64"]
        data = encode_json(report)
        report_path.write_bytes(data)
        listed.update(size=len(data), xxh3_64=xxhash.xxh3_64_hexdigest(data))
    doc["format_version"] = 2
    path.write_text(json.dumps(doc))


def test_a_format_2_checkpoint_still_loads_and_verifies(make_engine, tmp_path):
    state = _state(5)
    engine = _save(make_engine, state)
    root = tmp_path / "ckpt"
    _to_v2(root / "c1")
    assert verify_checkpoint(str(root), "c1") == []
    assert_same(engine.load("c1", "f"), state)
    path, _ = _tensor_file(root)
    with open(path, "r+b") as f:
        f.seek(_header_padding_offset(path))
        f.write(b"\t")
    (problem,) = verify_checkpoint(str(root), "c1")
    assert "checksum mismatch (xxh3-64): the bytes changed" in problem.what
    with pytest.raises(CheckpointError, match="fails its checksum"):
        engine.load("c1", "f")


def test_a_peer_replica_is_checked_in_the_pieces_its_holder_sends(tmp_path):
    """The receiving side of a replica (peer_link): the cuts travel with the file; bad cuts are refused."""
    from megatron_ext.engine.save.replicas.peer_link import BundleFile, _Sink, mismatch

    data = bytes(random.Random(1).getrandbits(8) for _ in range(9000))
    cuts = [4096, 6000, 9000]
    want = combine(xxhash.xxh3_64_intdigest(data[a:b]) for a, b in ((0, 4096), (4096, 6000), (6000, 9000)))
    wire = {"rel": "c1/f.x.safetensors", "size": len(data), "xxh3_64": want, "cuts": cuts}  # as a peer sends it
    files = (BundleFile.from_wire(wire),)
    sink = _Sink(str(tmp_path / "in"), files)
    for lo in range(0, len(data), 1000):
        sink.write(0, memoryview(data[lo:lo + 1000]))
    received = sink.finish()
    assert mismatch(files, received) is None and (tmp_path / "in" / "c1" / "f.x.safetensors").read_bytes() == data
    sink = _Sink(str(tmp_path / "in2"), (BundleFile.from_wire({k: v for k, v in wire.items() if k != "cuts"}),))
    sink.write(0, memoryview(data))
    assert mismatch(files, sink.finish()) == "c1/f.x.safetensors fails its checksum"  # no cuts: the plain digest
    for bad in ([6000, 4096], [4096, 9001], "4096"):
        with pytest.raises(CheckpointError, match="malformed checksum pieces; refused"):
            BundleFile.from_wire(dict(wire, cuts=bad))
    for bad in ({"rel": "../x"}, {"rel": "c1/f", "size": -1}, {"rel": "c1/f", "size": "9"}, ["c1/f"]):
        with pytest.raises(CheckpointError, match="refused"):
            BundleFile.from_wire(bad)


def test_staging_a_file_checks_its_pieces_in_the_copy(tmp_path):
    """The I/O worker's copy to the next level (``FileIo.stage``): the copy passes with the file's
    digest of its pieces; one changed byte of the header fails it, naming the file."""
    import mmap

    from megatron_ext.engine.save.flow.io_ops import FileIo, IoError

    data = bytearray(random.Random(2).getrandbits(8) for _ in range(3 * 4096 + 100))
    cuts = [4096, 4096 + 5000, len(data)]
    want = combine(xxhash.xxh3_64_intdigest(bytes(data[a:b])) for a, b in ((0, 4096), (4096, 9096), (9096, len(data))))
    src = tmp_path / "src.safetensors"
    src.write_bytes(data)
    io = FileIo(memoryview(mmap.mmap(-1, 4096)))
    try:
        io.stage(str(src), str(tmp_path / "dst.safetensors"), False, want, 4096, cuts)
        assert (tmp_path / "dst.safetensors").read_bytes() == data
        data[100] ^= 1
        src.write_bytes(data)
        with pytest.raises(IoError, match=f"checksum mismatch while staging {src}"):
            io.stage(str(src), str(tmp_path / "dst2.safetensors"), False, want, 4096, cuts)
    finally:
        io.close()
