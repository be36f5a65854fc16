"""``object_store`` against a real S3 server (SeaweedFS, ``megatron_ext.testing.s3_server``, started
once per test run): every operation's bytes, the multipart ``Upload`` at awkward run sizes, uploads
aborted or left behind by a crash, and each refusal as the ``OSError`` a file system would raise."""

from __future__ import annotations

import errno
import os
import random
import time

import pytest

from megatron_ext.engine import object_store
from megatron_ext.engine.object_store import ObjectUrl

MIB = 1 << 20


def noise(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def incomplete_uploads(url: str) -> list[str]:
    u = ObjectUrl.parse(url)
    reply = object_store.client().list_multipart_uploads(Bucket=u.bucket, Prefix=u.prefix)
    return sorted(up["Key"] for up in reply.get("Uploads", ()))


def use_identity(monkeypatch, server, identity: str) -> None:
    for variable, value in server.env(identity).items():
        monkeypatch.setenv(variable, value)
    object_store.reset_clients()


# ------------------------------------------------------------------ URLs


@pytest.mark.parametrize("url, why", [
    ("s3://", "no valid bucket"), ("s3:///key", "no valid bucket"), ("s3://../key", "no valid bucket"),
    ("s3://bucket/a/../b", "may not hold empty, '.' or '..'"), ("s3://bucket/a//b", "may not hold empty"),
    ("s3://bucket/./a", "may not hold"), ("/local/dir", "not an object-store URL"), ("S3://bucket/a", "not an object"),
])
def test_malformed_urls_are_refused_naming_the_url(url, why):
    with pytest.raises(ValueError, match=why) as refused:
        ObjectUrl.parse(url)
    assert repr(url) in str(refused.value)


def test_urls_have_one_spelling():
    u = ObjectUrl.parse("s3://bucket/run/iter_0000003/")
    assert (u.bucket, u.key, u.url, u.prefix) == ("bucket", "run/iter_0000003", "s3://bucket/run/iter_0000003",
                                                  "run/iter_0000003/")
    assert u.child("manifest.json") == "s3://bucket/run/iter_0000003/manifest.json"
    top = ObjectUrl.parse("s3://bucket/")
    assert (top.key, top.url, top.prefix, top.child("x")) == ("", "s3://bucket", "", "s3://bucket/x")
    assert object_store.normalize("s3://bucket/a/") == "s3://bucket/a"
    assert object_store.join("s3://bucket/a/", "/b/", "c") == "s3://bucket/a/b/c"


# ------------------------------------------------------------------ whole objects


def test_put_get_size_and_exists(s3_bucket):
    url = f"s3://{s3_bucket}/run/blob.bin"
    data = noise(3 * MIB + 17, seed=1)
    object_store.put(url, memoryview(data))
    assert object_store.get(url) == data and object_store.size(url) == len(data) and object_store.exists(url)
    empty = f"s3://{s3_bucket}/run/empty"
    object_store.put(empty, b"")
    assert object_store.get(empty) == b"" and object_store.size(empty) == 0

    with pytest.raises(OSError) as too_big:
        object_store.get(url, max_bytes=len(data) - 1)
    assert too_big.value.errno == errno.EFBIG and too_big.value.filename == url

    missing = f"s3://{s3_bucket}/run/missing"
    assert not object_store.exists(missing)
    for read in (object_store.get, object_store.size):
        with pytest.raises(FileNotFoundError) as gone:
            read(missing)
        assert gone.value.errno == errno.ENOENT and gone.value.filename == missing
    with pytest.raises(FileNotFoundError, match="the bucket 'no-such-bucket-x' does not exist"):
        object_store.get("s3://no-such-bucket-x/a")


def test_read_into_reads_exact_ranges_and_refuses_short_ones(s3_bucket):
    url = f"s3://{s3_bucket}/ranges.bin"
    data = noise(5 * MIB + 3, seed=2)
    object_store.put(url, data)
    for offset, length in [(0, 1), (0, len(data)), (len(data) - 1, 1), (4093, 9 * 1024 * 1024 // 2 + 5),
                           (1 * MIB, 0)]:
        buf = bytearray(length)
        object_store.read_into(url, offset, memoryview(buf))
        assert buf == data[offset:offset + length], (offset, length)
    for offset, length in [(len(data) - 10, 11), (len(data), 1)]:  # past the end: short, or no byte at all
        with pytest.raises(OSError) as short:
            object_store.read_into(url, offset, memoryview(bytearray(length)))
        assert short.value.errno == errno.EIO and short.value.filename == url


def test_download_writes_every_piece_at_its_offset(s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/whole.bin"
    data = noise(10 * MIB + 123, seed=3)
    object_store.put(url, data)
    path = tmp_path / "whole.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        object_store.download(url, fd, len(data), piece_bytes=MIB + 7)  # 11 pieces, the last of 53 bytes
    finally:
        os.close(fd)
    assert path.read_bytes() == data


# ------------------------------------------------------------------ listing and deleting


def test_list_children_and_walk_see_only_what_lies_under_the_url(s3_bucket):
    root = f"s3://{s3_bucket}/run"
    names = {"a": 1, "d1/x": 2, "d1/y/z": 3, "d2/w": 4, ".hidden": 5}
    for name, n in names.items():
        object_store.put(f"{root}/{name}", b"x" * n)
    object_store.put(f"s3://{s3_bucket}/runner/q", b"sibling")  # shares the prefix "run" as a string only
    dirs, objects = object_store.list_children(root)
    assert sorted(dirs) == ["d1", "d2"] and sorted(objects) == [".hidden", "a"]
    assert object_store.list_children(f"{root}/d1/") == (["y"], ["x"])
    assert sorted(object_store.list_children(f"s3://{s3_bucket}")[0]) == ["run", "runner"]
    assert object_store.list_children(f"{root}/nothing-here") == ([], [])
    assert dict(object_store.walk(root)) == names
    assert list(object_store.walk(f"{root}/d1/y")) == [("z", 3)]


def test_delete_and_delete_tree(s3_bucket):
    root = f"s3://{s3_bucket}/run"
    for name in ("a", "b", "sub/c", "sub/deeper/d"):
        object_store.put(f"{root}/{name}", name.encode())
    object_store.put(f"s3://{s3_bucket}/runner/kept", b"k")
    object_store.delete([f"{root}/a", f"{root}/never-there"])  # a missing object is no error
    assert sorted(n for n, _ in object_store.walk(root)) == ["b", "sub/c", "sub/deeper/d"]
    assert object_store.delete_tree(f"{root}/sub") == 2
    assert [n for n, _ in object_store.walk(root)] == ["b"]
    assert object_store.delete_tree(root) == 1 and object_store.delete_tree(root) == 0
    assert list(object_store.walk(f"s3://{s3_bucket}")) == [("runner/kept", 1)]
    object_store.delete([])


def test_delete_goes_in_batches_of_a_thousand(s3_bucket):
    """S3 deletes at most 1,000 keys a request: 1,003 objects take two."""
    import concurrent.futures as cf

    root = f"s3://{s3_bucket}/many"
    urls = [f"{root}/{i:05d}" for i in range(1003)]
    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda u: object_store.put(u, b""), urls))
    assert object_store.delete_tree(root) == 1003
    assert list(object_store.walk(root)) == []


# ------------------------------------------------------------------ multipart uploads


def small_parts(monkeypatch, nbytes: int = 256 * 1024) -> int:
    """Parts of ``nbytes``, under S3's 5 MiB: the same logic on fewer bytes, for uploads never completed
    (the server takes such parts, and refuses only to complete an upload of them)."""
    monkeypatch.setattr(object_store, "MIN_PART_BYTES", nbytes)
    monkeypatch.setattr(object_store, "PART_BYTES", nbytes)
    return nbytes


def _parts(upload: object_store.Upload) -> list[int]:
    u = ObjectUrl.parse(upload.path)
    reply = object_store.client().list_parts(Bucket=u.bucket, Key=u.key, UploadId=upload._upload_id)
    return [p["Size"] for p in reply.get("Parts", ())]


def test_upload_runs_of_awkward_sizes_make_the_same_bytes(s3_bucket, monkeypatch):
    """Runs smaller than a part, exactly a part (after kept bytes and alone), spanning several parts,
    and a small rest: every part but the last at least S3's 5 MiB (the server refuses to complete
    an upload of smaller ones), the object's bytes those written."""
    monkeypatch.setattr(object_store, "PART_BYTES", object_store.MIN_PART_BYTES)
    part = object_store.MIN_PART_BYTES
    url = f"s3://{s3_bucket}/run/big.safetensors"
    runs = [100 * 1024 + 3, part, part, 3 * part + 12345, 2 * MIB + 1]
    data = noise(sum(runs), seed=4)
    upload = object_store.Upload(url)
    assert upload.part_bytes == part
    offset = 0
    for n in runs:
        upload.write_at(offset, memoryview(data)[offset:offset + n])
        offset += n
    sizes = _parts(upload)
    assert sizes == [part + 100 * 1024 + 3, part, part, part, part]  # the rest kept until close
    assert not object_store.exists(url)  # nothing visible before close
    with pytest.raises(OSError) as disorder:
        upload.write_at(offset + 1, memoryview(b"x"))
    assert disorder.value.errno == errno.EINVAL and disorder.value.filename == url
    upload.close(len(data))
    assert object_store.get(url) == data
    assert incomplete_uploads(f"s3://{s3_bucket}/run") == []


def test_upload_of_a_large_run_sends_parallel_parts_of_at_least_a_part(s3_bucket, monkeypatch):
    monkeypatch.setattr(object_store, "PART_BYTES", object_store.MIN_PART_BYTES)
    part = object_store.MIN_PART_BYTES
    url = f"s3://{s3_bucket}/wide.bin"
    data = noise(9 * part + 5, seed=5)  # more whole parts than the pool's 8 requests
    upload = object_store.Upload(url)
    upload.write_at(0, memoryview(data))
    sizes = _parts(upload)
    assert len(sizes) == object_store.CONCURRENCY and sum(sizes) == 9 * part and min(sizes) >= part
    upload.close(len(data))
    assert object_store.get(url) == data


@pytest.mark.parametrize("nbytes", [0, 1, 4 * MIB])
def test_an_upload_smaller_than_a_part_is_one_put(s3_bucket, nbytes):
    url = f"s3://{s3_bucket}/small.bin"
    data = noise(nbytes, seed=nbytes)
    upload = object_store.Upload(url)
    for start in range(0, nbytes, MIB):
        upload.write_at(start, memoryview(data)[start:start + MIB])
    assert upload._upload_id is None
    upload.close(nbytes)
    assert object_store.get(url) == data


def test_an_aborted_upload_leaves_no_object_and_no_upload(s3_bucket, monkeypatch):
    part = small_parts(monkeypatch)
    url = f"s3://{s3_bucket}/run/aborted.bin"
    upload = object_store.Upload(url)
    upload.write_at(0, memoryview(noise(2 * part + 9, seed=6)))
    assert incomplete_uploads(f"s3://{s3_bucket}/run") == ["run/aborted.bin"]
    upload.abort()
    upload.abort()  # twice: nothing left to abort, no error
    assert not object_store.exists(url) and incomplete_uploads(f"s3://{s3_bucket}") == []


def test_closing_with_the_wrong_size_aborts_and_names_the_object(s3_bucket, monkeypatch):
    part = small_parts(monkeypatch)
    url = f"s3://{s3_bucket}/wrong-size.bin"
    upload = object_store.Upload(url)
    upload.write_at(0, memoryview(noise(part + 1, seed=7)))
    with pytest.raises(OSError, match="closed as 99") as wrong:
        upload.close(99)
    assert wrong.value.filename == url
    assert not object_store.exists(url) and incomplete_uploads(f"s3://{s3_bucket}") == []


def test_an_upload_a_crash_left_incomplete_is_found_and_aborted_under_its_root_only(s3_bucket, monkeypatch):
    """A writer "crashes" (its uploads never closed): ``abort_incomplete_uploads`` of the root aborts
    those under it and leaves another root's alone (a key prefix that is only a string prefix)."""
    part = small_parts(monkeypatch)
    root, other = f"s3://{s3_bucket}/run", f"s3://{s3_bucket}/runner"
    for url in (f"{root}/iter_1/rank_0.safetensors", f"{root}/iter_1/rank_1.safetensors", f"{other}/x"):
        object_store.Upload(url).write_at(0, memoryview(noise(part, seed=8)))
    assert incomplete_uploads(root) == ["run/iter_1/rank_0.safetensors", "run/iter_1/rank_1.safetensors"]
    assert object_store.abort_incomplete_uploads(root) == 2
    assert incomplete_uploads(root) == [] and incomplete_uploads(other) == ["runner/x"]
    assert object_store.abort_incomplete_uploads(root) == 0
    assert list(object_store.walk(f"s3://{s3_bucket}")) == []  # no object ever came of them


# ------------------------------------------------------------------ refusals at start-up


def test_probe_root_accepts_a_writable_root_and_leaves_nothing(s3_bucket):
    object_store.probe_root(f"s3://{s3_bucket}/ckpt")
    object_store.probe_root(f"s3://{s3_bucket}")
    assert list(object_store.walk(f"s3://{s3_bucket}")) == []


def test_probe_root_names_a_missing_bucket(s3_bucket):
    with pytest.raises(FileNotFoundError) as missing:
        object_store.probe_root("s3://no-such-bucket-here/ckpt")
    assert missing.value.errno == errno.ENOENT and "bucket 'no-such-bucket-here' does not exist" in str(missing.value)
    assert missing.value.filename == "s3://no-such-bucket-here/ckpt"


@pytest.mark.parametrize("identity", ["wrong_secret", "unknown_key"])
def test_refused_credentials_are_a_permission_error_that_shows_no_secret(s3_server, s3_bucket, monkeypatch, identity):
    use_identity(monkeypatch, s3_server, "wrong_secret")
    if identity == "unknown_key":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "no-such-access-key")
    root = f"s3://{s3_bucket}/ckpt"
    for call in (lambda: object_store.probe_root(root), lambda: object_store.get(f"{root}/x"),
                 lambda: object_store.put(f"{root}/x", b"1")):
        with pytest.raises(PermissionError) as refused:
            call()
        assert refused.value.errno == errno.EACCES and "access refused" in str(refused.value)
        assert os.environ["AWS_SECRET_ACCESS_KEY"] not in str(refused.value)


