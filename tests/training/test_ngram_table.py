"""`specdecode train ngram-table`: the table of the target's own answers, as a drafter checkpoint."""

import json

import numpy as np
import pytest

from specdecode.drafters import build_drafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.errors import SpecDecodeError
from specdecode.training.ngram_table import build_table_checkpoint
from specdecode.training.regen import read_regen


@pytest.fixture(scope="module")
def data(make_regen):
    return make_regen("table", 12, "count the stones of wall number {}")


def test_a_table_checkpoint_serves_ngram_table_and_knows_its_answers(data, tmp_path):
    target, regen = data
    out = tmp_path / "table"
    summary = build_table_checkpoint(target, regen, out, min_count=1)
    assert summary["answers"] == 12 and summary["contexts"] > 0
    card = json.loads((out / "config.json").read_text())
    assert card["method"] == "ngram-table" and card["arch"]["orders"] == [4, 3, 2]
    drafter = build_drafter("ngram-table", target, str(out))
    assert isinstance(drafter, NgramDrafter) and drafter.name == "ngram-table"
    # every answer's own contexts are in the table: a walk from its first 4 tokens drafts its next one
    rec = read_regen(regen, "train")[0]
    start = rec["loss_mask"].index(1)
    ctx = np.asarray(rec["input_ids"][start - 3 : start + 1])
    assert len(drafter.table.draft(ctx, 1)) == 1
    with pytest.raises(SpecDecodeError, match="not used|ngram"):
        build_drafter("ngram", target, str(out))  # plain prompt lookup reads no table
    with pytest.raises(SpecDecodeError, match="min-count"):
        build_table_checkpoint(target, regen, tmp_path / "x", min_count=0)
    with pytest.raises(SpecDecodeError, match="table-width"):
        build_table_checkpoint(target, regen, tmp_path / "x", width=0)
    # the tree variant reads the same checkpoint, and the card records the table's width
    assert card["arch"]["width"] == 2
    tree = build_drafter("ngram-table-tree", target, str(out))
    assert tree.name == "ngram-table-tree" and tree.tree and tree.table.size == drafter.table.size


def test_min_share_decides_where_the_walk_stops(data, tmp_path):
    """`--min-share 0` keeps no stop (every kept context drafts its most frequent next token);
    0.3 and 1.0 keep the contexts whose best next token is rarer than that as stops (1.0 the
    most); the card records the share."""
    target, regen = data
    stops = {}
    for share in (0.0, 0.3, 1.0):
        out = tmp_path / f"share{share}"
        build_table_checkpoint(target, regen, out, min_count=1, min_share=share)
        assert json.loads((out / "config.json").read_text())["arch"]["min_share"] == share
        table = build_drafter("ngram-table", target, str(out)).table
        stops[share] = sum(int((sh[:, 0] < table.min_share).sum()) for _, _, sh in table.tables.values())
    assert stops[0.0] == 0 < stops[1.0] and stops[0.3] <= stops[1.0]
    with pytest.raises(SpecDecodeError, match="min-share"):
        build_table_checkpoint(target, regen, tmp_path / "y", min_share=1.5)


def test_the_stop_share_is_a_threshold_on_the_best_next_tokens_share():
    """A context seen 5 times, followed by A A B C D: its best next token (A) has a 40 % share.
    It drafts A at min_share <= 0.4 and is a stop above; the default share (MIN_SHARE) drafts it."""
    from specdecode.drafters.ngram import MIN_SHARE, NgramTable

    seqs = [[7, 8, nxt] for nxt in (1, 1, 2, 3, 4)]
    for share, want in ((0.0, 1), (0.4, 1), (0.41, None), (0.9, None), (MIN_SHARE, 1)):
        table = NgramTable.build(seqs, orders=(2,), min_count=1, min_share=share)
        assert table.next_token(np.array([7, 8])) == want, share
