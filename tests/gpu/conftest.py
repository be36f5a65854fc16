"""GPU node check: every test here needs CUDA and is skipped without it (``pytest tests/gpu`` on a GPU node;
``scripts/gpu_check.sh`` runs it together with ``bench engine --device cuda``)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU node: scripts/gpu_check.sh)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
