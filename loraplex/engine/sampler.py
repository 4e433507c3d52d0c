"""Batched sampling from one step's logits, with vLLM's semantics.

Order of operations per row (as vLLM v1):

1. ``logit_bias``: each listed token's bias (in [-100, 100]) added to its logit (OpenAI's
   ``logit_bias``; greedy rows too). Only rows with a bias cost anything: a batch without one
   does no work here.
2. ``min_tokens``: while fewer tokens were generated, EOS (unless ``ignore_eos``) and
   ``stop_token_ids`` get ``-inf``.
3. Penalties: ``repetition_penalty`` over prompt + output tokens (positive logits divided,
   negative multiplied); ``frequency_penalty * count`` and ``presence_penalty * (count > 0)``
   subtracted, counting output tokens only.
4. ``allowed_token_ids`` (vLLM's): every other token gets ``-inf``; ``bad_words``: the token
   that would complete a bad word gets ``-inf``. Structured output: tokens the sequence's grammar does not allow next get ``-inf``; the
   sampled token then advances the grammar (``loraplex.structured_output``). With a
   ``reasoning_boundary`` the grammar holds only once the reasoning has ended
   (``loraplex.engine.reasoning_gate``): reasoning tokens are left as they are.
5. Greedy rows (``temperature == 0``) take the argmax here.
6. Other rows: divide by temperature, then ``min_p`` (drop tokens with probability below
   ``min_p`` times the top one), ``top_k``, ``top_p`` (smallest set of top tokens whose mass
   reaches ``top_p``; ordering only the tokens that can survive: ``top_k_top_p``), then draw
   from the softmax. Rows with a top_k of at most the sampler's ``partial_top_k_max`` do all of
   step 6 over their top_k best tokens only (the same distribution, far less work).

Logprobs (``params.logprobs = N``) are those of the raw model distribution, before any of the
above, like vLLM's default ``raw_logprobs`` mode: the chosen token's logprob plus the top N.
So neither penalties nor ``logit_bias`` show in them: with ``logit_bias`` a chosen token may
carry a low logprob, and the top N are the model's own favourites (vLLM's default reports the
same). One rule for every per-request logit change keeps logprobs comparable across requests
that differ only in how they steer sampling.

Seeds: a row with ``params.seed`` draws its noise from a generator seeded by
``(seed, sequence index, number of tokens generated so far)``, so the same seed gives the same
output whatever else shares the batch, and a sequence preempted and recomputed continues
exactly where it was. Rows without a seed share the sampler's own generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence as Seq

import numpy as np
import torch

from loraplex.engine.bad_words import apply_bad_words, ban_tokens
from loraplex.host_arrays import to_device, to_tensor, values_to_device
from loraplex.engine.logprob_floor import reportable
from loraplex.engine.outputs import SampledToken
from loraplex.engine.penalties import PendingLastTokens, PromptTokens, apply_penalties
from loraplex.engine.race_noise import RaceNoise
from loraplex.engine.top_k_top_p import PARTIAL_TOP_K_MAX, apply_top_k_top_p, keep_candidates, rows_with_small_top_k

if TYPE_CHECKING:  # pragma: no cover
    from loraplex.engine.sequence import Sequence

_MASK64 = (1 << 63) - 1


def row_seed(seed: int, index: int, step: int) -> int:
    """A well-mixed 63-bit seed for one draw of one sequence (splitmix64-style)."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """Turns ``logits[N, vocab]`` (fp32) for N sequences into one ``SampledToken`` each.

    ``partial_top_k_max``: rows with a top_k up to it draw among their top_k best tokens, and
    on the CPU rows of top_p alone try that many best tokens before a full sort
    (``top_k_top_p``); 0 sorts and draws over the whole vocabulary (benchmarks' baseline)."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", partial_top_k_max: int = PARTIAL_TOP_K_MAX):
        self.device = torch.device(device)
        self.partial_top_k_max = partial_top_k_max
        self.noise = RaceNoise(seed, self.device)
        # structured output: (matchers) -> [n, vocab] bool allowed tokens, computed in parallel
        # (the engine's GrammarFactory.allowed_tokens); None computes them one by one
        self.grammar_masks = None
        self.prompts = PromptTokens()  # the repetition penalty's prompts, on the device

    def forget(self, seq_ids) -> None:
        """Drop what the sampler keeps of released sequences (their prompts on the device)."""
        self.prompts.forget(seq_ids)

    def __call__(
        self, logits: torch.Tensor, seqs: Seq["Sequence"], eos_token_ids: set[int] | frozenset[int] = frozenset()
    ) -> list[SampledToken]:
        return self.launch(logits, seqs, eos_token_ids).result()

    def launch(
        self, logits: torch.Tensor, seqs: Seq["Sequence"], eos_token_ids: set[int] | frozenset[int] = frozenset(),
        pending: PendingLastTokens | None = None,
    ) -> "PendingTokens":
        """Queue the draw on the logits' device; ``result()`` of what it returns reads the tokens
        back (on a GPU, the wait for the step's device work) and advances the grammars.
        ``pending``: in a step launched ahead, the rows whose last output token is still being
        drawn by the step before (penalties count it, ``min_tokens`` and seeds count it too)."""
        uses = _logit_changes(seqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if uses.logprobs else None
        # each apply_* below does nothing to a batch without its option (so is skipped for it)
        if uses.logit_bias:
            logits = apply_logit_bias(logits, seqs)
        if uses.min_tokens:
            logits = apply_min_tokens(logits, seqs, eos_token_ids, pending)
        if uses.penalties:
            logits = apply_penalties(logits, seqs, self.prompts, pending)
        if uses.allowed_token_ids:
            logits = apply_allowed_token_ids(logits, seqs)
        if uses.bad_words:
            logits = apply_bad_words(logits, seqs, pending)
        grammar_rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None] if uses.grammar else []
        # rows still reasoning are left free (their grammar starts after it)
        masked_rows = [r for r in grammar_rows if seqs[r].reasoning_gate is None or seqs[r].reasoning_gate.masks]
        if masked_rows:
            logits = apply_grammars(logits, seqs, masked_rows, eos_token_ids, self.grammar_masks)

        if uses.all_greedy:
            token_ids = row_argmax(logits)
        else:
            params = [s.params for s in seqs]
            greedy = [p.temperature == 0.0 for p in params]
            token_ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
            greedy_rows = [i for i, g in enumerate(greedy) if g]
            random_rows = [i for i, g in enumerate(greedy) if not g]
            if greedy_rows:
                index = values_to_device(greedy_rows, torch.long, logits.device)
                token_ids[index] = row_argmax(logits[index])
            index = values_to_device(random_rows, torch.long, logits.device)
            # what a seeded draw is seeded by: the tokens its sequence has generated so far
            generated = {j: len(seqs[i].output_token_ids) if pending is None else pending.num_generated(i, seqs[i])
                         for j, i in enumerate(random_rows) if params[i].seed is not None}
            chosen = self._sample_random(logits[index], [seqs[i] for i in random_rows], generated)
            token_ids[index] = chosen

        return PendingTokens(token_ids, seqs, grammar_rows, raw_logprobs)

    def _sample_random(self, logits: torch.Tensor, seqs: list["Sequence"], generated: dict[int, int]
                       ) -> torch.Tensor:
        # generated: for each seeded row (an index into seqs), the tokens its sequence has generated so far
        params = [s.params for s in seqs]
        seeds = [None if p.seed is None else row_seed(p.seed, getattr(seq, "index", 0), generated[i])
                 for i, (seq, p) in enumerate(zip(seqs, params))]
        near = rows_with_small_top_k([p.top_k for p in params], logits.shape[1], self.partial_top_k_max)
        if len(near) == len(params):
            return self._draw_among_best(logits, params, seeds)
        if not near:
            return self._draw_over_vocab(logits, params, seeds)
        chosen = torch.empty(len(params), dtype=torch.long, device=logits.device)
        near_set = set(near)
        far = [i for i in range(len(params)) if i not in near_set]
        for rows, draw in ((near, self._draw_among_best), (far, self._draw_over_vocab)):
            index = values_to_device(rows, torch.long, logits.device)
            chosen[index] = draw(logits[index], [params[i] for i in rows], [seeds[i] for i in rows])
        return chosen

    def _draw_over_vocab(self, logits: torch.Tensor, params: list, seeds: list[int | None]) -> torch.Tensor:
        """One token per row ([n] int64) from the whole vocabulary's softmax after temperature,
        min_p, top_k and top_p. ``seeds``: each row's draw seed (None: the shared generator)."""
        scaled = apply_min_p(_scaled(logits, logits.amax(dim=1, keepdim=True), params), [p.min_p for p in params])
        scaled = apply_top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params],
                                   self.partial_top_k_max)
        probs = torch.softmax(scaled, dim=-1)  # [n, vocab]
        return row_argmax(probs / self.noise(probs, seeds))

    def _draw_among_best(self, logits: torch.Tensor, params: list, seeds: list[int | None]) -> torch.Tensor:
        """``_draw_over_vocab`` for rows that all have a small top_k (``rows_with_small_top_k``):
        the same distribution, computed over each row's top_k best tokens only (on a CPU,
        sorting and drawing over the whole vocabulary made SmolLM2's sampled steps nearly twice
        as long as its greedy ones: README "Sampling"). A seeded
        row's noise is drawn for its own top_k candidates, best first, so it does not depend on
        the rest of the batch either."""
        ks = [p.top_k for p in params]
        best, order = logits.topk(max(ks), dim=-1)  # [n, width], best first
        scaled = apply_min_p(_scaled(best, best[:, :1], params), [p.min_p for p in params])
        scaled = keep_candidates(scaled, ks, [p.top_p for p in params])[0]
        probs = torch.softmax(scaled, dim=-1)  # [n, width]; 0 past each row's survivors
        choice = row_argmax(probs / self.noise(probs, seeds, ks))
        return order.gather(1, choice.unsqueeze(1).to(order.device)).squeeze(1)


