"""The object-store level: a checkpoint root ``s3://bucket/prefix`` on any S3-compatible server.

Paths on this level are URLs (``s3://bucket/prefix/iter_0000003/rank_00000.safetensors``) and travel
through the engine as strings, like file paths; every operation that touches one asks
``is_object_url`` and comes here. The client is boto3 (docs/ARCHITECTURE.md, "The object-store
level": explicit multipart uploads, so parts go up as runs of the host cache are filled and an
upload a crash left behind can be listed and aborted; the credential chain users already
configure: environment, ``AWS_PROFILE`` and the shared files, instance roles). The server comes from
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` when set (path-style addressing then), else AWS.
Credentials are never logged: errors name the URL, the server's error code and message only.

Every failure is an ``OSError`` with an errno and the URL as its file name, the way a file system's
would be (so it crosses the I/O worker's pipe and reaches the training thread as one): ENOENT for a
missing object or bucket, EACCES for refused access or credentials, ETIMEDOUT and ECONNREFUSED for
an unreachable server, EIO for the rest. Each request is bounded: connect and read timeouts, and
five attempts with the SDK's backoff (a throttled or briefly failing server, SlowDown or 5xx, is
retried; one that stays down fails the file as a failed write would).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import errno
import hashlib
import os
import threading
from typing import Iterator

SCHEME = "s3://"

#: S3's smallest part (all but the last), its largest part count and the part size this level aims for.
MIN_PART_BYTES = 5 * 1024 * 1024
MAX_PARTS = 10_000
PART_BYTES = 16 * 1024 * 1024
#: Concurrent requests per process: parts of one run, pieces of one ranged read.
CONCURRENCY = 8
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 120
#: Attempts per request, with the SDK's standard backoff between them (throttling, 5xx answers).
ATTEMPTS = 5


def is_object_url(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


@dataclasses.dataclass(frozen=True)
class ObjectUrl:
    """``s3://bucket/key``: the key has no leading or trailing slash, no empty, ``.`` or ``..`` segment."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> "ObjectUrl":
        if not is_object_url(url):
            raise ValueError(f"not an object-store URL: {url!r} (expected s3://bucket/prefix)")
        bucket, _, key = url[len(SCHEME):].partition("/")
        key = key.rstrip("/")
        if not bucket or any(c in bucket for c in " \\") or bucket in (".", ".."):
            raise ValueError(f"{url!r}: no valid bucket name after s3://")
        if key and any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"{url!r}: the key may not hold empty, '.' or '..' parts")
        return cls(bucket, key)

    def child(self, name: str) -> str:
        return f"{SCHEME}{self.bucket}/{self.key + '/' if self.key else ''}{name}"

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    @property
    def prefix(self) -> str:
        """The key prefix of everything under this URL (``key/``, or empty at the bucket's top)."""
        return self.key + "/" if self.key else ""


def normalize(url: str) -> str:
    """``url`` in its one spelling (no trailing slash), checked."""
    return ObjectUrl.parse(url).url


def resolve_root(root: str) -> str:
    """A level root in its one spelling: an object-store URL normalised, a path made absolute."""
    return normalize(root) if is_object_url(root) else os.path.abspath(root)


def under(root: str, name: str) -> str:
    """``name`` under a level root: a key below an object-store URL, else a path below a directory."""
    return join(root, name) if is_object_url(root) else os.path.join(root, name)


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *(n.strip("/") for n in names)])


# ------------------------------------------------------------------ errors

_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound", "NoSuchUpload"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
           "InvalidToken", "ExpiredToken", "Forbidden"}


