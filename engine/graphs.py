"""CUDA graphs for the decode step, the MTP draft step and the 1+depth verify step.

``GraphRunner`` wraps a ``forward.Runner`` and replays one captured graph per (kind, rows): the
cache length lives on the device, so one graph serves every position; the ``*_logits`` steps capture
the output projection too (an eager 248k-row product per draft held the GPU up while the host
launched it), and ``main+token`` (the greedy step, ``Runner.forward_token``) the embedding of its
input token and the argmax as well (``main+tokenh`` also returns the step's hidden states, for
``mtp="auto"``'s plain steps), and ``mtp+row`` (the MTP catch-up over a verify's rows,
``speculative.catch_up``) the pick of its kept row on the device; the host bookkeeping the eager
forward does (staged row counts, the DeltaNet per-row states) is re-applied after each replay.
Prompts (many rows) always run eagerly. Graphs need weights that stay where they are while the graph
lives (a GraphRunner is kept between generations only while the model's weights stay where they
were, ``engine/held.py``, and the next generation checks ``graph_blocker`` again): when a module
still called in the step streams its weights in or patches them per call, lives off the GPU, or the
attention backend is not graph-safe, ``graph_blocker`` names the reason and generation runs eagerly
(said once). A module that casts a resident weight per call (ComfyUI's ``comfy_cast_weights``) is
captured: the replay casts the same storage again. Without the fused kernels (no Triton) the whole
module path is captured this way. A bucketed attention backend (``kernels.bucket_end``) reads a span
fixed at capture, so its graphs are kept per (kind, rows, span). When a capture fails inside a
module call of several rows over an int8 weight the hook reads in place (comfy-kitchen 0.2.24's int8
product of 2-8 rows at K = 12288 cannot be captured on Hopper), that weight shape's several-row
products go to ``int8_rows`` (torch's int8 matmul on the same weights) and the capture is tried
again; a step whose capture still fails runs eagerly from then on in this process, said once with
the reason, while the other steps stay in graphs. A failed capture puts the CUDA random generator's
state back (it would refuse every later draw otherwise). ``cuda_graphs=True``: the error propagates.
"""

from __future__ import annotations

import logging

import torch

from ..kernels import ATTENTION_BACKENDS, MAX_DECODE_ROWS, attention_torch, backend_for, say_once
from .errors import Qwen35Error, exception_line

log = logging.getLogger(__name__)


def _modules(binding):
    yield binding.transformer
    if binding.mtp is not None:
        yield binding.mtp


#: ``failure_key`` -> {(kind, rows): why its capture failed}: those steps run eagerly in this process.
_CAPTURE_FAILED: dict[tuple, dict[tuple[str, int], str]] = {}
#: ``failure_key`` -> int8 weight shapes whose several-row products go to ``int8_rows`` in graphs.
_REROUTED: dict[tuple, set[tuple[int, int]]] = {}
#: Most weight shapes one capture reroutes before it runs eagerly.
REROUTES = 4


def failure_key(device: torch.device, dtype: torch.dtype, attention: str, plan=None) -> tuple:
    """What decides which operations a step captures: the device, dtype, attention and the path."""
    return str(device), dtype, attention, "modules" if plan is None else plan.describe()


def _backend(binding, device, dtype: torch.dtype, attention: str) -> str:
    """The decode-attention backend ``attention`` ("auto" or a name) runs as for this model here."""
    cfg = binding.config
    return backend_for(attention, cfg.num_attention_heads, cfg.head_dim, dtype, device)[0]


