// What the prompt enhancer nodes show follows their preset:
// - the sampling widgets and `attention` only with preset "custom" (the official presets ignore the
//   sampling values; `attention` is for comparisons). Hidden widgets keep their values and their place
//   in a saved workflow, so workflows saved before this extension load unchanged;
// - image inputs: every connected one, plus one free input to connect the next, with preset "edit" or
//   "custom"; only the connected ones with "text-to-image". Inputs are removed and put back in their
//   declared order, every link kept on the input it was made to.
// The Templates dialog (Templates -> Extensions) describes an extension's template by its file name
// again; DESCRIPTIONS says what each of this pack's workflows does instead.
// Every node of the pack shows its status (the text under the node) at least STATUS_LINES lines high
// and STATUS_WIDTH wide, so the line to act on and the summary under it stay in view.
import { app } from "../../scripts/app.js";

const STATUS_WIDGET = "$$node-text-preview"; // the frontend's progress-text widget
const STATUS_LINES = 6;
const STATUS_LINE_HEIGHT = 16; // the widget's 12 px text
const STATUS_WIDTH = 340;

const ENHANCERS = ["Qwen35FastPromptEnhancer", "Qwen35FastPromptEnhancerServer"];
const CUSTOM_ONLY = ["temperature", "top_k", "top_p", "min_p", "presence_penalty", "attention"];
const IMAGE = /^image(\d+)$/;
const SLOT_FIELDS = ["name", "type", "shape", "localized_name", "label", "tooltip", "color_on", "color_off", "dir"];
const declared = new WeakMap(); // node -> {order: input names as declared, images: {name: slot fields}}

function remember(node) {
  if (declared.has(node)) return declared.get(node);
  const images = {};
  for (const input of node.inputs || []) {
    if (IMAGE.test(input.name)) {
      images[input.name] = Object.fromEntries(SLOT_FIELDS.filter((k) => input[k] !== undefined).map((k) => [k, input[k]]));
    }
  }
  const record = { order: (node.inputs || []).map((i) => i.name), images };
  declared.set(node, record);
  return record;
}

function wantedImages(node, preset, names) {
  const linked = new Set(node.inputs.filter((i) => IMAGE.test(i.name) && i.link != null).map((i) => i.name));
  const wanted = new Set(linked);
  if (preset === "edit" || preset === "custom") {
    const free = names.find((n) => !linked.has(n) && names.indexOf(n) > Math.max(-1, ...[...linked].map((l) => names.indexOf(l))));
    if (free) wanted.add(free);
  }
  return wanted;
}

function showPresetImages(node, preset) {
  const record = remember(node);
  const names = Object.keys(record.images).sort((a, b) => IMAGE.exec(a)[1] - IMAGE.exec(b)[1]);
  if (!names.length) return false;
  const wanted = wantedImages(node, preset, names);
  let changed = false;
  for (let i = node.inputs.length - 1; i >= 0; i--) {
    const input = node.inputs[i];
    if (IMAGE.test(input.name) && input.link == null && !wanted.has(input.name)) {
      node.removeInput(i);
      changed = true;
    }
  }
  for (const name of names) {
    if (wanted.has(name) && !node.inputs.some((i) => i.name === name)) {
      node.addInput(name, record.images[name].type, { ...record.images[name] });
      changed = true;
    }
  }
  return reorder(node, record.order) || changed;
}

function reorder(node, order) {
  const rank = (input) => {
    const at = order.indexOf(input.name);
    return at === -1 ? order.length : at;
  };
  if (node.inputs.every((input, i) => i === 0 || rank(node.inputs[i - 1]) <= rank(input))) return false;
  node.inputs.sort((a, b) => rank(a) - rank(b));
  node.inputs.forEach((input, slot) => {
    const link = input.link == null ? null : node.graph?._links?.get?.(input.link) ?? node.graph?.links?.[input.link];
    if (link) link.target_slot = slot;
  });
  return true;
}

function showPresetWidgets(node) {
  const preset = node.widgets?.find((w) => w.name === "preset");
  if (!preset) return;
  const hide = preset.value !== "custom";
  let changed = showPresetImages(node, preset.value);
  for (const w of node.widgets) {
    if (CUSTOM_ONLY.includes(w.name) && Boolean(w.hidden) !== hide) {
      w.hidden = hide;
      changed = true;
    }
  }
  if (changed) {
    node.setSize([node.size[0], node.computeSize()[1]]);
    node.setDirtyCanvas?.(true, true);
  }
}

const DESCRIPTIONS = {
  pe_text_to_image: "Prompt enhancer (MTP) -> Qwen-Image 2.1 text-to-image",
  pe_edit: "Load Image -> prompt enhancer in edit mode -> Qwen-Image 2.1 edit",
  pe_text_to_image_server: "Prompt enhancer on a server -> Qwen-Image 2.1 text-to-image",
  textgenerate_length_aware: "Core Load CLIP -> Length-aware decode (MTP) -> core Generate Text",
};

function describeTemplates(root) {
  for (const [name, description] of Object.entries(DESCRIPTIONS)) {
    const spaced = name.replace(/[-_]/g, " ");
    for (const title of root.querySelectorAll?.("*") ?? []) {
      if (title.childElementCount || title.textContent.trim() !== name) continue;
      const card = title.parentElement;
      const repeat = card && [...card.querySelectorAll("*")].find(
        (e) => !e.childElementCount && e !== title && e.textContent.trim() === spaced);
      if (repeat) repeat.textContent = description;
    }
  }
}

function watchTemplateCards() {
  let queued = false;
  new MutationObserver(() => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      document.querySelectorAll("[role=dialog]").forEach(describeTemplates);
    });
  }).observe(document.body, { childList: true, subtree: true });
}

function roomForStatus(node) {
  const add = node.addCustomWidget;
  node.addCustomWidget = function (widget, ...rest) {
    if (widget?.name === STATUS_WIDGET && widget.options) {
      const min = widget.options.getMinHeight;
      widget.options.getMinHeight = () => Math.max(min?.() ?? 0, STATUS_LINES * STATUS_LINE_HEIGHT + 12);
    }
    const out = add.call(this, widget, ...rest);
    if (widget?.name === STATUS_WIDGET) {
      const [w, h] = this.computeSize();
      this.setSize([Math.max(this.size[0], w, STATUS_WIDTH), Math.max(this.size[1], h)]);
      this.setDirtyCanvas?.(true, true);
    }
    return out;
  };
}

app.registerExtension({
  name: "Qwen35Fast.PresetWidgets",
  setup() {
    watchTemplateCards();
  },
  nodeCreated(node) {
    if (node.comfyClass?.startsWith("Qwen35Fast") && typeof node.addCustomWidget === "function") roomForStatus(node);
    if (!ENHANCERS.includes(node.comfyClass)) return;
    remember(node); // the declared inputs, before a saved workflow's (or this extension's) changes
    const preset = node.widgets?.find((w) => w.name === "preset");
    if (!preset) return;
    const callback = preset.callback;
    preset.callback = function (...args) {
      const out = callback?.apply(this, args);
      showPresetWidgets(node);
      return out;
    };
    const connections = node.onConnectionsChange;
    node.onConnectionsChange = function (...args) {
      const out = connections?.apply(this, args);
      if (args[0] === 1 /* an input */) queueMicrotask(() => showPresetWidgets(node));
      return out;
    };
    showPresetWidgets(node);
  },
  loadedGraphNode(node) {
    if (ENHANCERS.includes(node.comfyClass)) showPresetWidgets(node);
  },
});