def _os_error(exc: BaseException, url: str, what: str) -> OSError:
    """``exc`` (botocore's) as the ``OSError`` a file system would have raised, naming ``url``."""
    from botocore import exceptions as bx

    if isinstance(exc, OSError) and not isinstance(exc, bx.BotoCoreError):
        return exc
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "")) or str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return _answer_error(code, err.get("Message") or code, url, what)
    if isinstance(exc, bx.NoCredentialsError):
        return PermissionError(errno.EACCES, f"{what}: no credentials found (set AWS_ACCESS_KEY_ID and "
                                             "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)", url)
    server = endpoint_url() or "AWS S3"
    if isinstance(exc, (bx.ConnectTimeoutError, bx.ReadTimeoutError)):
        return TimeoutError(errno.ETIMEDOUT, f"{what}: the server ({server}) did not answer in time", url)
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectionClosedError)):
        return ConnectionRefusedError(errno.ECONNREFUSED, f"{what}: cannot reach the server ({server})", url)
    return OSError(errno.EIO, f"{what}: {type(exc).__name__}: {exc}", url)


def _answer_error(code: str, message: str, url: str, what: str) -> OSError:
    """The server's error ``code`` (of a request, or of one key of a batch) as an ``OSError``."""
    if code == "NoSuchBucket":
        return FileNotFoundError(errno.ENOENT, f"{what}: the bucket {ObjectUrl.parse(url).bucket!r} does not exist", url)
    if code in _MISSING:
        return FileNotFoundError(errno.ENOENT, f"{what}: no such object ({code})", url)
    if code in _DENIED:
        return PermissionError(errno.EACCES, f"{what}: access refused by the server ({code}: {message})", url)
    return OSError(errno.EIO, f"{what}: the server answered {code}: {message}", url)


# ------------------------------------------------------------------ the client

_client_lock = threading.Lock()
_clients: dict[tuple, object] = {}
_pool: cf.ThreadPoolExecutor | None = None


def endpoint_url() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def client():
    """This process's boto3 S3 client for the configured endpoint and credentials (thread-safe; made
    once per pid, since a client never crosses a fork, and again when the environment names another
    endpoint, profile or credentials: only a digest of them is kept as the key)."""
    endpoint = endpoint_url()
    secrets = "\0".join(os.environ.get(k, "") for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"))
    key = (os.getpid(), endpoint, os.environ.get("AWS_PROFILE"), hashlib.sha256(secrets.encode()).hexdigest())
    found = _clients.get(key)
    if found is not None:
        return found
    with _client_lock:
        found = _clients.get(key)
        if found is None:
            import boto3
            from botocore.config import Config

            config = Config(
                connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                retries={"max_attempts": ATTEMPTS, "mode": "standard"},
                max_pool_connections=2 * CONCURRENCY,
                # Our own xxh3-64 checks every byte end to end; the SDK's CRCs would hash it all again.
                request_checksum_calculation="when_required", response_checksum_validation="when_required",
                s3={"addressing_style": "path"} if endpoint else None,
            )
            session = boto3.session.Session()
            found = _clients[key] = session.client("s3", endpoint_url=endpoint, config=config,
                                                   region_name=session.region_name or "us-east-1")
    return found


def _executor() -> cf.ThreadPoolExecutor:
    global _pool
    with _client_lock:
        if _pool is None:
            _pool = cf.ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="datastates-s3")
        return _pool


class _ViewBody:
    """A read-only, seekable file over a memoryview: a request body without a copy of it
    (botocore takes bytes or a file; it reads, hashes and seeks back)."""

    def __init__(self, view: memoryview):
        self._view = view.cast("B") if view.format != "B" else view
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        data = bytes(self._view[self._pos:end])
        self._pos = end
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._view))[whence]
        self._pos = max(0, min(len(self._view), base + pos))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


def put(url: str, data: bytes | memoryview) -> None:
    """One object, whole (S3 makes it visible all at once or not at all: the manifest's atomic write)."""
    u = ObjectUrl.parse(url)
    try:
        client().put_object(Bucket=u.bucket, Key=u.key, Body=_ViewBody(memoryview(data)), ContentLength=len(data))
    except Exception as exc:
        raise _os_error(exc, url, "writing") from None


