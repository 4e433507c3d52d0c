"""Scheduling policies: the admission order and preemption victims of fair (weighted by each
tenant's share), priority and fcfs, checked against a brute-force statement of each policy and
through the scheduler."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loraplex.engine.admission_order import admission_order, check_priority, check_tenant_weight, preemption_victim
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from tests.engine.scheduler_harness import Harness, reference_output


def _seq(i: int, tenant, priority: int, arrival: float, status=SequenceStatus.WAITING, weight: float = 1.0) -> Sequence:
    seq = Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=[1], params=SamplingParams(),
                   tenant=tenant, priority=priority, arrival_time=arrival, tenant_weight=weight)
    seq.status = status
    return seq


def _stated_weights(seqs) -> dict:
    """A tenant's weight as stated: the one on its latest arrival (the later seq id among equals)."""
    weights = {}
    for seq in sorted(seqs, key=lambda s: (s.arrival_time, s.seq_id)):
        weights[seq.tenant] = seq.tenant_weight
    return weights


def _brute_force_order(waiting, running, policy, admit):
    """The policy as stated, one pick at a time over everything still waiting. fcfs: the first
    arrived; priority: the minimum of (priority, arrival); fair: the tenant with the minimum of
    (running count / weight, arrival of its best request), and that tenant's best request, best
    being the minimum of (priority, arrival)."""
    left = list(waiting)
    load = Counter(s.tenant for s in running)
    weight = _stated_weights(list(waiting) + list(running))
    order = []
    while left:
        if policy == "fcfs":
            best = min(left, key=lambda s: s.arrival_time)
        elif policy == "priority":
            best = min(left, key=lambda s: (s.priority, s.arrival_time))
        else:
            heads = {}
            for s in left:
                if s.tenant not in heads or (s.priority, s.arrival_time) < (heads[s.tenant].priority,
                                                                             heads[s.tenant].arrival_time):
                    heads[s.tenant] = s
            best = min(heads.values(), key=lambda s: (load[s.tenant] / weight[s.tenant], s.arrival_time))
        left.remove(best)
        order.append(best)
        if admit(best):
            load[best.tenant] += 1
    return order


@pytest.mark.parametrize("policy", ["fair", "priority", "fcfs"])
@pytest.mark.parametrize("seed", range(12))
def test_admission_order_matches_the_policy_as_stated(policy, seed):
    rng = random.Random(seed * 31 + len(policy))
    tenants = ["a", "b", "c", None][: rng.randint(1, 4)]
    share = {t: rng.choice([0.5, 1.0, 1.0, 2.0, 3.0]) for t in tenants}

    def weight(tenant):  # now and then a request carries a changed weight (an operator's edit)
        return share[tenant] if rng.random() < 0.85 else rng.choice([0.25, 1.5, 4.0])

    ids = iter(range(1000))
    running = [_seq(next(ids), t, 0, -1.0, SequenceStatus.RUNNING, weight(t))
               for t in (rng.choice(tenants) for _ in range(rng.randint(0, 8)))]
    arrivals = rng.sample(range(1000), rng.randint(1, 25))
    waiting = sorted((_seq(next(ids), t, rng.choice([0, 0, 0, -1, 2]), float(a), weight=weight(t))
                      for t, a in ((rng.choice(tenants), a) for a in arrivals)), key=lambda s: s.arrival_time)
    admitted = {s.seq_id for s in waiting if rng.random() < 0.6}  # the rest are skipped (no slot, ...)

    def admit(seq):
        return seq.seq_id in admitted

    expected = _brute_force_order(waiting, running, policy, admit)
    got = []
    for seq in admission_order(waiting, running, policy):
        got.append(seq)
        if admit(seq):
            seq.status = SequenceStatus.RUNNING  # what the scheduler does on admission
    assert [s.seq_id for s in got] == [s.seq_id for s in expected]


def test_preemption_victims():
    running = [_seq(0, "a", 0, 0.0), _seq(1, "b", 0, 1.0), _seq(2, "a", 0, 2.0), _seq(3, "b", 0, 3.0),
               _seq(4, "a", 0, 4.0), _seq(5, "c", 0, 5.0)]
    assert preemption_victim(running, "fcfs") is running[5]  # the newest admitted
    assert preemption_victim(running, "fair") is running[4]  # tenant a holds most: its newest
    running[1].priority = 3
    assert preemption_victim(running, "priority") is running[1]  # the lowest priority goes first
    assert preemption_victim(running, "fair") is running[4]  # priority orders only a's own
    running[2].priority = 1
    assert preemption_victim(running, "fair") is running[2]  # a's lowest priority goes first


