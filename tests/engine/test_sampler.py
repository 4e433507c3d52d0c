"""Sampler behaviour against direct torch computations of the same rules."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.penalties import PromptTokens
from loraplex.engine.sampler import Sampler, apply_logit_bias, apply_penalties
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams

VOCAB = 50


def seq(params: SamplingParams, prompt=(3, 4), output=(), seq_id=0, index=0) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), prompt_token_ids=list(prompt), params=params,
                    index=index, output_token_ids=list(output))


def random_logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 2.0


def draw_support(logits_row: torch.Tensor, params: SamplingParams, draws: int = 3000) -> set[int]:
    """Tokens drawn from ``draws`` identical rows in one batch."""
    sampler = Sampler(seed=0)
    tokens = sampler(logits_row.expand(draws, -1).clone(), [seq(params, seq_id=i) for i in range(draws)])
    return {t.token_id for t in tokens}


def test_greedy_is_argmax():
    logits = random_logits(8)
    tokens = Sampler()(logits.clone(), [seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(8)])
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()


def test_top_k_support():
    logits = random_logits()[0] * 0.3  # flat enough that every kept token gets drawn
    expected = set(logits.topk(5).indices.tolist())
    assert draw_support(logits, SamplingParams(temperature=1.0, top_k=5)) == expected


def test_top_p_support():
    logits = random_logits(seed=1)[0]
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    keep = int((cumulative < 0.6).sum().item()) + 1  # smallest prefix whose mass reaches 0.6
    expected = set(order[:keep].tolist())
    assert draw_support(logits, SamplingParams(temperature=1.0, top_p=0.6), draws=6000) == expected


def test_min_p_support_uses_temperature_scaled_probs():
    logits = random_logits(seed=2)[0] * 0.5
    probs = torch.softmax(logits / 0.7, -1)
    expected = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    assert draw_support(logits, SamplingParams(temperature=0.7, min_p=0.2), draws=6000) == expected


def test_top_k_then_top_p():
    logits = random_logits(seed=3)[0] * 0.5
    top = logits.topk(10)
    probs = torch.softmax(top.values, -1)  # renormalised over the top 10
    keep = int((probs.cumsum(0) < 0.5).sum().item()) + 1
    expected = set(top.indices[:keep].tolist())
    assert draw_support(logits, SamplingParams(temperature=1.0, top_k=10, top_p=0.5), draws=6000) == expected


def test_temperature_distribution():
    logits = random_logits(seed=4)[0] * 0.4
    draws = 20000
    tokens = Sampler(seed=1)(logits.expand(draws, -1).clone(),
                             [seq(SamplingParams(temperature=1.5), seq_id=i) for i in range(draws)])
    counts = torch.bincount(torch.tensor([t.token_id for t in tokens]), minlength=VOCAB).float() / draws
    expected = torch.softmax(logits / 1.5, -1)
    assert (counts - expected).abs().max().item() < 0.015


def test_penalties_formula():
    logits = random_logits(2, seed=5)
    p = SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3)
    rows = [seq(p, prompt=[1, 2, 2, 40], output=[2, 7, 7, 7, 9]), seq(SamplingParams(), prompt=[1], output=[1, 1])]
    got = apply_penalties(logits.clone(), rows, PromptTokens())
    want = logits.clone()
    for token in range(VOCAB):
        x = want[0, token].item()
        if token in (1, 2, 40, 7, 9):  # prompt or output: repetition penalty
            x = x / 1.7 if x > 0 else x * 1.7
        count = [2, 7, 7, 7, 9].count(token)  # output only: frequency and presence
        x -= 0.3 * count + 0.5 * (count > 0)
        want[0, token] = x
    torch.testing.assert_close(got, want)


def test_seed_reproducible_and_independent_of_batch():
    logits = random_logits(1, seed=6)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(seed=0)(logits.unsqueeze(0).clone(), [seq(seeded, output=[5, 6])])[0].token_id
    others = [seq(SamplingParams(temperature=1.0), seq_id=i) for i in range(1, 6)]
    batch = torch.cat([random_logits(5, seed=7), logits.unsqueeze(0)])
    in_batch = Sampler(seed=99)(batch, others + [seq(seeded, output=[5, 6], seq_id=9)])[5].token_id
    assert alone == in_batch
    # different steps and different seeds draw differently (over many draws)
    flat = torch.zeros(1, VOCAB)
    by_step = {Sampler()(flat.clone(), [seq(seeded, output=[0] * n)])[0].token_id for n in range(40)}
    by_seed = {Sampler()(flat.clone(), [seq(SamplingParams(temperature=1.0, seed=s))])[0].token_id for s in range(40)}
    assert len(by_step) > 10 and len(by_seed) > 10


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, 1] = 10.0  # eos
    logits[0, 8] = 9.0  # a stop token id
    logits[0, 20] = 5.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8])
    early = Sampler()(logits.clone(), [seq(p, output=[20, 20])], eos_token_ids={1})[0].token_id
    late = Sampler()(logits.clone(), [seq(p, output=[20, 20, 20])], eos_token_ids={1})[0].token_id
    assert early == 20 and late == 1
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler()(logits.clone(), [seq(ignore, output=[])], eos_token_ids={1})[0].token_id == 1


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_raw_model_logprobs(temperature):
    logits = random_logits(2, seed=8)
    p = SamplingParams(temperature=temperature, logprobs=3, repetition_penalty=1.5)
    tokens = Sampler()(logits.clone(), [seq(p, output=[4]), seq(SamplingParams(temperature=0.0))])
    raw = torch.log_softmax(logits[0], -1)
    first = tokens[0]
    assert first.logprob == pytest.approx(raw[first.token_id].item(), abs=1e-6)
    top = raw.topk(3)
    assert list(first.top_logprobs) == top.indices.tolist()
    assert list(first.top_logprobs.values()) == pytest.approx(top.values.tolist(), abs=1e-6)
    assert tokens[1].logprob is None and tokens[1].top_logprobs is None
    zero = Sampler()(logits[:1].clone(), [seq(SamplingParams(temperature=0.0, logprobs=0))])[0]
    assert zero.top_logprobs == {} and zero.logprob == pytest.approx(raw.max().item(), abs=1e-6)


STEERING = {
    "temperature": dict(temperature=0.3),
    "hot": dict(temperature=2.0, top_k=3),
    "logit_bias": dict(temperature=0.0, logit_bias={7: 100.0, 2: -100.0}),
    "allowed_token_ids": dict(temperature=0.8, allowed_token_ids=[1, 9, 11]),
    "bad_words": dict(temperature=0.0, bad_words_token_ids=[[4, 5], [6]]),
    "top_p_min_p": dict(temperature=1.0, top_p=0.3, min_p=0.4),
    "min_tokens": dict(temperature=0.0, min_tokens=5, stop_token_ids=[0, 1]),
    "penalties": dict(temperature=0.5, frequency_penalty=1.5, presence_penalty=-0.5),
}


@pytest.mark.parametrize("options", STEERING.values(), ids=list(STEERING))
def test_logprobs_are_the_models_before_any_steering(options):
    """vLLM's default --logprobs-mode raw_logprobs (vllm/config/model.py): the log-softmax of
    the model's logits before temperature, penalties, logit_bias, allowed/bad tokens, min_tokens
    and top-k/p/min-p; loraplex takes only that mode, so every per-request option must leave them
    as the plain torch reference computes them, for the chosen token and for the top N."""
    logits = random_logits(seed=11)
    raw = torch.log_softmax(logits[0], -1)
    params = SamplingParams(logprobs=5, seed=3, **options)
    token = Sampler()(logits.clone(), [seq(params, output=[4, 4, 6])], eos_token_ids={0})[0]
    assert token.logprob == pytest.approx(raw[token.token_id].item(), abs=1e-6)
    top = raw.topk(5)
    assert list(token.top_logprobs) == top.indices.tolist()
    assert list(token.top_logprobs.values()) == pytest.approx(top.values.tolist(), abs=1e-6)


def test_greedy_sees_penalised_logits():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 9] = 3.0, 2.0
    plain = Sampler()(logits.clone(), [seq(SamplingParams(temperature=0.0), output=[7])])[0].token_id
    penalised = SamplingParams(temperature=0.0, presence_penalty=1.5)
    assert plain == 7
    assert Sampler()(logits.clone(), [seq(penalised, output=[7])])[0].token_id == 9


def test_logit_bias_added_per_row_before_sampling():
    logits = random_logits(3, seed=9)
    biased = SamplingParams(temperature=0.0, logit_bias={3: 5.5, 17: -2.0, 40: 100})
    rows = [seq(SamplingParams(temperature=0.0), seq_id=0), seq(biased, seq_id=1), seq(biased, seq_id=2)]
    got = apply_logit_bias(logits.clone(), rows)
    want = logits.clone()
    for row in (1, 2):
        want[row, 3] += 5.5
        want[row, 17] -= 2.0
        want[row, 40] += 100.0
    torch.testing.assert_close(got, want)
    # the greedy choice of the biased rows is the biased argmax; the plain row is untouched
    tokens = Sampler()(logits.clone(), rows)
    assert [t.token_id for t in tokens] == [logits[0].argmax().item(), 40, 40]


def test_logit_bias_free_when_unused_and_drives_random_rows():
    logits = random_logits(2, seed=10)
    rows = [seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(2)]
    assert apply_logit_bias(logits, rows) is logits  # no row with a bias: nothing built
    # -100 on every token but one: a temperature-1 draw can only pick that one
    banned = {t: -100.0 for t in range(VOCAB) if t != 11}
    draws = Sampler(seed=3)(logits[:1].expand(200, -1).clone(),
                            [seq(SamplingParams(temperature=1.0, logit_bias=banned), seq_id=i) for i in range(200)])
    assert {t.token_id for t in draws} == {11}


def test_logprobs_ignore_logit_bias_like_penalties():
    logits = random_logits(1, seed=11)
    p = SamplingParams(temperature=0.0, logprobs=2, logit_bias={5: 100.0})
    token = Sampler()(logits.clone(), [seq(p)])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert token.token_id == 5
    assert token.logprob == pytest.approx(raw[5].item(), abs=1e-6)  # the model's own logprob
    assert list(token.top_logprobs) == raw.topk(2).indices.tolist()


@pytest.mark.parametrize(
    "bias",
    [{-1: 1.0}, {"3": 1.0}, {True: 1.0}, {3: 100.5}, {3: -101}, {3: "x"}, {3: float("nan")}, {3: None}, [1, 2]],
)
def test_logit_bias_validation(bias):
    from loraplex.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"


def test_logit_bias_normalised():
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={3: 1}).logit_bias == {3: 1.0}


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-40, 1e-45])
@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}, {"top_k": 5, "min_p": 0.1}, {"seed": 7}])
def test_tiny_temperatures_sample_the_best_token(temperature, extra):
    # softmax(logits / T) for T far below the logit gaps is the point mass on the argmax; dividing
    # fp32 logits by such a T overflows to +-inf (inf - inf: NaN probabilities) unless shifted first
    logits = random_logits(16, seed=6) * 5.0
    params = SamplingParams(temperature=temperature, **extra)
    tokens = Sampler(seed=0)(logits.clone(), [seq(params, seq_id=i) for i in range(16)])
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()


def test_row_argmax_is_torch_argmax_on_ties_nan_and_inf():
    """The CPU fast path (numpy) picks what torch.argmax picks: the first maximum, NaN above all."""
    from loraplex.engine.sampler import row_argmax

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        x = torch.randint(0, 4, (9, 33), generator=g).float()  # many ties
        if trial % 3 == 0:
            x[x == 0] = float("-inf")
        if trial % 4 == 0:
            x[torch.rand(x.shape, generator=g) < 0.05] = float("nan")
        x[1] = float("-inf")
        x[2, 5:] = float("nan")
        got, want = row_argmax(x), x.argmax(dim=-1)
        assert got.dtype == want.dtype and torch.equal(got, want)
    bf16 = torch.randn(4, 10, generator=g).bfloat16()  # not a numpy dtype: torch's own
    assert torch.equal(row_argmax(bf16), bf16.argmax(dim=-1))


def _check_survivors(row: torch.Tensor, filtered: torch.Tensor, k: int, p: float) -> int:
    """``filtered`` (one row of apply_top_k_top_p) against the rule computed in float64 from a
    full argsort of ``row``: the best token kept, none past the top k, every token whose mass of
    better tokens is below p kept and every one above it dropped, except within ``fringe`` of p
    (float32 sums over thousands of tokens differ in their last bits, which moves a token whose
    mass before it lies that close to p); survivors keep their own logits. Returns how many."""
    fringe = 1e-4
    vocab = row.shape[0]
    order = row.argsort(descending=True)
    k = k if 0 < k < vocab else vocab
    kept = torch.isfinite(filtered)
    assert kept[order[0]], "the best token dropped"
    assert not kept[order[k:]].any(), "a token past the top k kept"
    assert torch.equal(filtered[kept], row[kept])
    if p < 1.0:
        probs = torch.softmax(row[order[:k]].double(), -1)
        mass_before = probs.cumsum(0) - probs
        keep, dropped = order[:k][mass_before < p - fringe], order[:k][mass_before > p + fringe]
        assert kept[keep].all() and not kept[dropped].any(), (k, p)
    else:
        assert kept[order[:k]].all()
    return int(kept.sum())


def _batch(seed: int, ks: list[int], rng, vocab: int = 3000) -> tuple[torch.Tensor, list[float]]:
    """Logits [len(ks), vocab], flat to peaked rows, and a top_p for each row."""
    ps = [rng.choice([1.0, 0.8, 0.3, 0.05, 0.95, 0.999]) for _ in ks]
    scales = torch.tensor([rng.choice([0.05, 1.0, 3.0]) for _ in ks]).unsqueeze(1)
    return torch.randn(len(ks), vocab, generator=torch.Generator().manual_seed(seed)) * scales, ps


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_over_the_vocabulary_matches_the_rule_and_the_full_sort(seed):
    """What ``_draw_over_vocab`` filters: rows without a top_k or with one above
    PARTIAL_TOP_K_MAX (and, still right, a small one). On the CPU, rows of top_p alone first try
    their best PARTIAL_TOP_K_MAX tokens (flat rows' nuclei reach past them and are sorted in
    full). Every row keeps the rule's survivors at their own logits, as the full sort does."""
    import random

    from loraplex.engine import top_k_top_p as filters

    rng = random.Random(seed)
    nuclei = []  # sizes of the top_p-alone rows' survivors
    for ks in ([rng.choice([0, 0, 20, 2000]) for _ in range(11)] + [0], [0] * 6, [2000, 1500, 0]):
        logits, ps = _batch(seed, ks, rng)  # vocab 3000: above PARTIAL_TOP_K_MAX
        got = filters.apply_top_k_top_p(logits.clone(), ks, ps)
        full_sort = filters.apply_top_k_top_p(logits.clone(), ks, ps, partial_max=0)  # every row sorted in full
        for row, (k, p) in enumerate(zip(ks, ps)):
            survivors = _check_survivors(logits[row], got[row], k, p)
            _check_survivors(logits[row], full_sort[row], k, p)
            if k == 0 and p < 1.0:
                nuclei.append(survivors)
            elif k > 0:  # sorted in full either way
                assert torch.equal(got[row], full_sort[row])
    # both kinds of top_p-alone rows occurred: within the first tokens, and reaching past them
    assert min(nuclei) <= filters.PARTIAL_TOP_K_MAX < max(nuclei), nuclei


