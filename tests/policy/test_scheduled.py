"""The confidence scheduler: decisions (load, context, acceptance, Algorithm 1) and losslessness
through the decoding loop (greedy == ar in fp32, seeded sampling independent of K and batch,
distribution with per-draft confidences), plus chunked prefill and abort in the step API."""

import collections

import pytest
import torch
from fakes import ShiftedDrafter
from scipy.stats import chi2_contingency

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.policy import FixedK, PolicyState, ScheduledK, StepCostModel
from specdecode.policy.profile import batch_step_costs


class GreedySelfDrafter(DraftModelDrafter):
    """Drafts a model's greedy tokens as point masses (q = one-hot), at any temperature."""

    def propose(self, batch, num_draft):
        greedy = [type(r)(r.slot, r.token_ids, SamplingParams(), r.generator) for r in batch]
        prop = super().propose(greedy, num_draft)
        prop.draft_probs = None
        return prop


class ConfidentDrafter(DraftModelDrafter):
    """A draft model that reports c_k = max q_k: known before x_k is drawn (depends on x_<k)."""

    provides_confidences = True

    def propose(self, batch, num_draft):
        prop = super().propose(batch, num_draft)
        if prop.draft_probs is not None:
            prop.extras["confidences"] = prop.draft_probs.max(dim=-1).values  # [B, K]
        return prop


def _prompts(tok):
    texts = ["the cat sat on the mat and the cat", "hello world, hello", "a b c d e f g a b c"]
    return [tok(t)["input_ids"] for t in texts]


def _run(target, drafter, policy, prompts, max_new=24, params=None, max_batch=8, seed=0, mode="rejection"):
    dec = SpeculativeDecoder(target, drafter, policy, max_batch=max_batch, verify_mode=mode)
    reqs = [
        GenerationRequest(p, params or SamplingParams(), max_new, seed=seed + i, id=str(i), ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    return dec.generate(reqs)


def _states(n, context=100, rate=None, k=4):
    states = []
    for _ in range(n):
        st = PolicyState(context_len=context)
        if rate is not None:
            st.pos_reached, st.pos_accepted = [50.0] * k, [50.0 * rate] * k
        states.append(st)
    return states


# ---- decisions -------------------------------------------------------------------------------
def test_flat_costs_and_good_acceptance_draft_everything():
    sch = ScheduledK(4, StepCostModel.flat())
    assert sch.choose(_states(3, rate=0.9)) == [4, 4, 4]


def test_compute_bound_costs_turn_speculation_off():
    # Verifying k+1 tokens costs k+1 steps: not even perfect acceptance pays; no probing either.
    sch = ScheduledK(4, StepCostModel.linear(0.01))
    states = _states(2, rate=1.0)
    assert all(sch.choose(states) == [0, 0] for _ in range(100))


def test_load_turns_speculation_down():
    # A fixed cost per step (weights read once) plus a cost per token: cheap to verify at low
    # load, expensive when the batch already fills the machine.
    cost = StepCostModel.flat(step=1.0, per_token=0.1)
    sch = ScheduledK(4, cost)
    assert sum(sch.choose(_states(1, rate=0.8))) > 0
    assert sch.choose(_states(64, rate=0.8)) == [0] * 64


def test_long_context_turns_speculation_down():
    # Attention over the context costs per verified token: at 8k tokens it dominates.
    rows, blocks, ctxs = [1, 8], [1, 5], [0, 8192]
    times = [[[1.0 + 0.01 * r * b + c * 0.001 * r * b for b in blocks] for r in rows] for c in ctxs]
    sch = ScheduledK(4, StepCostModel(rows, blocks, ctxs, times))
    assert sum(sch.choose(_states(2, context=100, rate=0.7))) > 0
    assert sch.choose(_states(2, context=8000, rate=0.7)) == [0, 0]


def test_low_acceptance_stops_drafting_then_probes():
    sch = ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.05), probe_every=4)
    st = PolicyState(context_len=50)
    assert sch.choose([st])[0] > 0  # optimistic enough to try
    for _ in range(40):
        sch.observe(st, 4, 0)
    ks = [sch.choose([st])[0] for _ in range(32)]
    assert ks.count(0) >= 28 and 1 in ks  # mostly off, but it keeps probing (backing off)


def test_drafts_asked_for_but_not_proposed_count_as_rejections():
    # An n-gram drafter without a match proposes nothing, yet the padded column is paid for.
    sch = ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.05))
    st = PolicyState(context_len=50)
    assert sch.choose([st])[0] > 0
    for _ in range(40):
        sch.choose([st])
        sch.observe(st, 0, 0)
    assert [sch.choose([st])[0] for _ in range(4)].count(0) >= 3


