"""The model runner: the only part of the engine that touches tensors.

It loads the model and tokenizer, owns the paged KV cache, turns a ``SchedulerOutput`` into one
flat token batch, runs the decoder (with the step's LoRA context when a LoRA manager is set)
and samples a token for every sequence that reached the end of its known tokens.

Device and dtype (``EngineConfig.device`` / ``dtype`` = ``"auto"``): CUDA with bfloat16 when a
GPU is present (float16 where the card lacks bf16), else CPU with float32 (exact against
transformers, and faster than bf16 on CPUs without native bf16 matmul). CPU accepts float32
and bfloat16; CUDA bfloat16, float16 and float32.

KV layout (``kv_layout.KVLayout``): the layers are grouped by the window they attend within;
the cache is ``group_size`` storage tensors of ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` pages, and layer ``l`` keeps its KV in tensor ``layer_slot[l]`` at its group's pages
(``kv_caches[l]`` is that tensor). A model without windows, or with one window on every layer, is
one group: a tensor per layer, as before.

KV dtype (``kv_cache_dtype``): the model's, or fp8 (``kv_quant``): twice bf16's pages per byte.

KV budget: ``kv_cache_bytes`` when given; else, on CUDA, ``gpu_memory_utilization`` of the GPU's
total memory less what this process holds once its weights are in (vLLM's rule; a start with
less than that free is refused) when given, or ``kv_cache_memory_fraction`` of the free device
memory after the weights are loaded (``kv_budget``); on CPU ``kv_cache_memory_fraction`` of
``min(CPU_KV_CAP_BYTES, half the available RAM)``, ``gpu_memory_utilization`` or not. On CUDA
the LoRA slot pool (``lora_slot_bytes``) is left out of the budget: the pool is allocated at the
first adapter load, after the cache, and without the reserve ``--max-loras 32 --max-lora-rank
64`` on an 8B model (about 11 GiB of slots) would fail that first load for lack of memory
instead of sizing the cache smaller at start, as vLLM's memory profile does. Never more blocks than ``max_num_seqs`` full-length sequences can use.

With ``cuda_graphs`` on a GPU, steps of one token per sequence replay a captured forward
(``cuda_graphs.DecodeGraphs``); every other step runs eagerly. Mixture-of-experts models too:
on CUDA their experts are the fused Triton kernels, which read no routing back to the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.config import GiB, EngineConfig
from loraplex.engine.block_table_mirror import BlockTableMirror
from loraplex.engine.cuda_graphs import DecodeGraphs, cuda_capture
from loraplex.engine.decode_inputs import decode_inputs, is_one_token_step, window_first_blocks
from loraplex.engine.device_choice import available_ram_bytes, resolve_device, resolve_dtype
from loraplex.host_arrays import to_device, to_tensor
from loraplex.engine.kv_budget import (
    cpu_budget, device_memory, fraction_budget, memory_at_start, sizing_option, utilization_budget,
)
from loraplex.engine.kv_layout import KVLayout
from loraplex.engine.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from loraplex.engine.pending_run import DeferredDraw, PendingRun, last_tokens_ahead, pending_items, put_pending
from loraplex.engine.penalties import PendingLastTokens
from loraplex.engine.prompt_logprobs import prompt_token_logprobs
from loraplex.engine.sampler import Sampler
from loraplex.engine.spec_verify import position_views
from loraplex.kernels.kv_quant import check_kv_dtype_device, kv_cache_torch_dtype
from loraplex.lora.context import logits_lora
from loraplex.lora.shrink_overlap import ShrinkOverlap
from loraplex.lora.slots import SlotPool, slot_pool_dtype
from loraplex.lora.spec import LoRATargetSpec
from loraplex.model.config import ModelSpec
from loraplex.model.layers import AttentionMetadata
from loraplex.model.loader import load_generation_eos, load_model, load_tokenizer, resolve_model_dir

logger = logging.getLogger(__name__)

CPU_KV_CAP_BYTES = 1 * GiB  # CPU KV budget cap before the fraction (vLLM's CPU default is 4 GiB)
@dataclass
class FlatBatch:
    """One step's tokens, concatenated over sequences (no padding)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    token_adapter_ids: list[str | None]  # [T]
    sample_rows: list[int]  # flat row of each sampled sequence's last token
    # the Sequence behind each sample row; for a speculative sequence, one spec_verify
    # PositionView per verified row (its last 1 + len(draft) rows)
    sample_seqs: list
    # (seq, first target prompt position, its flat row - 1, count): rows whose logits give the
    # logprobs of prompt tokens first .. first + count - 1 (each row predicts the next token)
    prompt_logprob_rows: list[tuple] = field(default_factory=list)
    # (seq_id, index of its first row in sample_rows, number of rows) per speculative sequence
    verify_spans: list[tuple] = field(default_factory=list)
    # a step launched ahead: the sampled rows whose input token the step before is still drawing
    pending: PendingLastTokens | None = None