@pytest.mark.parametrize("seed", range(5))
def test_small_top_k_candidates_match_the_full_sort(seed):
    """What ``_draw_among_best`` filters: ``keep_candidates`` over the ``topk`` of the batch's
    largest top_k keeps the rule's survivors, bit for bit those of the full sort (the same
    prefix sums over the same candidates; columns past a row's own top_k add exact zeros)."""
    import random

    from loraplex.engine import top_k_top_p as filters

    rng = random.Random(seed)
    for ks in ([rng.choice([1, 5, 20, 64]) for _ in range(9)], [filters.PARTIAL_TOP_K_MAX, 3], [7] * 4):
        logits, ps = _batch(seed, ks, rng)
        best, order = logits.topk(max(ks), dim=-1)
        kept = filters.keep_candidates(best, ks, ps)[0]
        got = torch.full_like(logits, float("-inf")).scatter_(1, order, kept)
        assert torch.equal(got, filters.apply_top_k_top_p(logits.clone(), ks, ps))
        for row, (k, p) in enumerate(zip(ks, ps)):
            _check_survivors(logits[row], got[row], k, p)


def test_a_rows_survivors_do_not_depend_on_its_batch():
    """The same row beside companions of other top_k (so ordered by topk of another width, or by
    a full sort) keeps exactly the same tokens, p at many boundaries included."""
    from loraplex.engine.top_k_top_p import apply_top_k_top_p

    logits = torch.randn(1, 3000, generator=torch.Generator().manual_seed(11)) * 2
    companion = torch.randn(1, 3000, generator=torch.Generator().manual_seed(12))
    for k in (20, 300):
        for p in [i / 40 for i in range(1, 40)]:
            alone = apply_top_k_top_p(logits.clone(), [k], [p])
            for other in (k + 1, 1000, 0):
                pair = apply_top_k_top_p(torch.cat([logits, companion]), [k, other], [p, 0.9])
                assert torch.equal(pair[0], alone[0]), (k, p, other)