def test_room_caps_drafts():
    sch = ScheduledK(4, StepCostModel.flat())
    states = _states(2, rate=0.9)
    states[0].room = 1
    assert sch.choose(states) == [1, 4]


def test_algorithm1_on_confidences_stops_at_first_non_increase():
    # SPS(B) for one request: block 1 -> 1 s, 2 -> 1.5 s, 3 -> 1.6 s. Confidences 0.9, 0.5, 0.9:
    # survival 0.9, 0.45, 0.405. Theta: 1.0 -> 1.9/1.5 = 1.267 -> 2.35/1.6 = 1.469 -> stop at
    # block 4 (2.755 / 3.0). The last candidate would not raise Theta.
    cost = StepCostModel([1], [1, 2, 3, 4], [0], [[[1.0, 1.5, 1.6, 3.0]]])
    sch = ScheduledK(3, cost)
    conf = torch.tensor([[0.9, 0.5, 0.9]])
    assert sch.truncate(_states(1), conf, [3]) == [2]
    # Across requests, by survival: once a block length is paid for (rows are padded to it), the
    # other rows' candidates at that position cost nothing and are admitted; a deeper block is
    # not worth it for survival 0.05.
    cost = StepCostModel.flat(step=1.0, per_token=0.1, max_rows=2)  # 1.2, 1.4, 1.6 s at 2 rows
    sch = ScheduledK(2, cost)
    conf = torch.tensor([[0.99, 0.05], [0.2, 0.1]])
    assert sch.truncate(_states(2), conf, [2, 2]) == [1, 1]
    conf = torch.tensor([[0.99, 0.99], [0.2, 0.1]])
    assert sch.truncate(_states(2), conf, [2, 2]) == [2, 2]


def test_production_variant_uses_the_budget_of_two_steps_earlier():
    sch = ScheduledK(3, StepCostModel.flat(step=1.0, per_token=0.01), variant="production")
    high, low = torch.full((2, 3), 0.95), torch.full((2, 3), 0.01)
    states = _states(2)
    sch.truncate(states, high, [3, 3])  # budget from these: 6 draft tokens
    sch.truncate(states, low, [3, 3])  # budget from these: 0
    assert sum(sch.truncate(states, low, [3, 3])) == 6  # uses the high budget (two steps back)
    assert sum(sch.truncate(states, high, [3, 3])) == 0  # uses the low budget


def test_confidence_drafter_runs_only_when_a_round_is_expected_to_pay():
    # A drafting round costs one target step; verifying is nearly free. Confident rounds pay,
    # so everyone may draft; once the reported survival is low, nobody drafts (the drafter does
    # not run) except probe rounds, which back off.
    sch = ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.01), draft_cost=0.25)
    states = _states(2)
    assert sch.bounds(states) == [4, 4]  # nothing known yet: optimistic
    sch.truncate(states, torch.full((2, 4), 0.95), [4, 4])
    assert sch.bounds(states) == [4, 4]
    for _ in range(30):
        sch.truncate(states, torch.full((2, 4), 0.2), [4, 4])
    drafted = [sum(sch.bounds(states)) > 0 for _ in range(100)]
    assert 1 <= drafted.count(True) <= 6  # probes at 8, 16, 32, 64 idle steps
    assert not any(drafted[:7])
    # New requests start from the batch-wide survival, not from optimism.
    assert sch.bounds(_states(2)) == [0, 0]
    # A probe that finds confident drafts brings drafting back.
    for _ in range(40):
        sch.truncate(states, torch.full((2, 4), 0.95), [4, 4])
    assert sch.bounds(states) == [4, 4]


def test_truncation_ignores_the_sunk_drafting_cost():
    # The drafts exist already: a costly drafter does not make admitting them look worse.
    sch = ScheduledK(2, StepCostModel.flat(step=1.0, per_token=0.05), draft_cost=5.0)
    assert sch.truncate(_states(1), torch.tensor([[0.9, 0.9]]), [2]) == [2]


def test_online_costs_follow_the_measured_steps():
    # The profile says verifying is nearly free; the machine says a block of 5 costs 5 steps and
    # a drafting round 1 step: the statistics-based schedule turns drafting off.
    sch = ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.01), online=True)
    states = _states(1, rate=0.9)
    assert sch.choose(states) == [4]
    for _ in range(50):
        sch.observe_step(1, 5, 100, 4, draft_s=1.0, verify_s=5.0)
        sch.observe_step(1, 1, 100, 0, draft_s=0.0, verify_s=1.0)
    assert sch.verify_scale[5] == pytest.approx(5.0 / 1.05, rel=0.05)
    assert sch.round_steps[4] == pytest.approx(1.0, rel=0.1)
    assert sch.choose(states) == [0]
    # Plain steps only from now on: the unrefreshed corrections drift back to the profile, so
    # one bad stretch cannot switch speculation off for good.
    for _ in range(600):
        sch.observe_step(1, 1, 100, 0, draft_s=0.0, verify_s=1.0)
    assert sch.choose(states)[0] > 0
    # One slow step moves a correction by a tenth only.
    fresh = ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.01), online=True)
    fresh.observe_step(1, 5, 100, 4, draft_s=0.0, verify_s=100.0)
    assert fresh.verify_scale[5] < 2.0
    # Without `online` the measurements are ignored.
    off = ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.01))
    off.observe_step(1, 5, 100, 4, draft_s=1.0, verify_s=5.0)
    assert off.verify_scale[5] is None and off.choose(states) == [4]