def graph_blocker(binding, device: torch.device, dtype: torch.dtype, attention: str, plan=None) -> str | None:
    """None when decode steps can be captured, else the reason (one line). With a fused ``plan``, a
    step calls no module but the projections the plan did not read in place (norms, convs and the
    resolved projections are tensors on the device, read by the kernels): those modules must be
    safe to capture (the binding's weight hook says) with their weights on the device. Without a
    plan, the same holds for every module of the model."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (running on {device.type})"
    dev = _indexed(device)
    backend = _backend(binding, device, dtype, attention)
    if not ATTENTION_BACKENDS[backend].graph_safe:
        return f"the '{backend}' attention backend syncs with the host"
    return module_blocker(binding, dev, plan)


def module_blocker(binding, dev: torch.device, plan=None) -> str | None:
    """``graph_blocker``'s check of the modules a step calls on ``dev`` (any device type)."""
    if plan is not None:
        for name, mod in plan.unresolved_modules.items():
            why = binding.weights.module_call_reason(mod) or _off_device(mod, dev)
            if why is not None:
                return f"{name} runs through its module call ({plan.unresolved[name]}; {why})"
        return None
    for root in _modules(binding):
        for name, mod in root.named_modules():
            why = binding.weights.module_call_reason(mod)
            if why is not None:
                return f"{name or 'model'}: {why}"
        for name, p in list(root.named_parameters()) + list(root.named_buffers()):
            if p.device != dev:
                return f"weight {name} lives on {p.device}, not {dev} (partially loaded model)"
    return None


