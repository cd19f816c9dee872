"""Node: write a 4-bit copy (convrot_w4a4 or nvfp4, ComfyUI's own formats) of a Qwen3.5 text-encoder file."""

from __future__ import annotations

from comfy_api.latest import io

from ..patches import convert_4bit
from ..patches.comfy_bridge import show_status
from ..patches.stats_line import short_name


class Qwen35Save4bit(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id="Qwen35FastSave4bit",
            display_name="Save Qwen3.5 4-bit",
            category="text/qwen3.5",
            search_aliases=["qwen3.5", "4-bit", "nvfp4", "w4a4", "quantize", "convert"],
            description="Writes a 4-bit copy of a Qwen3.5 text encoder (official int8_convrot or bf16 file) next to "
                        "it: about half the int8 file's size and read per token. 4 bits may change the answers: "
                        "the pack measures only the numerics, so compare answers on your own prompts with the "
                        "int8 file.",
            inputs=[
                io.Combo.Input("clip_name", options=folder_paths.get_filename_list("text_encoders"),
                               tooltip="The Qwen3.5 file in models/text_encoders to convert (it is only read)."),
                io.Combo.Input("format", options=list(convert_4bit.FORMATS), default=convert_4bit.FORMATS[0],
                               tooltip="convrot_w4a4: int4 with ConvRot, the fastest decode here (any NVIDIA GPU "
                                       "with Triton reads it in place); nvfp4: FP4 with FP8 block scales, less "
                                       "weight error, slower decode for now (Blackwell's tensor cores in "
                                       "ComfyUI's own path)."),
            ],
            outputs=[io.String.Output(display_name="status", tooltip="The file written, and what stayed 8/16-bit.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, clip_name, format=convert_4bit.FORMATS[0]) -> io.NodeOutput:  # noqa: A002 - the input's name
        import comfy.model_management as mm
        import comfy.utils
        import folder_paths

        source = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        steps = convert_4bit.plan(source, format)
        bar = comfy.utils.ProgressBar(len(steps))
        errors: dict[str, float] = {}

        def cancelled() -> bool:
            mm.throw_exception_if_processing_interrupted()
            return False

        out = convert_4bit.convert(source, folder_paths.get_folder_paths("text_encoders")[0], format,
                                   progress=lambda done, total, key: bar.update_absolute(done, total),
                                   cancelled=cancelled, errors=errors)
        # first what to do with it (4 bits may change the answers), short; then the full summary
        status = (f"Wrote {short_name(str(out))}: compare its answers with the source's.\n"
                  f"{convert_4bit.summary(out, steps, errors)}")
        show_status(status)  # on the node itself
        return io.NodeOutput(status, ui={"text": [status]})