def _scaled(logits: torch.Tensor, best: torch.Tensor, params: list) -> torch.Tensor:
    """``logits`` ([n, width]) less each row's ``best`` logit ([n, 1]), over its temperature.
    With the best at 0 (softmax does not change), a tiny temperature sends the others to -inf
    instead of overflowing everything to +-inf (NaN probabilities)."""
    temps = values_to_device([p.temperature for p in params], logits.dtype, logits.device)
    return (logits - best) / temps.unsqueeze(1)


class PendingTokens:
    """A batch's draw, queued by ``Sampler.launch``: ``result()`` reads the tokens back (once).

    What ``result`` reads (the tokens; with logprobs the chosen token's and the top ones) is
    computed at once and copied toward the host without waiting (``HostCopy``): a read-back
    queued on the stream at ``result`` time would wait for every step queued since, and with
    ``schedule_ahead`` the next step is queued before this one is read."""

    __slots__ = ("token_ids", "seqs", "grammar_rows", "_copy", "_max_top")

    def __init__(self, token_ids: torch.Tensor, seqs: Seq["Sequence"], grammar_rows: list[int],
                 raw_logprobs: torch.Tensor | None):
        self.token_ids = token_ids  # [n] int64, on the logits' device
        self.seqs = seqs
        self.grammar_rows = grammar_rows  # rows whose grammar takes the sampled token
        parts = [token_ids]
        self._max_top = -1  # -1: no row asked for logprobs
        if raw_logprobs is not None:  # [n, vocab] fp32
            self._max_top = max((s.params.logprobs or 0) for s in seqs)
            chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [n] the chosen token's
            parts.append(reportable(chosen))
            if self._max_top > 0:
                top = raw_logprobs.topk(self._max_top, dim=-1)
                parts += [reportable(top.values), top.indices]  # [n, max_top] each
        self._copy = HostCopy(parts)

    def result(self) -> list[SampledToken]:
        ids, *logprobs = self._copy.lists()
        seqs = self.seqs
        for row in self.grammar_rows:
            gate = seqs[row].reasoning_gate
            if gate is None:
                seqs[row].grammar.consume_token(ids[row])
            else:
                gate.advance(ids[row], seqs[row].grammar)
        if self._max_top < 0:
            return [SampledToken(t) for t in ids]  # positional: a keyword costs more, per row
        chosen, top_vals, top_ids = logprobs[0], *(logprobs[1:] or (None, None))
        return _with_logprobs(ids, chosen, top_vals, top_ids, [s.params for s in seqs])


