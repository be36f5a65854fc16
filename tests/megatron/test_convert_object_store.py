"""``megatron-ext convert`` with its datastates side on the object-store level (the session's real S3 server).

A megatron-core ``torch_dist`` checkpoint (TP=2 x PP=2 x DP=2, written by megatron-core's own
``dist_checkpointing.save``: ``megatron_ext.testing.torch_dist_layout``) converted ``--to datastates
s3://...`` is committed there (manifest and tracker objects), passes ``verify`` on the URL with every
checksum, and converted back ``--to torch_dist`` from the URL holds exactly the source's tensors
(megatron-core's ``load_plain_tensors`` on both). A URL on the side megatron-core reads or writes
through the file system, or another scheme, is refused in one line before anything is read.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from megatron_ext import cli  # noqa: E402
from megatron_ext.engine import object_store  # noqa: E402
from megatron_ext.engine.read.verify import verify_root  # noqa: E402

from helpers.procs import REPO, child_env  # noqa: E402
from helpers.torch_dist_compare import SAME_TENSORS  # noqa: E402

TIMEOUT_S = 300


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=child_env(CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_convert_into_and_out_of_an_object_store_keeps_every_tensor(tmp_path, s3_root):
    source = tmp_path / "torch_dist"
    built = json.loads(_run("-m", "megatron_ext.testing.torch_dist_layout", str(source), "--tp", "2", "--pp", "2",
                            "--dp", "2", "--layers", "2", "--hidden", "64", "--ffn", "128",
                            "--vocab", "256").stdout.strip().splitlines()[-1])

    summary = json.loads(_run("-m", "megatron_ext", "convert", str(source), "--to", "datastates", s3_root,
                              "--json", "--quiet").stdout)
    assert summary["out"] == f"{s3_root}/iter_0000007" and summary["ranks"] == 8
    assert summary["shards"] == built["shards"]
    assert object_store.get(f"{s3_root}/latest_checkpointed_iteration.txt") == b"7"
    checked, problems = verify_root(s3_root, None, deep=True)
    assert checked == ["iter_0000007"] and problems == []

    back = tmp_path / "back"
    _run("-m", "megatron_ext", "convert", s3_root, "--to", "torch_dist", str(back), "--quiet")
    _run("-c", SAME_TENSORS, str(source / "iter_0000007"), str(back / "iter_0000007"))


@pytest.mark.parametrize("argv, said", [
    (["s3://b/ckpt", "--to", "datastates", "out"], "DIR 's3://b/ckpt' is a URL: convert reads torch_dist"),
    (["in", "--to", "torch_dist", "s3://b/out"], "'s3://b/out' is a URL: megatron-core writes torch_dist"),
    (["in", "--to", "datastates", "gs://b/out"], "'gs://b/out' is a gs:// URL; the object-store level takes s3://"),
])
def test_a_url_where_the_file_system_is_needed_is_one_line(tmp_path, capsys, argv, said):
    assert cli.main(["convert", *argv]) != 0
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
