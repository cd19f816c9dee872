"""Node: load a Qwen3.5 text encoder as a core CLIP, with an optional MTP head grafted in memory."""

from __future__ import annotations

from comfy_api.latest import io

from ..downloads import model_fetch
from ..downloads.head_check import has_mtp_tensors
from ..patches.clip_loader import NO_MTP_FILE, load_qwen35_clip
from ..patches.comfy_bridge import set_clip_info, show_status
from ..patches.stats_line import short_name


class Qwen35CLIPLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        files = folder_paths.get_filename_list("text_encoders")
        offered = [n for n in model_fetch.PE_FILES if n not in files]  # downloaded when picked
        heads = [n for n in files if has_mtp_tensors(folder_paths.get_full_path("text_encoders", n) or "")]
        return io.Schema(
            node_id="Qwen35FastCLIPLoader",
            display_name="Load Qwen3.5 CLIP (MTP)",
            category="text/qwen3.5",
            search_aliases=["qwen3.5", "prompt enhancer", "mtp", "qwen image 2.1"],
            description="Loads a Qwen3.5 text encoder (any size, incl. the Comfy-Org int8_convrot "
                        "prompt-enhancer files) as a core CLIP and grafts an MTP head for faster decoding.",
            inputs=[
                io.Combo.Input("clip_name", options=[*files, *offered],
                               tooltip="Qwen3.5 checkpoint in models/text_encoders, e.g. "
                                       "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors. A Comfy-Org "
                                       "enhancer file you do not have yet is listed too and downloaded "
                                       "(about 10 GB, with progress) the first time it runs."),
                io.Combo.Input("mtp_head", options=[*model_fetch.mtp_download_options(), NO_MTP_FILE, *heads],
                               default=model_fetch.mtp_download_options()[0],
                               tooltip="The MTP head (mtp.* tensors of the same Qwen3.5 size). 'download (base "
                                       "model of the same size)' (or a named base repository) fetches only those "
                                       "tensors of the base model once (about 0.5 GB for 9B) into "
                                       "models/text_encoders; or pick a file with mtp.* tensors; 'none' "
                                       "uses the main file's mtp.* tensors if it has any, else MTP is off."),
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

        folder = folder_paths.get_folder_paths("text_encoders")[0]
        try:
            clip_path = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        except FileNotFoundError:
            if clip_name not in model_fetch.PE_FILES:
                raise
            clip_path = model_fetch.fetch_pe_file(clip_name, folder, progress=model_fetch.comfy_progress(),
                                                  check=model_fetch.comfy_check())
        mtp_path = None
        if model_fetch.is_download(mtp_head):
            mtp_path = model_fetch.mtp_head_for(mtp_head, clip_path, folder, progress=model_fetch.comfy_progress(),
                                                check=model_fetch.comfy_check())
        elif mtp_head and mtp_head != NO_MTP_FILE:
            mtp_path = folder_paths.get_full_path_or_raise("text_encoders", mtp_head)
        result = load_qwen35_clip(clip_path, mtp_path, device=device,
                                  embedding_directory=folder_paths.get_folder_paths("embeddings"))
        # a head fetched by range reads: after generations that never accept its drafts, say it may be wrong
        if mtp_path is not None and model_fetch.is_download(mtp_head):
            set_clip_info(result.clip, fetched_head=mtp_path)
        status = "\n".join(status_lines(clip_path, mtp_path, result))
        show_status(status)  # on the node itself, not only through a connected preview
        return io.NodeOutput(result.clip, status, ui={"text": [status]})


def status_lines(clip_path: str, mtp_path: str | None, result) -> list[str]:
    """The loader's status: whether MTP is on (the fix first when it is off), the file loaded (names
    shortened), then the loader's full line (head source, how it was attached, its size)."""
    first = (f"MTP on: head {short_name(mtp_path or clip_path)}" if result.mtp else
             f"MTP off: no head. Pick mtp_head '{model_fetch.mtp_download_options()[0]}'.")
    return [first, f"Loaded {short_name(clip_path)}", result.status]
