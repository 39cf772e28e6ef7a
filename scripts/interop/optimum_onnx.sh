#!/usr/bin/env bash
# Interop: optimum-onnx (in its own venv, with the transformers it pins) loads our ONNX exports of a
# tiny quantized llama with ORTModelForCausalLM and must generate the same greedy tokens as our torch model.
# The venv is made once (torch pinned to the local CPU wheel) and reused; set INTEROP_VENV to move it.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${INTEROP_VENV:-build/venv-interop}"
PROJECT_PY=.venv/bin/python
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if ! "$VENV/bin/python" -c "import optimum.onnxruntime" >/dev/null 2>&1; then
    echo "creating $VENV with optimum-onnx"
    "$PROJECT_PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 "optimum-onnx[onnxruntime]" \
        >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; exit 1; }
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PROJECT_PY" scripts/interop/optimum_onnx.py export "$WORK" 2>"$WORK/export.log" || { cat "$WORK/export.log"; exit 1; }
"$VENV/bin/python" scripts/interop/optimum_onnx.py check "$WORK"
