"""Weighted fair share: two queued tenants of weights 2 and 1 share ``max_num_seqs`` about 2:1
through the scheduler (outputs exact, blocks all freed), equal weights share evenly, offline
use keeps arrival order, and a request's ``tenant_weight`` reaches its sequences in the real
engine. The order itself is checked against the policy's brute-force statement in
test_fair_scheduling.py."""

from __future__ import annotations

from collections import Counter

import pytest

from loraplex.sampling_params import InvalidRequestError, SamplingParams
from tests.engine.scheduler_harness import Harness, reference_output
from tests.engine.test_fair_scheduling import _admitted_order


def test_weight_two_tenant_holds_twice_the_running_sequences():
    # both tenants keep a queue; six sequences run at a time, a has weight 2 and b weight 1
    h = Harness(num_blocks=256, block_size=4, max_num_seqs=6, scheduling_policy="fair")
    seqs = []
    for i in range(30):  # interleaved arrivals: arrival order alone would share 1:1
        seqs.append(h.add([10 + i % 7] * 5, tenant="a", tenant_weight=2.0, max_tokens=3 + i % 4))
        seqs.append(h.add([40 + i % 5] * 5, tenant="b", tenant_weight=1.0, max_tokens=3 + i % 3))
    held = Counter()
    while h.scheduler.has_unfinished():
        h.step()
        waiting = {s.tenant for s in h.scheduler.waiting}
        if waiting == {"a", "b"}:  # both still queued: the share is what the policy decides
            held.update(s.tenant for s in h.scheduler.running)
    assert held["b"] > 0 and 1.7 <= held["a"] / held["b"] <= 2.3, held
    for seq in seqs:
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.params.max_tokens)
    assert h.block_manager.num_free_blocks == h.block_manager.num_blocks


def test_equal_weights_share_evenly_and_offline_is_unchanged():
    h = Harness(num_blocks=256, block_size=4, max_num_seqs=4, scheduling_policy="fair")
    for i in range(16):
        h.add([5 + i % 3] * 5, tenant="a", max_tokens=4)
        h.add([9 + i % 3] * 5, tenant="b", max_tokens=4)
    first = Counter(e.seq.tenant for e in h.step().scheduled)
    assert first == {"a": 2, "b": 2}
    offline = Harness(num_blocks=64, block_size=4, max_num_seqs=2, scheduling_policy="fair")
    seqs = [offline.add([3 + i] * 4, max_tokens=2) for i in range(5)]  # no tenant: arrival order
    assert _admitted_order(offline) == [s.seq_id for s in seqs]


def test_tenant_weight_reaches_the_sequences_and_a_bad_one_is_refused(tiny_llama_dir, loraplex_home):
    from tests.engine.test_engine_exact import tight_llm

    engine = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64).engine
    req = engine.prepare_request("paying", [5, 6, 7], SamplingParams(max_tokens=2, n=2), tenant="a", tenant_weight=2.5)
    engine.add_prepared(req)
    engine.add_request("free", [8, 9], SamplingParams(max_tokens=2), tenant="b")
    assert [(s.request_id, s.tenant, s.tenant_weight) for s in engine.scheduler.waiting] == [
        ("paying", "a", 2.5), ("paying", "a", 2.5), ("free", "b", 1.0)]
    for bad in (0, -1.0, float("nan"), "2"):
        with pytest.raises(InvalidRequestError) as err:
            engine.prepare_request(None, [5], SamplingParams(), tenant="a", tenant_weight=bad)
        assert err.value.param == "tenant_weight"
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
