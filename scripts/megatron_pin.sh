# Sourced by the patch scripts: the one place the Megatron-LM pin is written down.
MEGATRON_PIN_COMMIT=5be9626709af2722333bf54797c954c09edeada3
MEGATRON_PIN_TAG=core_v0.19.0
MEGATRON_LM_URL="${MEGATRON_LM_URL:-https://github.com/NVIDIA/Megatron-LM.git}"
PATCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../patches" && pwd)"

die() { echo "error: $*" >&2; exit 1; }

require_git() {
    command -v git >/dev/null 2>&1 || die "git is not installed; install git and run again"
}

patch_series() {
    ls "$PATCH_DIR"/[0-9][0-9][0-9][0-9]-*.patch
}

# Prints "applied", "clean" or "dirty" for the checkout $1 (which must be at the pin).
patch_state() {
    local dir="$1"
    # shellcheck disable=SC2046
    if git -C "$dir" apply --reverse --check $(patch_series) >/dev/null 2>&1; then
        echo applied
    elif [[ -z "$(git -C "$dir" status --porcelain --untracked-files=no)" ]]; then
        echo clean
    else
        echo dirty
    fi
}

check_pin() {
    local dir="$1" head
    git -C "$dir" rev-parse --git-dir >/dev/null 2>&1 || die "$dir is not a git checkout of Megatron-LM"
    head="$(git -C "$dir" rev-parse HEAD)"
    [[ "$head" == "$MEGATRON_PIN_COMMIT" ]] || die "$dir is at commit $head, but the patches are for $MEGATRON_PIN_TAG ($MEGATRON_PIN_COMMIT); run: git -C $dir checkout $MEGATRON_PIN_COMMIT"
}