def get(url: str, max_bytes: int | None = None) -> bytes:
    """An object's bytes; more than ``max_bytes`` is refused before they are read."""
    u = ObjectUrl.parse(url)
    try:
        reply = client().get_object(Bucket=u.bucket, Key=u.key)
        length = int(reply.get("ContentLength", 0))
        if max_bytes is not None and length > max_bytes:
            reply["Body"].close()
            raise OSError(errno.EFBIG, f"{length} bytes, more than the {max_bytes} allowed", url)
        return reply["Body"].read()
    except Exception as exc:  # botocore's timeouts are OSErrors too: each becomes the one of its errno
        raise _os_error(exc, url, "reading") from None


def size(url: str) -> int:
    u = ObjectUrl.parse(url)
    try:
        return int(client().head_object(Bucket=u.bucket, Key=u.key)["ContentLength"])
    except Exception as exc:
        raise _os_error(exc, url, "looking up") from None


def identity(url: str) -> tuple:
    """What changes whenever the object is written again: its ETag and size (``FileNotFoundError`` if none)."""
    u = ObjectUrl.parse(url)
    try:
        head = client().head_object(Bucket=u.bucket, Key=u.key)
    except Exception as exc:
        raise _os_error(exc, url, "looking up") from None
    return head.get("ETag"), int(head["ContentLength"])


def exists(url: str) -> bool:
    try:
        size(url)
    except FileNotFoundError:
        return False
    return True


def read_into(url: str, offset: int, view: memoryview) -> None:
    """Bytes [offset, offset + len(view)) of an object into ``view``: one ranged GET; short is an error."""
    if not len(view):
        return
    u = ObjectUrl.parse(url)
    want = len(view)
    try:
        reply = client().get_object(Bucket=u.bucket, Key=u.key, Range=f"bytes={offset}-{offset + want - 1}")
        body = reply["Body"]
        got = 0
        while got < want:
            n = body.readinto(view[got:])  # straight from the socket into the caller's memory
            if not n:
                break
            got += n
        body.close()
    except Exception as exc:  # botocore's timeouts are OSErrors too: each becomes the one of its errno
        raise _os_error(exc, url, "reading") from None
    if got != want:
        raise OSError(errno.EIO, f"short read: {got} of {want} bytes at offset {offset}", url)


def download(url: str, fd: int, nbytes: int, piece_bytes: int = 32 << 20) -> None:
    """The whole object (``nbytes``) into the open file ``fd``: ranged GETs in parallel, each piece
    written at its offset."""
    def fetch(start: int) -> None:
        buf = bytearray(min(piece_bytes, nbytes - start))
        read_into(url, start, memoryview(buf))
        view, done = memoryview(buf), 0
        while done < len(buf):
            done += os.pwrite(fd, view[done:], start + done)

    futures = [_executor().submit(fetch, start) for start in range(0, nbytes, piece_bytes)]
    _all(futures)


def _all(futures: list[cf.Future]) -> None:
    """Wait for every future; the first failure is raised once all have ended (none left writing)."""
    first = None
    for f in futures:
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001 - kept, raised below
            first = first or exc
    if first is not None:
        raise first


def list_children(url: str) -> tuple[list[str], list[str]]:
    """What lies directly under ``url``: the names of its "directories" (common prefixes) and of its objects."""
    u = ObjectUrl.parse(url)
    dirs, objects = [], []
    try:
        pages = client().get_paginator("list_objects_v2").paginate(Bucket=u.bucket, Prefix=u.prefix, Delimiter="/")
        for page in pages:
            dirs += [p["Prefix"][len(u.prefix):].rstrip("/") for p in page.get("CommonPrefixes", ())]
            # A key equal to the prefix is a directory marker some servers keep, not an object of ours.
            objects += [o["Key"][len(u.prefix):] for o in page.get("Contents", ()) if len(o["Key"]) > len(u.prefix)]
    except Exception as exc:
        raise _os_error(exc, url, "listing") from None
    return dirs, objects


def has_objects(url: str) -> bool:
    """Whether any object lies under ``url`` (a "directory" exists): one listing of at most one key."""
    u = ObjectUrl.parse(url)
    try:
        reply = client().list_objects_v2(Bucket=u.bucket, Prefix=u.prefix, MaxKeys=1)
    except Exception as exc:
        raise _os_error(exc, url, "listing") from None
    return bool(reply.get("KeyCount") or reply.get("Contents"))


