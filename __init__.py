"""ComfyUI-Qwen35-Fast: Qwen3.5 text generation in ComfyUI whose cost follows the filled length.

Importing this package loads nothing heavy; ComfyUI calls ``comfy_entrypoint`` to get the V3 nodes.
"""


#: The frontend extension (``web/qwen35_fast.js``): the enhancers' sampling widgets only with preset "custom".
WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """V3 entry point called by ComfyUI; returns the pack's ``ComfyExtension``."""
    from .nodes.extension import comfy_entrypoint as entry

    return await entry()
