import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.config import SamplingParams
from specdecode.drafter import DraftRow
from specdecode.drafters.ngram import (
    SHORT_MATCH_DRAFTS,
    NgramDrafter,
    NgramTable,
    context_keys,
    lookup_continuation,
    lookup_tree,
    match_starts,
    table_continuation,
    table_tree,
)


def test_lookup_prefers_longest_and_latest_match():
    toks = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3])
    # trailing 3-gram [5,2,3] never occurred before; 2-gram [2,3] occurred at 1 and 5 -> latest (5) wins
    assert lookup_continuation(toks, 3, 1, 3).tolist() == [7, 8, 5]
    assert lookup_continuation(np.array([4, 5, 6]), 3, 1, 3).tolist() == []  # no match at all
    assert lookup_continuation(np.array([1, 2, 1, 2]), 5, 1, 3).tolist() == [1, 2]  # ends at the context


def _match_starts_by_brute_force(toks: list[int], min_ngram: int, max_ngram: int) -> list[int]:
    out = []
    for n in range(min(max_ngram, len(toks) - 1), min_ngram - 1, -1):
        for s in range(len(toks) - 1 - n, -1, -1):  # windows ending before the last token
            if toks[s : s + n] == toks[-n:]:
                out.append(s + n)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 3), st.integers(1, 4))
def test_match_starts_finds_every_match_longest_and_latest_first(toks, min_ngram, span):
    max_ngram = min_ngram + span - 1
    got = list(match_starts(np.array(toks, dtype=np.int64), min_ngram, max_ngram))
    assert got == _match_starts_by_brute_force(toks, min_ngram, max_ngram)


def test_propose_is_ragged_and_point_mass():
    d = NgramDrafter(short_match_drafts={})  # every match drafts up to K
    g = torch.Generator()
    rows = [
        DraftRow(0, [1, 2, 3, 4, 1, 2], SamplingParams(), g),
        DraftRow(1, [5, 6, 7], SamplingParams(), g),
    ]
    prop = d.propose(rows, [4, 4])
    assert prop.draft_probs is None
    assert prop.num_draft.tolist() == [4, 0]
    assert prop.draft_ids[0].tolist() == [3, 4, 1, 2]
    assert d.propose(rows, [0, 0]).num_draft.tolist() == [0, 0]


def test_short_matches_propose_fewer_drafts():
    g = torch.Generator()
    rows = [
        DraftRow(0, [1, 2, 3, 4, 1, 2], SamplingParams(), g),  # a 2-token match ([1, 2])
        DraftRow(1, [7, 1, 2, 3, 4, 5, 1, 2, 3], SamplingParams(), g),  # a 3-token match
        DraftRow(2, [9, 4, 5, 6, 7, 8, 3, 9], SamplingParams(), g),  # a 1-token match ([9])
    ]
    prop = NgramDrafter().propose(rows, [4, 4, 4])
    assert SHORT_MATCH_DRAFTS == {1: 1, 2: 2}
    assert prop.num_draft.tolist() == [2, 4, 1]
    assert prop.draft_ids[0, :2].tolist() == [3, 4]
    assert prop.draft_ids[1].tolist() == [4, 5, 1, 2]
    assert prop.draft_ids[2, :1].tolist() == [4]
    uncapped = NgramDrafter(short_match_drafts={}).propose(rows, [4, 4, 4])
    assert uncapped.num_draft.tolist() == [4, 4, 4]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 6), st.integers(0, 3), st.integers(0, 3))
def test_capped_lookup_is_the_same_match_cut_to_its_cap(toks, k, cap1, cap2):
    t = np.array(toks, dtype=np.int64)
    full = lookup_continuation(t, k, 1, 3)
    got = lookup_continuation(t, k, 1, 3, {1: cap1, 2: cap2})
    n = next((n for n in (3, 2, 1) if next(match_starts(t, n, n), None) is not None), None)
    assert got.tolist() == full[: {1: cap1, 2: cap2}.get(n, k)].tolist()


def test_lookup_tree_merges_the_continuations_of_every_match():
    toks = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3])
    # [2, 3] matched at 5 (latest) then 1: [7, 8, 5, 2, 3] and [9, 9, 2, 3, 7, 8, 5, 2] side by side;
    # the 1-gram [3] finds the same two starts again, which add nothing
    toks_, parents = lookup_tree(toks, 16, 1, 3)
    assert toks_ == [7, 8, 5, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2]
    assert parents == [-1, 0, 1, 2, 3, -1, 5, 6, 7, 8, 9, 10, 11]
    assert lookup_tree(toks, 3, 1, 3) == ([7, 8, 5], [-1, 0, 1])  # the budget caps the nodes
    # two matches that share their first token share its node
    toks_, parents = lookup_tree(np.array([4, 1, 5, 6, 4, 1, 5, 7, 0, 4]), 16, 1, 1, depth=3)
    assert toks_ == [1, 5, 7, 6] and parents == [-1, 0, 1, 1]
    assert lookup_tree(np.array([4, 5, 6]), 8, 1, 3) == ([], [])


