"""``bench train``'s CPU account (``reference_trainer.process_cpu_seconds``): the engine's share is
the threads it names in the OS and the rank's child processes (the I/O worker), the training
thread's is the caller's own clock, and the total holds both."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from megatron_ext.engine.threads import EngineThread
from megatron_ext.testing.reference_trainer import process_cpu_seconds

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _others_cpu(exclude: int) -> float:
    """CPU seconds of this process's live children other than ``exclude``: the session's warm-rank
    zygotes are children of the test process too, and one still importing would count here."""
    from megatron_ext.engine.threads import proc_cpu_seconds

    children: set[str] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                children.update(f.read().split())
        except OSError:
            continue
    return sum(proc_cpu_seconds(f"/proc/{pid}/stat") for pid in children if int(pid) != exclude)


def test_engine_threads_and_child_processes_count_as_the_engine_s_cpu():
    before = process_cpu_seconds()
    others_before = _others_cpu(exclude=-1)
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.4\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        named = EngineThread(_spin, "datastates-test-spin", (0.3,))
        named.start()
        named.join()
        plain_spun, plain_done = threading.Event(), threading.Event()
        plain = threading.Thread(target=lambda: (_spin(0.3), plain_spun.set(), plain_done.wait(30)))  # alive, not the engine's
        plain.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the child has spun once its CPU shows
            after = process_cpu_seconds()
            if after["cpu_engine_s"] - before["cpu_engine_s"] >= 0.35:
                break
            time.sleep(0.05)
        _spin(0.2)
        assert plain_spun.wait(20)  # on a loaded machine the plain thread's 0.3 s may come after the main thread's
        after = process_cpu_seconds()
        others = _others_cpu(exclude=child.pid) - others_before
        plain_done.set()
        plain.join()
    finally:
        child.kill()
        child.wait()
    # The named thread ended: its CPU is in the process's total, not in the live engine threads' sum.
    # The child (0.4 s) counts as the engine's while alive; the plain thread never does.
    engine = after["cpu_engine_s"] - before["cpu_engine_s"] - others
    assert 0.35 <= engine < 0.4 + 0.3 + 0.05, (before, after, others)
    assert after["cpu_main_s"] - before["cpu_main_s"] >= 0.2
    assert after["cpu_s"] - before["cpu_s"] - others >= 0.3 + 0.3 + 0.2 + 0.35, (before, after, others)


def test_a_live_engine_thread_counts_as_the_engine_s():
    started, release = threading.Event(), threading.Event()

    def spin_then_wait() -> None:
        _spin(0.3)
        started.set()
        release.wait(30)

    before = process_cpu_seconds()
    thread = EngineThread(spin_then_wait, "datastates-test-spin")
    thread.start()
    try:
        assert started.wait(30)
        after = process_cpu_seconds()
    finally:
        release.set()
        thread.join()
    assert after["cpu_engine_s"] - before["cpu_engine_s"] >= 0.25, (before, after)


def test_round_figures_are_ratios_within_the_round_and_every_figure_has_its_rounds():
    from megatron_ext.bench import train_bench
    from megatron_ext.bench.common import figures_over_rounds

    def runs(base: float) -> dict:
        one = {"iter_s": base, "cpu_s_per_iter": 2 * base, "cpu_main_s_per_iter": base, "cpu_engine_s_per_iter": 0.0,
               "blocked_s": 0.1, "ckpt_bytes_per_rank": 1e9, "save_call_cpu_s": None}
        return {"baseline": one, "datastates": {**one, "iter_s": 1.5 * base, "cpu_engine_s_per_iter": 0.5,
                                                "save_call_cpu_s": 0.01 * base},
                "megatron_async": {**one, "iter_s": 3 * base, "blocked_s": 1.0, "save_call_cpu_s": 0.05 * base}}

    rounds = [train_bench.round_figures(runs(b)) for b in (1.0, 2.0, 4.0)]
    assert [r["ratio_iter_datastates_vs_baseline"] for r in rounds] == [1.5, 1.5, 1.5]
    got = figures_over_rounds(rounds)
    assert got["iter_s_baseline"] == 2.0 and got["iter_s_baseline_by_round"] == [1.0, 2.0, 4.0]
    assert got["iter_s_baseline_spread"] == 3.0 and got["ratio_blocked_megatron_vs_datastates"] == 10.0
    assert got["datastates_cpu_s_per_gb"] == 0.0
    assert got["save_call_cpu_s_by_round"] == [0.01, 0.02, 0.04] and got["save_call_cpu_s_megatron_async"] == 0.1
