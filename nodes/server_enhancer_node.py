"""Node: the Qwen-Image 2.1 prompt enhancer on an OpenAI-compatible server (vLLM, SGLang, llama-server,
Ollama, LM Studio, transformers serve); a list of prompts is sent concurrently. Outputs are lists in input
order; a prompt of a list that failed gives your own prompt with parse_ok False and its error in ``status``
(the node fails only when every prompt failed)."""

from __future__ import annotations

from comfy_api.latest import io

from ..enhancer.enhancer_images import MAX_IMAGES
from ..enhancer.prompt_enhancer import MAX_LENGTH_LIMIT, OFFICIAL, PRESET_NAMES
from ..enhancer.server_api import API_NAMES, AUTO, SEED_MAX, ServerSpec
from ..enhancer.server_enhancer import ComfyHooks, ServerJob, run_jobs
from ..enhancer.server_keys import PAIRING_FILE

_SERVER_KEYS = {"base_url": None, "model": None, "api": AUTO, "api_key_env": "", "max_concurrent": 4, "timeout_s": 300,
                "deadline_s": 3600}
_SAMPLING = {"temperature": 1.0, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "presence_penalty": 1.5}
# "fixed" after each run, as the shipped workflows (ComfyUI's enum where it has one)
_FIXED = getattr(getattr(io, "ControlAfterGenerate", None), "fixed", True)


class Qwen35PromptEnhancerServer(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="Qwen35FastPromptEnhancerServer",
            display_name="Qwen3.5 Prompt Enhancer (server)",
            category="text/qwen3.5",
            search_aliases=["prompt enhance", "vllm", "sglang", "llama.cpp", "ollama", "openai", "server"],
            description="The Qwen3.5 Prompt Enhancer (same presets, official system prompts, answer parsing and "
                        "outputs) run on an OpenAI-compatible server. A list of prompts is sent concurrently; "
                        "outputs keep the input order.",
            is_input_list=True,
            inputs=[
                io.String.Input("base_url", default="http://127.0.0.1:8000/v1",
                                tooltip="The server's OpenAI-compatible address (vLLM :8000/v1, SGLang :30000/v1, "
                                        "llama-server :8080/v1, Ollama :11434/v1, LM Studio :1234/v1)."),
                io.String.Input("model", default="Qwen/Qwen-Image-2.1-PE-T2I",
                                tooltip="The model name the server serves (GET /v1/models)."),
                io.Combo.Input("api", options=list(API_NAMES), default=AUTO,
                               tooltip="The server kind, which decides the fields sent. auto asks the server once "
                                       "(GET /v1/models, ...) and sends only what it honours."),
                io.String.Input("api_key_env", default="",
                                tooltip="NAME of the environment variable holding the API key (empty: no key). "
                                        f"Sent only to a server you paired with that name in {PAIRING_FILE} "
                                        "in ComfyUI's user folder; never stored in the workflow."),
                io.Int.Input("max_concurrent", default=4, min=1, max=64,
                             tooltip="Most prompts of a list sent at once."),
                io.Int.Input("timeout_s", default=300, min=1, max=3600, advanced=True,
                             tooltip="Seconds to wait for the connection and for each chunk."),
                io.String.Input("prompt", multiline=True, dynamic_prompts=True, default="",
                                tooltip="Your prompt or edit instruction; a list runs concurrently."),
                io.String.Input("system_prompt", multiline=True, default=OFFICIAL,
                                tooltip="'official': Qwen's prompt for the preset (fetched once); or your text."),
                io.Combo.Input("preset", options=list(PRESET_NAMES), default="text-to-image"),
                io.Int.Input("max_length", default=16256, min=1, max=MAX_LENGTH_LIMIT, tooltip="Most new tokens."),
                io.Int.Input("seed", default=42, min=0, max=SEED_MAX, control_after_generate=_FIXED,
                             tooltip="Sent to the server as it is (0..2147483647, the range every server takes)."),
                io.Boolean.Input("thinking", default=True),
                io.Float.Input("megapixels", default=1.0, min=0.1, max=16.0, step=0.05),
                *[io.Image.Input(f"image{k}", optional=True, tooltip=f"<image{k}> (edit preset)")
                  for k in range(1, MAX_IMAGES + 1)],
                io.Float.Input("temperature", default=1.0, min=0.0, max=2.0, step=0.01, optional=True, advanced=True),
                io.Int.Input("top_k", default=20, min=0, max=1000, optional=True, advanced=True),
                io.Float.Input("top_p", default=0.95, min=0.0, max=1.0, step=0.01, optional=True, advanced=True),
                io.Float.Input("min_p", default=0.0, min=0.0, max=1.0, step=0.01, optional=True, advanced=True),
                io.Float.Input("presence_penalty", default=1.5, min=0.0, max=5.0, step=0.01, optional=True,
                               advanced=True),
                io.Int.Input("deadline_s", default=3600, min=1, max=86400, optional=True, advanced=True,
                             tooltip="Seconds a whole prompt may take, from the connection to the last token."),
            ],
            outputs=[
                io.String.Output(display_name="rewritten_prompt", is_output_list=True),
                io.String.Output(display_name="thinking", is_output_list=True),
                io.String.Output(display_name="wh_ratio", is_output_list=True),
                io.String.Output(display_name="ratio_follow", is_output_list=True),
                io.Int.Output(display_name="width", is_output_list=True),
                io.Int.Output(display_name="height", is_output_list=True),
                io.Boolean.Output(display_name="parse_ok", is_output_list=True),
                io.String.Output(display_name="status", is_output_list=True,
                                 tooltip="What to act on first (a failed prompt, a cut at max_length, dropped "
                                         "images), then which server and model answered: tokens, seconds, tok/s."),
            ],
        )

    @classmethod
    def execute(cls, **lists) -> io.NodeOutput:
        def at(name, i, default=None):
            values = lists.get(name) or [default]
            return values[min(i, len(values) - 1)]

        spec = ServerSpec(**{k: at(k, 0, d) for k, d in _SERVER_KEYS.items()})
        n = max(len(lists.get("prompt") or [""]), *(len(v) for k, v in lists.items() if k.startswith("image")), 1)
        jobs = [ServerJob(prompt=at("prompt", i), system_prompt=at("system_prompt", i), preset=at("preset", i),
                          custom={k: at(k, i, d) for k, d in _SAMPLING.items()}, max_length=at("max_length", i),
                          seed=at("seed", i), thinking=at("thinking", i), megapixels=at("megapixels", i),
                          images=[at(f"image{k}", i) for k in range(1, MAX_IMAGES + 1)])
                for i in range(n)]
        hooks = ComfyHooks()
        outcomes = run_jobs(spec, jobs, hooks)
        statuses = ["\n".join(o.status) for o in outcomes]
        hooks.finish(statuses[0] if n == 1 else "\n".join(f"[prompt {i + 1}/{n}] {o.status[0]}"
                                                              for i, o in enumerate(outcomes)))
        cols = [[getattr(o.result, f) for o in outcomes] for f in ("rewritten_prompt", "thinking", "wh_ratio",
                                                                   "ratio_follow", "width", "height", "parse_ok")]
        return io.NodeOutput(*cols, statuses)
