"""HFAdapter: non-native architectures (GPT-2, OPT) behind the CausalLM interface, batch 1."""

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.hf_adapter import HFAdapter
from specdecode.models.loader import load_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=["gpt2", "opt"])
def model_dir(request, tiny_gpt2_dir, make_tiny_model):
    return tiny_gpt2_dir if request.param == "gpt2" else make_tiny_model("opt", seed=5)


@pytest.fixture(scope="module")
def gpt2(model_dir):
    lm = load_model(str(model_dir), dtype="fp32", device="cpu")
    assert isinstance(lm.model, HFAdapter)
    return lm.model


def _ids(n, seed=0):
    return torch.randint(0, 400, (1, n), generator=torch.Generator().manual_seed(seed))


def test_matches_transformers_with_rollback(gpt2, model_dir, hf_reference):
    ref = hf_reference(model_dir)
    ids = _ids(16)
    with torch.no_grad():
        r = ref(ids, output_hidden_states=True)
    cache = gpt2.new_cache(1, 32)
    out = gpt2.prefill(ids[:, :8], cache, [0], capture=(0, -1), chunk_size=3)
    assert cache.lengths == [8]
    torch.testing.assert_close(out.logits[0, 0], r.logits[0, 7], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden[0], r.hidden_states[1][:, :8], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden[-1], r.hidden_states[-1][:, :8], atol=ATOL, rtol=0)
    # A rejected block (not committed) leaves no trace.
    gpt2.forward(_ids(4, seed=1), None, cache, [0])
    for j in range(8, 12):
        o = gpt2.forward(ids[:, j : j + 1], None, cache, [0])
        torch.testing.assert_close(o.logits[0, 0], r.logits[0, j], atol=ATOL, rtol=0)
        cache.commit(0, 1)
    block = gpt2.forward(ids[:, 12:16], None, cache, [0], num_new=[3])
    torch.testing.assert_close(block.logits[:, :3], r.logits[:, 12:15], atol=ATOL, rtol=0)
    assert block.logits.shape == (1, 4, 448) and gpt2.info.vocab_size == 448


def test_tree_mask_and_compaction(gpt2):
    parents = [-1, 0, 0, 1, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    depth = []
    for i in range(5):
        j, d = i, 0
        while j >= 0:
            mask[i, j], j, d = True, parents[j], d + 1
        depth.append(d - 1)
    cache = gpt2.new_cache(1, 32)
    gpt2.prefill(_ids(6), cache, [0])
    tree = _ids(5, seed=2)
    out = gpt2.forward(tree, 6 + torch.tensor([depth]), cache, [0], tree_mask=mask[None])
    for path in ([0, 1, 3], [0, 2, 4]):
        chain = gpt2.forward(tree[:, path], None, cache, [0])
        torch.testing.assert_close(out.logits[:, path], chain.logits, atol=ATOL, rtol=0)
    gpt2.forward(tree, 6 + torch.tensor([depth]), cache, [0], tree_mask=mask[None])
    cache.commit(0, 3, kept_rows=[0, 2, 4])
    nxt = gpt2.forward(_ids(1, seed=3), None, cache, [0]).logits
    ref = gpt2.new_cache(1, 32)
    gpt2.prefill(torch.cat([_ids(6), tree[:, [0, 2, 4]]], 1), ref, [0])
    torch.testing.assert_close(nxt, gpt2.forward(_ids(1, seed=3), None, ref, [0]).logits, atol=ATOL, rtol=0)


def test_refusals(gpt2, make_tiny_model):
    with pytest.raises(SpecDecodeError, match="one request at a time"):
        gpt2.new_cache(2, 16)
    cache = gpt2.new_cache(1, 8)
    with pytest.raises(SpecDecodeError, match="batch 1"):
        gpt2.forward(torch.zeros(2, 1, dtype=torch.long), None, cache, [0, 1])
    with pytest.raises(SpecDecodeError, match="raw output of the last layer"):
        gpt2.forward(_ids(2), None, cache, [0], capture=(1,))
    with pytest.raises(SpecDecodeError, match="exceeds the cache/context length 8"):
        gpt2.forward(_ids(9), None, cache, [0])
    # An architecture without a verified 4D-mask path refuses trees clearly.
    neox = HFAdapter.__new__(HFAdapter)
    from dataclasses import replace

    neox.info, neox.model = replace(gpt2.info, arch="gpt_neox", supports_tree=False), gpt2.model
    with pytest.raises(SpecDecodeError, match="tree drafting needs a natively supported architecture"):
        neox.forward(_ids(2), None, cache, [0], tree_mask=torch.ones(1, 2, 2, dtype=torch.bool))
