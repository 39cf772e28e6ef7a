#!/usr/bin/env bash
# The ready GPU check (issue 36; docs/gpu.md): on a CUDA machine with torch and Triton and no package index, run
# the Triton kernel tests on the GPU, time the kernels and the engine, and write one JSON, in under 8 minutes.
#
#   bash scripts/gpu_check.sh                      # -> $OUT/gpu_check.json (./out/gpu_check/ when OUT is unset)
#   bash scripts/gpu_check.sh --dry-run            # the CPU form: TRITON_INTERPRET=1, tiny shapes (CI runs it)
#   bash scripts/gpu_check.sh --layers 8 --only engine,int4_gemm    # options go to scripts/bench/gpu_check.py
#
# Python: $GPU_CHECK_PYTHON, else the first of python3, python, .venv/bin/python that imports torch (one that sees
# CUDA first). Nothing is downloaded: wheels in $GPU_CHECK_WHEELS (default .whl/, ignored by git; carried with
# the tree) are installed with --no-index into a scratch folder put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OUT=${OUT:-$PWD/out/gpu_check}
mkdir -p "$OUT"
dry=0
for a in "$@"; do [ "$a" = --dry-run ] && dry=1; done

probe='import torch; print("cuda" if torch.cuda.is_available() else "cpu", torch.__version__)'
pick_python() {
  local fallback="" c
  for c in ${GPU_CHECK_PYTHON:-} python3 python .venv/bin/python; do
    command -v "$c" >/dev/null 2>&1 || continue
    local seen
    seen=$("$c" -c "$probe" 2>/dev/null) || { echo "gpu_check.sh: $c has no torch" >&2; continue; }
    echo "gpu_check.sh: $c: torch ${seen#* } on ${seen%% *}" >&2
    if [ "$c" = "${GPU_CHECK_PYTHON:-}" ] || [ $dry = 1 ] || [ "${seen%% *}" = cuda ]; then echo "$c"; return; fi
    [ -z "$fallback" ] && fallback=$c
  done
  echo "$fallback"
}

wheels=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/gpu_check_site
  py_for_pip=$(command -v python3 || command -v python)
  echo "gpu_check.sh: installing $(ls "$wheels"/*.whl | wc -l) carried wheel(s) from $wheels into $site (no index)"
  "$py_for_pip" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl || echo "gpu_check.sh: installing the carried wheels failed; going on without them" >&2
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

py=$(pick_python)
if [ -z "$py" ]; then
  msg="no python with torch found (tried ${GPU_CHECK_PYTHON:-} python3 python .venv/bin/python); set GPU_CHECK_PYTHON"
  echo "gpu_check.sh: $msg" >&2
  printf '{"schema": 1, "error": "%s"}\n' "$msg" >"$OUT/gpu_check.json"
  exit 2
fi
if [ $dry = 0 ] && [ "$("$py" -c "$probe" 2>/dev/null | cut -d' ' -f1)" != cuda ]; then
  echo "gpu_check.sh: $py sees no CUDA device: only the environment section runs (--dry-run is the CPU form)" >&2
fi
exec "$py" scripts/bench/gpu_check.py --out "$OUT/gpu_check.json" "$@"
