#!/usr/bin/env bash
# Run the test suite against one torch release, in a throwaway venv outside the repo.
#
#   scripts/check_torch.sh VERSION [VENV_DIR]
#
# Makes a venv (VENV_DIR, or a new temp dir), installs torch==VERSION first, then the package with
# its test extras (`pip install -e '.[test,hf]'`), checks that the second install left torch alone,
# runs `python -m pytest -q` from the repo root and ends with one line:
#
#   check_torch: torch 2.14.1 (python 3.11.7): 312 passed, 3 skipped; 201 s; 2026-12-01
#
# The venv is deleted afterwards (a CUDA build of torch is several GB) unless KEEP_VENV=1 or
# VENV_DIR was given and existed before. The full pytest log is kept at $LOG (default: a temp
# file, printed). FAST=1 runs the fast tier (`-m "not slow"`). Extra pytest arguments can go in
# PYTEST_ARGS (split on spaces). Exit status: pytest's, or 2 for a
# failed install, 3 when installing the package replaced the requested torch.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 VERSION [VENV_DIR]" >&2
    exit 64
fi
version=$1
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}

if [[ $# -eq 2 ]]; then
    venv=$2
    case "$(realpath -m "$venv")/" in
        "$repo"/*) echo "check_torch: VENV_DIR must lie outside the repo ($repo)" >&2; exit 64 ;;
    esac
    [[ -e $venv ]] && KEEP_VENV=${KEEP_VENV:-1}
else
    venv=$(mktemp -d -t "check_torch_${version}.XXXXXX")  # under $TMPDIR
fi
log=${LOG:-$(mktemp -t "check_torch_${version}.XXXXXX.log")}

cleanup() {
    if [[ ${KEEP_VENV:-0} != 1 ]]; then rm -rf "$venv"; fi
}
trap cleanup EXIT

say() { echo "check_torch: $*"; }
fail_line() { say "torch $version: $1; $(date -u +%F)"; }

say "venv $venv, log $log"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip >/dev/null 2>&1 || true

if ! "${pip[@]}" install "torch==$version" 2>&1 | tail -n 3; then
    fail_line "pip install torch==$version failed"; exit 2
fi
# `set -o pipefail` makes the `if !` above see pip's status; check the result directly too.
torch_version() { "$venv/bin/python" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null; }
before=$(torch_version) || { fail_line "torch $version does not import"; exit 2; }

if ! (cd "$repo" && "${pip[@]}" install -e '.[test,hf]' 2>&1 | tail -n 3); then
    fail_line "pip install -e '.[test,hf]' failed"; exit 2
fi
after=$(torch_version)
if [[ $before != "$after" ]]; then
    fail_line "installing the package replaced torch $before with $after"; exit 3
fi
pyver=$("$venv/bin/python" -c 'import platform; print(platform.python_version())')

start=$(date +%s)
set +e
tier=()
[[ ${FAST:-0} == 1 ]] && tier=(-m "not slow")
# shellcheck disable=SC2086
(cd "$repo" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tier[@]}" ${PYTEST_ARGS:-}) >"$log" 2>&1
rc=$?
set -e
wall=$(( $(date +%s) - start ))

tail -n 30 "$log"
# pytest's closing line, e.g. "== 3 failed, 300 passed, 2 skipped in 190.12s (0:03:10) ==".
# With -q the "=" frame is left off; `|| true`: a log with no such line must still reach the summary.
summary=$({ grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s' "$log" \
    || grep -E 'no tests ran' "$log" || true; } | tail -n 1 | sed -E 's/^=+ //; s/ in [0-9.]+s.*$//; s/ =+$//')
say "torch $after (python $pyver)${tier:+, fast tier}: ${summary:-no pytest summary, exit $rc}; ${wall} s; $(date -u +%F)"
exit "$rc"
