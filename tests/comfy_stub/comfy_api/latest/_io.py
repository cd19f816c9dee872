"""Stand-in for ``comfy_api.latest.io`` with the attributes of the real classes the pack uses."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Input:
    io_type = "*"
    widget = False

    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, extra_dict=None,
                 raw_link=None, advanced=None, default=None, socketless=None, force_input=None, **extra):
        if not isinstance(id, str) or not id:
            raise ValueError("input id must be a non-empty string")
        self.id, self.display_name, self.optional, self.tooltip = id, display_name, optional, tooltip
        self.advanced, self.default, self.force_input = advanced, default, force_input
        for k, v in extra.items():
            setattr(self, k, v)


class Output:
    io_type = "*"

    def __init__(self, id=None, display_name=None, tooltip=None, is_output_list=False, **extra):
        self.id, self.display_name, self.tooltip, self.is_output_list = id, display_name, tooltip, is_output_list


def _type(name, io_type, widget=False, **known):
    inp = type(f"{name}Input", (Input,), {"io_type": io_type, "widget": widget})

    def init(self, id, *args, **kw):
        allowed = {"display_name", "optional", "tooltip", "lazy", "extra_dict", "raw_link", "advanced",
                   "default", "socketless", "force_input", *known}
        bad = set(kw) - allowed
        if args or bad:
            raise TypeError(f"{name}.Input got unexpected arguments {args or sorted(bad)}")
        Input.__init__(self, id, **kw)
        for k, v in known.items():
            if not hasattr(self, k):
                setattr(self, k, v)
    inp.__init__ = init
    out = type(f"{name}Output", (Output,), {"io_type": io_type})
    return type(name, (), {"Input": inp, "Output": out, "io_type": io_type})


Int = _type("Int", "INT", True, min=None, max=None, step=None, control_after_generate=None, display_mode=None)
Float = _type("Float", "FLOAT", True, min=None, max=None, step=None, round=None, display_mode=None)
String = _type("String", "STRING", True, multiline=False, placeholder=None, dynamic_prompts=None)
Boolean = _type("Boolean", "BOOLEAN", True, label_on=None, label_off=None)
Combo = _type("Combo", "COMBO", True, options=None, control_after_generate=None, upload=None, image_folder=None,
              remote=None)
Clip = _type("Clip", "CLIP")
Image = _type("Image", "IMAGE")
Model = _type("Model", "MODEL")
Conditioning = _type("Conditioning", "CONDITIONING")


class Hidden(str, Enum):
    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"


@dataclass
class Schema:
    node_id: str
    display_name: str = None
    category: str = "sd"
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    description: str = ""
    search_aliases: list = field(default_factory=list)
    is_output_node: bool = False
    is_input_list: bool = False
    is_deprecated: bool = False
    is_experimental: bool = False
    not_idempotent: bool = False

    def validate(self):
        ids = [i.id for i in self.inputs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.node_id}: duplicate input ids")
        for i in self.inputs:
            if isinstance(i, Combo.Input):
                if i.options is None or (i.default is not None and i.default not in i.options):
                    raise ValueError(f"{self.node_id}.{i.id}: bad combo options/default")
            if getattr(i, "min", None) is not None and i.default is not None and not i.min <= i.default <= i.max:
                raise ValueError(f"{self.node_id}.{i.id}: default outside [min, max]")


class ComfyNode:
    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs):
        raise NotImplementedError


class NodeOutput:
    def __init__(self, *args: Any, ui=None, expand=None, block_execution=None):
        self.args, self.ui = args, ui

    @property
    def result(self):
        return self.args if self.args else None
