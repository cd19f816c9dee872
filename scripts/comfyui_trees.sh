#!/usr/bin/env bash
# Build (once, cached) the ComfyUI trees the real-ComfyUI tests run against, and a Python for them.
#   0.29.0   unpacked from $SHARED/comfyui/comfyui-0.29.0.tar.xz
#   v3bias   $SHARED/comfyui/stacks/build.sh over it (FixedKVBias, core MTP for text prompts)
#   v5cache  the same (FixedKVCache + kitchen GQA decode); needs comfy-kitchen 0.2.39 first on its path
# and a venv with torch 2.14.1 / torchvision 0.29.1 / torchaudio 2.11.1 (--no-deps) and ComfyUI's
# requirements.txt (without its torch lines), plus pytest.
# Everything lives in $QWEN35_FAST_CI_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/qwen35-fast-ci),
# keyed by a hash of its inputs, so a second run on the same machine reuses it.
# SHARED defaults to ../shared beside the repository (QWEN35_FAST_SHARED overrides).
# Prints, on stdout: "python PATH", then "tree LABEL PATH EXTRA_PYTHONPATH" per tree ("-" = none).
set -euo pipefail
cd "$(dirname "$0")/.."
shared="${QWEN35_FAST_SHARED:-../shared}"
shared="$(cd "$shared" && pwd)"
tarball="$shared/comfyui/comfyui-0.29.0.tar.xz"
stacks="$shared/comfyui/stacks"
cache="${QWEN35_FAST_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qwen35-fast-ci}"
torch_spec=(torch==2.14.1 torchvision==0.29.1)
torchaudio_spec=torchaudio==2.11.1
kitchen_v5=0.2.39
mkdir -p "$cache"
[ -f "$tarball" ] || { echo "missing $tarball (ComfyUI 0.29.0 tree; see ../shared/COMFYUI-TESTING.md)" >&2; exit 2; }

hash_of() { sha256sum "$@" | cut -d' ' -f1 | sha256sum | cut -c1-16; }  # contents only, not paths
py_tag="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

exec 9>"$cache/lock"
flock 9  # one builder at a time; a second CI run waits and then reuses

# --- trees ----------------------------------------------------------------------------------
tree_key="$(hash_of "$tarball" "$stacks"/*.sh "$stacks"/*.py "$stacks"/specs/*)"
trees="$cache/trees-$tree_key"
if [ ! -f "$trees/.ok" ]; then
  echo "building ComfyUI trees in $trees" >&2
  rm -rf "$trees"; mkdir -p "$trees/base"
  tar -xJf "$tarball" -C "$trees/base"
  base="$(find "$trees/base" -maxdepth 2 -name main.py -printf '%h\n' | head -1)"
  [ -n "$base" ] || { echo "no main.py in $tarball" >&2; exit 1; }
  ln -s "$base" "$trees/comfy-0.29.0"
  bash "$stacks/build.sh" "$base" "$trees" v3bias v5cache >/dev/null
  touch "$trees/.ok"
fi

# --- comfy-kitchen for v5cache ----------------------------------------------------------------
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

# --- venv ------------------------------------------------------------------------------------
req="$trees/comfy-0.29.0/requirements.txt"
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

# Playwright (the browser test's client) where Chromium is there to drive; without it the test skips.
if command -v chromium >/dev/null 2>&1 && ! "$venv/bin/python" -c "import playwright" 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check playwright >&2 \
    || echo "Playwright could not be installed: the browser test will skip" >&2
fi

echo "python $venv/bin/python"
echo "tree 0.29.0 $(cd "$trees/comfy-0.29.0" && pwd -P) -"
echo "tree v3bias $trees/comfy-v3bias -"
echo "tree v5cache $trees/comfy-v5cache $ck"
