"""The Qwen-Image 2.1 prompt enhancer: presets and chat text, the answer parsed, the edit-mode images."""