def walk(url: str) -> Iterator[tuple[str, int]]:
    """Every object under ``url``, at any depth: (its name below ``url``, its size)."""
    u = ObjectUrl.parse(url)
    try:
        for page in client().get_paginator("list_objects_v2").paginate(Bucket=u.bucket, Prefix=u.prefix):
            for o in page.get("Contents", ()):
                if len(o["Key"]) > len(u.prefix) and not o["Key"].endswith("/"):  # not a directory marker
                    yield o["Key"][len(u.prefix):], int(o["Size"])
    except Exception as exc:
        raise _os_error(exc, url, "listing") from None


def delete(urls: list[str]) -> None:
    """Delete objects (missing ones are no error), in batches of S3's 1,000 per request."""
    by_bucket: dict[str, list[str]] = {}
    for url in urls:
        u = ObjectUrl.parse(url)
        by_bucket.setdefault(u.bucket, []).append(u.key)
    for bucket, keys in by_bucket.items():
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]
            try:
                reply = client().delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch],
                                                                       "Quiet": True})
            except Exception as exc:
                raise _os_error(exc, f"{SCHEME}{bucket}/{batch[0]}", "deleting") from None
            errors = [e for e in reply.get("Errors", ()) if e.get("Code") not in _MISSING]
            if errors:
                e = errors[0]
                raise _answer_error(str(e.get("Code")), str(e.get("Message")), f"{SCHEME}{bucket}/{e.get('Key')}",
                                    "deleting")


def delete_tree(url: str) -> int:
    """Delete every object under ``url``; the number deleted."""
    names = [join(url, name) for name, _ in walk(url)]
    delete(names)
    return len(names)


def abort_incomplete_uploads(url: str) -> int:
    """Abort the multipart uploads under ``url`` that never completed (a crash mid-flush leaves them,
    and the server keeps their parts, billed, until aborted); the number aborted."""
    u = ObjectUrl.parse(url)
    aborted = 0
    try:
        for page in client().get_paginator("list_multipart_uploads").paginate(Bucket=u.bucket, Prefix=u.prefix):
            for up in page.get("Uploads", ()):
                client().abort_multipart_upload(Bucket=u.bucket, Key=up["Key"], UploadId=up["UploadId"])
                aborted += 1
    except Exception as exc:
        raise _os_error(exc, url, "aborting incomplete uploads") from None
    return aborted


def probe_root(url: str) -> None:
    """At start-up: the bucket exists, the credentials are accepted and writes are allowed (a probe
    object written and deleted). Raises the ``OSError`` naming the first problem."""
    probe = ObjectUrl.parse(url).child(f".datastates-probe-{os.getpid()}-{threading.get_ident()}")
    u = ObjectUrl.parse(url)
    try:
        client().head_bucket(Bucket=u.bucket)
    except Exception as exc:
        error = _os_error(exc, url, "opening the bucket")
        if isinstance(error, FileNotFoundError):  # HEAD has no body: a bare 404 is the bucket's
            error = FileNotFoundError(errno.ENOENT, f"the bucket {u.bucket!r} does not exist", url)
        raise error from None
    put(probe, b"")
    delete([probe])


