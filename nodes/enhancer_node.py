"""Node: the Qwen-Image 2.1 prompt enhancer (Qwen3.5) with MTP and length-aware decode."""

from __future__ import annotations

from comfy_api.latest import io

from ..enhancer.enhancer_images import MAX_IMAGES
from ..enhancer.prompt_enhancer import MAX_LENGTH_LIMIT, OFFICIAL, PRESET_NAMES, enhance
from ..patches.comfy_bridge import ATTENTION_CHOICES, MTP_CHOICES

CUSTOM_ONLY = "Used only with preset 'custom'; the other presets ignore it and use the official value: "
THINKING_BUDGET_TIP = ("0: think as long as the model wants (official). Else after this many thinking tokens "
                       "the thinking is closed and the answer follows: less time, maybe a plainer prompt. "
                       "Used with thinking on.")


class Qwen35PromptEnhancer(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="Qwen35FastPromptEnhancer",
            display_name="Qwen3.5 Prompt Enhancer (MTP)",
            category="text/qwen3.5",
            search_aliases=["prompt enhance", "qwen image 2.1", "rewrite prompt", "LLM", "qwen3.5"],
            description="Rewrites a prompt with the Qwen-Image 2.1 prompt enhancer (Qwen3.5), thinking "
                        "included, and returns the rewritten prompt plus a latent size for its aspect "
                        "ratio. Connect images for edit mode.",
            inputs=[
                io.Clip.Input("clip", tooltip="The prompt-enhancer CLIP (Load Qwen3.5 CLIP (MTP))."),
                io.String.Input("prompt", multiline=True, dynamic_prompts=True, default="",
                                tooltip="Your prompt (text-to-image) or edit instruction (edit)."),
                io.String.Input("system_prompt", multiline=True, default=OFFICIAL,
                                tooltip="'official': Qwen's system prompt for the preset (fetched once from "
                                        "Qwen/Qwen-Image-2.1-PE-T2I or -I2I into models/qwen_image_pe, Qwen "
                                        "Research License). Any other text replaces it."),
                io.Combo.Input("preset", options=list(PRESET_NAMES), default="text-to-image",
                               tooltip="Official sampling settings (text-to-image: presence penalty "
                                       "1.5; edit: 0; both temperature 1, top_p 0.95, top_k 20). "
                                       "'custom' uses the advanced 'custom: ...' inputs, which every "
                                       "other preset ignores."),
                io.Int.Input("max_length", default=16256, min=1, max=MAX_LENGTH_LIMIT,
                             tooltip="Most new tokens (official: 16256 text-to-image, 24000 edit). "
                                     "Speed does not depend on it."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True),
                io.Combo.Input("mtp", options=list(MTP_CHOICES), default="auto",
                               tooltip="MTP speculative decoding (needs an MTP head on the CLIP): auto picks and "
                                       "adapts the depth as it goes, off disables it, 1..5 drafts that many."),
                io.Boolean.Input("thinking", default=True, tooltip="Let the model think first (official)."),
                io.Float.Input("megapixels", default=1.0, min=0.1, max=16.0, step=0.05,
                               tooltip="Target size of the width/height outputs."),
                *[io.Image.Input(f"image{k}", optional=True,
                                 tooltip=f"Input image {k} for edit mode, <image{k}> in the prompt; any size "
                                         "(capped at 1 MP). Needs the _i2i enhancer file.")
                  for k in range(1, MAX_IMAGES + 1)],
                # Flat, advanced (hidden until the node's advanced inputs are shown) and marked "custom",
                # not a DynamicCombo under preset: frontend 1.47.10 (ComfyUI 0.29.0) loads widgets_values
                # by position (LGraphNode.configure; migrateWidgetsValues only drops forceInput values), so
                # removing these five from the middle would shift saved workflows' values onto attention.
                io.Float.Input("temperature", display_name="custom: temperature", default=1.0, min=0.0, max=2.0,
                               step=0.01, optional=True, advanced=True, tooltip=CUSTOM_ONLY + "1."),
                io.Int.Input("top_k", display_name="custom: top_k", default=20, min=0, max=1000, optional=True,
                             advanced=True, tooltip=CUSTOM_ONLY + "20."),
                io.Float.Input("top_p", display_name="custom: top_p", default=0.95, min=0.0, max=1.0, step=0.01,
                               optional=True, advanced=True, tooltip=CUSTOM_ONLY + "0.95."),
                io.Float.Input("min_p", display_name="custom: min_p", default=0.0, min=0.0, max=1.0, step=0.01,
                               optional=True, advanced=True, tooltip=CUSTOM_ONLY + "0."),
                io.Float.Input("presence_penalty", display_name="custom: presence_penalty", default=1.5, min=0.0,
                               max=5.0, step=0.01, optional=True, advanced=True,
                               tooltip=CUSTOM_ONLY + "1.5 text-to-image, 0 edit."),
                io.Combo.Input("attention", options=list(ATTENTION_CHOICES), default="auto", optional=True,
                               advanced=True, tooltip="Decode attention backend."),
                # Last, so saved workflows (their widgets_values by position) load unchanged.
                io.Int.Input("thinking_budget", default=0, min=0, max=MAX_LENGTH_LIMIT, optional=True,
                             tooltip=THINKING_BUDGET_TIP),
            ],
            outputs=[
                io.String.Output(display_name="rewritten_prompt"),
                io.String.Output(display_name="thinking"),
                io.String.Output(display_name="wh_ratio"),
                io.String.Output(display_name="ratio_follow",
                                 tooltip="The input image whose shape the result keeps (e.g. <image1>); width "
                                         "and height follow it when set."),
                io.Int.Output(display_name="width"),
                io.Int.Output(display_name="height"),
                io.Boolean.Output(display_name="parse_ok"),
            ],
        )

    @classmethod
    def execute(cls, clip, prompt, system_prompt, preset, max_length, seed, mtp, thinking, megapixels,
                temperature=1.0, top_k=20, top_p=0.95, min_p=0.0, presence_penalty=1.5,
                attention="auto", thinking_budget=0, **images) -> io.NodeOutput:
        custom = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      presence_penalty=presence_penalty)
        ordered = [images.get(f"image{k}") for k in range(1, MAX_IMAGES + 1)]
        r = enhance(clip, prompt, system_prompt=system_prompt, images=ordered, preset=preset, custom=custom,
                    max_length=max_length, seed=seed, mtp=mtp, attention=attention, thinking=thinking,
                    megapixels=megapixels, thinking_budget=thinking_budget)
        return io.NodeOutput(r.rewritten_prompt, r.thinking, r.wh_ratio, r.ratio_follow, r.width, r.height,
                             r.parse_ok)