def test_tree_proposal_is_point_mass_with_parents_first():
    d = NgramDrafter(tree=True)
    g = torch.Generator()
    rows = [
        DraftRow(0, [4, 1, 5, 6, 4, 1, 5, 7, 0, 4], SamplingParams(), g),
        DraftRow(1, [5, 6, 7], SamplingParams(), g),
    ]
    prop = d.propose(rows, [16, 16])
    assert prop.draft_probs is None and not prop.tree_iid
    assert prop.num_draft.tolist() == [11, 0]  # [1, 5, 7, 0, 4] and [6, 4, 1, 5, 7, 0] under 5
    parents = prop.parents[0].tolist()
    assert all(p < i for i, p in enumerate(parents))


def test_table_keeps_the_most_frequent_next_token_of_frequent_contexts():
    # (2, 3) is followed by 4 three times and by 5 once; (7, 8) once only; (5, 6) by 1 or 2 alike
    seqs = [[1, 2, 3, 4]] * 3 + [[9, 2, 3, 5], [7, 8, 0], [5, 6, 1], [5, 6, 2], [0, 6, 1], [0, 6, 1]]
    table = NgramTable.build(seqs, orders=(2, 1), min_count=2, min_share=0.6)
    assert table.draft(np.array([0, 2, 3]), 1).tolist() == [4]
    assert table.draft(np.array([1, 2]), 3).tolist() == [3, 4]  # a walk: each token extends the context
    # (7, 8) is too rare to keep: the walk backs off to (8,), unseen too, and stops
    assert table.draft(np.array([7, 8]), 2).tolist() == []
    # (5, 6) splits 1:1, under min_share: a stop, even though the shorter (6,) prefers 1 (3 of 4)
    assert table.draft(np.array([5, 6]), 2).tolist() == []
    assert table.draft(np.array([3, 6]), 1).tolist() == [1]  # (3, 6) unseen: (6,) decides
    # a short context grows into the longer orders: after (7,) -> 8 the walk reads (7, 8) -> 1,
    # where (8,) alone splits between 1 and 2 and would stop
    grows = NgramTable.build([[7, 8, 1]] * 3 + [[5, 8, 2]] * 3, orders=(2, 1), min_count=2, min_share=0.6)
    assert grows.draft(np.array([7]), 2).tolist() == [8, 1]
    again = NgramTable.from_state(table.state(), min_share=0.6)
    for n, arrays in table.tables.items():
        assert all(np.array_equal(a, b) for a, b in zip(again.tables[n], arrays, strict=True))
    assert (
        again.draft(np.array([1, 2]), 3).tolist() == [3, 4]
        and again.draft(np.array([5, 6]), 2).tolist() == []
    )


def test_table_keeps_each_contexts_likeliest_next_tokens_with_their_shares():
    # (2, 3) -> 4 three times, 5 once, 6 never: width 2 keeps 4 (0.75) then 5 (0.25)
    table = NgramTable.build([[2, 3, 4]] * 3 + [[2, 3, 5]], orders=(2,), min_count=1, width=2)
    toks, shares = table.candidates(np.array([9, 2, 3]))
    assert toks.tolist() == [4, 5] and np.allclose(shares, [0.75, 0.25], atol=1 / 255)
    assert table.candidates(np.array([7, 7])) is None  # never seen
    # one next token only: the second slot is empty
    solo = NgramTable.build([[2, 3, 4]] * 2, orders=(2,), min_count=1, width=2)
    toks, shares = solo.candidates(np.array([2, 3]))
    assert toks.tolist() == [4, -1] and shares.tolist()[1] == 0.0
    # stored as uint16 ids with shares in 1/255 steps, read back the same; ids past uint16 as int32
    state = table.state()
    assert state["next2"].dtype == torch.int16 and state["share2"].dtype == torch.uint8
    big = NgramTable.build([[70000, 70001, 70002]] * 2, orders=(2,), min_count=1)
    assert big.state()["next2"].dtype == torch.int32
    for t in (table, solo, big):
        again = NgramTable.from_state(t.state())
        for n, arrays in t.tables.items():
            assert all(np.array_equal(a, b) for a, b in zip(again.tables[n], arrays, strict=True))


