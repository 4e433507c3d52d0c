"""A fake model runner and a driver loop for scheduler tests (no torch).

The fake runner keeps a paged "KV cache" of token ids: it writes each scheduled token into the
slot its block table gives, and when asked to sample it reads the whole context back through
the block table. So a wrong block table, a block shared by mistake, a token recomputed at the
wrong place or a stale prefix-cache hit all show up as a wrong context, and the sampled token
(a deterministic function of the context) would differ from an unpaged reference.

With ``sliding_window`` the fake model sees only the window (the last ``window`` tokens), and the
runner reads back every key the chunk's queries attend to (from ``start - window + 1``): a block
freed too early and reused by another sequence shows up as a wrong context. With
``group_windows`` (layer groups, one block table each, see ``kv_layout``) every token is written
through every group's table and each group's keys are read back through its own; the fake
model sees the whole context when some group is global, else the (shared) window.
"""

from __future__ import annotations

from types import SimpleNamespace

import dataclasses
import hashlib
import itertools

from loraplex.config import EngineConfig
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.sampling_params import SamplingParams

VOCAB = 97


def next_token(context: list[int], adapter_id: str | None = None) -> int:
    """The fake model: a deterministic function of every previous token (and the adapter)."""
    data = repr((adapter_id, context)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little") % VOCAB


def reference_output(
    prompt: list[int], max_tokens: int, adapter_id: str | None = None, sliding_window: int | None = None
) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        tok = next_token(tokens if sliding_window is None else tokens[-sliding_window:], adapter_id)
        tokens.append(tok)
        out.append(tok)
    return out


class FakeRunner:
    """Checks the scheduler's output against a paged token-id cache and samples ``next_token``."""

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int | None = None,
                 group_windows: tuple[int | None, ...] | None = None):
        self.block_size = block_size
        self.group_windows = group_windows or (sliding_window,)
        # what the fake model sees: everything when some group is global
        self.sliding_window = None if None in self.group_windows else max(self.group_windows)
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token id)
        self.num_slots = num_blocks * block_size
        self.steps: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput, ahead: bool = False) -> ModelRunnerOutput:
        """``ahead``: a step launched before the one it follows was applied, run late (see
        ``FakeModelRunner.launch``): the scheduler may have gone ahead again meanwhile."""
        # like the real model (per layer: write every scheduled token's K/V, then attend), all
        # writes of a step land before any read, so a block filled in this step may be shared
        self.steps.append(out)
        sampled: dict[int, SampledToken] = {}
        used_blocks: dict[int, int] = {}
        for entry in out.scheduled:
            seq = entry.seq
            end = entry.start_pos + entry.num_tokens
            # run late, a step may find its sequences already advanced past it by the step ahead
            assert seq.num_computed_tokens == entry.start_pos or ahead and seq.num_computed_tokens == end
            assert end <= seq.num_tokens
            assert len(entry.block_tables) == len(self.group_windows)
            tokens = seq.all_token_ids
            for table in entry.block_tables:
                assert len(table) * self.block_size >= end
                for pos in range(entry.start_pos, end):
                    block = table[pos // self.block_size]
                    # a block being written belongs to this sequence (and group) alone in this step
                    assert used_blocks.setdefault(block, (seq.seq_id, id(table))) == (seq.seq_id, id(table))
                    self.kv[block * self.block_size + pos % self.block_size] = (pos, tokens[pos])
        for entry in out.scheduled:
            seq = entry.seq
            end = entry.start_pos + entry.num_tokens
            tokens = seq.all_token_ids
            for window, table in zip(self.group_windows, entry.block_tables):
                # every key some query of the chunk attends to: all before it, or its first window
                first = 0 if window is None else max(0, entry.start_pos - window + 1)
                context = []
                for pos in range(first, end):
                    block = table[pos // self.block_size]
                    assert block >= 0, f"position {pos} of seq {seq.seq_id} is in a freed block"
                    stored_pos, tok = self.kv[block * self.block_size + pos % self.block_size]
                    assert stored_pos == pos
                    context.append(tok)
                assert context == tokens[first:end]
            context = tokens[:end]
            if entry.needs_sample:
                assert end == seq.num_tokens
                if self.sliding_window is not None:
                    context = context[-self.sliding_window:]
                sampled[seq.seq_id] = SampledToken(next_token(context, seq.adapter_id))
        return ModelRunnerOutput(sampled=sampled)


class Harness:
    """A scheduler, its block manager and a fake runner, driven step by step."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, gate=None, eos_token_ids=(),
                 sliding_window: int | None = None, group_windows: tuple[int | None, ...] | None = None,
                 **config):
        self.config = EngineConfig(block_size=block_size, **config)
        self.block_manager = BlockManager(num_blocks, block_size, self.config.enable_prefix_caching, sliding_window,
                                          group_windows=group_windows)
        self.scheduler = Scheduler(self.config, self.block_manager, gate, eos_token_ids=eos_token_ids)
        self.runner = FakeRunner(num_blocks, block_size, sliding_window, group_windows)
        self._ids = itertools.count()
        self.seqs: list[Sequence] = []
        self.time = 0.0

    def add(self, prompt: list[int], adapter_id: str | None = None, tenant: str | None = None, priority: int = 0,
            tenant_weight: float = 1.0, **params) -> Sequence:
        params.setdefault("max_tokens", 8)
        params.setdefault("ignore_eos", True)
        seq_id = next(self._ids)
        self.time += 1.0  # strictly increasing arrival times keep FCFS order well defined
        seq = Sequence(
            seq_id=seq_id,
            request_id=f"req-{seq_id}",
            prompt_token_ids=list(prompt),
            params=SamplingParams(temperature=0.0, **params),
            adapter_id=adapter_id,
            tenant=tenant,
            priority=priority,
            tenant_weight=tenant_weight,
            arrival_time=self.time,
        )
        self.scheduler.add(seq)
        self.seqs.append(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.config.max_num_seqs
        run_out = self.runner.execute(out)
        self.scheduler.update(out, run_out)
        return out

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps


class FakeModelRunner(FakeRunner):
    """``ModelRunner`` stand-in for engine tests: the fake model behind the runner interface,
    with the tiny byte-level tokenizer of the test fixtures (ids 4..96 are bytes)."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256, eos_token_ids=(1,)):
        super().__init__(num_blocks, block_size)
        from tests.fixtures.tiny_models import make_tiny_tokenizer

        self.num_blocks = num_blocks
        self.tokenizer = make_tiny_tokenizer()
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        self.device = "cpu"
        self.dtype = "float32"
        self.vocab_size = VOCAB
        self.lora_manager = None
        self.released: list[int] = []
        self.num_ahead = 0  # steps launched after one not yet read back

    def release(self, seq_ids) -> None:
        self.released.extend(seq_ids)

    def launch(self, out: SchedulerOutput, after=None):
        """``ModelRunner.launch``: the fake model runs at once; the result is what it sampled.
        A step launched ``after`` one not yet read back (schedule_ahead) runs when its result is
        asked for, once the engine has applied the step before (the host then knows the input
        tokens a GPU would take from the device); the rows of sequences that ended meanwhile are
        computed by no one, as a GPU's are dropped."""
        if after is None:
            run_out = self.execute(out)
            return SimpleNamespace(result=lambda: run_out)
        self.num_ahead += 1

        def result():
            live = [e for e in out.scheduled if e.seq.status is SequenceStatus.RUNNING]
            return self.execute(dataclasses.replace(out, scheduled=live), ahead=True)

        return SimpleNamespace(result=result)
