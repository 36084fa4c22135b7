import pytest

from specdecode.errors import SpecDecodeError
from specdecode.policy import AdaptiveK, FixedK, PolicyState, expected_tau, make_policy


def test_expected_tau_limits():
    assert expected_tau(0.0, 5) == pytest.approx(1.0)
    assert expected_tau(1.0, 5) == 6.0
    assert expected_tau(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_fixed_k():
    assert FixedK(3).choose([PolicyState(), PolicyState()]) == [3, 3]
    with pytest.raises(SpecDecodeError, match="num-draft-tokens"):
        FixedK(-1)


def test_adaptive_lowers_k_when_acceptance_is_poor_and_probes():
    pol = AdaptiveK(k_max=6, draft_cost=0.2)
    st = PolicyState()
    for _ in range(30):
        pol.observe(st, num_draft=6, num_accepted=0)
    ks = [pol.choose([st])[0] for _ in range(16)]
    assert ks.count(0) >= 14  # mostly plain decoding
    assert 1 in ks  # but it keeps probing


def test_adaptive_keeps_k_high_when_drafts_are_accepted():
    pol = AdaptiveK(k_max=6, draft_cost=0.0)
    st = PolicyState()
    for _ in range(30):
        pol.observe(st, num_draft=6, num_accepted=6)
    assert pol.choose([st]) == [6]


def test_make_policy_rejects_unknown():
    with pytest.raises(SpecDecodeError, match="fixed, adaptive"):
        make_policy("sometimes", 3)


def test_adaptive_never_drafts_when_even_perfect_acceptance_cannot_pay():
    # An AVX2-like cost curve: verifying k+1 tokens costs ~k+1 steps, and drafting is not free.
    pol = AdaptiveK(k_max=4, draft_cost=0.35, verify_cost=[1.0, 1.7, 2.33, 2.9, 3.4])
    assert not pol.enabled
    st = PolicyState()
    for _ in range(20):
        pol.observe(st, num_draft=4, num_accepted=4)
    assert all(pol.choose([st]) == [0] for _ in range(100))
    # The same drafter with nearly free verification (AMX / GPU) drafts.
    assert AdaptiveK(k_max=4, draft_cost=0.35, verify_cost=[1.0, 1.05, 1.1, 1.15, 1.2]).enabled


def test_a_fixed_round_cost_raises_the_acceptance_drafting_needs():
    # verify is nearly free; a drafting round costs 0.3 step whatever K: at alpha 0.2 drafting
    # pays without the fixed cost and does not with it
    flat = [1.0, 1.02, 1.04, 1.06, 1.08]
    assert AdaptiveK(k_max=4, draft_cost=0.02, verify_cost=flat).best_k(0.2) > 0
    pol = AdaptiveK(k_max=4, draft_cost=0.02, verify_cost=flat, draft_fixed=0.3)
    assert pol.best_k(0.2) == 0 and pol.round_cost(2) == 1.04 + 0.3 + 0.04
    assert pol.best_k(0.9) == 4  # a predictable text still drafts the most


def test_a_measured_round_curve_replaces_the_line():
    """A tree's round grows one level per K up to its depth, then stays flat: the line through
    K = 1 and K = 16 puts a 4-node round at a third of its cost. With the measured curve the
    policy prices K = 4 at what it costs, and at middling acceptance drafts less than the line
    would have it."""
    flat = [1.0 + 0.02 * k for k in range(17)]
    curve = [0.05 + 0.1 * (min(k, 5) - 1) for k in range(1, 17)]  # 0.05 ... 0.45, flat from K = 5
    line = AdaptiveK(k_max=16, draft_cost=(0.45 - 0.05) / 15, draft_fixed=0.05 - 0.4 / 15, verify_cost=flat)
    bent = AdaptiveK(k_max=16, draft_cost=0.0, verify_cost=flat, draft_curve=curve)
    assert bent.round_cost(4) == pytest.approx(1.08 + 0.35) and line.round_cost(4) < 1.08 + 0.2
    assert bent.round_cost(0) == 1.0 and bent.round_cost(16) == pytest.approx(1.32 + 0.45)
    assert (line.best_k(0.3), bent.best_k(0.3)) == (2, 1) and (line.best_k(0.5), bent.best_k(0.5)) == (3, 2)
    with pytest.raises(ValueError, match="draft_curve needs 16"):
        AdaptiveK(k_max=16, verify_cost=flat, draft_curve=curve[:8])


def test_a_sampled_request_pays_its_extra_and_a_greedy_one_does_not():
    """At T > 0 a round costs `sampled_extra[K]` more (q and rejection sampling): at middling
    acceptance a greedy request drafts and a sampled one with the same acceptance does not."""
    flat = [1.0, 1.05, 1.1, 1.15, 1.2]
    pol = AdaptiveK(k_max=4, draft_cost=0.05, verify_cost=flat, sampled_extra=[0.0, 0.25, 0.3, 0.35, 0.4])
    assert pol.round_cost(2, sampled=True) == pytest.approx(pol.round_cost(2) + 0.3)
    assert pol.round_cost(0, sampled=True) == pol.round_cost(0) == 1.0
    assert pol.best_k(0.35) > 0 and pol.best_k(0.35, sampled=True) == 0
    assert pol.best_k(0.9, sampled=True) == 4
    states = [PolicyState(accepted=0.35, tried=1.0), PolicyState(accepted=0.35, tried=1.0, sampled=True)]
    ks = pol.choose(states)
    assert ks[0] > 0 and ks[1] == 0
    with pytest.raises(ValueError, match="sampled_extra needs 5"):
        AdaptiveK(k_max=4, verify_cost=flat, sampled_extra=[0.0, 0.1])


def test_a_sampled_request_remembers_longer_than_a_greedy_one():
    """The same history (40 rounds at alpha 1/3, then 5 rounds without an accepted draft): a
    greedy request's estimate (decay 0.9) falls under what drafting needs, a sampled one's (0.95:
    a sampled round's acceptance is a few random draws) stays above it and keeps drafting."""
    pol = AdaptiveK(k_max=4, draft_fixed=0.15, verify_cost=[1.0, 1.05, 1.08, 1.1, 1.12])
    states = [PolicyState(), PolicyState(sampled=True)]
    for st in states:
        for i in range(40):
            pol.observe(st, num_draft=4, num_accepted=1 if i % 2 == 0 else 0)
        for _ in range(5):
            pol.observe(st, num_draft=4, num_accepted=0)
    greedy, sampled = pol.choose(states)
    assert greedy == 0 and sampled >= 2
    assert states[0].accepted / states[0].tried < states[1].accepted / states[1].tried < 1 / 3


def test_a_sampled_request_is_bounded_by_what_the_drafter_drafts_when_sampling():
    """An EAGLE-2 tree drafts a chain of at most its depth at T > 0: the policy gives such a
    request no K past `sampled_k_max` (E[tau] of more drafts would be a promise the round cannot
    keep), and a greedy request still gets up to k_max."""
    flat = [1.0] * 17
    pol = make_policy("adaptive", 16, draft_cost=0.01, verify_cost=flat, sampled_k_max=5)
    assert pol.best_k(0.95) == 16 and pol.best_k(0.95, sampled=True) == 5
    states = [PolicyState(accepted=9.5, tried=10.0), PolicyState(accepted=9.5, tried=10.0, sampled=True)]
    assert pol.choose(states) == [16, 5]
    assert AdaptiveK(k_max=3, verify_cost=flat, sampled_k_max=5).best_k(0.95, sampled=True) == 3
    with pytest.raises(ValueError, match="sampled_k_max"):
        AdaptiveK(k_max=4, verify_cost=flat, sampled_k_max=0)


def test_a_round_must_promise_the_margin_over_plain_decoding():
    """Free verification and drafting: one draft at acceptance alpha promises 1 + alpha. Below
    1 + MARGIN the policy decodes plainly (the model leaves out catch-up and probes), above it
    drafts."""
    pol = AdaptiveK(k_max=1, draft_cost=0.0, verify_cost=[1.0, 1.0])
    assert pol.best_k(AdaptiveK.MARGIN * 0.6) == 0 and pol.best_k(AdaptiveK.MARGIN * 1.5) == 1


def test_verify_cost_is_read_at_the_requests_context():
    """Curves measured at 256 / 1,024 / 2,048 committed tokens (seconds; AMX-like: 8 tokens cost
    1.3 steps over 256 tokens, 1.65 over 1,024): a long-context request prices K at its own
    context, so at the same acceptance it drafts less or not at all, and a short one as before."""
    short = [10.0, 10.7, 11.2, 11.5, 11.8, 12.4, 12.7, 13.0]  # t(1..8), ms
    mid = [14.0, 16.4, 17.1, 18.0, 19.2, 21.8, 22.1, 23.1]
    longer = [18.0, 22.1, 23.0, 24.5, 26.6, 31.2, 31.5, 33.2]
    curves = {256: short, 1024: mid, 2048: longer}
    base = [t / short[0] for t in short]
    pol = AdaptiveK(k_max=7, draft_cost=0.01, draft_fixed=0.1, verify_cost=base, verify_curves=curves)
    plain = AdaptiveK(k_max=7, draft_cost=0.01, draft_fixed=0.1, verify_cost=base)
    assert pol.verify_at(300) == pytest.approx(base)  # within the first bucket: the 256 curve
    assert pol.verify_at(0) == pytest.approx(base)  # never cheaper than the shortest measured
    assert pol.verify_at(1024)[7] == pytest.approx(23.1 / 14.0)
    mid_ratio = pol.verify_at(640)[7]  # halfway between 256 and 1,024: each t(n) interpolated
    assert mid_ratio == pytest.approx((13.0 + 23.1) / 2 / ((10.0 + 14.0) / 2))
    assert pol.verify_at(4096)[7] == pytest.approx((33.2 + 2 * (33.2 - 23.1)) / (18.0 + 2 * 4.0))
    assert pol.best_k(0.4, 256) == plain.best_k(0.4) > pol.best_k(0.4, 2048)
    assert pol.best_k(0.3, 2048) == 0 < pol.best_k(0.3, 256)
    st = PolicyState(context_len=2048)
    for i in range(12):  # one draft in three rounds accepted: alpha ~0.27
        pol.observe(st, num_draft=3, num_accepted=int(i % 3 == 2))
    near = PolicyState(**{**st.__dict__, "context_len": 256})
    assert pol.choose([st]) == [0] and pol.choose([near]) != [0]
    with pytest.raises(ValueError, match="verify_curves need 8"):
        AdaptiveK(k_max=7, verify_cost=base, verify_curves={256: short[:4]})


def test_a_noisy_longer_context_never_extrapolates_to_a_cheaper_step():
    """t(1) measured a little lower at 2,048 than at 1,024 (noise) must not extrapolate to a
    falling one-token step (ratios blowing up far past the longest context): each t(n) is held
    non-decreasing over the contexts."""
    curves = {256: [10.0, 11.0, 12.0], 1024: [14.0, 16.0, 17.0], 2048: [13.5, 17.0, 18.0]}
    pol = AdaptiveK(k_max=2, verify_cost=[1.0, 1.1, 1.2], verify_curves=curves)
    assert pol.verify_curves[2048] == [14.0, 17.0, 18.0]
    far = pol.verify_at(8192)  # t(1) held at 14 ms, t(3) growing 1 ms per 1,024 tokens
    assert far[2] == pytest.approx((18.0 + 6) / 14.0) and 1.0 <= far[1] <= far[2]