def test_a_read_only_identity_reads_and_is_refused_writes(s3_server, s3_bucket, monkeypatch):
    root = f"s3://{s3_bucket}/ckpt"
    object_store.put(f"{root}/kept", b"written by admin")
    use_identity(monkeypatch, s3_server, "read_only")
    assert object_store.get(f"{root}/kept") == b"written by admin"
    assert object_store.list_children(root) == ([], ["kept"])
    with pytest.raises(PermissionError, match="access refused"):
        object_store.probe_root(root)
    for write in (lambda: object_store.put(f"{root}/x", b"1"),
                  lambda: object_store.Upload(f"{root}/y").write_at(0, memoryview(b"z" * object_store.PART_BYTES))):
        with pytest.raises(PermissionError):
            write()
    with pytest.raises(OSError):
        object_store.delete([f"{root}/kept"])
    use_identity(monkeypatch, s3_server, "admin")
    assert object_store.get(f"{root}/kept") == b"written by admin"


def test_a_read_only_identity_is_refused_deletes_as_a_permission_error(s3_server, s3_bucket, monkeypatch):
    root = f"s3://{s3_bucket}/ckpt"
    object_store.put(f"{root}/kept", b"written by admin")
    use_identity(monkeypatch, s3_server, "read_only")
    with pytest.raises(PermissionError) as refused:
        object_store.delete([f"{root}/kept"])
    assert refused.value.errno == errno.EACCES and refused.value.filename == f"{root}/kept"