class Upload:
    """One object written in parts at increasing offsets (``write_at``), completed by ``close``.

    The interface of ``files.ChunkFile``, so the I/O worker writes either the same way. Parts of a
    run go up in parallel, each at least ``part_bytes`` (and S3's 5 MiB), cut where the run allows;
    bytes too few for a part are kept (copied) until the next run or the end. ``write_at`` returns
    once its bytes are with the server or kept: the caller may reuse its memory then. Nothing is
    visible until ``close`` completes the upload; ``abort`` removes its parts.
    """

    direct = False

    def __init__(self, url: str, expected_size: int | None = None):
        self.path = url
        self._u = ObjectUrl.parse(url)
        target = PART_BYTES if expected_size is None else max(PART_BYTES, -(-expected_size // (MAX_PARTS - 10)))
        self.part_bytes = max(MIN_PART_BYTES, target)
        self.position = 0
        self._pending = bytearray()
        self._parts: list[dict] = []
        self._upload_id: str | None = None

    def _begin(self) -> str:
        if self._upload_id is None:
            try:
                reply = client().create_multipart_upload(Bucket=self._u.bucket, Key=self._u.key)
            except Exception as exc:
                raise _os_error(exc, self.path, "starting an upload") from None
            self._upload_id = reply["UploadId"]
        return self._upload_id

    def _send(self, pieces: list[memoryview]) -> None:
        upload_id = self._begin()
        first = len(self._parts) + 1

        def one(number: int, piece: memoryview) -> dict:
            try:
                reply = client().upload_part(Bucket=self._u.bucket, Key=self._u.key, UploadId=upload_id,
                                             PartNumber=number, Body=_ViewBody(piece), ContentLength=len(piece))
            except Exception as exc:
                raise _os_error(exc, self.path, f"uploading part {number}") from None
            return {"PartNumber": number, "ETag": reply["ETag"]}

        if len(pieces) == 1:
            self._parts.append(one(first, pieces[0]))
            return
        futures = [_executor().submit(one, first + i, p) for i, p in enumerate(pieces)]
        _all(futures)
        self._parts += [f.result() for f in futures]

    def write_at(self, offset: int, data: memoryview) -> None:
        if offset != self.position:
            raise OSError(errno.EINVAL, f"upload written at {offset}, expected {self.position}: out of order", self.path)
        data = data.cast("B") if data.format != "B" else data
        self.position += len(data)
        if self._pending:
            self._pending += data
            if len(self._pending) >= self.part_bytes:
                whole, self._pending = memoryview(self._pending), bytearray()  # sent as it is: no second copy
                self._send(self._cut(whole))
            return
        whole_parts = len(data) // self.part_bytes
        if whole_parts == 0:
            self._pending += data
            return
        sent = whole_parts * self.part_bytes
        self._send(self._cut(data[:sent]))
        if sent < len(data):
            self._pending += data[sent:]

    def _cut(self, view: memoryview) -> list[memoryview]:
        """``view`` in at most ``CONCURRENCY`` parts, each at least ``part_bytes``."""
        count = max(1, min(CONCURRENCY, len(view) // self.part_bytes))
        step = len(view) // count
        return [view[i * step: (i + 1) * step if i < count - 1 else len(view)] for i in range(count)]

    def close(self, size: int, sync_dir: bool = True) -> None:
        """The last bytes up and the upload completed: the object exists, ``size`` bytes long."""
        if size != self.position:
            self.abort()
            raise OSError(errno.EIO, f"upload of {self.position} bytes closed as {size}", self.path)
        if self._upload_id is None:  # small: one object, no multipart
            rest, self._pending = self._pending, bytearray()
            put(self.path, rest)
            return
        if self._pending or not self._parts:
            rest, self._pending = memoryview(self._pending), bytearray()
            self._send([rest])
        try:
            client().complete_multipart_upload(Bucket=self._u.bucket, Key=self._u.key, UploadId=self._upload_id,
                                               MultipartUpload={"Parts": self._parts})
        except Exception as exc:
            self.abort()
            raise _os_error(exc, self.path, "completing the upload") from None
        self._upload_id = None

    def abort(self) -> None:
        upload_id, self._upload_id = self._upload_id, None
        self._pending = bytearray()
        if upload_id is not None:
            try:
                client().abort_multipart_upload(Bucket=self._u.bucket, Key=self._u.key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - best effort: the next start-up aborts what is left
                pass


__all__ = ["SCHEME", "ObjectUrl", "Upload", "is_object_url", "normalize", "resolve_root", "under", "join", "put", "get", "size", "exists",
           "identity", "read_into", "download", "list_children", "walk", "delete", "delete_tree", "abort_incomplete_uploads",
           "probe_root", "client", "endpoint_url"]


def reset_clients() -> None:
    """Forget this process's clients, so the next ``client()`` is made afresh from the environment as it
    is then (tests that restart a server on other ports, or tidy up after switching credentials)."""
    with _client_lock:
        _clients.clear()
