"""Stand-in for ``comfy_api.latest``: ``io`` and ``ComfyExtension``."""
from abc import ABC, abstractmethod

from . import _io as io  # noqa: F401


class ComfyExtension(ABC):
    async def on_load(self) -> None:
        return None

    @abstractmethod
    async def get_node_list(self):
        ...
