"""Site settings for ``scripts/launch.sh`` as a user writes them (configs/site.env.example), pointing
at placeholder paths: a Megatron-LM directory whose ``pretrain_gpt.py`` only exits, and the shared and
node-local checkpoint levels (``lustre``, ``scratch``), all under one directory."""

from __future__ import annotations

from pathlib import Path


def placeholder_site(directory: Path, **settings: str) -> Path:
    """Writes ``directory/site.env`` (plus ``settings``, e.g. ``PYTHON``) and returns its path."""
    megatron = directory / "Megatron-LM"
    megatron.mkdir(parents=True, exist_ok=True)
    (megatron / "pretrain_gpt.py").write_text("raise SystemExit('placeholder')\n")
    values = {"MEGATRON_LM_DIR": megatron, "CKPT_ROOT": directory / "lustre", "LOCAL_SCRATCH": directory / "scratch",
              **settings}
    site = directory / "site.env"
    site.write_text("".join(f"{key}={value}\n" for key, value in values.items()))
    return site