def test_a_table_of_the_first_format_still_loads():
    """The first tables stored the best next token only, [M] int32, -1 for a stop."""
    keys = context_keys(np.array([[1, 2], [5, 6]]))  # (1, 2) -> 3; (5, 6) a stop
    order = np.argsort(keys)
    old = {
        "keys2": torch.from_numpy(keys[order].view(np.int64).copy()),
        "next2": torch.from_numpy(np.array([3, -1], dtype=np.int32)[order]),
    }
    table = NgramTable.from_state(old)
    assert table.draft(np.array([1, 2]), 2).tolist() == [3]
    assert table.draft(np.array([5, 6]), 2).tolist() == []
    assert table_tree(np.array([1, 2]), 4, table, 2, 3) == ([3], [-1])


def test_table_tree_puts_the_context_match_first_then_the_tables_paths_best_first():
    # the table: (0, 1) -> 2 (0.75) or 3 (0.25); (1, 2) -> 4; (1, 3) -> 5; (2, 4) -> 6 or 7 (0.5 each)
    seqs = [[0, 1, 2, 4, 6]] * 2 + [[0, 1, 2, 4, 7]] * 2 + [[0, 1, 2]] * 2 + [[0, 1, 3, 5]] * 2
    table = NgramTable.build(seqs, orders=(2,), min_count=1, width=2)
    # no match in the context: paths by their product of shares, 2 (.75), 4 (.75), 6 and 7 (.375),
    # 3 (.25), 5 (.25); a node after its parent, ties in the row's order
    toks, parents = table_tree(np.array([9, 0, 1]), 16, table, 1, 3, min_path=0.0)
    assert (toks, parents) == ([2, 4, 6, 7, 3, 5], [-1, 0, 1, 1, -1, 4])
    assert table_tree(np.array([9, 0, 1]), 2, table, 1, 3, min_path=0.0) == ([2, 4], [-1, 0])  # the budget
    assert table_tree(np.array([9, 0, 1]), 16, table, 1, 3, min_path=0.3)[0] == [2, 4, 6, 7]  # min_path
    assert table_tree(np.array([9, 0, 1]), 16, table, 1, 3, min_path=0.4)[0] == [2, 4]  # a product: .75 x .5
    # the context repeats [0, 1]: its continuation first, then the table's paths, sharing its nodes
    # (3 and then 5 are already there; 2's branch is new)
    toks, parents = table_tree(np.array([0, 1, 3, 5, 8, 0, 1]), 16, table, 1, 3, min_path=0.0)
    assert toks == [3, 5, 8, 0, 1, 2, 4, 6, 7] and parents == [-1, 0, 1, 2, 3, -1, 5, 6, 6]
    # the drafter's tree variant proposes it, as point masses
    d = NgramDrafter(table=table, tree=True)
    prop = d.propose([DraftRow(0, [9, 0, 1], SamplingParams(), torch.Generator())], [4])
    assert d.name == "ngram-table-tree" and prop.draft_probs is None and not prop.tree_iid
    assert prop.draft_ids[0].tolist() == [2, 4, 6, 7] and prop.parents[0].tolist() == [-1, 0, 1, 1]


def test_table_continuation_prefers_the_context_then_the_table_then_one_token_matches():
    table = NgramTable.build([[4, 5, 6, 7]] * 2, orders=(2,), min_count=2)
    # the context repeats [1, 2]: its continuation wins over the table
    assert table_continuation(np.array([1, 2, 9, 4, 5, 1, 2]), 2, table, 1, 3).tolist() == [9, 4]
    # no match of 2+ tokens in the context: the table's walk after (4, 5)
    assert table_continuation(np.array([5, 8, 4, 5]), 3, table, 1, 3).tolist() == [6, 7]
    # neither: the latest single-token match ([8] -> 3)
    assert table_continuation(np.array([8, 3, 1, 8]), 2, table, 1, 3).tolist() == [3, 1]
    # with caps the context's short matches are cut, the table's walk is not
    caps = {1: 1, 2: 2}
    assert table_continuation(np.array([1, 2, 9, 4, 5, 1, 2]), 4, table, 1, 3).tolist() == [9, 4, 5, 1]
    assert table_continuation(np.array([1, 2, 9, 4, 5, 1, 2]), 4, table, 1, 3, caps).tolist() == [9, 4]
    assert table_continuation(np.array([8, 3, 1, 8]), 2, table, 1, 3, caps).tolist() == [3]
    assert table_continuation(np.array([5, 8, 4, 5]), 3, table, 1, 3, {1: 1, 2: 1}).tolist() == [6, 7]
    d = NgramDrafter(table=table)
    rows = [DraftRow(0, [5, 8, 4, 5], SamplingParams(), torch.Generator())]
    prop = d.propose(rows, [3])
    assert d.name == "ngram-table" and prop.draft_probs is None and prop.draft_ids[0].tolist() == [6, 7]
