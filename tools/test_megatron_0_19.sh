#!/usr/bin/env bash
# Run the Megatron-core tests against megatron-core 0.19.2 on Python 3.11 (CPU), in a separate venv.
#
# megatron-core 0.19.x declares Python >= 3.12, but its wheel is pure Python and runs on 3.11 once
# triton (imported unconditionally by 0.19's MoE paged-stash ops) is present. CI tests 0.16.1 (the
# newest release that installs normally on 3.11); this script checks the other end of the support range.
#
#   bash tools/test_megatron_0_19.sh            # venv at ${MOEALIGN_VENV19:-/tmp/moealign-mcore019}
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MOEALIGN_VENV19:-/tmp/moealign-mcore019}"
PY="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import megatron.core, transformers, triton" >/dev/null 2>&1; then
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install "transformers==5.23.0" pytest safetensors tqdm numpy packaging
  "${PIP[@]}" install --no-deps --ignore-requires-python "megatron-core==0.19.2"
  "${PIP[@]}" install triton
fi
"${PIP[@]}" install --no-deps -e .
"$VENV/bin/python" -c "import megatron.core as m; print('megatron-core', m.__version__)"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_patches_megatron.py tests/test_megatron_parallel.py \
  tests/test_megatron_checkpoint.py tests/test_mismatch_megatron.py tests/test_vocab_parallel_mask.py "$@"