class HostCopy:
    """Device tensors on their way to the host: page-locked copies queued now, without waiting;
    ``lists()`` waits for those copies alone (not for work queued on the stream after them) and
    returns each as a list. On the CPU the tensors are read as they are."""

    __slots__ = ("_host", "_done")

    def __init__(self, tensors: list[torch.Tensor]):
        self._done = None
        if tensors and tensors[0].is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors]
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = tensors

    def lists(self) -> list[list]:
        if self._done is not None:
            self._done.synchronize()
        return [t.tolist() for t in self._host]


class _LogitChanges:
    """Which of the per-request options some row of a batch uses (``_logit_changes``)."""

    __slots__ = ("logprobs", "logit_bias", "min_tokens", "penalties", "allowed_token_ids", "bad_words", "grammar",
                 "all_greedy")


def _logit_changes(seqs: Seq["Sequence"]) -> _LogitChanges:
    """One pass over the batch for what each ``apply_*`` and the draw would each look for in a
    pass of their own (most batches use none of them). A row counts for an option exactly
    where that function would change its logits."""
    logprobs = logit_bias = min_tokens = penalties = allowed = bad_words = grammar = False
    all_greedy = True
    for seq in seqs:
        p = seq.params
        if p.logprobs is not None:
            logprobs = True
        if p.logit_bias:
            logit_bias = True
        if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
            min_tokens = True
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            penalties = True
        if p.allowed_token_ids:
            allowed = True
        if p.bad_words_token_ids:
            bad_words = True
        if seq.grammar is not None:
            grammar = True
        if p.temperature != 0.0:
            all_greedy = False
    uses = _LogitChanges()
    uses.logprobs, uses.logit_bias, uses.min_tokens, uses.penalties = logprobs, logit_bias, min_tokens, penalties
    uses.allowed_token_ids, uses.bad_words, uses.grammar, uses.all_greedy = allowed, bad_words, grammar, all_greedy
    return uses


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on ties, NaN above all, as ``torch.argmax``). A float32 CPU
    tensor goes through numpy: torch's CPU argmax is not vectorised (256 rows of 512 logits: 300
    us against numpy's 14, single-threaded), and a decode step at large batches waits for it."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(values.numpy().argmax(axis=-1))
    return values.argmax(dim=-1)


