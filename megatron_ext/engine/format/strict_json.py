"""The one JSON parser for everything a checkpoint holds: strict, so a malformed file fails by name."""

from __future__ import annotations

import json
from typing import Any


def parse_json(raw: bytes) -> Any:
    """This format's JSON (headers, manifests, sidecars): UTF-8, no duplicate keys, no NaN literals.

    ``ValueError`` says what is wrong (``RecursionError`` for absurd nesting becomes one too).
    """
    def pairs(items: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for key, value in items:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
