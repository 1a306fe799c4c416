"""The model runner: packs a step's rows, pads them, runs the model's forward.

:meth:`ModelRunner.run` takes a :class:`generation.engine.scheduler.StepPlan` and the answers
it was made for, lays the plan's tokens out as one packed row (each answer's segment over its
own KV buffer, :mod:`generation.packed_attention`), pads it to the plan's row count
(:func:`generation.engine.scheduler.padded_rows`; on CUDA one fixed count) and returns the
logits of the rows that need them. It changes nothing in the answers but their KV buffers
(the attention writes the new K/V there); moving positions and choosing tokens is the engine
core's job. The calibration timers (``generation.local``) time steps through this API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from foundation.compute import torch_threads
from generation.engine.request import Request
from generation.engine.scheduler import StepPlan, padded_rows
from generation.packed_attention import Segment, StepAborted, StepContext

__all__ = ["ModelRunner", "StepAborted"]


class ModelRunner:
    """One model's forward over packed, padded steps.

    Args:
        model: a transformers causal LM whose attention implementation is
            :data:`generation.packed_attention.ATTN_NAME`.
        device: torch device string.
        fixed_rows: pad every step and LM-head call to exactly this many rows (CUDA);
            None pads by :func:`generation.engine.scheduler.padded_rows` (CPU).
        threads: torch intra-op threads every forward runs at, set on the calling thread when
            it differs (another model of the process may have set its own); None leaves the
            thread's count as it is.
        pad: False runs every step and LM-head call with exactly its real rows (no padding):
            only for a model whose every row-mixing op is exact whatever the row count (the
            int8 precision, :func:`generation.precision.pads_rows`).
    """

    def __init__(self, model: Any, device: str, fixed_rows: int | None = None,
                 threads: int | None = None, pad: bool = True) -> None:
        self.model, self.device = model, device
        self.fixed_rows, self.threads, self.pad = fixed_rows, threads, pad

    def _rows(self, n: int) -> int:
        """Rows a call of ``n`` real rows runs with (``n`` itself when not padding)."""
        return padded_rows(n, self.fixed_rows) if self.pad else n

    def run(self, plan: StepPlan, requests: Sequence[Request],
            abort: Callable[[], bool] | None = None) -> Any:
        """Run ``plan`` (made by ``schedule(requests, ...)``): logits of its rows that need
        them, in plan order, ``(plan.logit_rows, vocab)``. ``abort``, asked at every layer
        (:class:`generation.packed_attention.StepContext`), may stop the forward with
        :class:`generation.packed_attention.StepAborted`.

        Every answer in the plan must hold its KV buffer (admitted). The step runs with
        ``padded_rows(plan.tokens)`` rows (padding rows: token 0 at position 0; no padding when
        ``pad`` is False); the LM head runs on the logit rows padded the same way (the first
        logit row repeated), or not at all when no row needs logits.
        """
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        logit_rows: list[int] = []
        for item in plan.chunks:
            req = requests[item.index]
            assert req.kv is not None
            toks = ([req.next_tok] if item.decode and req.next_tok is not None
                    else req.prompt[item.start:item.start + item.tokens])
            segments.append(Segment(req.kv, len(ids), len(toks), item.start))
            ids.extend(toks)
            positions.extend(range(item.start, item.start + len(toks)))
            if item.needs_logits:
                logit_rows.append(len(ids) - 1)
        pad = self._rows(len(ids)) - len(ids)
        ids.extend([0] * pad)
        positions.extend([0] * pad)
        # The LM head runs on the logit rows padded like a step (same kernel for every row
        # count); a step that only prefills (no row needs logits) skips it.
        keep = (logit_rows + [logit_rows[0]] * (self._rows(len(logit_rows)) - len(logit_rows))
                if logit_rows else [])
        return self.forward(ids, positions, keep, StepContext(segments, abort))

    def forward(self, ids: list[int], positions: list[int], keep: list[int],
                ctx: StepContext) -> Any:
        """One model forward over the packed rows ``ids`` at ``positions`` (both ``(rows,)``);
        logits of the ``keep`` rows, ``(len(keep), vocab)``."""
        import torch

        with torch_threads(self.threads, restore=False), torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, rows)
            pos = torch.tensor([positions], dtype=torch.long, device=self.device)  # (1, rows)
            out = self.model(input_ids=x, position_ids=pos, use_cache=False,
                             logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
                             ragbudget_step=ctx)
            return out.logits[0]  # (len(keep), vocab)
