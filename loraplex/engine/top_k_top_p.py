"""Top-k and top-p filtering of a batch's logits over the whole vocabulary (the sampler's last
filter before a draw over the vocabulary; ``keep_candidates`` is the same rule over each row's
best tokens, which rows with a small top_k draw among: ``Sampler._draw_among_best``).

Both need each row's tokens best first, and a sort of the whole vocabulary is the costly part:
vLLM timed a sort-based top-k over 256 rows of a 131,072 vocabulary at 3.8 ms on its GPU
(vllm-project/vllm#32558), and on this project's 2-core CPU seconds over 256 rows of Qwen's 152k
(``benchmarks/bench_top_k.py``). The rows that come here have no top_k or one above
the sampler's ``partial_top_k_max`` (any top_k is still filtered right, by a full sort). So:

- on the CPU, rows of top_p alone: their best ``partial_max`` tokens first, with the mass
  taken over the whole row; a row whose nucleus reaches past them is sorted in full. Deciding
  that reads a flag per row back, free on the CPU; on a GPU it would wait for the device (and
  for the step ahead of it, ``schedule_ahead``), so there those rows are sorted in full;
- anything else: a full sort.

A row's survivors never depend on the rest of its batch: the mass is a prefix sum over the row's
own candidates, best first (the columns past its top_k add exact zeros), and a row of top_p 1
keeps everything.
"""

from __future__ import annotations

import torch

from loraplex.host_arrays import values_to_device

# the most tokens of a row ordered by ``topk`` instead of a full sort (Qwen's generation config
# asks top_k 20); ``topk``'s cost grows with it (bench_top_k: top_k 1000 costs several times 20).
# A sampler's default; benchmarks pass 0 (every row sorted in full: the way before)
PARTIAL_TOP_K_MAX = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float],
                      partial_max: int = PARTIAL_TOP_K_MAX) -> torch.Tensor:
    """Keep each row's ``top_k`` best tokens (0 = all), then the smallest prefix (by probability)
    whose mass reaches ``top_p``; the rest become -inf. The best token always survives.
    ``logits``: [n, vocab]. ``partial_max``: on the CPU, rows of top_p alone try their best
    ``partial_max`` tokens first (0: every row sorted in full)."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    ps = list(top_ps)
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
        return logits
    if logits.device.type == "cpu" and 0 < partial_max < vocab:
        top_p_alone = [r for r, (k, p) in enumerate(zip(ks, ps)) if k == vocab and p < 1.0]
        if top_p_alone:
            return _keep_best_cpu(logits, ks, ps, top_p_alone, partial_max)
    return _keep_best(logits, *logits.sort(dim=-1, descending=True), ks, ps)[0]


def rows_with_small_top_k(top_ks: list[int], vocab: int, partial_max: int = PARTIAL_TOP_K_MAX) -> list[int]:
    """The rows whose top_k (0 < k < vocab) is at most ``partial_max``: their candidates are the
    ``topk`` of the batch's largest such top_k, whatever the rest of the batch asks."""
    limit = min(partial_max, vocab - 1)
    return [row for row, k in enumerate(top_ks) if 0 < k <= limit]


def keep_candidates(best: torch.Tensor, ks: list[int], ps: list[float], row_sums: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's survivors among its candidates ``best`` ([n, width], best first; the rest
    become -inf), and whether each row's last candidate was dropped ([n] bool). ``ks``: each
    row's top_k (``width`` or more: none). The top_p mass is over the candidates, or over the
    whole row where ``row_sums`` ([n, 1]: sum of exp(logit - best logit)) is given."""
    width, device = best.shape[1], best.device
    drop = torch.zeros_like(best, dtype=torch.bool)
    if any(k < width for k in ks):
        ranks = torch.arange(width, device=device).unsqueeze(0)
        drop |= ranks >= values_to_device(ks, torch.long, device).unsqueeze(1)
        best = best.masked_fill(drop, float("-inf"))
    if any(p < 1.0 for p in ps):
        # a row of top_p 1 keeps all (rounding may bring its mass to 1 before the last token)
        limits = values_to_device([p if p < 1.0 else float("inf") for p in ps], best.dtype, device).unsqueeze(1)
        # each row's mass from its own candidates, best first, by a prefix sum: the columns past
        # its top_k (there are more when another row of the batch has a larger one) add exact
        # zeros after the entries that decide, instead of joining a softmax's sum over the row
        weights = torch.exp(best - best[:, :1])  # [n, width]; dropped ones 0
        cumulative = weights.cumsum(dim=-1)
        total = cumulative[:, -1:] if row_sums is None else row_sums
        drop |= (cumulative - weights) / total >= limits  # the mass of strictly better tokens
        drop[:, 0] = False
    return best.masked_fill(drop, float("-inf")), drop[:, -1]


def _keep_best(logits: torch.Tensor, best: torch.Tensor, order: torch.Tensor, ks: list[int], ps: list[float],
               whole_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``keep_candidates`` over ``best`` ([n, width], best first; ``order`` their token ids),
    scattered back into [n, vocab] logits (-inf for every token not among the survivors);
    ``whole_row``: the top_p mass over the whole row, not the candidates."""
    row_sums = torch.exp(logits - best[:, :1]).sum(dim=-1, keepdim=True) if whole_row else None
    best, last_dropped = keep_candidates(best, ks, ps, row_sums)
    if best.shape[1] < logits.shape[1]:  # the tokens past every row's candidates are dropped
        return torch.full_like(logits, float("-inf")).scatter_(1, order, best), last_dropped
    return torch.empty_like(logits).scatter_(1, order, best), last_dropped


def _keep_best_cpu(logits: torch.Tensor, ks: list[int], ps: list[float], near: list[int], limit: int
                   ) -> torch.Tensor:
    """``apply_top_k_top_p`` on the CPU: rows of top_p alone (``near``) whose nucleus lies within
    their best ``limit`` tokens from ``topk``; the others with a filter sorted in full."""
    vocab = logits.shape[1]
    out = logits.clone()  # rows with neither filter stay as they are
    far = [r for r, k in enumerate(ks) if k < vocab]
    sub = logits[near]
    kept, last_dropped = _keep_best(sub, *sub.topk(limit, dim=-1), [vocab] * len(near), [ps[r] for r in near],
                                    whole_row=True)
    # a row fits when its last candidate was dropped: every token past it has at least that
    # much better mass (read back: free on the CPU)
    fits = last_dropped.tolist()
    out[[r for r, ok in zip(near, fits) if ok]] = kept[[i for i, ok in enumerate(fits) if ok]]
    far += [r for r, ok in zip(near, fits) if not ok]
    if far:
        sub = logits[far]
        out[far] = _keep_best(sub, *sub.sort(dim=-1, descending=True), [ks[r] for r in far], [ps[r] for r in far])[0]
    return out
