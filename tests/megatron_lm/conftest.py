"""Megatron-LM's own training loop (``pretrain_gpt.py``) on CPU ranks: needs the patched checkout.

``scripts/fetch_megatron.sh`` puts it in the user's cache (from ``MEGATRON_LM_DIR`` or a clone);
without it these tests skip with one line saying how to get it.
"""

import pytest

from helpers.megatron_lm_runs import checkout_or_skip


@pytest.fixture(scope="session")
def checkout():
    return checkout_or_skip()
