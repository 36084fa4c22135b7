import dataclasses
import json

import pytest

from specdecode import measured
from specdecode.models.loader import load_model
from specdecode.policy.profile import (
    SAMPLED_REPEATS,
    contexts_for,
    draft_round_costs,
    measure_step_cost_curves,
    measure_step_costs,
    monotone_envelope,
    step_cost_curves,
    step_costs,
)


def test_step_costs_are_measured_once_and_cached(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    m = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    ctxs = contexts_for(m.model, 4)
    curves = step_cost_curves(m.model, m.fingerprint, 4)
    assert list(curves) == ctxs and all(len(c) == 4 and min(c) > 0 for c in curves.values())
    assert step_costs(m.model, m.fingerprint, 4) == curves[ctxs[0]]
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1
    # A cached profile measured quietly is reused as is: plant known numbers and read them back.
    five = [1.0, 2.0, 3.0, 4.0, 5.0]
    planted = {"contexts": {str(c): five for c in ctxs}, "cpu_share": 0.95, "order": "interleaved"}
    files[0].write_text(json.dumps(planted))
    assert step_costs(m.model, m.fingerprint, 3) == [1.0, 2.0, 3.0]
    # A bump is read through the envelope: 3 tokens never cost more than 4 or 5.
    bumped = {str(c): [1.0, 2.0, 4.5, 3.0, 5.0] for c in ctxs}
    files[0].write_text(json.dumps({**planted, "contexts": bumped}))
    assert step_costs(m.model, m.fingerprint, 4) == [1.0, 2.0, 3.0, 3.0]
    # One timed size after size (written before the interleaved order) is measured again.
    files[0].write_text(json.dumps({"costs": five, "cpu_share": 0.95}))
    assert step_costs(m.model, m.fingerprint, 3) != [1.0, 2.0, 3.0]
    # Asking for more tokens than cached measures again.
    assert len(step_costs(m.model, m.fingerprint, 6)) == 6


def test_profiles_are_timed_at_the_contexts_the_window_holds(tiny_llama_dir):
    """256, 1,024 and 2,048 committed tokens where the model's positions reach; the largest that
    fits for a model with a short window."""

    class Info:
        max_position = 4096

    class Model:
        info = Info()

    assert contexts_for(Model(), 9) == [256, 1024, 2048]
    Info.max_position = 1100
    assert contexts_for(Model(), 9) == [256, 1024]
    Info.max_position = 100
    assert contexts_for(Model(), 9) == [90]
    m = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    curves = measure_step_cost_curves(m.model, 3, repeats=1, contexts=(8, 32))
    assert list(curves) == [8, 32] and all(len(v) == 3 and min(v) > 0 for v in curves.values())


def test_measure_leaves_no_state(tiny_llama_dir):
    m = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    assert len(measure_step_costs(m.model, 2, repeats=1)) == 2


def test_drafting_round_costs_measured_on_a_busy_machine_are_measured_again(tmp_path, monkeypatch):
    """The costs that steer the adaptive policy go through `specdecode.measured`: a record taken
    while other work shared the cores (faked: a share of 0) is timed again
    at the next load, up to MAX_ATTEMPTS, and one measured quietly is final."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "run_with_share", lambda fn: (fn(), 0.0))
    timed = []

    def round_seconds(k):
        timed.append(k)
        return 0.001 * (2 + k)

    for n in range(1, measured.MAX_ATTEMPTS + 2):
        fixed, per_token, *_ = draft_round_costs(["drafter", "target"], 4, round_seconds)
        assert timed == [1, 4] * min(n, measured.MAX_ATTEMPTS)
    assert fixed == pytest.approx(0.002) and per_token == pytest.approx(0.001)
    (path,) = (tmp_path / "profiles").glob("draft-*.json")
    quiet = {**json.loads(path.read_text()), "fixed_s": 0.5, "cpu_share": 0.9, "attempts": 1}
    path.write_text(json.dumps(quiet))
    assert draft_round_costs(["drafter", "target"], 4, round_seconds)[0] == 0.5


def test_drafting_round_curve_passes_through_every_timed_k(tmp_path, monkeypatch):
    """A drafter that names where its cost bends (a tree: its depth) is timed there too; the
    curve over K = 1..k is linear between timed points and the (fixed, per token) line still
    runs through K = 1 and K = k."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "run_with_share", lambda fn: (fn(), 1.0))
    timed = []

    def round_seconds(k):
        timed.append(k)
        return 0.001 * min(k, 5)

    fixed, per_token, curve, extra = draft_round_costs(["tree", "target"], 16, round_seconds, points=(5, 99))
    assert timed == [1, 5, 16]  # a point past k is not timed
    assert curve == pytest.approx([0.001 * min(k, 5) for k in range(1, 17)])
    assert fixed + per_token == pytest.approx(0.001) and fixed + 16 * per_token == pytest.approx(0.005)
    assert extra is None  # no sampled steps timed
    _, _, again, _ = draft_round_costs(["tree", "target"], 16, round_seconds, points=(5,))
    assert again == curve and timed == [1, 5, 16]  # cached


def test_sampled_steps_add_their_extra_beyond_plain_sampled_decoding(tmp_path, monkeypatch):
    """With `step_seconds`, whole steps are timed greedy and sampled at K = 0 and every timed K:
    the extra a sampled step costs over a greedy one, less plain sampled decoding's own extra, is
    interpolated over K = 0..k and never negative; it is cached with the round costs."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "run_with_share", lambda fn: (fn(), 1.0))
    timed = []

    def step_seconds(k, t):
        timed.append((k, t))
        base = 0.010 + 0.001 * k
        return base + (0.0005 + 0.0002 * k if t > 0 else 0.0)  # sampling: 0.5 ms + 0.2 ms a draft

    rc = draft_round_costs(["eagle", "target"], 4, lambda k: 0.001 * k, step_seconds=step_seconds)
    assert rc.sampled_extra == pytest.approx([0.0, 0.0002, 0.0004, 0.0006, 0.0008])
    n = 6 * SAMPLED_REPEATS  # greedy and sampled at K = 0, 1, 4, each repeat
    assert sorted({k for k, _ in timed}) == [0, 1, 4] and len(timed) == n
    assert timed[:2] == [(0, 0.0), (0, 1.0)] and timed[6:8] == [(0, 1.0), (0, 0.0)]  # order alternates
    again = draft_round_costs(["eagle", "target"], 4, lambda k: 0.001 * k, step_seconds=step_seconds)
    assert again.sampled_extra == rc.sampled_extra and len(timed) == n  # cached
    faster = lambda k, t: 0.01 - 0.001 * t * (k + 1)  # noqa: E731 (noise: sampled steps timed faster)
    noisy = draft_round_costs(["other", "target"], 4, lambda k: 0.001, step_seconds=faster)
    assert noisy.sampled_extra == [0.0] * 5


def test_sampled_extra_is_the_median_of_paired_timings(tmp_path, monkeypatch):
    """A host that stalls now and then (one timing in 17 3 ms slow, on either side) moves no
    median; the second run of a pair being faster (a warm decoder, the more so the more it
    drafts) cancels out between the two orders; a K that reads dearer than a larger one is
    lowered to it."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "run_with_share", lambda fn: (fn(), 1.0))
    want = [0.0, 0.0005, 0.0005, 0.0005, 0.0005]

    def timer(stall_every: int, second_faster: float):
        calls = []

        def step_seconds(k, t):
            calls.append((k, t))
            stall = 0.003 if stall_every and len(calls) % stall_every == 0 else 0.0
            warm = second_faster * (1 + k) if len(calls) % 2 == 0 else 0.0
            extra = {0: 0.0002, 1: 0.0009, 4: 0.0007}[k] if t > 0 else 0.0  # K = 1 dearer than K = 4
            return 0.010 + extra + stall - warm

        return step_seconds

    rc = draft_round_costs(["stalls", "target"], 4, lambda k: 0.001, step_seconds=timer(17, 0.0))
    assert rc.sampled_extra == pytest.approx(want)
    rc = draft_round_costs(["warm", "target"], 4, lambda k: 0.001, step_seconds=timer(0, 0.0001))
    assert rc.sampled_extra == pytest.approx(want)


def test_monotone_envelope_lowers_bumps_and_keeps_a_rising_curve():
    assert monotone_envelope([1.0, 1.2, 1.5, 2.0]) == [1.0, 1.2, 1.5, 2.0]
    assert monotone_envelope([1.0, 1.37, 1.33, 1.25, 2.7]) == [1.0, 1.25, 1.25, 1.25, 2.7]
    assert monotone_envelope([]) == []


def test_a_one_slot_model_is_timed_one_context_after_another(tiny_llama_dir, monkeypatch):
    """The transformers adapter holds one request (`max_slots` 1): the contexts are then timed
    in turn, each in a one-slot cache, instead of one cache holding them all (which it refuses)."""
    m = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    m.model.info = dataclasses.replace(m.model.info, max_slots=1)
    sizes, real = [], m.model.new_cache

    def new_cache(num_slots, max_len):
        sizes.append(num_slots)
        return real(num_slots, max_len)

    monkeypatch.setattr(m.model, "new_cache", new_cache)
    curves = measure_step_cost_curves(m.model, 2, repeats=1, contexts=(8, 32))
    assert list(curves) == [8, 32] and all(len(v) == 2 and min(v) > 0 for v in curves.values())
    assert sizes == [1, 1]
