#!/usr/bin/env bash
# Check the whole patch series against a real Megatron-LM checkout without modifying it:
# export the pinned commit to a temporary directory, apply the series there, byte-compile every
# patched file and import the patched modules with megatron_ext on the path.
#   scripts/check_patches.sh MEGATRON_DIR [PYTHON]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/megatron_pin.sh"
require_git
DIR="${1:?usage: check_patches.sh MEGATRON_DIR [PYTHON]}"
PY="${2:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python}"
"$PY" -m pip install --quiet -r "$(dirname "$PATCH_DIR")/requirements/megatron-lm.txt" 2>/dev/null \
    || die "could not install requirements/megatron-lm.txt into $PY's environment"
git -C "$DIR" cat-file -e "$MEGATRON_PIN_COMMIT^{commit}" 2>/dev/null || die "$DIR does not contain commit $MEGATRON_PIN_COMMIT"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
git -C "$DIR" archive "$MEGATRON_PIN_COMMIT" | tar -x -C "$TMP"
cd "$TMP"
git init --quiet && git add -A && git -c user.name=check -c user.email=check@localhost commit --quiet -m pin
for p in $(patch_series); do
    git apply --check "$p" || die "$(basename "$p") does not apply"
    git apply "$p"
    echo "ok   $(basename "$p") applies"
done
files="$(git diff --name-only)"
for f in $files; do
    "$PY" -m py_compile "$f" || die "$f does not compile after patching"
done
echo "ok   patched files compile: $(echo $files | tr '\n' ' ')"
PYTHONPATH="$TMP" "$PY" - <<'PYEOF'
import argparse
from megatron.training import arguments, checkpointing, async_utils  # the patched modules
parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
args = parser.parse_args(["--use-datastates", "--datastates-host-cache-size", "2", "--save", "/tmp"])
assert args.use_datastates and args.datastates_host_cache_size == 2.0
print("ok   patched megatron.training modules import; --use-datastates parses")
PYEOF
echo "ok   the patch series is consistent with $MEGATRON_PIN_TAG ($MEGATRON_PIN_COMMIT)"
