"""Shared pytest options (long runs stay out of the default suite unless --run-slow is given) and the
session's warm ranks."""

import pytest

#: The object-store tests' S3 server and buckets (s3_server, s3_bucket, s3_root).
pytest_plugins = ["helpers.s3_fixtures"]


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (many crash trials, full benchmarks)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


_zygotes = []  # the session's warm ranks (helpers.warm_ranks), one per flavour
_summary = []  # what the zygotes served, for the terminal summary


def pytest_sessionstart(session):
    """Start the session's warm ranks (``helpers.warm_ranks``): every torchrun job of the tests forks its
    ranks from a process that imported torch, megatron-core and megatron.training (or DeepSpeed) once."""
    import os
    import tempfile

    from helpers import warm_ranks

    if session.config.option.collectonly or os.environ.get("MEGATRON_EXT_COLD_RANKS", "") not in ("", "0"):
        return
    from megatron_ext.testing import megatron_lm

    from helpers.procs import child_env

    checkout = None
    if megatron_lm.cache_dir().is_dir():  # brought up to date with the patch series before it is imported
        found, _ = megatron_lm.find_checkout()
        checkout = str(found) if found else None
    _compile_sources(checkout)
    directory = tempfile.mkdtemp(prefix="megatron-ext-warm-ranks-")
    _zygotes.append(warm_ranks.start_zygote(directory, "megatron", megatron_lm.environment(child_env()), checkout))
    _zygotes.append(warm_ranks.start_zygote(directory, "deepspeed", child_env(DS_ACCELERATOR="cpu",
                                                                             CUDA_VISIBLE_DEVICES="")))
    os.environ[warm_ranks.ENV] = directory


def _compile_sources(checkout):
    """Bytecode for what the session's processes import from source: this checkout and the patched
    Megatron-LM (site-packages has its own from pip). Where ``PYTHONDONTWRITEBYTECODE`` is set (these
    VMs), every process would compile them again: 0.3-0.5 s of CPU for ``megatron_ext`` alone."""
    import compileall
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    for path in (repo / "megatron_ext", repo / "tests", *([Path(checkout) / "megatron" / "training"] if checkout else [])):
        compileall.compile_dir(str(path), quiet=2, workers=0)
    for path in [repo / "datastates.py", *(Path(checkout).glob("*.py") if checkout else [])]:
        compileall.compile_file(str(path), quiet=2)


def pytest_sessionfinish(session, exitstatus):
    import os
    import shutil

    from helpers import warm_ranks

    if _zygotes:
        for zygote in _zygotes:
            warm_ranks.stop_zygote(zygote)
        directory = os.environ.pop(warm_ranks.ENV)
        logs = [os.path.join(directory, flavour, "zygote.log") for flavour in warm_ranks.FLAVOURS]
        logs.append(os.path.join(directory, warm_ranks.COLD_LOG_NAME))
        lines = []
        for path in logs:
            if os.path.exists(path):
                with open(path) as log:
                    lines += log.read().splitlines()
        if os.environ.get("MEGATRON_EXT_WARM_RANKS_LOG"):  # where the zygotes' logs of the jobs they served go
            with open(os.environ["MEGATRON_EXT_WARM_RANKS_LOG"], "w") as out:
                out.writelines(line + "\n" for line in lines)
        warm = sum(line.endswith(": warm") for line in lines)
        cold = [line for line in lines if " cold start of " in line]
        _summary.append(f"warm ranks: {warm} jobs forked from the session's zygotes, {len(cold)} started cold")
        _summary.extend(cold)
        shutil.rmtree(directory, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    """How many jobs ran warm, and every cold start with its reason: a CI log shows what the run paid."""
    for line in _summary:
        terminalreporter.write_line(line)
