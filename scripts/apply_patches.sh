#!/usr/bin/env bash
# Apply megatron_ext's patch series to a Megatron-LM checkout at the pinned commit.
#   scripts/apply_patches.sh [MEGATRON_DIR]      (default: ./Megatron-LM)
# Clones Megatron-LM (MEGATRON_LM_URL) when MEGATRON_DIR does not exist, checks out the pin,
# refuses a dirty tree or another commit, and does nothing when the series is already applied.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/megatron_pin.sh"
require_git
DIR="${1:-Megatron-LM}"

if [[ ! -e "$DIR" ]]; then
    echo "cloning Megatron-LM into $DIR"
    git clone --quiet "$MEGATRON_LM_URL" "$DIR" || die "could not clone $MEGATRON_LM_URL"
    git -C "$DIR" checkout --quiet "$MEGATRON_PIN_COMMIT" || die "commit $MEGATRON_PIN_COMMIT not found in the clone"
fi
check_pin "$DIR"
case "$(patch_state "$DIR")" in
    applied) echo "megatron_ext patches are already applied to $DIR; nothing to do"; exit 0 ;;
    dirty) die "$DIR has uncommitted changes; commit or stash them first (git -C $DIR status)" ;;
esac
# shellcheck disable=SC2046
git -C "$DIR" apply --check $(patch_series) || die "the patch series does not apply to $DIR; nothing was changed"
# shellcheck disable=SC2046
git -C "$DIR" apply $(patch_series)
echo "applied $(patch_series | wc -l) patches to $DIR:"
patch_series | xargs -n1 basename | sed 's/^/  /'