def apply_allowed_token_ids(logits: torch.Tensor, seqs: Seq["Sequence"]) -> torch.Tensor:
    """vLLM's ``allowed_token_ids``: ``-inf`` for every other token of that row (in place)."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.allowed_token_ids]
    for row in rows:
        ids = _cached_ids(seqs[row].params, "allowed_token_ids", logits.device)
        kept = logits[row, ids]
        logits[row] = float("-inf")
        logits[row, ids] = kept
    return logits


def _cached_ids(params, name: str, device: torch.device) -> torch.Tensor:
    """``params.<name>`` (a list of token ids) as a device tensor, made once per request."""
    ids = getattr(params, name)
    key = f"_{name}_tensor"
    cached = params.__dict__.get(key)
    if cached is None or cached[0] is not ids or cached[1].device != device:
        cached = (ids, to_tensor(ids, np.int64, device))
        params.__dict__[key] = cached
    return cached[1]


def serial_allowed_tokens(matchers: list, vocab: int) -> np.ndarray:  # [len(matchers), vocab] bool
    """Each matcher's allowed next tokens, one after another (a sampler without the engine's
    ``GrammarFactory.allowed_tokens``, which computes them in parallel)."""
    allowed = np.zeros((len(matchers), vocab), dtype=bool)
    for k, matcher in enumerate(matchers):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab]
        allowed[k, : bits.shape[0]] = bits
    return allowed


def apply_grammars(
    logits: torch.Tensor,
    seqs: Seq["Sequence"],
    rows: list[int],
    eos_token_ids: set[int] | frozenset[int],
    allowed_tokens=None,  # (matchers) -> [n, vocab] bool; None: serial_allowed_tokens
) -> torch.Tensor:
    """Structured output: in each of ``rows``, ``-inf`` for every token its sequence's grammar
    does not allow next (llguidance's bitmask, one bit per token). A matcher with nothing left
    to allow (an error state) allows EOS, so the sequence ends instead of sampling garbage.
    A sequence whose first tokens may open its reasoning (reasoning_gate.py) also allows the
    opening marker's next token."""
    vocab = logits.shape[1]
    matchers = [seqs[row].grammar for row in rows]
    if allowed_tokens is None:
        allowed = serial_allowed_tokens(matchers, vocab)
    else:
        allowed = allowed_tokens(matchers)  # a fresh array, ours to change
        if allowed.shape[1] != vocab:
            padded = np.zeros((len(rows), vocab), dtype=bool)
            padded[:, : min(vocab, allowed.shape[1])] = allowed[:, :vocab]
            allowed = padded
    for k, row in enumerate(rows):
        gate = seqs[row].reasoning_gate
        if gate is not None and gate.opening_token() is not None:  # the output may open its reasoning
            if not gate.grammar_open:
                allowed[k] = False
            allowed[k, gate.opening_token()] = True
    for k in np.flatnonzero(~allowed.any(axis=1)):
        allowed[k, [t for t in eos_token_ids if t < vocab]] = True
    index = values_to_device(rows, torch.long, logits.device)
    mask = to_device(allowed, logits.device)
    logits[index] = logits[index].masked_fill(~mask, float("-inf"))
    return logits


def apply_logit_bias(logits: torch.Tensor, seqs: Seq["Sequence"]) -> torch.Tensor:
    """Add each row's ``params.logit_bias`` to its logits, in place; one scatter for the batch.

    Token ids were checked against the vocabulary when the engine took the request. The bias
    of one request is turned into device tensors once and kept on its ``SamplingParams`` (read
    once: changing ``logit_bias`` in place after the request started is not seen)."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.logit_bias]
    if not rows:
        return logits
    ids, values, counts = [], [], []
    for row in rows:
        row_ids, row_values = _logit_bias_tensors(seqs[row].params, logits.device)
        ids.append(row_ids)
        values.append(row_values)
        counts.append(row_ids.numel())
    row_index = torch.repeat_interleave(  # output_size: no device sync to learn the length
        values_to_device(rows, torch.long, logits.device), values_to_device(counts, torch.long, logits.device),
        output_size=sum(counts)
    )
    logits.index_put_((row_index, torch.cat(ids)), torch.cat(values).to(logits.dtype), accumulate=True)
    return logits


def _logit_bias_tensors(params, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    bias = params.logit_bias
    cached = params.__dict__.get("_logit_bias_tensors")
    if cached is None or cached[0] is not bias or cached[1] != device:
        ids = to_tensor(list(bias.keys()), np.int64, device)
        values = to_tensor(list(bias.values()), np.float32, device)
        cached = (bias, device, ids, values)
        params.__dict__["_logit_bias_tensors"] = cached
    return cached[2], cached[3]


def apply_min_tokens(logits: torch.Tensor, seqs: Seq["Sequence"], eos_token_ids,
                     pending: PendingLastTokens | None = None) -> torch.Tensor:
    """Forbid EOS and stop token ids for rows that have not yet generated ``min_tokens`` (in
    place, one write for the batch)."""
    banned: list[tuple[int, int]] = []  # (row, token)
    for row, seq in enumerate(seqs):
        p = seq.params
        generated = len(seq.output_token_ids) if pending is None else pending.num_generated(row, seq)
        if p.min_tokens and generated < p.min_tokens:
            tokens = set(p.stop_token_ids)
            if not p.ignore_eos:
                tokens |= set(eos_token_ids)
            banned += [(row, t) for t in tokens if 0 <= t < logits.shape[1]]
    ban_tokens(logits, banned)
    return logits


def apply_min_p(scaled: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drop each token whose probability is below ``min_p`` times the best one's. ``scaled``:
    [n, width], each row's best at 0 (``_scaled``), so that ratio is exp(the token's value)."""
    if not any(m > 0.0 for m in min_ps):
        return scaled
    min_p = values_to_device(min_ps, scaled.dtype, scaled.device).unsqueeze(1)
    return scaled.masked_fill(torch.exp(scaled) < min_p, float("-inf"))


def _with_logprobs(ids: list[int], chosen: list[float], top_vals: list[list[float]] | None,
                   top_ids: list[list[int]] | None, params) -> list[SampledToken]:
    out: list[SampledToken] = []
    for row, (token, p) in enumerate(zip(ids, params)):
        if p.logprobs is None:
            out.append(SampledToken(token_id=token))
            continue
        n = p.logprobs
        top_lp = {top_ids[row][j]: top_vals[row][j] for j in range(n)} if n > 0 else {}
        out.append(SampledToken(token_id=token, logprob=chosen[row], top_logprobs=top_lp))
    return out
