"""Choosing one answer's next token from its logits: stop-id masking, greedy, temperature and top-p.

One engine step computes the logits of every answer in it; each answer's row then
goes through :func:`select_token` on its own (the scheduler catches a failure per
row, so one answer's sampling can never end another's). Everything here is per row:
a row's token depends on its logits, its parameters and its own seeded generator only.

Numerics. ``softmax(logits / T)`` in float32 overflows when ``|logit| / T`` passes
float32's largest value (3.4e38: temperatures below about 1e-37 for logits of order 10,
and a subnormal ``T`` rounds to 0 in float32): the scaled row's maximum is then infinite
and the softmax NaN. Such a row is computed instead as ``softmax((logits - max) / T)`` in
float64, the same distribution written so that no term overflows (vLLM clamps
``0 < T < 0.01`` up to 0.01 for the same reason; here every ``T`` the API accepts keeps
its meaning). Likewise the nucleus always keeps the most likely token, also for a ``top_p``
below float32's smallest value (which compares as 0). Rows whose scaled maximum is finite are
computed exactly as before, so a seeded answer recorded by an earlier version regenerates
the same tokens.
"""

from __future__ import annotations

import math
from typing import Any

from foundation.errors import BackendError
from generation.base import GenParams


class SamplingFailed(BackendError):
    """One answer's next token could not be chosen (non-finite logits, nothing left to choose);
    it ends that answer only."""

    code = "sampling_failed"


def mask_ids(logits: Any, ids: frozenset[int]) -> Any:
    """A copy of ``logits`` ``(vocab,)`` with ``ids`` (those inside the vocabulary) set to
    ``-inf``: vLLM's ``min_tokens`` processor. The input is not modified (the prefix cache
    keeps its logits)."""
    import torch

    keep = sorted(i for i in ids if 0 <= i < int(logits.shape[-1]))
    if not keep:
        return logits
    out = logits.clone()
    out[torch.tensor(keep, dtype=torch.long, device=out.device)] = float("-inf")
    return out


def probabilities(logits: Any, temperature: float) -> Any:
    """``softmax(logits / temperature)`` as a float32 CPU tensor ``(vocab,)``, finite for every
    ``temperature > 0`` (module docstring). ``-inf`` logits (masked ids) get probability 0.

    Raises:
        SamplingFailed: a NaN or ``+inf`` logit, or every logit ``-inf``.
    """
    import torch

    x = logits.float().cpu()  # (vocab,)
    if bool(torch.isnan(x).any()) or bool(torch.isposinf(x).any()):
        raise SamplingFailed("the model produced non-finite logits for this answer")
    top = float(x.max())
    if top == float("-inf"):
        raise SamplingFailed("every token is masked: nothing left to sample")
    scaled = x / temperature  # (vocab,)
    if math.isfinite(float(scaled.max())):
        return torch.softmax(scaled, dim=-1)
    shifted = (x.double() - top) / temperature  # (vocab,) float64, max exactly 0
    return torch.softmax(shifted, dim=-1).float()


def select_token(logits: Any, params: GenParams, rng: Any) -> int:
    """The next token id from ``logits`` ``(vocab,)``: argmax when greedy, else temperature +
    top-p (nucleus; Holtzman et al. 2020) sampling with the answer's seeded ``rng``.

    Raises:
        SamplingFailed: see :func:`probabilities`, or probabilities that are not finite and
            positive (never for finite logits and parameters :meth:`GenParams.validate` accepts).
    """
    import torch

    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = probabilities(logits, params.temperature)  # (vocab,)
    order = None
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)  # (vocab,), (vocab,)
        keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < params.top_p  # (vocab,) bool
        keep[0] = True  # the most likely token always stays (a top_p below float32's range is 0)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = sorted_p / sorted_p.sum()
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        raise SamplingFailed("sampling probabilities are not finite for this answer")
    choice = int(torch.multinomial(probs, 1, generator=rng).item())
    return int(order[choice].item()) if order is not None else choice
