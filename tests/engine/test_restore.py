"""Fast restore: parallel aligned reads (with and without O_DIRECT) bit-exact for every dtype and
size, damage still caught and named, one storage level agreed by all ranks, and the benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError, ConfigError, EngineConfig
from megatron_ext.engine.files import supports_o_direct
from megatron_ext.engine.format.entries import ListedFile
from megatron_ext.engine.host_cache import HostCache
from megatron_ext.engine.read import fast_read, read_plan, staged_read

from helpers.damage import cut_tail, flip_bits, overwrite
from helpers.procs import REPO, child_env, torchrun_command
from helpers.states import TINY, assert_same, clone_state

HERE = Path(__file__).resolve().parent

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.complex64]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype`` (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    if dtype == torch.complex64:  # random bits would hold NaNs, which the value comparison rejects
        return torch.randn(shape, dtype=dtype, generator=g)
    return raw.view(dtype).reshape(shape)


def _every_dtype_state() -> dict:
    state = {f"d/{str(dtype)}": _random((3, 1001 + i), dtype, i) for i, dtype in enumerate(DTYPES)}
    state["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    state["empty"] = torch.empty(0, 7)
    state["odd"] = _random((4097 * 3 + 5,), torch.int8, 99)  # not a multiple of 4096
    # Larger than a read piece (8 MiB) and than the staging slots: split across threads.
    state["big"] = _random(((read_plan.READ_PIECE + 12_345) // 4,), torch.float32, 7)
    state["small"] = [_random((i % 13 + 1,), torch.float16, 1000 + i) for i in range(400)]
    state["meta"] = {"step": 3, "name": "x"}
    return state


@pytest.fixture(params=["direct", "buffered"])
def o_direct(request, tmp_path):
    if request.param == "direct":
        if not supports_o_direct(str(tmp_path)):
            pytest.skip("this file system refuses O_DIRECT")
        return True
    return False


def _saved(make_engine, o_direct, **config) -> tuple[CheckpointEngine, dict]:
    engine = make_engine(host_cache_size=0.02, chunk_size_mb=1, o_direct=o_direct, restore_threads=3, **config)
    state = _every_dtype_state()
    expected = clone_state(state)
    engine.save_and_commit(state, "c1", "model", version=1)
    engine.wait_persisted()
    return engine, expected


def test_load_paths_are_bit_exact(make_engine, o_direct):
    engine, expected = _saved(make_engine, o_direct)
    assert_same(engine.load("c1", "model"), expected)
    reader = engine.open_checkpoint("c1").reader("model")
    assert reader.o_direct is o_direct
    assert_same(reader.part("small"), expected["small"])
    names = list(reader.listed.tensors)
    got = reader.tensors(names)
    for name in ("big", "odd", "scalar", "empty"):
        assert_same(reader.tensor(name), expected[name], name)
        assert_same(got[name], expected[name], name)
    # Every tensor has a storage of its own (torch.save of one tensor writes just its bytes).
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in got.values())


def test_load_into_fills_existing_tensors(make_engine, o_direct):
    engine, expected = _saved(make_engine, o_direct)
    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in expected.items()}
    template["small"] = [torch.zeros_like(t) for t in expected["small"]]
    pointers = {k: v.data_ptr() for k, v in template.items() if isinstance(v, torch.Tensor)}
    loaded = engine.load_into("c1", template, "model")
    assert_same(loaded, expected)
    assert all(loaded[k].data_ptr() == p for k, p in pointers.items())  # in place
    assert_same(template["big"], expected["big"])


def test_load_into_parameters_that_require_grad(make_engine, o_direct):
    """A live model's parameters are filled in place (no autograd error), as the Megatron load does."""
    engine = make_engine(host_cache_size=0.01, o_direct=o_direct)
    saved = {"w": _random((3000,), torch.float32, 5), "b": _random((7, 5), torch.bfloat16, 6)}
    engine.save_and_commit(saved, "c1", version=1)
    engine.wait_persisted()
    live = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in saved.items()}
    engine.load_into("c1", live)
    for name, param in live.items():
        assert param.requires_grad and torch.equal(param.detach().view(torch.uint8), saved[name].view(torch.uint8))


