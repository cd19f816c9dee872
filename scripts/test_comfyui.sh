#!/usr/bin/env bash
# The real-ComfyUI tests against every tree scripts/comfyui_trees.sh builds (0.29.0, v3bias, v5cache).
# Per tree: the in-process tests (core load_clip of random 0.8B checkpoints, bf16 and int8_convrot,
# with and without mtp.*; the engine on ComfyUI's own modules), then the server tests (every API
# workflow over HTTP, bad inputs, interrupt) on the trees in QWEN35_FAST_SERVER_TREES (default: v5cache,
# the newest; a server run costs 4-5 min on 2 CPU cores, too much for CI on all three; "all" = every tree).
# QWEN35_FAST_TREES limits the trees (e.g. "0.29.0 v5cache"). Tests marked one_tree (the pack's own
# kernels under the Triton interpreter, minutes each, the same on every tree) run on the tree named by
# QWEN35_FAST_ONE_TREE (default 0.29.0; "all" = every tree). Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${QWEN35_FAST_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qwen35-fast-ci}"
export QWEN35_FAST_CI_CACHE="$cache"
export QWEN35_FAST_CACHE="${QWEN35_FAST_CACHE:-$cache/checkpoints}"  # random checkpoints, built once
info="$(bash scripts/comfyui_trees.sh)"
python="$(awk '$1 == "python" {print $2}' <<<"$info")"
only="${QWEN35_FAST_TREES:-0.29.0 v3bias v5cache}"
server="${QWEN35_FAST_SERVER_TREES:-v5cache}"
one_tree="${QWEN35_FAST_ONE_TREE:-0.29.0}"
[ "$server" = all ] && server="0.29.0 v3bias v5cache"
status=0
while read -r kind label tree extra; do
  [ "$kind" = tree ] || continue
  [[ " $only " == *" $label "* ]] || continue
  pp="${PYTHONPATH:-}"; [ "$extra" != - ] && pp="$extra${pp:+:$pp}"  # v5cache: its comfy-kitchen first
  files=(tests/comfyui/test_comfyui_core.py tests/comfyui/test_engine_comfyui.py)
  [[ " $server " == *" $label "* ]] && files+=(tests/comfyui/test_comfyui_integration.py)
  # one transformers serve, reused; the real frontend in Chromium (skipped without it)
  [ "$label" = 0.29.0 ] && files+=(tests/comfyui/test_pe_server.py tests/comfyui/test_frontend_browser.py)
  select=()
  [ "$one_tree" = all ] || [ "$one_tree" = "$label" ] || select=(-m "not one_tree")
  echo "=== ComfyUI $label ($tree): ${files[*]}"
  start=$SECONDS
  if ! PYTHONPATH="$pp" QWEN35_FAST_COMFYUI="$tree" QWEN35_FAST_COMFYUI_PYTHON="$python" \
      "$python" -m pytest -q ${select[@]+"${select[@]}"} "${files[@]}" "$@"; then
    status=1
  fi
  echo "=== ComfyUI $label: $((SECONDS - start)) s"
done <<<"$info"
exit $status
