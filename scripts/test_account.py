#!/usr/bin/env python3
"""Where the test suite's wall time goes: per directory, per kind of process it starts, and the warm ranks.

    .venv/bin/python scripts/test_account.py OUT_DIR [pytest arguments, default: tests]

Runs pytest (as scripts/run_tests.sh does: one OpenMP thread, ``--durations=25``) with two probes:
a ``sitecustomize`` on ``PYTHONPATH`` that logs every Python interpreter the run starts (start, end,
its CPU seconds, its command line, the test that started it), and the session zygote's log of the
torchrun jobs it served warm (``helpers.warm_ranks``). Then prints a Markdown account of
``OUT_DIR/junit.xml`` and ``OUT_DIR/processes.log``, the tables of docs/TESTING.md; ``--report OUT_DIR``
prints it again without running anything. A process killed with SIGKILL logs no end: it is counted,
its CPU is not.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = '''
import atexit, os, time
if os.environ.get("MEGATRON_EXT_PROCESS_LOG"):
    _path = os.environ["MEGATRON_EXT_PROCESS_LOG"]
    _pid = os.getpid()
    with open("/proc/self/cmdline", "rb") as f:
        _cmd = f.read().replace(b"\\0", b" ").decode(errors="replace").strip()[:400]
    _test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
    with open(_path, "a") as f:
        f.write(f"S {time.time():.3f} {_pid} {os.getppid()} {_test} | {_cmd}\\n")
    def _end():
        if os.getpid() == _pid:  # not in a forked child
            t = os.times()
            with open(_path, "a") as f:
                f.write(f"E {time.time():.3f} {_pid} {t.user + t.system:.2f}\\n")
    atexit.register(_end)
'''


def run(out: Path, pytest_args: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    probe_dir = Path(tempfile.mkdtemp(prefix="megatron-ext-probe-"))
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               MEGATRON_EXT_PROCESS_LOG=str(out / "processes.log"),
               MEGATRON_EXT_WARM_RANKS_LOG=str(out / "zygote.log"),
               PYTHONPATH=os.pathsep.join(p for p in (str(probe_dir), os.environ.get("PYTHONPATH")) if p))
    (out / "processes.log").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "--durations=25", f"--junitxml={out / 'junit.xml'}",
           *(pytest_args or ["tests"])]
    started = time.monotonic()
    with open(out / "pytest.log", "w") as log:
        rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    (out / "wall_s").write_text(f"{time.monotonic() - started:.1f}\n")
    return rc


def _kind(cmd: str, agents: set[str], ppid: str) -> str:
    if "torch.distributed.run" in cmd:
        return "torchrun agent (cold launcher)"
    if "warm_ranks.py serve" in cmd:
        return "zygote (warm ranks)"
    if "warm_ranks.py launch" in cmd:
        return "warm launcher (client)"
    prefix = "torchrun rank: " if ppid in agents else ""
    if "multiprocessing.spawn" in cmd or "multiprocessing.forkserver" in cmd or "multiprocessing.resource" in cmd:
        return "multiprocessing child (spawn/forkserver)"
    m = re.search(r" -m (\S+)(?: (\S+))?", cmd)
    if m:
        module = m.group(1)
        if module == "megatron_ext" and m.group(2):
            module += " " + m.group(2)
        return prefix + "-m " + module
    m = re.search(r"(\S+\.py)\b", cmd)
    if m:
        return prefix + m.group(1).rsplit("/", 1)[-1]
    return prefix + ("python -c" if " -c " in cmd else cmd.split(" ")[0].rsplit("/", 1)[-1])


def report(out: Path) -> str:
    lines: list[str] = []
    wall = (out / "wall_s").read_text().strip() if (out / "wall_s").exists() else "?"
    cases = [(c.get("classname", ""), c.get("name", ""), float(c.get("time", 0)), c) for c in
             ET.parse(out / "junit.xml").getroot().iter("testcase")]
    outcome = collections.Counter("skipped" if c.find("skipped") is not None else
                                  "failed" if c.find("failure") is not None or c.find("error") is not None else
                                  "passed" for *_, c in cases)
    lines.append(f"pytest wall {float(wall) / 60:.1f} min; {outcome['passed']} passed, {outcome['failed']} failed, "
                 f"{outcome['skipped']} skipped")
    by_dir = collections.defaultdict(lambda: [0, 0.0])
    for classname, _, seconds, _ in cases:
        parts = classname.split(".")
        key = "/".join(parts[:2]) if len(parts) > 2 else parts[0] + ".py"
        by_dir[key][0] += 1
        by_dir[key][1] += seconds
    total = sum(v[1] for v in by_dir.values()) or 1.0
    lines += ["", "| tests | count | minutes | share |", "|---|---:|---:|---:|"]
    for key, (n, seconds) in sorted(by_dir.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{key}` | {n} | {seconds / 60:.1f} | {100 * seconds / total:.0f} % |")

    starts, ends = {}, {}
    log = out / "processes.log"
    for line in (log.read_text(errors="replace").splitlines() if log.exists() else []):
        p = line.split()
        if len(p) >= 5 and p[0] == "S":
            starts[p[2]] = (float(p[1]), p[3], p[4], line.split("|", 1)[1].strip())
        elif len(p) >= 4 and p[0] == "E":
            ends[p[2]] = (float(p[1]), float(p[3]))
    agents = {pid for pid, (_, _, _, cmd) in starts.items() if "torch.distributed.run" in cmd}
    kinds = collections.defaultdict(lambda: [0, 0, 0.0])
    for pid, (_, ppid, _, cmd) in starts.items():
        k = kinds[_kind(cmd, agents, ppid)]
        k[0] += 1
        if pid in ends:
            k[1] += 1
            k[2] += ends[pid][1]
    lines += ["", f"{len(starts)} Python processes started ({len(ends)} ended normally and logged their CPU)", "",
              "| process | started | CPU s (of those that ended normally) |", "|---|---:|---:|"]
    for name, (n, ended, cpu) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:30]:
        lines.append(f"| {name} | {n} | {cpu:.0f} ({ended}) |")
    zlog = out / "zygote.log"
    if zlog.exists():
        jobs = [line for line in zlog.read_text(errors="replace").splitlines() if re.match(r"\[warm_ranks\] \d\d:", line)]
        warm = [j for j in jobs if j.endswith(": warm")]
        ranks = sum(int(re.search(r"\] \S+ (\d+) x", j).group(1)) for j in warm)
        cold = collections.Counter(j.split(" because ", 1)[1] for j in jobs if " cold start of " in j)
        lines += ["", f"torchrun jobs through the zygote: {len(warm)} warm ({ranks} ranks forked), "
                      f"{sum(cold.values())} cold"]
        lines += [f"- cold: {n} x {why}" for why, n in cold.most_common()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--report"] and len(argv) == 2:
        print(report(Path(argv[1])))
        return 0
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    rc = run(out, argv[1:])
    print(report(out))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
