"""The pack's V3 extension: the node list ComfyUI gets from ``comfy_entrypoint``."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .convert_node import Qwen35Save4bit
from .enhancer_node import Qwen35PromptEnhancer
from .loader_node import Qwen35CLIPLoader
from .patch_node import Qwen35LengthAwarePatch
from .server_enhancer_node import Qwen35PromptEnhancerServer

NODES = [Qwen35CLIPLoader, Qwen35PromptEnhancer, Qwen35LengthAwarePatch, Qwen35PromptEnhancerServer, Qwen35Save4bit]


class Qwen35FastExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> Qwen35FastExtension:
    return Qwen35FastExtension()