class ModelRunner:
    """Loads the model, owns the KV cache, executes scheduler steps (see module docstring)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # refused before the model is loaded (a 16-bit name that is not the model's dtype, fp8 e4m3
        # on a GPU without it)
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)  # fp8: 1 byte per element
        check_kv_dtype_device(self.kv_dtype, self.device)
        self.model_dir, self.model_name = resolve_model_dir(config.model, config.home)
        self.spec = ModelSpec.from_dir(self.model_dir, name=self.model_name, quantization=config.quantization)
        self.max_model_len = self.spec.served_context_len(self.config.max_model_len)
        # before the weights load: a GPU another process holds is refused first (kv_budget)
        self.memory_at_start = memory_at_start(self.device, config.gpu_memory_utilization)
        self.model = load_model(self.model_dir, self.spec, self.dtype, self.device, self.max_model_len,
                                kv_cache_dtype=config.kv_cache_dtype)
        # the model's own tensors (fp8 weights and experts at one byte an element, their scales);
        # on CUDA the KV budget is measured once they are in (kv_budget); CPU prepacked copies are not
        # counted
        self.weight_bytes = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers())
                                if not t.is_meta)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids: set[int] = self._collect_eos_ids()
        # the generation config's EOS ids beyond the tokenizer's report themselves as stop_reason
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.reported_eos_token_ids: set[int] = self.eos_token_ids - {tokenizer_eos}
        self.block_size = config.block_size
        self.kv_bytes_per_token = self.spec.kv_bytes_per_token(self.kv_dtype.itemsize)
        self.kv_layout = KVLayout.from_layer_windows(self.spec.layer_windows)
        # a page holds one block of tokens for the group_size layers of one group
        self.kv_bytes_per_page = (
            2 * self.kv_layout.group_size * self.spec.num_kv_heads * self.spec.head_dim * self.kv_dtype.itemsize
            * self.block_size
        )
        self.num_blocks = self._size_kv_cache()
        self._limit_max_model_len_to_kv()
        cache_shape = (2, self.num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.kv_storage = [
            torch.zeros(cache_shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.kv_layout.group_size)
        ]
        # per layer: the storage tensor its group's pages index
        self.kv_caches = [self.kv_storage[slot] for slot in self.kv_layout.layer_slot]
        self.sampler = Sampler(seed=config.seed, device=self.device)
        # host copy of the running sequences' block tables, updated by what changed each step
        self.table_mirror = BlockTableMirror(self.kv_layout.num_groups, rows=config.max_num_seqs)
        self.lora_manager = None  # set by the engine (loraplex.lora LoRAManager)
        # decode steps replayed from CUDA graphs (opt-in; see cuda_graphs); None = always eager
        self.decode_graphs: DecodeGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_caches, self.block_size, self.max_model_len, config.max_num_seqs,
                capture=cuda_capture(torch.cuda.graph_pool_handle()), layout=self.kv_layout,
            )
        self.shrink_overlap: ShrinkOverlap | None = None
        self.set_overlap_lora_shrink(config.overlap_lora_shrink)
        logger.info(
            "model %s (%s, %d layers) on %s, dtype %s, weights %.1f MiB; KV cache (%s): %d bytes per token, "
            "%d blocks of %d tokens (%.1f MiB; %d layer groups of %d); max_model_len %d; "
            "LoRA slot pool up to %.1f MiB (%d slots of rank %d)",
            self.model_name,
            self.spec.architecture,
            self.spec.num_layers,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.weight_bytes / (1 << 20),
            str(self.kv_dtype).removeprefix("torch."),
            self.kv_bytes_per_token,
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.kv_bytes_per_page / (1 << 20),
            self.kv_layout.num_groups,
            self.kv_layout.group_size,
            self.max_model_len,
            self.lora_slot_bytes() / (1 << 20),
            self.config.max_loras,
            self.config.max_lora_rank,
        )

    # ---- set-up -------------------------------------------------------------------------------

    def set_overlap_lora_shrink(self, enabled: bool) -> None:
        """Run each LoRA shrink on a side stream beside its base matmul (``lora.shrink_overlap``),
        or not; CUDA only (on CPU nothing runs asynchronously: it stays off). Between steps only;
        CUDA graphs captured the other way are dropped (the GPU check times both)."""
        overlap = ShrinkOverlap.on(self.device) if enabled and self.device.type == "cuda" else None
        if (overlap is None) == (self.shrink_overlap is None):
            return
        self.shrink_overlap = overlap
        if self.decode_graphs is not None:
            self.decode_graphs.set_shrink_overlap(overlap)

    def lora_target_spec(self) -> LoRATargetSpec:
        return self.spec.lora_target_spec(expert_lora=self.config.enable_expert_lora)

    def _collect_eos_ids(self) -> set[int]:
        ids = set(load_generation_eos(self.model_dir)) | set(self.spec.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def _kv_budget_bytes(self) -> int:
        """The KV budget (module docstring); logs the rule that gave it."""
        config = self.config
        if config.kv_cache_bytes is not None:
            budget, rule = int(config.kv_cache_bytes), f"kv_cache_bytes {config.kv_cache_bytes}"
        elif self.device.type == "cuda":
            after = device_memory(self.device)
            by = (fraction_budget(config.kv_cache_memory_fraction, after) if config.gpu_memory_utilization is None
                  else utilization_budget(config.gpu_memory_utilization, self.memory_at_start, after))
            budget = self._leave_lora_slots(by.nbytes)
            rule = f"{by.rule}, less the LoRA slot pool ({self.lora_slot_bytes() / GiB:.2f} GiB)"
        else:  # on CPU the cap is a choice, not memory the slot pool competes for: that comes from RAM
            by = cpu_budget(config.kv_cache_memory_fraction, min(CPU_KV_CAP_BYTES, available_ram_bytes() // 2),
                            config.gpu_memory_utilization)
            budget, rule = by.nbytes, by.rule
        logger.info("KV budget: %s: %d bytes", rule, budget)
        return budget

    def _sizing_option(self) -> str:
        return sizing_option(self.config.kv_cache_bytes, self.config.gpu_memory_utilization, self.device)

    def _leave_lora_slots(self, budget: int) -> int:
        """``budget`` less the LoRA slot pool, which will come out of the same device memory."""
        reserve = self.lora_slot_bytes()
        if budget - reserve < self.kv_bytes_per_page:
            raise ValueError(
                f"no memory left for the KV cache: the LoRA slot pool ({self.config.max_loras} slots of rank "
                f"{self.config.max_lora_rank}) needs {reserve / GiB:.2f} GiB of the {budget / GiB:.2f} GiB "
                f"budget; lower max_loras or max_lora_rank, raise {self._sizing_option()}, or give kv_cache_bytes"
            )
        return budget - reserve

    def lora_slot_bytes(self) -> int:
        """Bytes of the LoRA slot pool at its largest: ``max_loras`` slots of ``max_lora_rank`` on every
        targetable module, embed_tokens and lm_head included, and every expert of an MoE model with
        ``enable_expert_lora`` (``lora.slots.SlotPool``, in its dtype: fp32 on CPU whatever the model's)."""
        # counted off the pool's own tensors, laid out on ``meta`` (no memory): its fp32 scalings and
        # int32 ranks too, which the adapters' byte sizes leave out
        pool = SlotPool(self.lora_target_spec(), self.config.max_loras, self.config.max_lora_rank,
                        torch.device("meta"), slot_pool_dtype(self.device, self.dtype))
        pool.allocate_all()
        return pool.allocated_bytes

    def _max_chunk_tokens(self) -> int | None:
        return self.config.max_num_batched_tokens if self.config.enable_chunked_prefill else None

    def peak_blocks_per_sequence(self) -> int:
        """The most KV pages one sequence holds at once, over all layer groups
        (``KVLayout.peak_pages_per_sequence``)."""
        return self.kv_layout.peak_pages_per_sequence(self.max_model_len, self.block_size, self._max_chunk_tokens())

    def _size_kv_cache(self) -> int:
        block_bytes = self.kv_bytes_per_page
        num_blocks = self._kv_budget_bytes() // block_bytes
        useful = self.config.max_num_seqs * self.peak_blocks_per_sequence()
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget too small: one block of {self.block_size} tokens needs {block_bytes} bytes"
            )
        return num_blocks

    def _limit_max_model_len_to_kv(self) -> None:
        # a windowed group's table holds only its window's pages, however long the context
        if self.num_blocks >= self.peak_blocks_per_sequence():
            return
        capacity = self.kv_layout.longest_context_within(
            self.num_blocks, self.max_model_len, self.block_size, self._max_chunk_tokens())
        if self.config.max_model_len is not None:
            raise ValueError(
                f"max_model_len={self.max_model_len} does not fit the KV cache ({capacity} tokens); "
                f"raise {self._sizing_option()} or lower max_model_len"
            )
        logger.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity, self.max_model_len)
        self.max_model_len = capacity

    # ---- per step -----------------------------------------------------------------------------

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return what it sampled."""
        return self.launch(sched_out).result()

    @torch.inference_mode()
    def launch(self, sched_out: SchedulerOutput, after: PendingRun | None = None) -> PendingRun:
        """Queue one step on the device (placing its adapters first); the result waits for the
        sampled tokens. On a GPU the host is free in between: the engine turns the previous
        step's tokens into outputs meanwhile. ``after``: the step before, launched and not yet
        read back (``Scheduler.schedule_ahead``, one token per sequence): each sequence's input
        token is the one ``after`` samples for it, taken on the device."""
        if sched_out.released_seq_ids:
            self.release(sched_out.released_seq_ids)
        if sched_out.is_empty:
            return PendingRun(None, [])
        scheduled = sched_out.scheduled
        lora_ctx = None
        if self.lora_manager is not None:
            adapter_ids = [item.adapter_id for item in scheduled]
            self.lora_manager.place(adapter_ids)
        if self.decode_graphs is not None and self.decode_graphs.can_run(scheduled):
            # in the scheduler's order: a graph step groups its tokens by slot itself (_fill_lora),
            # and each sequence's result is the same in any order
            return self._execute_graph(scheduled, after)
        if self.lora_manager is not None:
            # each adapter's tokens contiguous, in slot order within a rank (see batch_order_key)
            order = {a: self.lora_manager.batch_order_key(a) for a in set(adapter_ids)}  # once per adapter
            if len(order) > 1:  # one adapter (or the base model alone): already in order
                scheduled = sorted(scheduled, key=lambda item: order[item.adapter_id])
        batch = self.prepare_batch(scheduled, after)
        if self.lora_manager is not None:
            lora_ctx = self.lora_manager.step_context(batch.token_adapter_ids)
            if lora_ctx is not None and self.shrink_overlap is not None:
                lora_ctx.overlap = self.shrink_overlap
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_caches, lora=lora_ctx)
        prompt_logprobs = {}
        if batch.prompt_logprob_rows:
            prompt_logprobs = prompt_token_logprobs(self.model, hidden, batch.prompt_logprob_rows, lora_ctx)
        if not batch.sample_rows:
            return PendingRun(None, [], prompt_logprobs=prompt_logprobs)
        rows = to_tensor(batch.sample_rows, np.int64, self.device)
        head_lora = None if lora_ctx is None else lora_ctx.logits_lora(batch.sample_rows)
        run = self._sample(hidden[rows], batch.sample_seqs, batch.verify_spans, head_lora, batch.pending)
        run.prompt_logprobs = prompt_logprobs
        return run

    def _execute_graph(self, scheduled: list[ScheduledSeq], after: PendingRun | None) -> PendingRun:
        token_slots, pool = None, None
        if self.lora_manager is not None:
            token_slots = self.lora_manager.step_slots([item.adapter_id for item in scheduled])
            pool = self.lora_manager.pool
        inputs = decode_inputs(scheduled, self.block_size, self.kv_layout.group_windows, self.table_mirror,
                               pending_ok=after is not None)
        fill, pending = None, None
        if after is not None and inputs.pending_rows:
            rows = inputs.pending_rows  # every row of a graph step samples: row == sampled row
            pending = last_tokens_ahead(pending_items(scheduled, rows), rows, after)
            fill = lambda input_ids: put_pending(input_ids, rows, pending.tokens)  # noqa: E731
        hidden = self.decode_graphs.run(inputs, token_slots, pool, fill)  # [num_seqs, hidden_size]
        # the LM head runs after the replay, eagerly, so its LoRA takes this step's own metadata
        head_lora = None if token_slots is None else logits_lora(pool, token_slots)
        return self._sample(hidden, [item.seq for item in scheduled], head_lora=head_lora, pending=pending)

    def _sample(
        self, hidden: torch.Tensor, seqs: list, verify_spans: list[tuple] = (), head_lora=None,
        pending: PendingLastTokens | None = None,
    ) -> PendingRun:
        # hidden: [num_sampled, H]; head_lora: the lm_head LoRA of these rows (None = none)
        logits = self.model.compute_logits(hidden, head_lora)  # [num_sampled, vocab] fp32
        if pending is not None and any(seqs[row].grammar is not None for row in pending.rows):
            return PendingRun(DeferredDraw(self.sampler, logits, seqs, self.eos_token_ids), seqs, verify_spans)
        return PendingRun(self.sampler.launch(logits, seqs, self.eos_token_ids, pending), seqs, verify_spans)

    def release(self, seq_ids) -> None:
        """Drop per-sequence state: the sequences' rows in the host copy of the block tables and
        their prompts the sampler keeps on the device (seeded sampling derives its generator per
        draw, so it keeps none)."""
        self.table_mirror.forget(seq_ids)
        self.sampler.forget(seq_ids)

    def prepare_batch(self, scheduled: list[ScheduledSeq], after: PendingRun | None = None) -> FlatBatch:
        if is_one_token_step(scheduled):  # decodes: most steps at large batches
            return self._one_token_batch(scheduled, after)
        bs = self.block_size
        num_groups = self.kv_layout.num_groups
        input_ids: list[int] = []
        positions: list[int] = []
        group_slots: list[list[int]] = [[] for _ in range(num_groups)]  # per layer group
        adapters: list[str | None] = []
        seq_lens: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        sample_seqs: list = []
        prompt_logprob_rows: list[tuple] = []
        verify_spans: list[tuple] = []
        # (flat row, its sampled row, entry) of each token ``after`` is still sampling
        pending: list[tuple[int, int, ScheduledSeq]] = []
        for item in scheduled:
            start, n, item_tables = item.start_pos, item.num_tokens, item.block_tables
            end = start + n
            if n == 1:  # a decode token beside prompt chunks
                if after is not None and start >= item.seq.num_tokens:
                    pending.append((len(input_ids), len(sample_rows), item))  # (a decode samples)
                    input_ids.append(0)
                else:
                    input_ids.append(item.seq.token_at(start))
                positions.append(start)
                block, offset = divmod(start, bs)
                for slots, table in zip(group_slots, item_tables):
                    slots.append(table[block] * bs + offset)
                adapters.append(item.adapter_id)
            else:
                draft = item.draft_token_ids  # speculative: the known tokens, then the draft
                input_ids.extend(item.seq.token_slice(start, end - len(draft)))
                input_ids.extend(draft)
                positions.extend(range(start, end))
                pos = start
                while pos < end:  # one block at a time: its slots are a contiguous range
                    block, offset = divmod(pos, bs)
                    run = min(bs - offset, end - pos)
                    for slots, table in zip(group_slots, item_tables):
                        first = table[block] * bs + offset
                        slots.extend(range(first, first + run))
                    pos += run
                adapters.extend([item.adapter_id] * n)
            if item.seq.needs_prompt_logprobs:
                # targets: prompt positions start+1 .. end that are not computed yet (a chunk
                # recomputed after preemption skips what it already reported)
                seq = item.seq
                first = max(start + 1, len(seq.prompt_logprobs) + 1)
                last = min(end, seq.num_prompt_tokens - 1)
                if first == len(seq.prompt_logprobs) + 1 and first <= last:
                    prompt_logprob_rows.append((seq, first, query_start[-1] + first - 1 - start, last - first + 1))
            seq_lens.append(end)
            query_start.append(query_start[-1] + n)
            if item.draft_token_ids:  # sample at the last token and at every draft token
                views = position_views(item.seq, item.draft_token_ids)
                verify_spans.append((item.seq.seq_id, len(sample_rows), len(views)))
                sample_rows.extend(range(query_start[-1] - len(views), query_start[-1]))
                sample_seqs.extend(views)
            elif item.needs_sample:
                sample_rows.append(query_start[-1] - 1)
                sample_seqs.append(item.seq)
        dev = self.device
        starts = np.array([item.start_pos for item in scheduled], dtype=np.int64)
        tables = self.table_mirror.gather(
            self.table_mirror.sync(scheduled), [-(-n // bs) for n in seq_lens],
            [window_first_blocks(starts, window, bs) for window in self.kv_layout.group_windows])
        input_ids_t = to_tensor(input_ids, np.int64, dev)
        pending_last = None
        if pending:
            pending_last = last_tokens_ahead([item for _, _, item in pending], [sampled for _, sampled, _ in pending],
                                             after)
            put_pending(input_ids_t, [row for row, _, _ in pending], pending_last.tokens)
        return self._flat_batch(
            input_ids_t, to_tensor(positions, np.int64, dev), group_slots, tables,
            seq_lens, max(seq_lens), to_tensor(query_start, np.int32, dev),
            max(item.num_tokens for item in scheduled), adapters, sample_rows, sample_seqs, prompt_logprob_rows,
            verify_spans, pending_last)

    def _one_token_batch(self, scheduled: list[ScheduledSeq], after: PendingRun | None) -> FlatBatch:
        """``prepare_batch`` for a step of one token per sequence (``decode_inputs``)."""
        dev = self.device
        inputs = decode_inputs(scheduled, self.block_size, self.kv_layout.group_windows, self.table_mirror,
                               pending_ok=after is not None)
        sample_rows = [i for i, item in enumerate(scheduled) if item.needs_sample]
        sample_seqs = [scheduled[i].seq for i in sample_rows]
        pending = None
        if after is not None and inputs.pending_rows:
            rows = sampled = inputs.pending_rows
            if len(sample_rows) != len(scheduled):  # pending rows are decodes: each samples
                sampled_row = {row: i for i, row in enumerate(sample_rows)}
                sampled = [sampled_row[row] for row in rows]
            pending = last_tokens_ahead(pending_items(scheduled, rows), sampled, after)
        if pending is not None and len(pending.rows) == len(scheduled):
            input_ids = pending.tokens  # every row's token is still being drawn: nothing to upload
        else:
            input_ids = to_device(inputs.input_ids, dev)
            if pending is not None:
                put_pending(input_ids, inputs.pending_rows, pending.tokens)
        return self._flat_batch(
            input_ids, to_device(inputs.positions, dev),
            inputs.slot_mappings, inputs.block_tables, inputs.seq_lens, int(inputs.seq_lens.max()),
            torch.arange(len(scheduled) + 1, dtype=torch.int32, device=dev), 1,
            [item.adapter_id for item in scheduled], sample_rows, sample_seqs, [], [], pending)

    def _flat_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, group_slots: list,
                    tables: list[np.ndarray], seq_lens, max_seq_len: int, query_start_loc: torch.Tensor,
                    max_query_len: int, adapters: list, sample_rows: list[int], sample_seqs: list,
                    prompt_logprob_rows: list[tuple], verify_spans: list[tuple],
                    pending: PendingLastTokens | None = None) -> FlatBatch:
        # group_slots: per layer group [T] (lists or int64 arrays); tables: per layer group
        # [num_seqs, width] int32; seq_lens: [num_seqs] (a list or an int32 array)
        dev = self.device
        hybrid = self.kv_layout.num_groups > 1
        slot_mappings = [to_tensor(slots, np.int64, dev) for slots in group_slots]
        block_tables = [to_device(table, dev) for table in tables]
        attn = AttentionMetadata(
            slot_mapping=slot_mappings[0],
            block_tables=block_tables[0],
            seq_lens=to_tensor(seq_lens, np.int32, dev),
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            group_slot_mappings=slot_mappings if hybrid else None,
            group_block_tables=block_tables if hybrid else None,
            layer_group=self.kv_layout.layer_group if hybrid else None,
        )
        return FlatBatch(
            input_ids=input_ids,
            positions=positions,
            attn=attn,
            token_adapter_ids=adapters,
            sample_rows=sample_rows,
            sample_seqs=sample_seqs,
            prompt_logprob_rows=prompt_logprob_rows,
            verify_spans=verify_spans,
            pending=pending,
        )
