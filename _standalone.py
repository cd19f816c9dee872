"""Import the pack under a fixed name (``qwen35_fast``) whatever its folder is called.

Used by scripts, benchmarks and tests that run outside ComfyUI; ComfyUI itself imports the pack
under its folder name and never needs this.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE = "qwen35_fast"
ROOT = Path(__file__).resolve().parent


def load_pack(name: str = PACKAGE):
    """Register the repository root as package ``name`` and return it (idempotent)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
