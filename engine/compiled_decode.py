"""The decode step compiled with torch.compile (inductor, weights frozen as constants).

A decode step of one stream is some 40 small ops per layer between the matmuls, each a
dispatch of a microsecond or more; inductor fuses them into a few loops per layer. The
matmuls stay meshserve's own (oneDNN-packed, or the int4/int8 kernels), called from the
graph; freezing folds what depends only on weights (faster than unfrozen, measured with
int4 weights). Steps with prefill chunks stay eager: their shapes
vary more and their time is in the matmuls.

Two graphs, compiled at start-up (by default in a thread of their own while decode steps
run eagerly: the server is ready in seconds and speeds up once the graphs are; the warm-up
writes only a scratch block no sequence is given): one sequence, and two or more (torch specializes a size
of 1). The batch and block-table sizes are marked dynamic, so later steps reuse them; a
block table one block wide is padded to two (the mask or the lengths hide the padding),
since width 1 would be a third graph. A step that would still need a recompile runs
eagerly instead (counted), so serving never stalls on the compiler.
"""

from __future__ import annotations

import logging
import time

import torch

from meshserve.layers.attention import PagedMetadata

log = logging.getLogger(__name__)

COMPILE_OPTIONS = {"freezing": True, "cpp_wrapper": True}
"""Inductor's options. cpp_wrapper: the graph's kernels are called from generated C++
rather than from a Python wrapper, hundreds of calls per step at one stream: faster at one
stream and at many. The very first compile on a machine takes several times longer than
later ones, as without it: inductor's on-disk cache keeps what it builds."""

WARM_UP_WIDTH = 3
"""Block-table width of the warm-up steps: above 1, and unlike the warm-up batch of 2, so
the two dynamic sizes get separate symbols."""


def _mark_dynamic(input_ids, positions, meta: PagedMetadata, batch_dynamic: bool) -> None:
    batch, width = meta.dynamic_tensors()
    for tensor, dim in width:
        torch._dynamo.mark_dynamic(tensor, dim)
    if batch_dynamic:
        for tensor in (input_ids, positions, *batch):
            torch._dynamo.mark_dynamic(tensor, 0)


class CompiledDecode:
    def __init__(self, model, eager=None):
        """`eager`: what runs a step whose shapes fit no compiled graph (default the model's
        forward; engine/decode_path.py passes its eager forward)."""
        self.model = model
        self.eager = eager or model
        self._compiled = torch.compile(model.forward, options=COMPILE_OPTIONS)
        self.steps = 0
        """Steps run through the compiled graphs."""
        self.eager_steps = 0
        """Decode steps that would have needed a recompile and ran eagerly."""
        self.compile_seconds = 0.0

    @staticmethod
    def applies(meta) -> bool:
        """Only steps where every sequence decodes one token (the torch and cpu backends'
        metadata), none of them a draft tree's row that skips keys (the graph has no mask)."""
        return isinstance(meta, PagedMetadata) and meta.decode_only and meta.decode_skip is None

    def __call__(self, input_ids, positions, kv_caches, meta: PagedMetadata, hidden=None, residual=None):
        meta.for_graph()
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = self._compiled(input_ids, positions, kv_caches, meta, hidden, residual)
        except RuntimeError as e:  # torch raises a plain RuntimeError for this stance
            if "Detected recompile" not in str(e):
                raise
            self.eager_steps += 1
            if self.eager_steps == 1:
                log.warning("a decode step's shapes fit no compiled graph; running such steps eagerly (%s)", e)
            return self.eager(input_ids, positions, kv_caches, meta, hidden, residual)
        self.steps += 1
        return out

    @torch.inference_mode()
    def warm_up(self, backend, kv_caches, block_size: int, scratch_block: int, device) -> None:
        """Compile for one and for several decoding sequences, writing into `scratch_block`
        of the cache, a block no sequence is given (so this may run while others decode)."""
        log.info("compiling the decode step with torch.compile (inductor; tens of seconds)")
        start = time.perf_counter()
        length = block_size * (WARM_UP_WIDTH - 1) + 1
        for batch in (1, 2):
            meta = backend.build_metadata([1] * batch, [length] * batch, [[scratch_block] * WARM_UP_WIDTH] * batch,
                                          block_size, device)
            meta.for_graph()
            ids = torch.zeros(batch, dtype=torch.long, device=device)
            positions = torch.full((batch,), length - 1, dtype=torch.long, device=device)
            _mark_dynamic(ids, positions, meta, batch_dynamic=batch > 1)
            self._compiled(ids, positions, kv_caches, meta, None, None)
        for k, v in kv_caches:
            k[scratch_block].zero_()
            v[scratch_block].zero_()
        self.compile_seconds = time.perf_counter() - start
        log.info("compiled the decode step in %.1f s; decode steps run the compiled graphs from now on",
                 self.compile_seconds)
