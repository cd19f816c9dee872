"""Node: load a Qwen3.5 text encoder as a core CLIP, with an optional MTP head grafted in memory."""

from __future__ import annotations

from comfy_api.latest import io

from ..patches.clip_loader import NO_MTP_FILE, load_qwen35_clip


class Qwen35CLIPLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        files = folder_paths.get_filename_list("text_encoders")
        return io.Schema(
            node_id="Qwen35FastCLIPLoader",
            display_name="Load Qwen3.5 CLIP (MTP)",
            category="text/qwen3.5",
            search_aliases=["qwen3.5", "prompt enhancer", "mtp", "qwen image 2.1"],
            description="Loads a Qwen3.5 text encoder (any size, incl. the Comfy-Org int8_convrot "
                        "prompt-enhancer files) as a core CLIP and grafts an MTP head for faster decoding.",
            inputs=[
                io.Combo.Input("clip_name", options=files,
                               tooltip="Qwen3.5 checkpoint in models/text_encoders, e.g. "
                                       "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors"),
                io.Combo.Input("mtp_head", options=[NO_MTP_FILE, *files], default=NO_MTP_FILE,
                               tooltip="File with the mtp.* tensors of the same Qwen3.5 size (for the 9B "
                                       "enhancer: the MTP head of Qwen/Qwen3.5-9B). 'none' uses the "
                                       "main file's mtp.* tensors if it has any, else MTP is off."),
                io.Combo.Input("device", options=["default", "cpu"], default="default", optional=True,
                               advanced=True),
            ],
            outputs=[
                io.Clip.Output(display_name="CLIP"),
                io.String.Output(display_name="status", tooltip="What was loaded; says when MTP is off."),
            ],
        )

    @classmethod
    def execute(cls, clip_name, mtp_head=NO_MTP_FILE, device="default") -> io.NodeOutput:
        import folder_paths

        clip_path = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        mtp_path = None
        if mtp_head and mtp_head != NO_MTP_FILE:
            mtp_path = folder_paths.get_full_path_or_raise("text_encoders", mtp_head)
        result = load_qwen35_clip(clip_path, mtp_path, device=device,
                                  embedding_directory=folder_paths.get_folder_paths("embeddings"))
        return io.NodeOutput(result.clip, result.status, ui={"text": [result.status]})
