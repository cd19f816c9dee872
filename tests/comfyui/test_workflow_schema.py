"""Every shipped UI workflow passes the ComfyUI frontend's own workflow schema (the zod schema the
frontend checks on load; a failure shows users an "Invalid workflow against zod schema" toast).

The schema and zod come from the installed ``comfyui-frontend-package`` wheel (requirements-dev.txt)
and run under node; see tests/frontend_schema.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests import frontend_schema

ROOT = Path(__file__).resolve().parents[2]
UI_WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is needed to run the frontend's schema")


def test_shipped_workflows_pass_the_frontend_schema(tmp_path):
    assert UI_WORKFLOWS, "no UI workflows found"
    results = frontend_schema.validate(UI_WORKFLOWS, tmp_path)
    bad = {Path(f).name: issues for f, issues in results.items() if issues}
    assert not bad, f"workflows the frontend would reject: {json.dumps(bad, indent=1)}"


def test_the_schema_rejects_what_the_frontend_rejects(tmp_path):
    """The extracted schema is the real one: it refuses ``"id": null`` and a broken link, accepts the fix."""
    base = json.loads(UI_WORKFLOWS[0].read_text(encoding="utf-8"))
    cases = {"id_null": {**base, "id": None}, "no_id": {k: v for k, v in base.items() if k != "id"},
             "bad_links": {**base, "links": [["x"]]}, "uuid": {**base, "id": "3f1e6c2a-9d7b-4c55-8a41-2b0e9f7d6c13"}}
    files = []
    for name, data in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        files.append(path)
    results = {Path(f).stem: issues for f, issues in frontend_schema.validate(files, tmp_path).items()}
    assert results["id_null"] and any(issue.startswith("id:") for issue in results["id_null"])
    assert results["bad_links"]
    assert results["no_id"] is None and results["uuid"] is None
