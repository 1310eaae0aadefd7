"""How this rank runs a step's forward, chosen in one place: a decode step from captured
graphs (engine/decode_graphs.py) or through torch.compile (engine/compiled_decode.py) where
the config asks for them, else eagerly, where the cpu backend's decode-only steps run the
decoder layers in one C++ call (layers/fused_decode.py) when every op of theirs is one of
its kernels. `describe()` names what was chosen, for the start-up line.

The KV-transfer hook of disaggregated prefill (engine/kv_agent.py) is an argument of the
step, never set on the model: a step that sends KV runs eagerly through the Python layer
loop, which calls it after each layer.
"""

from __future__ import annotations

import logging
import threading

from meshserve.engine.compile_throttle import CompileThrottle
from meshserve.engine.compiled_decode import CompiledDecode
from meshserve.engine.decode_graphs import DecodeGraphs
from meshserve.layers.fused_decode import FusedDecodeLayers

log = logging.getLogger(__name__)


class EagerForward:
    """The model's eager forward: the fused C++ layers (`fused`) on the steps they take, else
    the Python layer loop (which alone calls `after_layer`)."""

    def __init__(self, model, fused: FusedDecodeLayers | None):
        self.model, self.fused = model, fused

    def __call__(self, input_ids, positions, kv_caches, meta, hidden=None, residual=None, after_layer=None):
        fused = self.fused
        layers = fused if fused is not None and after_layer is None and fused.runs(kv_caches, meta) else None
        return self.model(input_ids, positions, kv_caches, meta, hidden, residual, after_layer, layers)


class DecodePath:
    """Chooses, for each step, what runs the forward of `model` over `kv_caches`."""

    def __init__(self, model, fused: FusedDecodeLayers | None, kv_caches, block_size: int, num_blocks: int,
                 max_model_len: int, device, *, compile_decode: bool = False, compile_in_background: bool = False,
                 decode_graphs: int = 0):
        """`fused`: the model's layers in one C++ call for eager steps (layers/fused_decode.py
        fused_decode_layers), or None. `decode_graphs`: the largest batch whose decode steps
        replay captured graphs (0: none). `compile_decode`: decode steps through torch.compile, compiled here, or with
        `compile_in_background` in a thread of its own while decode steps run eagerly, which
        switch to the graphs once they are ready; that thread gives way to the steps
        (engine/compile_throttle.py). Both write block `num_blocks` of the cache
        (the padding rows' or the warm-up's scratch), which the caller allocated."""
        self.eager = EagerForward(model, fused)
        self.compiled: CompiledDecode | None = None
        """The compiled decode step once it is ready (decode steps run eagerly until then)."""
        self.compile_thread: threading.Thread | None = None
        self.throttle: CompileThrottle | None = None
        """While the background compile runs: each step tells it that steps are being served."""
        if compile_decode:
            compiled = CompiledDecode(model, self.eager)
            warm_up = (model.backend, kv_caches, block_size, num_blocks, device)
            if compile_in_background:
                self.throttle = CompileThrottle()
                self.compile_thread = threading.Thread(target=self._compile, args=(compiled, warm_up),
                                                       name="meshserve-compile", daemon=True)
                self.compile_thread.start()
            else:
                compiled.warm_up(*warm_up)
                self.compiled = compiled
        self.graphs: DecodeGraphs | None = None
        if decode_graphs:
            self.graphs = DecodeGraphs(model, kv_caches, block_size, max_model_len, num_blocks, decode_graphs,
                                       device, forward=self.eager)
            self.graphs.capture_all()

    def _compile(self, compiled: CompiledDecode, warm_up: tuple) -> None:
        """The background compile: decode steps switch to the graphs once they are ready; a
        failure leaves them eager (and says why)."""
        throttle = self.throttle
        try:
            with throttle.applied():
                compiled.warm_up(*warm_up)
        except Exception:  # noqa: BLE001 - any compiler failure: serving goes on eagerly
            log.exception("compiling the decode step failed; decode steps stay eager")
            return
        finally:
            self.throttle = None
        log.info("the background compile paused %d times for served steps", throttle.pauses)
        self.compiled = compiled

    def replays(self, query_lens: list[int]) -> bool:
        """Whether a step of these query lengths replays a captured graph."""
        return self.graphs is not None and self.graphs.fits(query_lens)

    def run(self, input_ids, positions, kv_caches, meta, hidden=None, graph_step: tuple | None = None,
            after_layer=None, lora: bool = False):
        """The step's (hidden, residual): from its graph (`graph_step`, the host lists
        DecodeGraphs.run takes; `meta` None then), compiled, or eager. `after_layer(i)`: the
        KV-transfer hook, called after each layer (the step then runs eagerly). `lora`: rows of
        the step use LoRA adapters, which the eager steps add (layers/lora.py: the Python loop's
        layers, or the fused C++ layers'), not the graphs or the compiled step."""
        if lora:
            return self.eager(input_ids, positions, kv_caches, meta, hidden, after_layer=after_layer)
        throttle = self.throttle
        if throttle is not None:
            throttle.note_step()
        if graph_step is not None:  # (no KV transfer with graphs: engine.build.uses_decode_graphs)
            return self.graphs.run(*graph_step), None
        compiled = self.compiled
        if compiled is not None and after_layer is None and meta is not None and compiled.applies(meta):
            return compiled(input_ids, positions, kv_caches, meta, hidden)
        return self.eager(input_ids, positions, kv_caches, meta, hidden, after_layer=after_layer)

    def describe(self) -> str:
        """What runs decode steps, e.g. `decode: compiled (torch.compile); eager steps: the
        layers in one C++ call`."""
        parts = []
        if self.graphs is not None:
            parts.append(f"captured graphs up to batch {self.graphs.buckets[-1]}")
        if self.compiled is not None:
            parts.append("compiled (torch.compile)")
        elif self.compile_thread is not None:
            parts.append("compiling in the background (eager until ready)")
        eager = "the layers in one C++ call" if self.eager.fused is not None else "the Python layer loop"
        parts.append(f"eager steps: {eager}")
        return f"decode: {'; '.join(parts)}"
