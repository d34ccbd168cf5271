#!/usr/bin/env bash
# Run moealign's vLLM import-level tests against vllm 0.33.0 on a CPU machine, in a separate venv.
#
# vllm 0.33 pins torch 2.14 / transformers < 5.21 and CUDA-only packages, so it cannot share the main
# venv (torch 2.13 CPU). The wheel imports without its compiled kernels; moealign's vLLM patches (the tree
# forward's and the precision patch's targets and signatures, the plugin) and the conversion of vLLM 0.33's own
# CompletionOutput (routed_experts, sampling_mask) into a record are tested at that level with its real classes. The recipe installs vllm
# with --no-deps plus the pure-python packages its imports need (about 1 minute, 2 GB).
#
#   bash tools/test_vllm_import.sh            # venv at ${MOEALIGN_VENV_VLLM:-/tmp/moealign-vllm}
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MOEALIGN_VENV_VLLM:-/tmp/moealign-vllm}"
PY="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install --no-deps "vllm==0.33.0" "xgrammar==0.2.8"
  "${PIP[@]}" install packaging psutil pyzmq urllib3 regex numpy "pydantic>=2.12" cbor2 \
    "transformers>=5.16.1,<5.21.0" "aiohttp>=3.14.4" "requests>=2.33.0" openai-harmony "openai>=2.25.0" pillow \
    pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo "prometheus_client>=0.18.0" \
    "fastapi>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0" einops "apache-tvm-ffi==0.1.11" \
    pytest safetensors tqdm
fi
"${PIP[@]}" install --no-deps -e .
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
# import level only: the tests that start an engine (the harvest round trip through the CPU recorder, the
# precision audit of a live model) need vLLM's compiled kernels, which this venv does not have
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_patches_vllm_tree.py tests/test_precision_policy.py \
  tests/test_vllm_harvest.py tests/test_vllm_precision.py -k "not round_trip and not audited" "$@"