def test_read_into_through_tiny_staging_slots(make_engine, tmp_path):
    """4 KiB staging slots, fewer than the threads: every tensor spans many pieces."""
    engine = make_engine(**TINY, restore_threads=4)
    state = {"a": _random((50_001,), torch.float32, 1), "b": _random((3, 333), torch.bfloat16, 2),
             "c": _random((7,), torch.int64, 3)}
    expected = clone_state(state)
    engine.save_and_commit(state, "c1", version=1)
    engine.wait_persisted()
    reader = engine.open_checkpoint("c1").reader("rank00000")
    staging = HostCache(3 * 4096, 4096, pin=False)
    try:
        target = {"a": torch.zeros(50_001), "b": torch.zeros(3, 333, dtype=torch.bfloat16)}
        staged_read.read_into(reader.tensor_path, reader.listed, target, staging, threads=4, timeout_s=60)
        assert_same(target, {"a": expected["a"], "b": expected["b"]})
    finally:
        staging.close()
    strided = {"a": torch.zeros(50_001), "b": torch.zeros(333, 3, dtype=torch.bfloat16).t(), "c": torch.zeros(7, dtype=torch.int64)}
    assert_same(engine.load_into("c1", strided), expected)  # a non-contiguous target is filled too
    with pytest.raises(CheckpointError, match="the target is"):
        engine.load_into("c1", {"a": torch.zeros(5), "b": strided["b"]})


def _streamed_file(make_engine, o_direct) -> tuple[str, ListedFile, dict]:
    """A committed file of every dtype (tensors larger than a piece among them): path, listed, expected."""
    engine, expected = _saved(make_engine, o_direct)
    reader = engine.open_checkpoint("c1").reader("model")
    reader.tensors([])  # checks the file against the manifest, as every reader call does
    return reader.tensor_path, reader.listed, expected


def _empty_targets(listed: ListedFile) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in listed.tensors.items()}


@pytest.mark.parametrize("slots, chunk", [(1, 4096), (3, 4096), (9, read_plan.READ_PIECE)])
def test_stream_into_fills_every_dtype_through_few_reused_slots(make_engine, o_direct, slots, chunk):
    """The GPU-node path (device tensors) run on host tensors: pieces in file order through the slots,
    each tensor hashed on them; one slot is enough, and every slot is given back."""
    path, listed, expected = _streamed_file(make_engine, o_direct)
    staging = HostCache(slots * chunk, chunk, pin=False)
    try:
        staging.wait_allocated(60)
        targets = _empty_targets(listed)
        staged_read.stream_into(path, listed, targets, staging, o_direct=o_direct, threads=4, timeout_s=60)
        reference = fast_read.read_tensors(path, listed, listed.tensors)
        assert_same(targets, {n: reference[n] for n in targets})  # every tensor, bit for bit
        for name in ("big", "odd", "scalar", "d/torch.bfloat16", "d/torch.bool"):
            assert_same(targets[name], expected[name], name)
        assert staging.free_slots == slots
    finally:
        staging.close()


