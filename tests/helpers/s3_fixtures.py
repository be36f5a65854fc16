"""Fixtures of the object-store tests (a pytest plugin, registered in tests/conftest.py): one real S3
server per test run (``megatron_ext.testing.s3_server``: SeaweedFS on loopback, started when a test
first asks for it) and a fresh bucket per test, the environment pointed at the server as its admin.

Tests that switch identity set the variables of ``s3_server.env(...)`` (monkeypatch) and call
``object_store.reset_clients()``: the module caches its client per endpoint, profile and access key.
"""

from __future__ import annotations

import itertools
import re

import pytest

_numbers = itertools.count()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The session's SeaweedFS S3 server (skips the test where the ``weed`` binary or boto3 is missing)."""
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install boto3)")
    from megatron_ext.testing.s3_server import INSTALL_HINT, S3Server, S3ServerError, weed_binary

    try:
        weed_binary()
    except S3ServerError:
        pytest.skip(f"no SeaweedFS 'weed' binary for the S3 tests: {INSTALL_HINT}")
    server = S3Server(tmp_path_factory.mktemp("s3-server")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, request):
    """A bucket of this test's own (its name), the environment set for the admin identity; removed
    at teardown, with the server resumed or restarted first if the test left it stopped."""
    from megatron_ext.engine import object_store
    from megatron_ext.testing.s3_server import COMPETING_VARIABLES

    s3_server.ensure_running()
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    name = f"t{next(_numbers):03d}-{slug}"[:63].rstrip("-")
    s3_server.create_bucket(name)
    for variable in COMPETING_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    for variable, value in s3_server.env("admin").items():
        monkeypatch.setenv(variable, value)
    object_store.reset_clients()
    yield name
    s3_server.ensure_running()
    s3_server.remove_bucket(name)  # the server's own admin client: the test may have changed the environment
    object_store.reset_clients()


@pytest.fixture
def s3_root(s3_bucket):
    """``s3://<this test's bucket>/ckpt``: a checkpoint root on the session's server."""
    return f"s3://{s3_bucket}/ckpt"