def test_weighted_preemption_victims():
    # a (weight 3) holds three, b (weight 1) two: b holds more for its share, so its newest goes
    running = [_seq(0, "a", 0, 0.0, weight=3), _seq(1, "b", 0, 1.0), _seq(2, "a", 0, 2.0, weight=3),
               _seq(3, "b", 0, 3.0), _seq(4, "a", 0, 4.0, weight=3)]
    assert preemption_victim(running, "fair") is running[3]
    running[4].tenant_weight = 1.0  # a's latest request says weight 1 now: a holds 3 for a share of 1
    assert preemption_victim(running, "fair") is running[4]


@pytest.mark.parametrize("seed", range(8))
def test_preemption_victim_matches_the_policy_as_stated(seed):
    rng = random.Random(seed)
    running = [_seq(i, rng.choice("abc"), rng.choice([0, 0, 1]), float(rng.randint(0, 50)),
                    weight=rng.choice([0.5, 1.0, 2.0])) for i in range(rng.randint(1, 12))]
    load = Counter(s.tenant for s in running)
    weight = _stated_weights(running)
    # the running sequence with the largest (tenant's load / weight, priority, admission index)
    stated = max(range(len(running)), key=lambda i: (load[running[i].tenant] / weight[running[i].tenant],
                                                      running[i].priority, i))
    assert preemption_victim(running, "fair") is running[stated]


def test_check_priority():
    check_priority(0, "fcfs")
    check_priority(-5, "fair")
    check_priority(7, "priority")
    for bad, policy in ((1, "fcfs"), (True, "fair"), (1.5, "priority"), (1 << 40, "fair"), ("1", "fair")):
        with pytest.raises(InvalidRequestError) as err:
            check_priority(bad, policy)
        assert err.value.param == "priority"


def test_check_tenant_weight():
    for good in (1, 0.01, 2.5, 100):
        check_tenant_weight(good)
    for bad in (0, -1, float("nan"), float("inf"), True, "2", None, 10**400, -10**400):  # 10**400: no float holds it
        with pytest.raises(InvalidRequestError) as err:
            check_tenant_weight(bad)
        assert err.value.param == "tenant_weight"


def _admitted_order(h: Harness) -> list[int]:
    order, seen = [], set()
    while h.scheduler.has_unfinished():
        out = h.step()
        for entry in out.scheduled:
            if entry.seq.seq_id not in seen:
                seen.add(entry.seq.seq_id)
                order.append(entry.seq.seq_id)
    return order


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_burst_does_not_hold_up_another_tenant(policy):
    # two sequences run at a time; tenant a queues six requests, two start, then b sends one
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=2, scheduling_policy=policy)
    burst = [h.add([10 + i] * 5, tenant="a", max_tokens=4) for i in range(6)]
    assert [e.seq.seq_id for e in h.step().scheduled] == [burst[0].seq_id, burst[1].seq_id]
    late = h.add([3] * 5, tenant="b", max_tokens=4)
    admitted_at = {}  # seq id -> the step it was first scheduled in
    step = 0
    while h.scheduler.has_unfinished():
        step += 1
        for entry in h.step().scheduled:
            admitted_at.setdefault(entry.seq.seq_id, step)
    if policy == "fcfs":  # behind the whole burst
        assert admitted_at[late.seq_id] > max(admitted_at[s.seq_id] for s in burst[2:])
    else:  # at the first free place: in the first step that admits anyone after it arrived
        assert admitted_at[late.seq_id] == min(admitted_at[s.seq_id] for s in burst[2:])
    for seq in burst + [late]:  # the order changes nothing in the outputs
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, 4)
    assert h.block_manager.num_free_blocks == h.block_manager.num_blocks


def test_priority_policy_orders_admission_within_and_across_tenants():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    seqs = [h.add([5 + i] * 3, tenant=t, priority=p, max_tokens=2)
            for i, (t, p) in enumerate([("a", 5), ("b", 0), ("a", -2), ("b", 5), ("a", 0)])]
    order = _admitted_order(h)
    # all are waiting at the first step, so the order is priority, then arrival
    expected = sorted(seqs, key=lambda s: (s.priority, s.arrival_time))
    assert order == [s.seq_id for s in expected]


