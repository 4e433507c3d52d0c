"""Engine stats of the queues (``num_seqs_waiting``, ``num_requests_waiting``, running counts,
which /metrics reports as ``vllm:num_requests_waiting`` and so on) against a count of the
sequences' own states, step by step, through admissions, KV preemptions, n > 1 and aborts."""

from __future__ import annotations

import random

import pytest

from tests.engine.test_engine_fake import greedy, make_engine


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
@pytest.mark.parametrize("policy", ["fair", "fcfs", "priority"])
def test_waiting_and_running_counts_follow_the_sequences(policy, overlap):
    """With overlap_outputs, a request whose final output has not left yet is neither."""
    rng = random.Random(policy)
    engine = make_engine(max_num_batched_tokens=32, num_blocks=12, max_num_seqs=8, scheduling_policy=policy,
                         overlap_outputs=overlap)
    for i in range(12):
        prompt = [rng.randrange(4, 97) for _ in range(rng.randint(6, 16))]
        engine.add_request(f"r{i}", prompt, greedy(max_tokens=rng.randint(4, 16), n=1 + (i % 4 == 0)),
                           tenant=rng.choice(["a", "b"]))
    seen_waiting = preempted = 0
    aborted = set()
    while engine.has_unfinished():
        if rng.random() < 0.1:
            request_id = f"r{rng.randrange(12)}"
            if engine.abort(request_id) is not None:
                aborted.add(request_id)
        engine.step()
        seqs = list(engine.scheduler._seqs.values())  # the unfinished sequences
        waiting = [s for s in seqs if s.status.value == "waiting"]
        running = [s for s in seqs if s.status.value == "running"]
        running_requests = {s.request_id for s in running}
        stats = engine.stats()
        assert stats["num_seqs_waiting"] == len(waiting)
        assert stats["num_seqs_running"] == len(running)
        assert stats["num_requests_running"] == len(running_requests)
        assert stats["num_requests_waiting"] == len({s.request_id for s in seqs} - running_requests)
        seen_waiting = max(seen_waiting, len(waiting))
        preempted = stats["num_preemptions"]
    stats = engine.stats()
    assert stats["num_seqs_waiting"] == stats["num_requests_waiting"] == stats["num_seqs_running"] == 0
    assert seen_waiting > 0 and preempted > 0 and aborted
