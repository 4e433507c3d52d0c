"""The logprobs of prompt tokens (vLLM's ``prompt_logprobs``) from a step's hidden rows."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.engine.logprob_floor import reportable
from loraplex.host_arrays import to_tensor

PROMPT_LOGPROB_ROWS = 256  # prompt rows per logits block: 256 x a 128k vocab in fp32 is 128 MiB


def prompt_token_logprobs(model, hidden: torch.Tensor, specs: list[tuple], lora_ctx=None) -> dict[int, list[dict]]:
    """Logprob, rank and top-N of prompt tokens under ``model`` (raw log-softmax, as for generated
    tokens), from the hidden rows before them (``hidden`` [rows, H]; ``specs``: (seq, first prompt
    index, first row, count) per sequence); ``PROMPT_LOGPROB_ROWS`` rows at a time, so a long
    chunk never holds its whole [rows, vocab] logits at once."""
    out: dict[int, list[dict]] = {}
    for seq, first, row0, count in specs:
        top_n = seq.params.prompt_logprobs
        entries: list[dict] = []
        for lo in range(0, count, PROMPT_LOGPROB_ROWS):
            hi = min(count, lo + PROMPT_LOGPROB_ROWS)
            targets = seq.prompt_token_ids[first + lo : first + hi]
            head_lora = None if lora_ctx is None else lora_ctx.logits_lora(list(range(row0 + lo, row0 + hi)))
            logits = model.compute_logits(hidden[row0 + lo : row0 + hi], head_lora)
            logprobs = torch.log_softmax(logits, dim=-1)
            chosen = logprobs.gather(1, to_tensor(targets, np.int64, logprobs.device).unsqueeze(1))  # [rows, 1]
            ranks = (logprobs > chosen).sum(dim=1) + 1
            chosen = reportable(chosen)
            top_ids = top_lps = None
            if top_n:
                top = logprobs.topk(top_n, dim=-1)
                top_ids, top_lps = top.indices.tolist(), reportable(top.values).tolist()
            for i, (token, lp, rank) in enumerate(zip(targets, chosen.squeeze(1).tolist(), ranks.tolist())):
                entries.append({
                    "token_id": token,
                    "logprob": lp,
                    "rank": rank,
                    "top_logprobs": dict(zip(top_ids[i], top_lps[i])) if top_n else {},
                })
        out[seq.seq_id] = entries
    return out
