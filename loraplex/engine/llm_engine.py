"""The synchronous engine loop: requests in, one batched model step at a time, outputs out.

``LLMEngine`` is single-threaded; ``AsyncLLMEngine`` runs one in its own thread.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from loraplex import generation_defaults
from loraplex.config import EngineConfig
from loraplex.engine.admission_order import check_priority, check_tenant_weight
from loraplex.engine.bad_words import bad_words_token_ids
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.engine_start import (
    build_lora_manager, finalised_config, kv_layout_of, log_start, max_concurrency, served_context,
)
from loraplex.engine.detokenizer import backend_decoder, single_token_texts
from loraplex.engine.grammar import GrammarFactory
from loraplex.engine.outputs import RequestOutput, SchedulerOutput
from loraplex.engine.reasoning_gate import ReasoningGate
from loraplex.engine.request_state import PreparedRequest, RequestState
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import FINISHED_STATUSES, Sequence, SequenceStatus
from loraplex.lora.errors import AdapterLoadFailedError
from loraplex.sampling_params import InvalidRequestError, SamplingParams, check_logprobs_cap, check_token_ids_in_vocab

logger = logging.getLogger("loraplex.engine")


class LLMEngine:
    """Model runner + LoRA manager + block manager + scheduler, stepped by the caller.

    ``runner`` may be passed in (tests); by default a ``ModelRunner(config)`` is built, which
    loads the model and tokenizer and sizes the KV cache.
    """

    def __init__(self, config: EngineConfig, runner=None, lora_manager=None):
        self.config = config
        # a bad override is refused before the model is loaded
        generation_defaults.check_options(config.generation_config, config.override_generation_config)
        if runner is None:
            from loraplex.engine.model_runner import ModelRunner

            runner = ModelRunner(config)
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self._fast_decode = backend_decoder(self.tokenizer)
        self._token_texts = single_token_texts()
        self.model_name = runner.model_name
        # what a request that leaves temperature, top_p, ... unset gets (vLLM's --generation-config)
        self.sampling_defaults = generation_defaults.resolve(
            config.generation_config, getattr(runner, "model_dir", None), config.override_generation_config)
        spec = getattr(runner, "spec", None)
        layout = kv_layout_of(runner)
        chunk = config.max_num_batched_tokens if config.enable_chunked_prefill else None
        self.max_model_len = served_context(runner, layout, chunk)
        # one config from here on: the runner was built before the context served was known
        self.config = runner.config = config = finalised_config(config, self.max_model_len)
        if lora_manager is None and getattr(runner, "lora_manager", None) is None:
            lora_manager = build_lora_manager(config, runner)
        self.lora_manager = lora_manager or getattr(runner, "lora_manager", None)
        runner.lora_manager = self.lora_manager
        # a windowed group gives back the pages before its window, a global one keeps them all
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, config.enable_prefix_caching,
                                          group_windows=layout.group_windows)
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            adapter_gate=self.lora_manager,
            eos_token_ids=runner.eos_token_ids,
            max_model_len=self.max_model_len,
            reported_eos_token_ids=getattr(runner, "reported_eos_token_ids", ()),
        )
        # prompt ids must index the model's embedding table
        self.vocab_size = getattr(runner, "vocab_size", None) or getattr(spec, "vocab_size", None) or len(self.tokenizer)
        # a multimodal checkpoint's image placeholder: only its text model is served
        self.image_token_id = getattr(spec, "image_token_id", None)
        self.grammars = GrammarFactory(self.tokenizer, self.vocab_size, set(runner.eos_token_ids))
        if getattr(runner, "sampler", None) is not None:
            runner.sampler.grammar_masks = self.grammars.allowed_tokens
        self._requests: dict[str, RequestState] = {}
        self._seq_tracks: dict[int, tuple[RequestState, object]] = {}  # seq id -> its request and track
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.last_step_was_empty = False  # nothing could run (e.g. every adapter still loading)
        # a sequence with one new token is detokenized inline in ``step``; False sends every one
        # through ``_detokenize`` (tests compare the two)
        self.inline_one_token = True
        # the AsyncLLMEngine whose thread steps this engine, while it runs: nothing else may step
        # it meanwhile (the engine and the LoRA manager have no locks)
        self.driver = None
        self.num_requests_finished = 0
        self.num_requests_aborted = 0
        # overlap_outputs: the sequences the last step changed, made into outputs by the next
        # step while the device runs it (``step``)
        device = getattr(getattr(runner, "device", None), "type", None)
        self.overlap_outputs = config.overlap_outputs if config.overlap_outputs is not None else device == "cuda"
        self._deferred: list[Sequence] = []
        # schedule_ahead: the next plain decode step is scheduled and launched right after this
        # one, its input tokens taken on the device (schedule_ahead.py); _ahead holds it until
        # the next call to ``step`` reads it back
        self.schedule_ahead = config.schedule_ahead
        self._ahead: tuple[SchedulerOutput, object] | None = None
        log_start(self, max_concurrency(runner.num_blocks, layout, self.max_model_len, runner.block_size, chunk))

    # ---- requests --------------------------------------------------------------------------
    def resolve_adapter(self, adapter, prepared=None) -> str | None:
        """Adapter reference (None, registered name, PEFT dir, AdapterRef) -> content hash.
        ``prepared``: the lora manager's ``read_ahead`` of the same reference, if any."""
        if adapter is None:
            return None
        if self.lora_manager is None:
            raise InvalidRequestError("this engine was built without LoRA support", param="adapter")
        return self.lora_manager.resolve(adapter, prepared)

    def prepare_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter_id: str | None = None,
        stream_deltas: bool = False,
        grammar=None,
        cache_salt: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
    ) -> PreparedRequest:
        """Validate and tokenize; raises ``InvalidRequestError`` (with ``param``) and changes
        nothing when the request is bad. ``adapter_id`` is an already resolved content hash;
        ``grammar`` a matcher for ``params.structured_outputs`` made ahead (else made here);
        ``cache_salt``: only requests with the same salt share prefix-cache blocks.
        ``priority`` (lower first), ``tenant`` and ``tenant_weight`` (the tenant's share, > 0)
        order admission under the scheduling policy."""
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", param="params")
        params.validate()
        check_token_ids_in_vocab(params, self.vocab_size)
        check_logprobs_cap(params, self.config.max_logprobs, self.vocab_size)
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        text: str | None = None
        if isinstance(prompt, str):
            text = prompt
            token_ids = list(self.tokenizer(prompt)["input_ids"]) if prompt else []
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
            if any(t < 0 or t >= self.vocab_size for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if self.image_token_id is not None and self.image_token_id in token_ids:
            raise InvalidRequestError(
                f"prompt holds the image placeholder token (id {self.image_token_id}); this server runs the "
                "model's text part only and serves no images",
                param="prompt",
            )
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(token_ids)} tokens, but the context is {self.max_model_len} tokens "
                "and at least one must be left to generate",
                param="prompt",
                code="context_length_exceeded",
            )
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
        check_priority(priority, self.config.scheduling_policy)
        check_tenant_weight(tenant_weight)
        req = PreparedRequest(request_id, text, token_ids, params, adapter_id, stream_deltas, cache_salt=cache_salt,
                              tenant=tenant, priority=priority, tenant_weight=float(tenant_weight))
        if params.structured_outputs is not None:
            req.grammar = grammar if grammar is not None else self.grammars.matcher(params.structured_outputs)
        return req

    def add_prepared(self, req: PreparedRequest) -> None:
        if req.request_id in self._requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=req.request_id,
                prompt_token_ids=list(req.prompt_token_ids),
                params=req.params,
                adapter_id=req.adapter_id,
                cache_salt=req.cache_salt,
                tenant=req.tenant,
                priority=req.priority,
                tenant_weight=req.tenant_weight,
                index=i,
                arrival_time=req.arrival_time,
                grammar=None if req.grammar is None else req.grammar if i == 0 else req.grammar.deep_copy(),
                reasoning_gate=(ReasoningGate(req.params.reasoning_boundary)
                                if req.grammar is not None and req.params.reasoning_boundary is not None else None),
            )
            for i in range(req.params.n)
        ]
        if req.adapter_id is not None and self.lora_manager is not None:
            # start the device load before it is needed; first, so that an adapter whose files
            # fail to load refuses the request before anything of it is recorded
            self.lora_manager.prefetch(req.adapter_id)
            if self.lora_manager.shares_base_kv(req.adapter_id):
                for seq in seqs:
                    seq.shares_base_kv = True
        state = RequestState(req, seqs, self.tokenizer, self._fast_decode, self._token_texts)
        self._requests[req.request_id] = state
        for track in state.tracks:
            self._seq_tracks[track.seq.seq_id] = (state, track)
        for seq in seqs:
            self.scheduler.add(seq)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter=None,
        stream_deltas: bool = False,
        cache_salt: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
    ) -> str:
        """Validate and queue a request; returns its id. ``adapter``: None, a registered name,
        a PEFT directory or an ``AdapterRef``. Bad requests raise ``InvalidRequestError``."""
        req = self.prepare_request(request_id, prompt, params, None, stream_deltas, cache_salt=cache_salt,
                                   priority=priority, tenant=tenant, tenant_weight=tenant_weight)
        req.adapter_id = self.resolve_adapter(adapter)
        self.add_prepared(req)
        return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its KV blocks are free on return); returns its final output."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        if self._deferred and self._detokenize_deferred(state):
            return self._finish_request(state)  # its last token's text completed a stop string
        self.scheduler.abort(request_id)
        self.num_requests_aborted += 1
        return self._finish_request(state)

    def _detokenize_deferred(self, state: RequestState) -> bool:
        """Detokenize the tokens of ``state``'s sequences that wait in ``_deferred``, as the step
        that sampled them would have without ``overlap_outputs``; whether that finished it (a stop
        string). Its outputs are then built from what it holds, never from the deferred list."""
        for track in state.tracks:
            seq = track.seq
            if track.detok_tokens < len(seq.output_token_ids):
                self._detokenize(seq, track)
        return state.finished

    def _finish_request(self, state: RequestState) -> RequestOutput | None:
        out = state.make_output()
        self._requests.pop(state.request_id, None)
        for t in state.tracks:
            self._seq_tracks.pop(t.seq.seq_id, None)
        self.num_requests_finished += 1
        if state.req.adapter_id is not None and self.lora_manager is not None:
            gen_tokens = sum(t.seq.num_output_tokens for t in state.tracks)
            self.lora_manager.on_request_finished(state.req.adapter_id, len(state.req.prompt_token_ids), gen_tokens)
        return out

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step --------------------------------------------------------------------------
    def step(self, deliver: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Run one batched model step; returns the outputs of requests that progressed
        (cumulative, or deltas for requests added with ``stream_deltas``). With
        ``overlap_outputs`` these are the previous step's, made while the device runs this one;
        a step that schedules nothing returns those still due. ``deliver``, when given, takes
        the previous step's outputs as soon as they are made, before this step's tokens are
        read back (a server streams them one device step sooner); they are not returned then."""
        failed: list[RequestOutput] = []
        if self.lora_manager is not None:  # adapters read in the background since the last step
            for exc in self.lora_manager.collect_reads():
                failed += self._drop_adapter(exc)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and any(e.seq.status is SequenceStatus.RUNNING for e in ahead[0].scheduled):
            sched_out, run = ahead  # launched by the last step (schedule_ahead)
        else:  # (a step ahead whose every sequence has ended since is dropped unread)
            sched_out = self.scheduler.schedule()
            if sched_out.is_empty:
                if sched_out.released_seq_ids:
                    self.runner.release(sched_out.released_seq_ids)
                outputs = self._outputs_of(self._take_deferred(), failed)
                self.last_step_was_empty = not outputs
                return outputs
            try:
                run = self.runner.launch(sched_out)
            except AdapterLoadFailedError as exc:
                failed += self._drop_adapter(exc)
                self.scheduler.requeue_unrun(sched_out)
                self.last_step_was_empty = False
                return self._outputs_of(self._take_deferred(), failed)
        self.last_step_was_empty = False
        if self.schedule_ahead:  # the next step queued behind this one before its tokens are back
            ahead = self.scheduler.schedule_ahead(sched_out)
            if ahead is not None:
                self._ahead = (ahead, self.runner.launch(ahead, after=run))
        # the host's share of the last step while the device runs this one (overlap_outputs)
        outputs = self._outputs_of(self._take_deferred(), failed)
        if deliver is not None and outputs:
            deliver(outputs)
            outputs = []
        changed = self.scheduler.update(sched_out, run.result())
        if self.overlap_outputs:
            self._deferred = changed
            return outputs
        return self._outputs_of(changed, outputs)

    def _num_reporting(self) -> int:
        """Requests whose sequences have all finished but whose final output waits in
        ``_deferred`` (overlap_outputs): neither running nor waiting."""
        states = {found[0] for seq in self._deferred if (found := self._seq_tracks.get(seq.seq_id)) is not None}
        return sum(state.finished for state in states)

    def _take_deferred(self) -> list[Sequence]:
        deferred, self._deferred = self._deferred, []
        return deferred

    def _outputs_of(self, changed: list[Sequence], outputs: list[RequestOutput] | None = None) -> list[RequestOutput]:
        """Detokenize what ``changed`` (a step's ``Scheduler.update``) got and append the outputs
        of the requests that progressed to ``outputs``."""
        outputs = [] if outputs is None else outputs
        if not changed:
            return outputs
        # per sequence per step (the host time of a decode step at large batches): one dict
        # read finds the request and the track, and the usual one new token skips _detokenize
        seq_tracks, inline_one_token = self._seq_tracks, self.inline_one_token
        # a request of several sequences reports once all of them are detokenized: a slot
        # keeps its place among the outputs (the order is first touch, as for the others)
        pending: dict[RequestState, int] = {}
        for seq in changed:
            found = seq_tracks.get(seq.seq_id)
            if found is None:
                continue
            state, track = found
            out_ids = seq.output_token_ids
            if inline_one_token and len(out_ids) == track.detok_tokens + 1 and seq.status is SequenceStatus.RUNNING:
                track.detok_tokens += 1
                stop = track.detok.add_token(out_ids[-1])
                if stop is not None:
                    self._end_at_stop_string(seq, track, len(out_ids), stop)
            else:
                self._detokenize(seq, track)
            if state.single is None:
                if state not in pending:
                    pending[state] = len(outputs)
                    outputs.append(None)
                continue
            # one sequence (once per step in ``changed``): its output is ready now
            if seq.status in FINISHED_STATUSES:
                out = self._finish_request(state)
            elif state.req.final_only:
                continue
            else:
                out = state.make_output()
            if out is not None:
                outputs.append(out)
        if pending:
            for state, slot in pending.items():
                if state.finished:
                    outputs[slot] = self._finish_request(state)
                elif not state.req.final_only:
                    outputs[slot] = state.make_output()
            outputs[:] = [out for out in outputs if out is not None]
        return outputs

    def _detokenize(self, seq: Sequence, track) -> None:
        """Feed the detokenizer the tokens ``seq`` got this step (several after a speculative
        step), in order, and end ``seq`` at the first stop string."""
        first = track.detok_tokens
        new = seq.output_token_ids[first:]
        track.detok_tokens = len(seq.output_token_ids)
        if seq.status is SequenceStatus.FINISHED_STOPPED and not seq.params.include_stop_str_in_output:
            # ended by EOS or one of stop_token_ids: that token stays in token_ids but its
            # text is no part of the output (vLLM's rule, as for stop strings)
            new = new[:-1]
        for i, token in enumerate(new):
            stop = track.detok.add_token(token)
            if stop is not None:
                self._end_at_stop_string(seq, track, first + i + 1, stop)
                return

    def _end_at_stop_string(self, seq: Sequence, track, keep: int, stop: str) -> None:
        """The detokenizer found ``stop`` once ``seq`` had ``keep`` output tokens: tokens after
        that one never were, and ``seq`` ends with the stop string as its reason."""
        if keep < len(seq.output_token_ids):
            self.scheduler.stats.num_generated_tokens -= len(seq.output_token_ids) - keep
            del seq.output_token_ids[keep:]
            del seq.output_logprobs[keep:]
            track.detok_tokens = keep
        if not seq.is_finished:
            self.scheduler.finish(seq.seq_id, "stop", stop)
        else:  # the same token also hit max_tokens / eos: the stop string wins
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop

    def _drop_adapter(self, exc: AdapterLoadFailedError) -> list[RequestOutput]:
        """A step's adapter could not be loaded (before anything of the step ran): its requests
        end with finish reason ``abort`` (``free`` unregisters their uncomputed blocks); the rest
        of the step runs again (see ``Scheduler.requeue_unrun``)."""
        logger.error("%s; aborting its requests", exc)
        victims = [state for state in self._requests.values() if state.req.adapter_id == exc.adapter_id]
        outputs = []
        for state in victims:
            never_ran = not any(t.seq.output_token_ids for t in state.tracks)  # the caller saw nothing
            out = self.abort(state.request_id)
            if out is not None:
                if never_ran and exc.__cause__ is not None:
                    out.error = exc.__cause__
                outputs.append(out)
        return outputs

    def reset_prefix_cache(self) -> None:
        """Forget the cached KV blocks no running sequence holds (benchmarks measure a cold
        cache this way; blocks in use stay shared)."""
        self.block_manager.reset_prefix_cache()

    # ---- adapters --------------------------------------------------------------------------
    def _require_lora(self):
        if self.lora_manager is None:
            raise InvalidRequestError("this engine was built without LoRA support", param="adapter")
        return self.lora_manager

    def register_adapter(self, name: str, path: str) -> str:
        return self._require_lora().register(name, path)

    def unregister_adapter(self, name: str) -> None:
        self._require_lora().unregister(name)

    # ---- stats -----------------------------------------------------------------------------
    def stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        s = sched.stats
        # refreshed by the async engine after every step that finishes a request: one pass
        num_requests_running = len({seq.request_id for seq in sched.running})
        out = {
            "model": self.model_name,
            "num_requests_running": num_requests_running,
            "num_requests_waiting": len(self._requests) - num_requests_running - self._num_reporting(),
            "num_seqs_running": sched.num_running,
            "num_seqs_waiting": sched.num_waiting,
            "num_unfinished_requests": len(self._requests),
            "num_blocks_total": bm.num_blocks,
            "num_blocks_free": bm.num_free_blocks,
            "block_size": bm.block_size,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,  # the step budget run with
            "kv_cache_usage": bm.usage,
            "num_steps": s.num_steps,
            "num_preemptions": s.num_preemptions,
            "num_chunked_prefills": s.num_chunked_prefills,
            "num_starvation_preemptions": s.num_starvation_preemptions,
            "prompt_tokens_total": s.num_prompt_tokens_computed,
            "generation_tokens_total": s.num_generated_tokens,
            "num_requests_finished": self.num_requests_finished,
            "num_requests_aborted": self.num_requests_aborted,
            "prefix_cache_queries": s.num_prefix_query_tokens,
            "prefix_cache_hits": s.num_prefix_hit_tokens,
            "spec_decode_num_drafts": s.num_spec_drafts,
            "spec_decode_num_draft_tokens": s.num_spec_draft_tokens,
            "spec_decode_num_accepted_tokens": s.num_spec_accepted_tokens,
            "running_adapters": sorted(sched.running_adapters()),
        }
        if self.lora_manager is not None:
            out["lora"] = self.lora_manager.stats()
        return out
