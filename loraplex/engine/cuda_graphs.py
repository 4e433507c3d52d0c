"""CUDA graphs for decode steps: the model forward of a batch of one-token sequences is captured
once per (batch bucket, LoRA segment class) and replayed with each step's inputs copied into
static buffers.

Why: a decode step of a small or medium model is bound by kernel launches and Python long before
the GPU is busy (a few hundred launches per step, several microseconds each, and the LoRA
kernels add eight per layer); a replay is one launch. Steps with prompt chunks stay eager: their
shapes vary too much to bucket, and they are compute-bound anyway.

Padding contract (what the kernels honour, kernels/README.md "CUDA graphs"): ``n`` decodes run
in the graph of the smallest bucket ``B >= n``. Rows ``n..B-1`` are padding: slot -1 (no KV
write), a sequence with no query token (attention returns at once and the split-KV merge
leaves the row alone), the base model for LoRA. Grids come from host ints fixed per graph:
attention's ``max_seq_len`` is ``max_model_len`` (each sequence still divides only its own
length); LoRA's ``num_segments`` is ``min(B, max_loras)``, ``max_seg_len`` the segment class
(the next power of two of the longest segment, at most ``B``) and ``max_rank`` the pool's; the
unused segments are empty. Which projections get a LoRA delta must not depend on the step, so
under a graph every projection with a slot stack runs the kernels (zero weights add nothing);
so does the embed_tokens LoRA once its stack exists (the LoRA graphs captured before it existed
are dropped then, once).
The LM head (and its LoRA) runs after the replay, eagerly.
With layer groups (``kv_layout``) each group has its own static slot mapping and block tables.
The step's inputs come from ``decode_inputs`` (the runner builds them as it does for an eager
decode step); this module only pads them to the bucket and copies them in.

The capture function is injected: ``cuda_capture`` on a GPU; the tests replay eagerly on CPU
(Triton interpreter) to check the padding and metadata against the unpadded forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from loraplex.engine.decode_inputs import DecodeInputs
from loraplex.engine.host_staging import HostStaging
from loraplex.engine.kv_layout import KVLayout
from loraplex.engine.outputs import ScheduledSeq
from loraplex.kernels import dispatch
from loraplex.kernels.lora_meta import LoRABatchMeta
from loraplex.lora.context import MAX_SLICES, LoRAStepContext, group_by_slot
from loraplex.lora.shrink_overlap import ShrinkOverlap
from loraplex.lora.slots import SlotPool
from loraplex.model.layers import AttentionMetadata

# batch sizes with a graph of their own; a batch runs in the smallest bucket that holds it
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# (callable running the forward) -> (object with .replay(), the output tensor each replay writes)
CaptureFn = Callable[[Callable[[], torch.Tensor]], tuple[object, torch.Tensor]]


def cuda_capture(pool_handle) -> CaptureFn:
    """Capture on the current CUDA device into the shared memory pool ``pool_handle``."""

    def capture(forward: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]:
        # warm-up outside the capture, on a side stream as torch's CUDA-graph notes advise:
        # compiles and loads the Triton variants, creates cuBLAS state, settles the allocator
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool_handle):
            hidden = forward()
        return graph, hidden

    return capture


class EagerReplay:
    """Stands in for ``torch.cuda.CUDAGraph`` without a GPU: ``replay`` reruns the forward into
    the tensor returned at capture, as a real replay rewrites the graph's own output. With the
    Triton kernels under the interpreter this runs the whole graph path on CPU (the tests, the
    GPU check's CPU smoke run)."""

    def __init__(self, forward: Callable[[], torch.Tensor]):
        self.forward = forward
        self.hidden = forward()
        self.replays = 0

    def replay(self) -> None:
        self.hidden.copy_(self.forward())
        self.replays += 1


def eager_capture(forward: Callable[[], torch.Tensor]) -> tuple[EagerReplay, torch.Tensor]:
    graph = EagerReplay(forward)
    return graph, graph.hidden


def segment_class(batch: int, max_seg_len: int) -> int:
    """The LoRA segment class a graph of bucket ``batch`` is captured for, for a step whose
    longest segment has ``max_seg_len`` rows: the next power of two, at most ``batch``."""
    return min(batch, 1 << (max(1, max_seg_len) - 1).bit_length())


@dataclass
class _Graph:
    graph: object  # .replay()
    hidden: torch.Tensor  # [B, hidden_size], rewritten by every replay


class DecodeGraphs:
    """Captured decode forwards and the static buffers they read (see module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        capture: CaptureFn,
        layout: KVLayout | None = None,  # None: one group of every layer
    ):
        self.model = model
        self.layout = layout or KVLayout.single(len(kv_caches))
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.max_batch = self.buckets[-1]
        self.capture = capture
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (bucket, segment class)
        self._embed_lora = False  # the LoRA graphs include the embed_tokens LoRA
        self._expert_lora = False  # the LoRA graphs include the MoE experts' LoRA
        device = kv_caches[0].device
        n, max_blocks = self.max_batch, -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        groups = self.layout.num_groups
        self.slot_mappings = [torch.full((n,), -1, dtype=torch.int64, device=device) for _ in range(groups)]
        self.block_tables = [torch.zeros(n, max_blocks, dtype=torch.int32, device=device) for _ in range(groups)]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.token_perm = torch.arange(n, dtype=torch.int64, device=device)
        self.seg_starts = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.seg_slot = torch.zeros(n, dtype=torch.int32, device=device)
        self._shrunk: torch.Tensor | None = None  # [max_partials, MAX_SLICES, max_batch, r_max] fp32, at first LoRA use
        self._staging = HostStaging(device)  # each step's values reach the buffers above through it
        # (bucket, token slots, segment class) the LoRA metadata buffers hold: a step of the same
        # slots in the same order (a steady decode batch) reuses them as they are
        self._lora_filled: tuple[int, list[int], int] | None = None
        self.shrink_overlap: ShrinkOverlap | None = None  # the LoRA graphs' shrinks on a side stream

    def set_shrink_overlap(self, overlap: ShrinkOverlap | None) -> None:
        """Capture the LoRA graphs from now on with ``overlap`` (None: one stream); those
        captured the other way are dropped."""
        self.shrink_overlap = overlap
        self.graphs = {k: g for k, g in self.graphs.items() if k[1] == 0}

    # ---- which steps ---------------------------------------------------------------------
    def can_run(self, scheduled: list[ScheduledSeq]) -> bool:
        """A step of one token per sequence (decodes, or one-token prompts) that fits a bucket."""
        return 0 < len(scheduled) <= self.max_batch and all(
            item.num_tokens == 1 and item.needs_sample for item in scheduled
        )

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    # ---- one step ------------------------------------------------------------------------
    def run(
        self,
        inputs: DecodeInputs,  # the step's one token per sequence (decode_inputs.decode_inputs)
        token_slots: list[int] | None,  # per sequence (one token each); None = no adapter in the step
        pool: SlotPool | None,
        # schedule_ahead: writes into the step's input ids ([num_seqs] on the device) the tokens
        # the step before is still sampling (zeros in ``inputs``)
        fill_pending: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:  # [num_seqs, hidden_size], in ``inputs`` order
        num_seqs = inputs.num_seqs
        batch = self.bucket_for(num_seqs)
        self._staging.begin()
        self._fill_inputs(inputs, batch)
        seg_class = 0
        if token_slots is not None:
            seg_class = self._fill_lora(token_slots, batch, pool)
        self._staging.end()
        if fill_pending is not None:  # after the staged copies, which wrote zeros there
            fill_pending(self.input_ids[:num_seqs])
        if seg_class > 0 and not self._embed_lora and pool.vocab.get("embed_tokens") is not None:
            # the first adapter with LoRA on embed_tokens: graphs captured before lack its ops
            self.graphs = {k: g for k, g in self.graphs.items() if k[1] == 0}
            self._embed_lora = True
        if seg_class > 0 and not self._expert_lora and pool.experts is not None and pool.experts.allocated:
            # the first adapter with expert LoRA: graphs captured before lack the experts' LoRA ops
            self.graphs = {k: g for k, g in self.graphs.items() if k[1] == 0}
            self._expert_lora = True
        key = (batch, seg_class)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(batch, seg_class, pool)
            self.graphs[key] = graph
        graph.graph.replay()
        return graph.hidden[:num_seqs]

    def _fill_inputs(self, inputs: DecodeInputs, batch: int) -> None:
        """Copy the step's inputs into the static buffers, rows ``n..batch-1`` as padding."""
        n = inputs.num_seqs
        if len(inputs.slot_mappings) != self.layout.num_groups:  # built without the runner's layout
            raise ValueError(f"{len(inputs.slot_mappings)} block tables per sequence for "
                             f"{self.layout.num_groups} layer groups")
        put = self._staging.put
        put(self.input_ids, inputs.input_ids, batch, fill=0)
        put(self.positions, inputs.positions, batch, fill=0)
        for slots, tables, slot_mapping, block_tables in zip(
            inputs.slot_mappings, inputs.block_tables, self.slot_mappings, self.block_tables
        ):
            put(slot_mapping, slots, batch, fill=-1)
            put(block_tables, tables)
        put(self.seq_lens, inputs.seq_lens, batch, fill=0)
        put(self.query_start_loc, np.arange(n + 1), batch + 1, fill=n)

    def _fill_lora(self, token_slots: list[int], batch: int, pool: SlotPool) -> int:
        """Copy the step's segments into the static metadata; returns the segment class."""
        filled = self._lora_filled
        if filled is not None and filled[0] == batch and filled[1] == token_slots:
            return filled[2]  # the buffers hold these segments already (only this method writes them)
        perm, seg_starts, seg_slot, max_seg_len = group_by_slot(token_slots + [-1] * (batch - len(token_slots)))
        num_segments = min(batch, pool.max_loras)
        # the segments past the real ones are empty: they start and end at the batch's end
        self._staging.put(self.token_perm, perm)
        self._staging.put(self.seg_starts, seg_starts, num_segments + 1, fill=batch)
        self._staging.put(self.seg_slot, seg_slot, num_segments, fill=0)
        seg_class = segment_class(batch, max_seg_len)
        self._lora_filled = (batch, list(token_slots), seg_class)
        return seg_class

    def _capture(self, batch: int, seg_class: int, pool: SlotPool | None) -> _Graph:
        slot_mappings = [t[:batch] for t in self.slot_mappings]
        block_tables = [t[:batch] for t in self.block_tables]
        hybrid = self.layout.is_hybrid
        attn = AttentionMetadata(
            slot_mapping=slot_mappings[0],
            block_tables=block_tables[0],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # an upper bound: sizes the split-KV choice only
            group_slot_mappings=slot_mappings if hybrid else None,
            group_block_tables=block_tables if hybrid else None,
            layer_group=self.layout.layer_group if hybrid else None,
        )
        lora = None if seg_class == 0 else self._lora_context(batch, seg_class, pool)
        input_ids, positions = self.input_ids[:batch], self.positions[:batch]

        def forward() -> torch.Tensor:
            return self.model(input_ids, positions, attn, self.kv_caches, lora=lora)

        graph, hidden = self.capture(forward)
        return _Graph(graph, hidden)

    def _lora_context(self, batch: int, seg_class: int, pool: SlotPool) -> LoRAStepContext:
        if self._shrunk is None:
            self._shrunk = dispatch.lora_shrink_scratch(self.input_ids, self.max_batch, pool.max_rank, MAX_SLICES)
        num_segments = min(batch, pool.max_loras)
        meta = LoRABatchMeta(
            token_perm=self.token_perm[:batch],
            seg_starts=self.seg_starts[: num_segments + 1],
            seg_slot=self.seg_slot[:num_segments],
            slot_rank=pool.slot_rank,
            num_tokens=batch,
            num_segments=num_segments,
            max_seg_len=seg_class,
            max_rank=pool.max_rank,
            # a full bucket of this class has at least batch / seg_class adapters: the kernels
            # split their work for those, as an eager step with them would
            sizing_segments=-(-batch // seg_class),
            # the Triton kernels read only the device tensors; these host lists stay empty
            seg_starts_host=[],
            seg_slot_host=[],
            slot_rank_host=[],
        )
        return LoRAStepContext(pool, meta, shrunk=self._shrunk[:, :, :batch], every_projection=True,
                               overlap=self.shrink_overlap)
