"""The pack's V3 extension: the node list ComfyUI gets from ``comfy_entrypoint``."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from ..downloads.hub_client import FetchError
from ..engine.errors import Qwen35Error
from ..enhancer.server_backend import ServerError
from ..kernels.launch import TableError
from ..patches.comfy_bridge import Qwen35Unsupported
from ..patches.convert_checks import ConversionError
from ..patches.mtp_graft import MTPHeadError
from .convert_node import Qwen35Save4bit
from .enhancer_node import Qwen35PromptEnhancer
from .loader_node import Qwen35CLIPLoader
from .patch_node import Qwen35LengthAwarePatch
from .server_enhancer_node import Qwen35PromptEnhancerServer

NODES = [Qwen35CLIPLoader, Qwen35PromptEnhancer, Qwen35LengthAwarePatch, Qwen35PromptEnhancerServer, Qwen35Save4bit]

#: The errors the pack's nodes raise for a user to read. ComfyUI names an error type by its class's
#: module path, which for a custom node is the pack folder's file path
#: ("/.../ComfyUI-Qwen35-Fast.downloads.hub_client.FetchError"); these carry ERROR_MODULE instead.
USER_ERRORS = (FetchError, Qwen35Error, ServerError, TableError, Qwen35Unsupported, MTPHeadError, ConversionError)
ERROR_MODULE = "qwen35_fast"


def short_error_names() -> None:
    """Give every class in USER_ERRORS, and their subclasses, the module ERROR_MODULE, so ComfyUI shows
    "qwen35_fast.FetchError"."""
    todo = list(USER_ERRORS)
    while todo:
        cls = todo.pop()
        cls.__module__ = ERROR_MODULE
        todo.extend(cls.__subclasses__())


class Qwen35FastExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> Qwen35FastExtension:
    short_error_names()
    return Qwen35FastExtension()
