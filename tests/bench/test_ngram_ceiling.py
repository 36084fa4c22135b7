"""benchmarks/ngram_ceiling.py: the match records and the round-by-round walk behind its ceilings."""

import importlib.util
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))  # the script imports bench_runtime beside it
_PATH = _DIR / "ngram_ceiling.py"
_spec = importlib.util.spec_from_file_location("ngram_ceiling", _PATH)
nc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nc)


def test_position_matches_finds_the_copied_span_and_its_accepted_run():
    prompt = [5, 6, 7, 8, 9, 10]
    answer = [6, 7, 8, 9, 11]  # copies 6 7 8 9 from the prompt, then leaves it
    recs = nc.position_matches(prompt, answer)
    assert len(recs) == len(answer)
    # at position 1 the context ends in "10 6": no earlier "10 6", so n = 1, the prompt's 6; its
    # continuation runs to the context's end (7 8 9 10 6, 5 tokens) and 7 8 9 are accepted
    assert recs[1] == (1, 3, 5)
    # at position 2 the context ends in "6 7": the prompt's "5 6 7" does not end it, "6 7" does
    assert recs[2][0] == 2 and recs[2][1] == 2  # continuation 8 9 10 ...: 8 9 accepted, 10 != 11
    # the last position (after "... 8 9") continues with 10 where the answer says 11: nothing taken
    assert recs[4][0] == 3 and recs[4][1] == 0


def test_verify_cost_interpolates_between_measured_sizes():
    cost = {1: 1.0, 2: 1.2, 4: 1.6}
    assert nc.verify_cost(3, cost) == pytest.approx(1.4)
    assert nc.verify_cost(9, cost) == 1.6
    assert nc.verify_cost(1, cost) == 1.0


def test_walk_charges_each_round_and_skips_the_accepted_tokens():
    # one answer of 6 positions: a match at 0 whose 3 tokens are accepted, then nothing
    recs = [(3, 3, 8), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0)]
    flat = {1: 1.0}
    # oracle at flat cost: round 1 emits 4 tokens, then 2 plain steps: 6 tokens in 3 steps
    assert nc.walk([recs], lambda n, run: run, flat) == pytest.approx(2.0)
    # K = 1: round 1 emits 2 (cost T(2)), then plain steps for the 4 left
    cost = {1: 1.0, 2: 1.5}
    assert nc.walk([recs], lambda n, run: 1, cost) == pytest.approx(6 / (1.5 + 4))
    # a rule that never drafts is ar: 1.0x
    assert nc.walk([recs], lambda n, run: 0, cost) == pytest.approx(1.0)


def test_position_matches_takes_the_latest_earlier_match_as_the_drafter_does():
    prompt = [9, 1, 2, 9, 1, 3]
    answer = [9, 1, 3, 7]
    # after "9 1" the prompt holds "9 1 2" and, later, "9 1 3": the latest gives 3, accepted
    assert nc.position_matches(prompt, answer)[2][:2] == (2, 1)  # n = 2, run 1
