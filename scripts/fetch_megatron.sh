#!/usr/bin/env bash
# Put a patched checkout of the pinned Megatron-LM where the tests and the main job look for it.
#   scripts/fetch_megatron.sh            prints the checkout's path on its last line
#
# Destination: $MEGATRON_EXT_CACHE/Megatron-LM-<short pin>, with MEGATRON_EXT_CACHE defaulting to
# ${XDG_CACHE_HOME:-~/.cache}/megatron_ext (a user-level cache, outside this repository: none of
# Megatron-LM's files are ever committed here).
# Source: $MEGATRON_LM_DIR when set (an existing checkout or a bare git mirror that contains the
# pinned commit; no network needed), else a clone of $MEGATRON_LM_URL.
# The pinned commit is verified, the patch series applied; when the series changed since the
# cached checkout was patched, the checkout is reset to the pin and patched again. Idempotent.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/megatron_pin.sh"
require_git
CACHE="${MEGATRON_EXT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron_ext}"
DEST="$CACHE/Megatron-LM-${MEGATRON_PIN_COMMIT:0:7}"
STAMP="$DEST/.megatron_ext_patches"  # untracked: which series the checkout carries
series_hash() { cat $(patch_series) | sha1sum | cut -d' ' -f1; }

if [[ ! -d "$DEST/.git" ]]; then
    SRC="${MEGATRON_LM_DIR:-$MEGATRON_LM_URL}"
    [[ -z "${MEGATRON_LM_DIR:-}" || -d "$MEGATRON_LM_DIR" ]] || die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR is not a directory"
    if [[ -n "${MEGATRON_LM_DIR:-}" ]]; then
        git -C "$MEGATRON_LM_DIR" cat-file -e "$MEGATRON_PIN_COMMIT^{commit}" 2>/dev/null \
            || die "$MEGATRON_LM_DIR does not contain commit $MEGATRON_PIN_COMMIT ($MEGATRON_PIN_TAG)"
    fi
    mkdir -p "$CACHE"
    TMP="$(mktemp -d "$CACHE/.clone.XXXXXX")"
    trap 'rm -rf "$TMP"' EXIT
    echo "fetch_megatron: cloning $SRC (commit $MEGATRON_PIN_COMMIT) into $DEST" >&2
    git clone --quiet --no-checkout "$SRC" "$TMP/repo" || die "could not clone $SRC (no network? set MEGATRON_LM_DIR to a local checkout or mirror)"
    git -C "$TMP/repo" -c advice.detachedHead=false checkout --quiet "$MEGATRON_PIN_COMMIT" \
        || die "commit $MEGATRON_PIN_COMMIT is not in $SRC"
    mv "$TMP/repo" "$DEST"
fi
check_pin "$DEST"
want="$(series_hash)"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" || "$(patch_state "$DEST")" != applied ]]; then
    # The series changed (or the tree was edited): back to the pin, then the current series.
    git -C "$DEST" checkout --quiet -- .
    bash "$(dirname "${BASH_SOURCE[0]}")/apply_patches.sh" "$DEST" >&2
    echo "$want" > "$STAMP"
fi
echo "fetch_megatron: $DEST is $MEGATRON_PIN_TAG ($MEGATRON_PIN_COMMIT) with the megatron_ext patches" >&2
echo "$DEST"