def test_stream_into_names_a_damaged_tensor_and_gives_back_its_slots(make_engine, tmp_path):
    path, listed, expected = _streamed_file(make_engine, False)
    lo, hi = listed.tensors["big"].begin, listed.tensors["big"].end
    staging = HostCache(3 * 4096, 4096, pin=False)
    try:
        flip_bits(path, (lo + hi) // 2)
        with pytest.raises(CheckpointError, match="tensor 'big' fails its checksum"):
            staged_read.stream_into(path, listed, _empty_targets(listed), staging, threads=4, timeout_s=60)
        assert staging.free_slots == 3
        flip_bits(path, (lo + hi) // 2)
        cut_tail(path, 100)
        with pytest.raises(CheckpointError, match=f"{os.path.basename(path)} is truncated"):
            staged_read.stream_into(path, listed, _empty_targets(listed), staging, threads=4, timeout_s=60)
        assert staging.free_slots == 3
    finally:
        staging.close()


def test_stream_into_gives_up_when_no_slot_is_freed(make_engine):
    """Slots held elsewhere (a stuck flush): an error naming the file within the timeout, not a hang."""
    path, listed, _ = _streamed_file(make_engine, False)
    staging = HostCache(2 * 4096, 4096, pin=False)
    try:
        taken = [staging.acquire(60), staging.acquire(60)]
        with pytest.raises(CheckpointError, match=f"reading {path}"):
            staged_read.stream_into(path, listed, _empty_targets(listed), staging, threads=2, timeout_s=1)
        for slot in taken:
            staging.release(slot)
        assert staging.free_slots == 2
    finally:
        staging.close()


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_damage_raises_naming_the_file(make_engine, tmp_path, how):
    engine = make_engine(host_cache_size=0.01, restore_threads=2)
    state = {"x": torch.arange(300_000, dtype=torch.float32), "y": torch.ones(10)}
    engine.save_and_commit(state, "c1", "f", version=1)
    engine.wait_persisted()
    listed = engine.open_checkpoint("c1").listed("f")  # with its tensors (format 2: from the rank report)
    path = str(tmp_path / "ckpt" / listed.file.tensor_file)
    last = max(listed.tensors.values(), key=lambda t: t.end).name  # holds the damaged end
    if how == "flip":
        flip_bits(path, -3)
    else:
        cut_tail(path, 100)
    base = os.path.basename(path)
    with pytest.raises(CheckpointError, match=base):
        engine.load("c1", "f")
    with pytest.raises(CheckpointError, match=base):
        engine.load_into("c1", {"x": torch.zeros(300_000), "y": torch.zeros(10)}, "f")
    with pytest.raises(CheckpointError, match=base):
        engine.open_checkpoint("c1").reader("f").tensor(last)


def test_flip_in_a_middle_tensor_names_it(make_engine, tmp_path):
    engine = make_engine(host_cache_size=0.01)
    engine.save_and_commit({"x": torch.zeros(40_000), "y": torch.ones(40_000)}, "c1", "f", version=1)
    engine.wait_persisted()
    listed = engine.open_checkpoint("c1").listed("f")
    x = listed.tensors["x"]
    overwrite(tmp_path / "ckpt" / listed.file.tensor_file, (x.begin + x.end) // 2, b"\x07")
    with pytest.raises(CheckpointError, match="tensor 'x' fails its checksum"):
        engine.load("c1", "f")
    assert torch.equal(engine.open_checkpoint("c1").reader("f").tensor("y"), torch.ones(40_000))


def test_restore_threads_is_validated():
    assert EngineConfig.from_dict({"restore_threads": 8}).restore_threads == 8
    for bad in (0, 65, 2.5, True, "4"):
        with pytest.raises(ConfigError, match="restore_threads"):
            EngineConfig.from_dict({"restore_threads": bad})


@pytest.mark.multiproc
@pytest.mark.parametrize("drop_rank, level", [(-1, "local"), (1, "shared")])
def test_all_ranks_agree_on_one_level(tmp_path, drop_rank, level):
    out = tmp_path / "out"
    out.mkdir()
    cmd = torchrun_command(2, str(HERE / "_restore_worker.py"), str(tmp_path / "root"), str(out), str(drop_rank))
    proc = subprocess.run(cmd, env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for r, result in enumerate(results):
        assert result["own_complete"] == (r != drop_rank)
        assert result["level"] == level and result["levels_used"] == [level] and result["exact"], result
        assert result["all_reduce_int"] == 3 and result["collective_device"] == "cpu", result


def test_bench_restore_json(tmp_path):
    cmd = [sys.executable, "-m", "megatron_ext", "bench", "restore", "--size-gb", "0.02", "--threads", "2",
           "--repeats", "2", "--megatron", "off", "--json", "--dir", str(tmp_path / "bench")]
    proc = subprocess.run(cmd, env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    reads = ("direct_read_gbps", "direct_read_parallel_gbps", "buffered_read_gbps", "buffered_read_parallel_gbps")
    for key in ("state_bytes", "datastates_restore_s", "datastates_restore_gbps", "torch_load_s", "dcp_load_s",
                "read_ceiling_gbps", "datastates_vs_ceiling", "datastates_vs_direct", "gpu_path_stream_s",
                "gpu_path_fresh_buffer_s", "gpu_path_stream_vs_fresh_buffer", "gpu_path_stream_vs_restore", *reads):
        assert result[key] > 0, key
    assert result["read_ceiling_gbps"] == max(result[k] for k in reads)
    assert len(result["rounds"]) == 2 and all(r["bit_exact"] for r in result["rounds"])
    assert result["datastates_bit_exact"] is True and "megatron_load_s_datastates" not in result

