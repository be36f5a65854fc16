#!/usr/bin/env bash
# Remove megatron_ext's patch series from a Megatron-LM checkout (the inverse of apply_patches.sh).
#   scripts/remove_patches.sh [MEGATRON_DIR]     (default: ./Megatron-LM)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/megatron_pin.sh"
require_git
DIR="${1:-Megatron-LM}"
[[ -d "$DIR" ]] || die "$DIR does not exist"
check_pin "$DIR"
case "$(patch_state "$DIR")" in
    clean) echo "megatron_ext patches are not applied to $DIR; nothing to do"; exit 0 ;;
    dirty) die "$DIR has changes other than the megatron_ext patches; refusing to touch it" ;;
esac
# shellcheck disable=SC2046
git -C "$DIR" apply --reverse $(patch_series)
echo "removed the megatron_ext patches from $DIR"
