"""Stand-in for ``comfy_execution.utils.get_executing_context``."""
from types import SimpleNamespace

NODE_ID = None


def get_executing_context():
    return None if NODE_ID is None else SimpleNamespace(node_id=NODE_ID, prompt_id="p", list_index=None)
