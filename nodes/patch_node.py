"""Node: CLIP -> CLIP whose Qwen3.5 generate() is length-aware (and gets MTP)."""

from __future__ import annotations

from comfy_api.latest import io

from ..patches.clip_patch import patch_clip, patch_status, report_runs_to
from ..patches.comfy_bridge import ATTENTION_CHOICES, MTP_CHOICES, executing_node_id, show_status


class Qwen35LengthAwarePatch(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="Qwen35FastLengthAwarePatch",
            display_name="Length-aware decode (Qwen3.5)",
            category="text/qwen3.5",
            search_aliases=["qwen3.5", "mtp", "fast generate", "text generate"],
            description="Returns a copy of the CLIP whose Qwen3.5 text generation costs follow the "
                        "filled length, not max_length, and uses MTP when a head is loaded. Core "
                        "'Generate Text' and any node calling clip.generate benefit. A CLIP loaded with "
                        "DynamicVRAM is reloaded once without it where it fits the GPU, so the fast "
                        "kernels can read its weights.",
            inputs=[
                io.Clip.Input("clip", tooltip="A Qwen3.5 CLIP (core 'Load CLIP' or 'Load Qwen3.5 CLIP (MTP)')."),
                io.Combo.Input("mtp", options=list(MTP_CHOICES), default="auto",
                               tooltip="MTP speculative decoding: auto picks and adapts the depth (0..5) from "
                                       "the drafts kept and each depth's cost, off disables it, 1..5 drafts that "
                                       "many tokens per step. Needs an MTP head."),
                io.Combo.Input("attention", options=list(ATTENTION_CHOICES), default="auto", advanced=True,
                               tooltip="Decode attention backend; 'auto' picks triton, else kitchen, else "
                                       "bucket (graph-safe torch, without Triton); 'masked' reproduces "
                                       "core's capacity-bound cost (for comparisons)."),
            ],
            outputs=[io.Clip.Output(display_name="CLIP")],
        )

    @classmethod
    def execute(cls, clip, mtp="auto", attention="auto") -> io.NodeOutput:
        patched = patch_clip(clip, mtp=mtp, attention=attention)
        status = patch_status(patched, mtp)
        show_status(status)  # on the node, e.g. "MTP off: no head. ..."
        report_runs_to(patched, executing_node_id(), status)  # each later run's stats line, on this node
        return io.NodeOutput(patched, ui={"text": [status]})