def test_loop_skips_the_confidence_drafter_when_it_cannot_pay(tiny, tiny_drafter):
    """Greedy, a drafter reporting confidence 0.01 whose round costs a target step: after the
    first rounds it runs only as a probe, and the output still equals ar."""

    class Unconfident(DraftModelDrafter):
        provides_confidences = True
        calls = 0

        def propose(self, batch, num_draft):
            Unconfident.calls += 1
            prop = super().propose(batch, num_draft)
            prop.extras["confidences"] = torch.full(prop.draft_ids.shape, 0.01)
            return prop

    prompts = _prompts(tiny.tokenizer)[:1]
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    base = _run(tiny, ARDrafter(), FixedK(0), prompts, max_new=60)
    sch = ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.01), draft_cost=0.25)
    spec = _run(tiny, Unconfident(tiny_drafter.model, v, rows), sch, prompts, max_new=60)
    assert spec[0].token_ids == base[0].token_ids
    assert 1 <= Unconfident.calls <= 6  # 60 steps: the first round, then probes at 8, 16, 32


def test_measured_profile_is_cached(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    cost = StepCostModel.measured(tiny, max_rows=4, max_block=3, max_context=64)
    assert cost.rows == [1, 2, 4] and cost.blocks == [1, 2, 3]
    assert all(t > 0 for grid in cost.times for line in grid for t in line)
    assert cost.sps(3, 2, 40) > 0
    files = list((tmp_path / "profiles").glob("batch-*.json"))
    assert len(files) == 1
    times = batch_step_costs(tiny.model, tiny.fingerprint, cost.rows, cost.blocks, cost.contexts)
    assert times == cost.times  # read back, not re-measured


# ---- losslessness through the loop -------------------------------------------------------------
def _drafters(tiny, tiny_drafter):
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    return {
        "ngram": lambda: NgramDrafter(),
        "draft-other": lambda: DraftModelDrafter(tiny_drafter.model, v, rows),
        "always-agrees": lambda: DraftModelDrafter(tiny.model, v, rows),
        "never-agrees": lambda: ShiftedDrafter(tiny.model, v, rows),
        "confident-other": lambda: ConfidentDrafter(tiny_drafter.model, v, rows),
        "confident-self": lambda: ConfidentDrafter(tiny.model, v, rows),
    }


@pytest.mark.parametrize("variant", ["exact", "production"])
def test_greedy_scheduled_equals_greedy_ar(tiny, tiny_drafter, variant):
    prompts = _prompts(tiny.tokenizer)
    base = _run(tiny, ARDrafter(), FixedK(0), prompts)
    for name, make in _drafters(tiny, tiny_drafter).items():
        sch = ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.01), variant=variant)
        spec = _run(tiny, make(), sch, prompts, max_batch=2)
        assert [s.token_ids for s in spec] == [b.token_ids for b in base], name
        if name in ("always-agrees", "confident-self"):
            assert all(s.tau > 2 for s in spec), name  # the scheduler really drafted


def test_seeded_sampling_is_independent_of_k_policy_and_batch(tiny):
    """Point-mass drafts: the output is the target's own sample for the seed, whatever K."""
    prompts = _prompts(tiny.tokenizer)
    params = SamplingParams(temperature=1.0, top_k=3)
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    base = _run(tiny, ARDrafter(), FixedK(0), prompts, params=params)
    runs = [
        _run(tiny, GreedySelfDrafter(tiny.model, v, rows), FixedK(3), prompts, params=params),
        _run(
            tiny,
            GreedySelfDrafter(tiny.model, v, rows),
            ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.01)),
            prompts,
            params=params,
            max_batch=3,
        ),
        _run(
            tiny,
            GreedySelfDrafter(tiny.model, v, rows),
            ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.01)),
            prompts[1:2],
            params=params,
            seed=1,
        ),
        _run(tiny, NgramDrafter(), ScheduledK(4, StepCostModel.flat()), prompts, params=params),
    ]
    taus = [r.tau for r in runs[0] + runs[1]]
    # Drafts were accepted at T = 1 (how many depends on each seed's samples, so on average).
    assert sum(taus) / len(taus) > 1.2 and min(taus) > 1.0, taus
    for run in runs[:2] + runs[3:]:
        assert [r.token_ids for r in run] == [b.token_ids for b in base]
    assert runs[2][0].token_ids == base[1].token_ids


