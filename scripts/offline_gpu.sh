#!/usr/bin/env bash
# Benchmarks and GPU tests on a GPU machine with no network whose Python has torch and Triton only.
#   bash scripts/offline_gpu.sh kit             where pip works: fills .gpu/ (git-ignored) with the
#                                               ComfyUI 0.29.0 tree ($SHARED/comfyui, SHARED defaults to
#                                               ../shared) and the wheels ComfyUI's imports and pytest
#                                               need beyond torch (Python $PYVER, default 3.12, x86-64);
#                                               copy the repository with .gpu/ to the GPU machine
#   END=<seconds> OUT=<dir> bash scripts/offline_gpu.sh run STEP...
#                                               on the GPU machine: installs the wheels into /tmp/site,
#                                               unpacks the tree, runs each STEP below in order, each
#                                               cut at the seconds left of END (default 585); logs and
#                                               JSON go to OUT (default ./out)
# Steps: tests (the GPU tests of graphs, MTP and the draft vocabulary), tests4 (the GPU tests of the 4-bit
# tiles), tiles (the 4-bit tiles launch by launch, `gemv4_tiles.py`), e2e4 (convrot_w4a4, int8, nvfp4
# files: MTP off, forced MTP-3, forced MTP-3 over the draft vocabulary), e2e4r (the same files, MTP off
# and forced MTP-3, 300 tokens, each row 3 times interleaved), acc8 / acc16 (`--accept`,
# int8 / bf16), acc8s (int8 `--accept` at P 0, 0.3, 0.5, 0.7 only), loop16 / loop24 (`loop_run.py`, the 9B
# int8 file at a 16 / 24 GB budget, ComfyUI's own moves then the pack's: 3 prompts of 2000 / 500 tokens),
# loop4 (the same, convrot_w4a4, 16 GB, 500 tokens), loopnt (int8, 16 GB, 500 tokens, Triton hidden),
# tests65 (the GPU test of the loop at 0.8B, with and without Triton), think (the GPU test of the thinking budget:
# fused kernels and graphs against the torch path).
set -uo pipefail
cd "$(dirname "$0")/.."
kit=.gpu
case "${1:-}" in
  kit)
    shared="$(cd "${QWEN35_FAST_SHARED:-../shared}" && pwd)" || exit 2
    req="$(tar -xJOf "$shared/comfyui/comfyui-0.29.0.tar.xz" --wildcards '*/requirements.txt')" || exit 2
    kitchen="$(printf '%s\n' "$req" | grep -E '^comfy-kitchen==' | head -1)"
    aimdo="$(printf '%s\n' "$req" | grep -E '^comfy-aimdo==' | head -1)"
    mkdir -p "$kit/whl"
    cp "$shared/comfyui/comfyui-0.29.0.tar.xz" "$kit/"
    plat=(); for tag in manylinux1 manylinux2014 manylinux_2_{17,24,27,28,31,34,35}; do
      plat+=(--platform "${tag}_x86_64"); done
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "${PYVER:-3.12}" --implementation cp "${plat[@]}" -d "$kit/whl" \
      "$kitchen" "$aimdo" torchsde trampoline einops simpleeval blake3 spandrel \
      "pytest>=8,<9" pluggy iniconfig pygments || exit 1
    du -sh "$kit"; exit 0 ;;
  run) shift ;;
  *) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 2 ;;
esac

START=$(date +%s); END=${END:-585}; OUT=${OUT:-out}; mkdir -p "$OUT"
left() { echo $(( END - ($(date +%s) - START) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$kit"/whl/*.whl >/dev/null 2>&1 || { echo "the wheels in $kit/whl did not install"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p /tmp/comfyui && tar -xJf "$kit/comfyui-0.29.0.tar.xz" -C /tmp/comfyui || exit 1
TREE="$(find /tmp/comfyui -maxdepth 2 -name main.py -printf '%h\n' | head -1)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step() {  # step NAME MAXSEC command...
  local name=$1 max=$2 t s0; shift 2; t=$(left)
  if [ "$t" -lt 40 ]; then echo "== $name: skipped, $t s left"; return; fi
  [ "$t" -gt "$max" ] && t=$max
  echo "== $name ($t s at most)"; s0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? in $(( $(date +%s) - s0 )) s"
  tail -n 45 "$OUT/$name.log"
}
E2E=(python3 benchmarks/comfy_e2e.py --comfyui "$TREE" --max-lengths 4096)
for s in "$@"; do
  case $s in
    tests) step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/engine/test_engine_graphs.py \
             -k "subset_drafts or auto_depth or fused_path_equals" ;;
    tests4) step gpu_tests4 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_gemv4m.py \
              tests/kernels/test_gemv4.py ;;
    tiles) step tiles 150 python3 benchmarks/gemv4_tiles.py --formats w4a4 nvfp4 --rows 1 4 \
             --json "$OUT/gemv4_tiles.json" ;;
    e2e4) step e2e4 260 "${E2E[@]}" --tokens 200 --kinds pack forced3 forced3-subset --formats w4a4 int8 nvfp4 \
            --json "$OUT/comfy_e2e_4bit.json" ;;
    e2e4r) step e2e4r 400 "${E2E[@]}" --tokens 300 --kinds pack forced3 --formats w4a4 int8 nvfp4 --repeat 3 \
             --json "$OUT/comfy_e2e_4bit_repeat.json" ;;
    acc8) step acc8 300 "${E2E[@]}" --formats int8 --accept 0 0.3 0.5 0.7 0.9 1 --tokens 300 \
            --json "$OUT/mtp_accept_int8.json" ;;
    acc8s) step acc8s 240 "${E2E[@]}" --formats int8 --accept 0 0.3 0.5 0.7 --tokens 300 \
             --json "$OUT/mtp_accept_int8_short.json" ;;
    acc16) step acc16 300 "${E2E[@]}" --formats bf16 --accept 0 0.3 0.5 0.7 0.9 1 --tokens 300 \
             --json "$OUT/mtp_accept_bf16.json" ;;
    loop16|loop24|loop4|loopnt)
      budget=16; fmt=int8; tokens=500; extra=()
      case $s in loop16) tokens=2000 ;; loop24) budget=24 ;; loop4) fmt=w4a4 ;; loopnt) extra=(--no-triton) ;; esac
      for swap in off on; do
        step "${s}_$swap" 280 python3 benchmarks/loop_run.py --comfyui "$TREE" --budget-gb $budget --format $fmt \
          --tokens $tokens --prompts 3 --swap $swap "${extra[@]}" --json "$OUT/${s}_$swap.json"
      done ;;
    tests65) step gpu_tests65 240 env QWEN35_FAST_COMFYUI="$TREE" python3 -m pytest -q -x -p no:cacheprovider -m gpu \
               tests/comfyui/test_comfyui_gpu.py -k loop_run ;;
    think) step gpu_think 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/engine/test_engine_graphs.py \
             -k thinking_budget ;;
    *) echo "unknown step $s (steps: tests tests4 tiles e2e4 e2e4r acc8 acc8s acc16 loop16 loop24 loop4 loopnt" \
            "tests65 think)"; exit 2 ;;
  esac
done
echo "== done, $(left) s left"