def test_a_server_that_is_not_there_is_connection_refused_quickly(s3_bucket, monkeypatch):
    from megatron_ext.testing.s3_server import free_ports

    monkeypatch.setattr(object_store, "CONNECT_TIMEOUT_S", 1)
    monkeypatch.setattr(object_store, "ATTEMPTS", 2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    object_store.reset_clients()
    start = time.monotonic()
    with pytest.raises(ConnectionRefusedError) as refused:
        object_store.probe_root(f"s3://{s3_bucket}/ckpt")
    assert refused.value.errno == errno.ECONNREFUSED and "cannot reach the server" in str(refused.value)
    assert refused.value.filename == f"s3://{s3_bucket}/ckpt"
    assert time.monotonic() - start < 10  # two attempts: bounded, no endless retry


def stalled(server, monkeypatch, call) -> tuple[BaseException | None, float]:
    """What ``call`` raises while the server is stopped (SIGSTOP: the kernel accepts connections,
    nothing answers), the read timeout cut to 0.2 s; and the seconds it took."""
    monkeypatch.setattr(object_store, "READ_TIMEOUT_S", 0.2)
    monkeypatch.setattr(object_store, "ATTEMPTS", 2)
    object_store.reset_clients()
    server.pause()
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc, time.monotonic() - start
    finally:
        server.resume()
    return None, time.monotonic() - start


def test_a_stalled_server_times_out_within_the_bounds_and_answers_again_once_resumed(s3_server, s3_bucket, monkeypatch):
    url = f"s3://{s3_bucket}/stalled"
    object_store.put(url, b"before")
    error, seconds = stalled(s3_server, monkeypatch, lambda: object_store.size(url))
    assert isinstance(error, TimeoutError) and error.errno == errno.ETIMEDOUT and error.filename == url, repr(error)
    assert seconds < 10  # two attempts of 0.2 s and their back-off: bounded, no endless retry
    assert object_store.get(url) == b"before"


def test_a_stalled_server_times_out_reads_as_a_timeout_error_naming_the_url(s3_server, s3_bucket, monkeypatch):
    url = f"s3://{s3_bucket}/stalled"
    object_store.put(url, b"before")
    error, _ = stalled(s3_server, monkeypatch, lambda: object_store.get(url))
    assert isinstance(error, TimeoutError) and error.errno == errno.ETIMEDOUT and error.filename == url, repr(error)


def test_the_test_server_keeps_its_data_across_a_kill_and_restart(s3_server, s3_bucket):
    """``S3Server.kill`` + ``restart`` (the engine tests' "server killed mid-upload"): same endpoint, same data."""
    url = f"s3://{s3_bucket}/survives"
    object_store.put(url, b"durable")
    endpoint = s3_server.endpoint
    s3_server.kill()
    assert not s3_server.running
    with pytest.raises(ConnectionRefusedError):
        object_store.size(url)
    s3_server.restart()
    assert s3_server.endpoint == endpoint and object_store.get(url) == b"durable"
