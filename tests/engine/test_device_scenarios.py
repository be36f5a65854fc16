"""The scenarios ``tests/gpu`` runs on a GPU (``helpers.device_scenarios``), here on the CPU: the
scenarios' own logic stays checked on machines without one."""

from __future__ import annotations

import pytest

from helpers import device_scenarios


@pytest.mark.parametrize("scenario", device_scenarios.SCENARIOS, ids=lambda s: s.__name__)
def test_scenario_on_cpu(scenario, tmp_path):
    scenario(tmp_path, "cpu")
