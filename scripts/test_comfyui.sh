#!/usr/bin/env bash
# The real-ComfyUI tests against every tree scripts/comfyui_trees.sh gives: with ../shared (CI) ComfyUI
# 0.29.0 and two newer stacks (v3bias, v5cache); else one tree, yours (QWEN35_FAST_COMFYUI_TREE) or
# 0.29.0 cloned by git. Where there is none, it prints one "skip: ..." line saying why and how, and
# exits 0 (QWEN35_FAST_REQUIRE_COMFYUI=1, as CI sets: it fails instead).
# Per tree: the in-process tests (core load_clip of random 0.8B checkpoints, bf16 and int8_convrot,
# with and without mtp.*; the engine on ComfyUI's own modules; the swap patcher's moves and ComfyUI's
# bookkeeping around them), then the server tests (every API
# workflow over HTTP, bad inputs, interrupt) on the trees in QWEN35_FAST_SERVER_TREES (default: v5cache,
# the newest, else the only tree; a server run costs 4-5 min on 2 CPU cores, too much for CI on all
# three; "all" = every tree). QWEN35_FAST_TREES limits the trees (e.g. "0.29.0 v5cache"). Tests marked
# one_tree (the pack's own kernels under the Triton interpreter, minutes each, the same on every tree)
# run on the tree named by QWEN35_FAST_ONE_TREE (default 0.29.0, else the first tree; "all" = every
# tree), as do the OpenAI-server and browser tests. Tests marked kitchen (quantized weights through
# ComfyUI's ops) run on 0.29.0 and on trees that bring their own comfy-kitchen (v5cache), not on a tree
# whose ops and comfy-kitchen are 0.29.0's (v3bias). Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cache_env.sh
cache="${QWEN35_FAST_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qwen35-fast-ci}"
export QWEN35_FAST_CI_CACHE="$cache"
export QWEN35_FAST_CACHE="${QWEN35_FAST_CACHE:-$cache/checkpoints}"  # random checkpoints, built once
info="$(bash scripts/comfyui_trees.sh)"
if grep -q '^skip:' <<<"$info"; then
  grep '^skip:' <<<"$info"
  exit 0
fi
python="$(awk '$1 == "python" {print $2}' <<<"$info")"
labels="$(awk '$1 == "tree" {printf "%s ", $2}' <<<"$info")"
first="$(awk '$1 == "tree" {print $2; exit}' <<<"$info")"
last="$(awk '$1 == "tree" {l = $2} END {print l}' <<<"$info")"
only="${QWEN35_FAST_TREES:-$labels}"
newest=$([[ " $labels " == *" v5cache "* ]] && echo v5cache || echo "$last")
main=$([[ " $labels " == *" 0.29.0 "* ]] && echo 0.29.0 || echo "$first")
server="${QWEN35_FAST_SERVER_TREES:-$newest}"
one_tree="${QWEN35_FAST_ONE_TREE:-$main}"
[ "$server" = all ] && server="$labels"
par=()  # a tree's test files on two workers, a file to a worker (its servers and fixtures stay together)
"$python" -c "import xdist" 2>/dev/null && par=(-n 2 --dist loadfile)
status=0
while read -r kind label tree extra; do
  [ "$kind" = tree ] || continue
  [[ " $only " == *" $label "* ]] || continue
  pp="${PYTHONPATH:-}"; [ "$extra" != - ] && pp="$extra${pp:+:$pp}"  # v5cache: its comfy-kitchen first
  files=(tests/comfyui/test_comfyui_core.py tests/comfyui/test_engine_comfyui.py tests/comfyui/test_swap_patcher.py)
  [[ " $server " == *" $label "* ]] && files+=(tests/comfyui/test_comfyui_integration.py)
  # one transformers serve, reused; the real frontend in Chromium (skipped without it)
  [ "$label" = "$main" ] && files+=(tests/comfyui/test_pe_server.py tests/comfyui/test_frontend_browser.py)
  expr=""
  if [ "$one_tree" = all ] || [ "$one_tree" = "$label" ]; then
    files+=(tests/comfyui/test_engine_comfyui_4bit.py)  # one_tree only: the 4-bit kernels interpreted
  else
    expr="not one_tree"
  fi
  # quantized weights through ComfyUI's ops: on the main tree and on trees with a comfy-kitchen of their own
  [ "$label" = "$main" ] || [ "$extra" != - ] || expr="${expr:+$expr and }not kitchen"
  select=()
  [ -n "$expr" ] && select=(-m "$expr")
  echo "=== ComfyUI $label ($tree): ${files[*]}"
  start=$SECONDS
  if ! PYTHONPATH="$pp" QWEN35_FAST_COMFYUI="$tree" QWEN35_FAST_COMFYUI_PYTHON="$python" \
      "$python" -m pytest -q ${par[@]+"${par[@]}"} ${select[@]+"${select[@]}"} "${files[@]}" "$@"; then
    status=1
  fi
  echo "=== ComfyUI $label: $((SECONDS - start)) s"
done <<<"$info"
exit $status