def test_fair_preemption_takes_from_the_tenant_holding_most():
    # KV for about three sequences; a runs two, b one; when memory runs out, a's newest gives way
    h = Harness(num_blocks=9, block_size=4, max_num_batched_tokens=64, scheduling_policy="fair")
    a1 = h.add([1] * 7, tenant="a", max_tokens=10)
    a2 = h.add([2] * 7, tenant="a", max_tokens=10)
    b1 = h.add([3] * 7, tenant="b", max_tokens=10)
    while not any(s.num_preemptions for s in (a1, a2, b1)):
        h.step()
    assert (a1.num_preemptions, a2.num_preemptions, b1.num_preemptions) == (0, 1, 0)
    h.run()
    for seq in (a1, a2, b1):
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, 10)
    assert h.block_manager.num_free_blocks == h.block_manager.num_blocks


def test_offline_priority_orders_runs_and_keeps_outputs_exact(tiny_llama_dir, loraplex_home):
    from tests.engine.test_engine_exact import hf_greedy_all, tight_llm

    prompts = [[5 + i, 9, 14, 3 + i, 40] for i in range(4)]
    priorities = [3, -1, 0, 2]
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    outs = llm.generate(prompts, params, priority=priorities)
    assert [o.token_ids for o in outs] == hf_greedy_all(tiny_llama_dir, prompts, 4)
    # one sequence at a time: each finishes before the next starts, lowest priority value first
    finish_order = sorted(range(4), key=lambda i: outs[i].metrics["finished_time"])
    assert finish_order == sorted(range(4), key=lambda i: priorities[i])
    with pytest.raises(InvalidRequestError):
        llm.generate(prompts, params, priority=[0])  # one per prompt
    fcfs = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, scheduling_policy="fcfs")
    with pytest.raises(InvalidRequestError) as err:
        fcfs.generate(prompts[:1], params, priority=[1])
    assert err.value.param == "priority"


def test_unknown_policy_is_refused():
    from loraplex.config import EngineConfig, Settings

    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError):
        Settings(scheduling_policy="lifo")
    assert EngineConfig().scheduling_policy == Settings().scheduling_policy == "fair"


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_engine_admits_another_tenant_ahead_of_a_burst(tiny_llama_dir, loraplex_home, policy):
    """Through the real engine: tenant a's four 60-token prompts fill the 64-token step budget
    for four steps; b's short request, added after the first step, gets its first token in
    the next step under fair and not before the burst's last prompt under fcfs. Tokens are exact."""
    from tests.engine.test_engine_exact import hf_greedy_all, tight_llm

    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, scheduling_policy=policy)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3)
    burst = [[7 + i] + list(range(20, 79)) for i in range(4)]
    ids = [engine.add_request(None, p, params, tenant="a") for p in burst]
    engine.step()
    quiet = [5, 6, 7, 8]
    ids.append(engine.add_request(None, quiet, params, tenant="b"))
    first_token_step: dict[str, int] = {}
    finals = {}
    step = 1
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first_token_step:
                first_token_step[out.request_id] = step
            if out.finished:
                finals[out.request_id] = out.token_ids
    burst_firsts = [first_token_step[i] for i in ids[:4]]
    if policy == "fair":
        assert first_token_step[ids[4]] == 2
    else:
        assert first_token_step[ids[4]] >= max(burst_firsts) >= 4  # behind the last prompt of the burst
    assert [finals[i] for i in ids] == hf_greedy_all(tiny_llama_dir, burst + [quiet], 3)


def test_fair_priority_cannot_starve_another_tenant():
    # tenant a keeps a backlog at priority -1; b's one request at priority 0 still gets the next
    # free place (its tenant runs nothing), where the priority policy would keep it waiting
    def first_step_of_b(policy):
        h = Harness(num_blocks=256, block_size=4, max_num_seqs=2, scheduling_policy=policy)
        for i in range(20):
            h.add([10 + i % 5] * 4, tenant="a", priority=-1, max_tokens=3)
        h.step()
        late = h.add([3] * 4, tenant="b", priority=0, max_tokens=3)
        for step in range(1, 200):
            if any(e.seq is late for e in h.step().scheduled):
                return step
        return None

    assert first_step_of_b("fair") <= 3
    assert first_step_of_b("priority") > 20