def _indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index (the current device's when ``device`` names none); others as given."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _rng_state(device: torch.device):
    """A copy of the device's default CUDA generator state (None where torch cannot copy it)."""
    gen = torch.cuda.default_generators[_indexed(device).index]
    return gen.clone_state() if hasattr(gen, "clone_state") else None


def _put_rng_state(device: torch.device, state) -> None:
    """Put back ``_rng_state``'s copy: a capture that failed leaves the generator registered with
    it, and every later CUDA random draw of the process would fail ("Offset increment outside graph
    capture encountered unexpectedly")."""
    if state is not None:
        torch.cuda.default_generators[_indexed(device).index].graphsafe_set_state(state)


def _off_device(module, dev: torch.device) -> str | None:
    for name, p in module.named_parameters():
        if p.device != dev:
            return f"its {name} lives on {p.device}, not {dev}"
    return None


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture. With a new stream per capture, allocated VRAM
    rose 0.41 GB over the first 20 generations of a soak (cuBLAS keeps a workspace per stream, the
    likely cause); with one shared stream it stayed flat over 200."""
    dev = _indexed(device)
    if dev not in _STREAMS:
        _STREAMS[dev] = torch.cuda.Stream(dev)
    return _STREAMS[dev]


class _Graph:
    """One captured forward with static inputs/outputs and the host state it leaves behind."""

    def __init__(self, graph, inputs, outputs, staged):
        self.graph, self.inputs, self.outputs, self.staged = graph, inputs, outputs, staged


class GraphRunner:
    """Drop-in for ``Runner`` whose ``forward``, ``forward_logits``, ``mtp_forward`` and
    ``mtp_logits`` (S <= 8 rows) replay CUDA graphs."""

    def __init__(self, runner, *, required: bool = False):
        self.runner = runner
        self.cache = runner.cache
        self.device = runner.device
        self.dtype = runner.dtype
        self.binding = runner.binding
        self.required = required  # a failed capture raises instead of running that step eagerly
        backend = _backend(runner.binding, runner.device, runner.dtype, runner.attention)
        self._bucketed = ATTENTION_BACKENDS[backend].bucketed
        # Steps whose capture failed on this path in this process: they run eagerly; the int8 weight
        # shapes whose several-row module calls failed a capture (``Runner.int8_shapes``), kept too.
        key = failure_key(_indexed(self.device), self.dtype, runner.attention, runner.fused)
        self._failed = _CAPTURE_FAILED.setdefault(key, {})
        runner.int8_shapes = _REROUTED.setdefault(key, set())
        # One private memory pool per graph: a replay never overwrites another graph's outputs.
        self._graphs: dict[tuple[str, int, int | None], _Graph] = {}

    # ------------------------------------------------------------------ public (Runner API)
    def forward(self, x: torch.Tensor, pos: torch.Tensor, *, keep_rows: bool = True):
        """Same contract as ``Runner.forward``; graphs for 1..8 rows, eager for longer inputs."""
        if x.shape[1] > MAX_DECODE_ROWS or not keep_rows:
            return self.runner.forward(x, pos, keep_rows=keep_rows)
        return self._run("main", x, pos)

    def mtp_forward(self, hidden: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Same contract as ``Runner.mtp_forward``; graphs for 1..8 rows."""
        if hidden.shape[1] > MAX_DECODE_ROWS:
            return self.runner.mtp_forward(hidden, emb, pos)
        return self._run("mtp", hidden, pos, emb)[0]

    def forward_logits(self, x: torch.Tensor, pos: torch.Tensor):
        """Same contract as ``Runner.forward_logits``; the output projection is in the graph."""
        if x.shape[1] > MAX_DECODE_ROWS:
            return self.runner.forward_logits(x, pos)
        return self._run("main+logits", x, pos)

    def forward_token(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Same contract as ``Runner.forward_token``: the embedding, the step, the output
        projection and the argmax in one graph; the token is written over the graph's own ids, so
        passing the last returned token back in costs no copy."""
        return self._run("main+token", ids, pos)[0]

    def forward_token_hidden(self, ids: torch.Tensor, pos: torch.Tensor):
        """Same contract as ``Runner.forward_token_hidden`` (one graph, as ``forward_token``)."""
        return self._run("main+tokenh", ids, pos)

    def mtp_logits(self, hidden: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor,
                   row: torch.Tensor | None = None, vocab: int | None = None):
        """Same contract as ``Runner.mtp_logits``; the output projection (and the pick of ``row``)
        is in the graph, one graph per draft vocabulary (kind ``mtp+logits/<vocab>``)."""
        if hidden.shape[1] > MAX_DECODE_ROWS:
            return self.runner.mtp_logits(hidden, emb, pos, row=row, vocab=vocab)
        cut = "" if vocab is None else f"/{vocab}"
        if row is not None:
            return self._run("mtp+row" + cut, hidden, pos, emb, row)
        return self._run("mtp+logits" + cut, hidden, pos, emb)

    # ------------------------------------------------------------------ internals
    def ready_depths(self) -> set[int]:
        """The MTP depths k whose verify step (k + 1 rows; 0: a plain step) has a graph already."""
        plain = {"main+tokenh", "main+logits"}  # depth 0: plain steps keeping hidden states
        return {rows - 1 for kind, rows, _ in self._graphs if kind == "main+logits" and rows > 1} | \
            ({0} if any(kind in plain and rows == 1 for kind, rows, _ in self._graphs) else set())

    def _keep(self, key: tuple, g: _Graph) -> None:
        """Store a new graph; with a bucketed backend drop this kind's graphs of spans more than one
        bucket away (a generation's span only grows, but for an MTP rollback across a bucket edge;
        a kept stack's next generation starts lower)."""
        kind, rows, span = key
        if span is not None:
            for old in [k for k in self._graphs if k[:2] == (kind, rows) and abs(k[2] - span) > attention_torch.BUCKET]:
                del self._graphs[old]
        self._graphs[key] = g

    def _capture_or_reroute(self, kind: str, inputs) -> _Graph | Exception:
        """``_capture``, or the exception it failed with. When the failure was a module call of
        several rows over an int8 weight the hook reads in place, that weight shape's products of
        several rows go to ``int8_rows`` from then on (in this process, on this path; said once)
        and the capture is tried again (at most ``REROUTES`` times). When it still fails, the shapes
        this call rerouted are taken back (``int8_rows`` itself may be what fails on this GPU)."""
        runner, rows = self.runner, inputs[0].shape[1]
        added = []  # taken back if the capture still fails: the eager step then calls the modules again
        for _ in range(REROUTES + 1):
            runner.failed_module = None
            try:
                return self._capture(kind, inputs)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - any capture fault: reroute, else run eagerly
                if self.required:
                    raise
                failed = exc
            plain = None if runner.failed_module is None or rows < 2 else runner.int8_weight(runner.failed_module)
            shape = None if plain is None else tuple(plain.weight.shape)
            if shape is None or shape in runner.int8_shapes:
                break
            runner.int8_shapes.add(shape)
            added.append(shape)
            say_once(log, f"Qwen3.5: ComfyUI's int8 product of several rows at {shape[0]}x{shape[1]} cannot be "
                          f"captured in a CUDA graph here ({exception_line(failed)}); those rows read the same "
                          "int8 weights through torch's int8 matmul instead")
        runner.int8_shapes.difference_update(added)
        return failed

    def _give_up(self, kind: str, rows: int, exc: Exception, inputs):
        """After a failed capture: this step runs eagerly, now and for the rest of the process on
        this path (said once); the other steps keep their graphs."""
        why = f"capturing the {kind} {rows}-row step failed ({exception_line(exc)})"
        self._failed[(kind, rows)] = why
        say_once(log, f"Qwen3.5 decode runs these steps without CUDA graphs (slower): {why}; the other steps "
                      "stay in graphs. Please report this with your torch, comfy-kitchen and GPU")
        return self._eager(kind, inputs)

    def _eager(self, kind: str, inputs):
        if kind == "mtp":
            return (self.runner.mtp_forward(inputs[0], inputs[2], inputs[1]),)
        if kind.startswith("mtp+"):  # mtp+logits, mtp+row; /<vocab>: the draft vocabulary
            step, _, cut = kind.partition("/")
            row = inputs[3] if step == "mtp+row" else None
            return self.runner.mtp_logits(inputs[0], inputs[2], inputs[1], row=row, vocab=int(cut) if cut else None)
        if kind == "main+logits":
            return self.runner.forward_logits(inputs[0], inputs[1])
        if kind == "main+token":
            return (self.runner.forward_token(inputs[0], inputs[1]),)
        if kind == "main+tokenh":
            return self.runner.forward_token_hidden(inputs[0], inputs[1])
        return self.runner.forward(inputs[0], inputs[1])

    def _capture(self, kind: str, inputs) -> _Graph:
        part = kind.split("+")[0]  # the cache part the step stages rows in
        static = [t.clone() for t in inputs]
        stream = _capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), self.cache.scratch_step(part):
            self._eager(kind, static)  # compiles kernels, allocates lazily built constants
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        rng = _rng_state(self.device)
        try:
            with torch.cuda.graph(graph):
                outputs = self._eager(kind, static)
        except Exception:
            self.cache.drop_staged(part, lengths_moved=False)
            _put_rng_state(self.device, rng)
            raise
        staged = self.cache.save_staged(part)
        self.cache.drop_staged(part, lengths_moved=False)
        return _Graph(graph, static, outputs, staged)

    def _run(self, kind: str, x: torch.Tensor, pos: torch.Tensor, *more: torch.Tensor):
        rows = x.shape[1]
        part = kind.split("+")[0]
        self.cache.check_room(part, rows)
        inputs = (x, pos, *more)
        if (kind, rows) in self._failed:
            if self.required:
                raise Qwen35Error(f"cuda_graphs=True but {self._failed[(kind, rows)]}; use cuda_graphs='auto'")
            return self._eager(kind, inputs)
        span = self.cache.span(part, rows) if self._bucketed else None
        key = (kind, rows, span)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture_or_reroute(kind, inputs)
            if not isinstance(g, _Graph):
                return self._give_up(kind, rows, g, inputs)
            self._keep(key, g)
            log.info("captured the %s %d-row step as a CUDA graph%s", kind, rows,
                     "" if span is None else f" (attention over {span} slots)")
        for dst, src in zip(g.inputs, inputs):
            if src.data_ptr() != dst.data_ptr() or src.shape != dst.shape or src.stride() != dst.stride():
                dst.copy_(src)  # else the same tensor: main+token's last token is already in place
        g.graph.replay()
        self.cache.restore_staged(g.staged)
        return g.outputs
