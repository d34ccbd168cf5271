#!/usr/bin/env bash
# Run the test suite with a given interpreter: what `bash tools/setup.sh test` (the README's command, .ci/run) and
# `bash tools/ci_lowest.sh` (the lowest-versions job) both run once their venv is ready.
#
#   bash tools/run_tests.sh PYTHON [pytest arguments]
#
# pytest-xdist workers when installed (one per core, at most 4; MOEALIGN_TEST_WORKERS=N, 0 or 1 serially), one OpenMP
# thread per worker, moealign byte-compiled first; pytest's exit code 5 (nothing collected) is reported and passes.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY="$1"
shift
# one pytest-xdist worker per core, at most 4 (files stay whole on one worker: their module fixtures are built
# once; long files first, in tests/conftest.py's order, not by test count); MOEALIGN_TEST_WORKERS=0 runs
# serially, and a later -n in the arguments wins
workers="${MOEALIGN_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
case "$workers" in
  ''|*[!0-9]*) echo "MOEALIGN_TEST_WORKERS must be a whole number, got '$workers'" >&2; exit 2 ;;
esac
[ "$workers" -gt 4 ] && workers=4
xdist=()
if [ "$workers" -gt 1 ] && "$VPY" -c "import xdist" >/dev/null 2>&1; then
  xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
  # one compute thread per worker unless told otherwise: two workers of two OpenMP threads each on two cores
  # spin at every parallel region's barrier (the diagnosis' tests ran 6x slower that way)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
# moealign's own modules byte-compiled once (an editable install: with PYTHONDONTWRITEBYTECODE every test
# process and engine child would compile them again); stale files are recompiled, unchanged ones skipped
"$VPY" -m compileall -qq -j 0 moealign >/dev/null 2>&1 || true
set +e
"$VPY" -m pytest -q --durations=15 "${xdist[@]}" "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests (exit 5): treated as success, but nothing was checked" >&2
  rc=0
fi
exit "$rc"
