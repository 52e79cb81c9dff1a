# Sourced by the scripts/setup_*.sh: what every side venv's setup shares. A side venv holds a tool (vLLM, TRL,
# agentlightning) whose pins would move .venv's own; a stamp in it marks a finished, verified install, so a
# rerun does nothing until the pins change or --force is given.
#   side_venv_begin NAME VENV WANT [--force]   exits 0 when VENV already holds WANT; else creates VENV
#   side_pip ARGS...                           pip install into VENV, minus this machine's index-folder noise
#   side_venv_done MESSAGE                     writes the stamp and says how long it took
# env: PYTHON (the base interpreter, default python3)

side_venv_begin() {
    SIDE_NAME="$1" SIDE_VENV="$2" SIDE_WANT="$3"
    SIDE_STAMP="$SIDE_VENV/.agl-$SIDE_NAME-setup"
    SIDE_START=$(date +%s)
    trap 'side_fail "command \"$BASH_COMMAND\" exited with $? (line $LINENO); rerun with --force after fixing"' ERR
    if [[ "${4:-}" == "--force" ]]; then rm -f "$SIDE_STAMP"; fi
    if [[ -f "$SIDE_STAMP" && "$(cat "$SIDE_STAMP")" == "$SIDE_WANT" && -x "$SIDE_VENV/bin/python" ]]; then
        echo "setup_$SIDE_NAME.sh: $SIDE_VENV already complete ($SIDE_WANT); nothing to do"
        exit 0
    fi
    local python="${PYTHON:-python3}"
    command -v "$python" >/dev/null || side_fail "base interpreter '$python' not found; set PYTHON=/path/to/python3.11"
    if [[ ! -x "$SIDE_VENV/bin/python" ]]; then
        echo "setup_$SIDE_NAME.sh: creating $SIDE_VENV"
        "$python" -m venv "$SIDE_VENV"
    fi
    echo '*' > "$SIDE_VENV/.gitignore"  # git never sees the venv, wherever it lies in the work tree
}

side_fail() { echo "setup_$SIDE_NAME.sh: FAILED: $*" >&2; exit 1; }

side_pip() {
    "$SIDE_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
}

side_venv_done() {
    echo "$SIDE_WANT" > "$SIDE_STAMP"
    echo "setup_$SIDE_NAME.sh: done in $(( $(date +%s) - SIDE_START ))s; $1"
}