def test_match_mode_with_a_stochastic_drafter_is_independent_of_k(tiny, tiny_drafter):
    prompts = _prompts(tiny.tokenizer)
    params = SamplingParams(temperature=1.0, top_k=20)
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    base = _run(tiny, ARDrafter(), FixedK(0), prompts, params=params)
    sch = ScheduledK(4, StepCostModel.flat())
    spec = _run(
        tiny, ConfidentDrafter(tiny_drafter.model, v, rows), sch, prompts, params=params, mode="match"
    )
    assert [s.token_ids for s in spec] == [b.token_ids for b in base]


def test_confidence_truncation_keeps_the_target_distribution(tiny, tiny_drafter):
    """T = 1, stochastic drafts truncated by their confidences: the joint law of the first two
    tokens matches plain sampling (chi-square)."""
    prompt = _prompts(tiny.tokenizer)[0]
    params = SamplingParams(temperature=1.0, top_k=6)
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    n = 1200

    def draw(drafter, policy, base_seed):
        dec = SpeculativeDecoder(tiny, drafter, policy, max_batch=64)
        reqs = [
            GenerationRequest(prompt, params, 2, seed=base_seed + i, id=str(i), ignore_eos=True)
            for i in range(n)
        ]
        return collections.Counter(tuple(r.token_ids) for r in dec.generate(reqs))

    ar = draw(ARDrafter(), FixedK(0), 0)
    cost = StepCostModel([1, 64], [1, 2, 3], [0], [[[1.0, 1.3, 1.35], [1.0, 1.3, 1.35]]])
    sd = draw(ConfidentDrafter(tiny_drafter.model, v, rows), ScheduledK(2, cost), 10**6)
    keys = [k for k in set(ar) | set(sd) if ar[k] + sd[k] >= 10]
    assert len(keys) >= 4
    assert chi2_contingency([[ar[k] for k in keys], [sd[k] for k in keys]]).pvalue > 1e-3


# ---- step API: chunked prefill and abort ----------------------------------------------------------
def test_chunked_prefill_interleaves_with_decoding(tiny):
    tok = tiny.tokenizer
    short = tok("hello world, hello")["input_ids"]
    long = tok("the quick brown fox jumps over the lazy dog. " * 12)["input_ids"]
    assert len(long) > 60
    ref = _run(tiny, NgramDrafter(), FixedK(3), [short], max_new=40) + _run(
        tiny, NgramDrafter(), FixedK(3), [long], max_new=12
    )
    dec = SpeculativeDecoder(
        tiny, NgramDrafter(), FixedK(3), max_batch=4, prefill_chunk=16, prefill_budget=16
    )
    dec.reserve(4, 256)
    dec.add_request(GenerationRequest(short, max_new_tokens=40, id="short", ignore_eos=True))
    first = dec.step()  # the short prompt is prefilled whole (nothing else runs yet)
    assert [e.request_id for e in first] == ["short"]
    dec.add_request(GenerationRequest(long, max_new_tokens=12, id="long", ignore_eos=True))
    results, steps_while_prefilling = {}, 0
    while dec.has_unfinished():
        prefilling = dec.num_active > len(dec._running)
        short_running = "short" not in results
        events = dec.step()
        if short_running:
            assert dec.last_step.prefill_tokens <= 16  # the budget holds while others decode
        if prefilling and any(e.request_id == "short" for e in events):
            steps_while_prefilling += 1
        results.update({e.request_id: e.result for e in events if e.result})
    assert steps_while_prefilling >= 3  # the short request kept streaming during the long prefill
    assert results["short"].token_ids == ref[0].token_ids
    assert results["long"].token_ids == ref[1].token_ids


def test_abort_frees_the_slot(tiny):
    dec = SpeculativeDecoder(tiny, NgramDrafter(), FixedK(2), max_batch=2)
    dec.reserve(2, 128)
    p = _prompts(tiny.tokenizer)
    for i in range(3):
        dec.add_request(GenerationRequest(p[i], max_new_tokens=30, id=str(i), ignore_eos=True))
    dec.step()
    assert dec.num_active == 2 and dec.num_waiting == 1 and dec.num_free_slots == 0
    assert dec.abort("0") and not dec.abort("0")
    assert dec.num_free_slots == 1
    dec.step()  # request 2 takes the slot
    assert dec.num_active == 2 and dec.num_waiting == 0
    assert dec.abort("2") and dec.abort("1")
    assert dec.num_free_slots == 2 and not dec.has_unfinished()
    with pytest.raises(Exception, match="served context"):
        dec.add_request(GenerationRequest(p[0], max_new_tokens=200))
