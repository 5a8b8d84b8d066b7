#!/usr/bin/env bash
# Engine proof: vLLM and sglang load porter's `--layout hf` output through their own `load_weights`, on CPU.
#
# Creates its own venv (default .venv-engines, override with ENGINES_VENV) beside the project's, installs
# CPU torch, porter with the test tools its engine tests use, the two engines with --no-deps (their wheels pin CUDA torch and
# other transformers versions) plus only the light dependencies their model/loader modules import, and runs
# tests/engines (one subprocess per engine). See docs/serving-engines.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${ENGINES_VENV:-.venv-engines}"
TORCH=torch==2.13.0
VLLM=vllm==0.33.0
SGLANG=sglang==0.5.23
# every package of this venv, pinned; after changing a pin or porter's dependencies, regenerate it with
#   .venv-engines/bin/pip freeze --exclude-editable | sed 's/+cpu$//'   (keep the two header lines)
PINS=tests/engines/constraints.txt
STAMP="$VENV/.porter-engines-installed"
WANT="$(sha256sum "$PINS" | cut -c1-16) $TORCH $VLLM $SGLANG"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  python3 -m venv "$VENV"
  . "$VENV/bin/activate"
  # torch first and pinned throughout: an engine dependency must never swap in a CUDA build
  pip install -q -c "$PINS" "$TORCH"
  # porter and the test tools the engine tests use (not the whole test extra: the local hub server's
  # dependencies conflict with the engines' pins, and lint has no business here)
  pip install -q -c "$PINS" -e . pytest "transformers==5.23.0" psutil hypothesis
  pip install -q -c "$PINS" --no-deps "$VLLM" "$SGLANG"
  echo "run.sh: pip's resolver errors and its '... is incompatible' lines below are expected: the engines are" \
    "installed --no-deps with only the dependencies their loaders import (docs/serving-engines.md)" >&2
  # vLLM's model, config and loader modules
  pip install -q -c "$PINS" numpy safetensors psutil pyzmq urllib3 cbor2 aiohttp requests openai-harmony \
    openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client xgrammar fastapi \
    partial_json_parser llguidance einops
  # sglang's
  pip install -q -c "$PINS" orjson psutil pybase64 requests triton pillow starlette msgspec pyzmq IPython \
    aiohttp apache-tvm-ffi dill sentencepiece compressed-tensors gguf einops openai partial_json_parser
  python -c "import torch, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__; \
print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "$WANT" > "$STAMP"
else
  . "$VENV/bin/activate"
fi
PORTER_ENGINES=1 python -m pytest -q tests/engines "$@"
