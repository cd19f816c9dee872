"""Validate workflow JSON with the ComfyUI frontend's own zod schema, run by node.

The frontend wheel (``comfyui-frontend-package``, installed with ComfyUI) ships its bundles with
source maps; the map of the chunk that holds ``validateComfyWorkflow`` carries the TypeScript source
of ``workflowSchema.ts``, and the ``vendor-zod`` chunk is the zod build the frontend runs. This helper
takes both from the installed wheel, removes the TypeScript-only syntax of that one file (imports,
interfaces, type aliases, annotations), and validates each workflow the way the frontend does on load
(``version == 1`` -> ``zComfyWorkflow1``, else ``zComfyWorkflow``). Nothing is copied into the repo.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

SCHEMA_SOURCE = "workflowSchema.ts"


class Unavailable(Exception):
    """No node, or no frontend package with the schema's source map."""


def frontend_assets() -> Path:
    try:
        import comfyui_frontend_package
    except ImportError as exc:
        raise Unavailable("comfyui_frontend_package is not installed") from exc
    assets = Path(comfyui_frontend_package.__file__).parent / "static" / "assets"
    if not assets.is_dir():
        raise Unavailable(f"{assets} does not exist")
    return assets


def schema_source(assets: Path) -> tuple[str, str]:
    """(TypeScript source of workflowSchema.ts, frontend version string)."""
    for m in sorted(assets.glob("*.js.map")):
        text = m.read_text(encoding="utf-8", errors="replace")
        if SCHEMA_SOURCE not in text or "validateComfyWorkflow" not in text:
            continue
        data = json.loads(text)
        for name, src in zip(data.get("sources", []), data.get("sourcesContent") or []):
            if name.endswith("/" + SCHEMA_SOURCE) and src and "zComfyWorkflow1" in src:
                return src, m.name
    raise Unavailable(f"no source map with {SCHEMA_SOURCE} under {assets}")


def strip_typescript(src: str) -> str:
    """The JavaScript of ``workflowSchema.ts`` (this file's TypeScript constructs only)."""
    lines = src.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("import "):
            i += 1
            continue
        if re.match(r"^(export )?interface ", line):
            while lines[i] != "}":
                i += 1
            i += 1
            continue
        if re.match(r"^(export )?type ", line):
            depth = 0
            while True:
                depth += lines[i].count("<") + lines[i].count("{") - lines[i].count(">") - lines[i].count("}")
                if depth <= 0 and not lines[i].rstrip().endswith(("=", "<", "|")):
                    break
                i += 1
            i += 1
            continue
        if line.startswith("export async function validateComfyWorkflow"):
            while lines[i] != "}":
                i += 1
            i += 1
            continue
        out.append(line)
        i += 1
    js = _drop_return_types("\n".join(out))
    js = re.sub(r"\)\s*satisfies\s+z\.ZodType<\w+>", ")", js)
    js = re.sub(r"\s+as\s+\[number,\s*number\]", "", js)
    js = re.sub(r"\((\w+): string, (\w+)\)", r"(\1, \2)", js)
    return js


def _drop_return_types(js: str) -> str:
    """``(): z.ZodArray<...> =>`` (an arrow's return type, possibly multi-line) -> ``() =>``."""
    out, pos = [], 0
    while (start := js.find("():", pos)) != -1:
        i = start + 3
        depth = 0
        while i < len(js):
            c = js[i]
            depth += (c == "<") - (c == ">")
            if depth == 0 and js.startswith("=>", i):
                break
            i += 1
        out.append(js[pos:start] + "() ")
        pos = i
    out.append(js[pos:])
    return "".join(out)


DRIVER = r"""
import * as zmod from %(zod)s
// The chunk is tree-shaken: its exports are zod's constructors under minified names. Name each one
// by the schema type it builds (ZodObject.create -> z.object, ...).
const NAMES = {ZodAny: 'any', ZodArray: 'array', ZodBoolean: 'boolean', ZodEnum: 'enum', ZodLazy: 'lazy',
               ZodLiteral: 'literal', ZodNumber: 'number', ZodObject: 'object', ZodRecord: 'record',
               ZodString: 'string', ZodTuple: 'tuple', ZodUnion: 'union'}
const TRIALS = [[], [['a']], [[]], [{}], [() => null]]
const z = {}
for (const f of Object.values(zmod)) {
  if (typeof f !== 'function') continue
  for (const args of TRIALS) {
    let made
    try { made = f(...args) } catch { continue }
    const kind = made && made._def && made._def.typeName
    if (kind in NAMES && !(NAMES[kind] in z)) { z[NAMES[kind]] = f; break }
  }
}
const missing = Object.values(NAMES).filter(n => !(n in z))
if (missing.length) { console.error('zod constructors not found in the vendor chunk: ' + missing); process.exit(3) }
%(schema)s
import { readFileSync } from 'node:fs'
const results = {}
for (const file of process.argv.slice(2)) {
  const data = JSON.parse(readFileSync(file, 'utf8'))
  const schema = data && data.version === 1 ? zComfyWorkflow1 : zComfyWorkflow
  const r = await schema.safeParseAsync(data)
  results[file] = r.success ? null : r.error.issues.map(i => `${i.path.join('.')}: ${i.message}`)
}
console.log(JSON.stringify(results))
"""


def validate(files: list[Path], workdir: Path) -> dict[str, list[str] | None]:
    """{file: None when valid, else the zod issues}; Unavailable when node or the schema is missing."""
    node = shutil.which("node")
    if node is None:
        raise Unavailable("node is not installed")
    assets = frontend_assets()
    src, _ = schema_source(assets)
    zod = next(iter(sorted(assets.glob("vendor-zod-*.js"))), None)
    if zod is None:
        raise Unavailable("no vendor-zod chunk in the frontend package")
    script = workdir / "validate_workflows.mjs"
    script.write_text(DRIVER % {"zod": json.dumps(zod.as_uri()), "schema": strip_typescript(src)}, encoding="utf-8")
    run = subprocess.run([node, str(script), *map(str, files)], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"the schema script failed ({run.returncode}): {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])
