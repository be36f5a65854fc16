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

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.dist_checkpointing.serialization import load_plain_tensors  # noqa: E402

from megatron_ext import cli  # noqa: E402
from megatron_ext.engine import object_store  # noqa: E402
from megatron_ext.engine.read.verify import verify_root  # noqa: E402
from megatron_ext.megatron.convert import single_process_group  # noqa: E402
from megatron_ext.testing import torch_dist_layout  # noqa: E402


def _cli(capsys, *args: str) -> str:
    """The command in this process (one import of megatron-core for the whole test), its stdout."""
    capsys.readouterr()
    code = cli.main(list(args))
    out = capsys.readouterr()
    assert code == 0, f"megatron-ext {' '.join(args)}: {out.err[-4000:]}"
    return out.out


def test_convert_into_and_out_of_an_object_store_keeps_every_tensor(tmp_path, capsys, s3_root):
    source = tmp_path / "torch_dist"
    built = torch_dist_layout.write(str(source), 2, 2, 2, layers=2, hidden=64, ffn=128, vocab=256)

    summary = json.loads(_cli(capsys, "convert", str(source), "--to", "datastates", s3_root, "--json", "--quiet"))
    assert summary["out"] == f"{s3_root}/iter_0000007" and summary["ranks"] == 8
    assert summary["shards"] == built["shards"]
    assert object_store.get(f"{s3_root}/latest_checkpointed_iteration.txt") == b"7"
    checked, problems = verify_root(s3_root, None, deep=True)
    assert checked == ["iter_0000007"] and problems == []

    back = tmp_path / "back"
    _cli(capsys, "convert", s3_root, "--to", "torch_dist", str(back), "--quiet")
    with single_process_group():
        a, b = (load_plain_tensors(str(p / "iter_0000007")) for p in (source, back))
    a, b = ({k: v for k, v in d.items() if isinstance(v, torch.Tensor)} for d in (a, b))
    assert sorted(a) == sorted(b) and len(a) > 10
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8),
                                                        b[k].reshape(-1).view(torch.uint8)) for k in a)


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
