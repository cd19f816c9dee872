// The prompt enhancer nodes show their sampling widgets only with preset "custom" (the other presets
// use the official settings and ignore them). Hidden widgets keep their values and their place in
// a saved workflow, so workflows saved before this extension load unchanged.
import { app } from "../../scripts/app.js";

const ENHANCERS = ["Qwen35FastPromptEnhancer", "Qwen35FastPromptEnhancerServer"];
const SAMPLING = ["temperature", "top_k", "top_p", "min_p", "presence_penalty"];

function showPresetWidgets(node) {
  const preset = node.widgets?.find((w) => w.name === "preset");
  if (!preset) return;
  const hide = preset.value !== "custom";
  let changed = false;
  for (const w of node.widgets) {
    if (SAMPLING.includes(w.name) && Boolean(w.hidden) !== hide) {
      w.hidden = hide;
      changed = true;
    }
  }
  if (changed) {
    node.setSize([node.size[0], node.computeSize()[1]]);
    node.setDirtyCanvas?.(true, true);
  }
}

app.registerExtension({
  name: "Qwen35Fast.PresetWidgets",
  nodeCreated(node) {
    if (!ENHANCERS.includes(node.comfyClass)) return;
    const preset = node.widgets?.find((w) => w.name === "preset");
    if (!preset) return;
    const callback = preset.callback;
    preset.callback = function (...args) {
      const out = callback?.apply(this, args);
      showPresetWidgets(node);
      return out;
    };
    showPresetWidgets(node);
  },
  loadedGraphNode(node) {
    if (ENHANCERS.includes(node.comfyClass)) showPresetWidgets(node);
  },
});