@pytest.mark.parametrize("options", [dict(top_k=10), dict(top_k=10, min_p=0.35), dict(top_k=12, top_p=0.7)],
                         ids=["top_k", "top_k+min_p", "top_k+top_p"])
def test_draw_among_the_best_follows_the_filtered_distribution(options):
    """Rows with a small top_k draw among their top_k best tokens only (``_draw_among_best``):
    the frequencies over many identical rows match the renormalised distribution that the rules
    leave, computed here over the whole vocabulary in float64."""
    logits = random_logits(seed=8)[0] * 0.6
    params = SamplingParams(temperature=0.9, **options)
    probs = torch.softmax(logits.double() / 0.9, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[order[: params.top_k]] = True
    if params.min_p:
        keep &= probs >= params.min_p * probs.max()
    if params.top_p < 1.0:
        kept = probs * keep
        kept = kept / kept.sum()
        mass_before = kept[order].cumsum(0) - kept[order]
        keep[order[mass_before >= params.top_p]] = False
    expected = probs * keep
    expected /= expected.sum()
    draws = 30000
    tokens = Sampler(seed=3)(logits.expand(draws, -1).clone(), [seq(params, seq_id=i) for i in range(draws)])
    counts = torch.bincount(torch.tensor([t.token_id for t in tokens]), minlength=VOCAB).double() / draws
    assert set(torch.nonzero(counts).flatten().tolist()) == set(torch.nonzero(expected).flatten().tolist())
    assert (counts - expected).abs().max().item() < 0.012


def test_seeded_rows_with_a_small_top_k_do_not_depend_on_the_batch():
    """A seeded row with a top_k draws the same token alone and beside rows that move the batch
    onto other paths: a larger top_k (other candidate width), none (the whole vocabulary), a
    greedy row; unseeded companions draw from the shared generator meanwhile."""
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=77)
    companions = [SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=0.7),
                  SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5, seed=5)]
    changed = 0
    for step in range(12):
        logits = random_logits(1, seed=100 + step) * 0.5
        alone = Sampler(seed=0)(logits.clone(), [seq(params, output=[1] * step)])[0].token_id
        for n in range(1, len(companions) + 1):
            batch = torch.cat([random_logits(n, seed=200 + step) * 0.5, logits])
            rows = [seq(p, seq_id=i + 1) for i, p in enumerate(companions[:n])] + [seq(params, output=[1] * step)]
            assert Sampler(seed=n)(batch, rows)[n].token_id == alone, (step, n)
        changed += alone != int(logits.argmax())
    assert changed > 0  # not the argmax every time: the noise decided


def test_rows_of_both_draws_in_one_batch_keep_their_own_tokens():
    """A batch mixing rows with a small top_k and rows without one (drawn apart, then put back
    in their rows): at tiny temperatures every row must still get its own argmax."""
    logits = random_logits(12, seed=9) * 5.0
    params = [SamplingParams(temperature=1e-30, top_k=[3, 0, 50, 0][i % 4], seed=[None, 4][i % 2]) for i in range(12)]
    tokens = Sampler(seed=0)(logits.clone(), [seq(p, seq_id=i) for i, p in enumerate(params)])
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()
