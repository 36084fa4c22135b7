"""The decoding loop: greedy speculative == greedy ar (fp32), batch == single, stops, distribution."""

import collections
import dataclasses

import pytest
import torch
from fakes import ShiftedDrafter
from scipy.stats import chi2_contingency

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafter import Proposal
from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter, NgramTable
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model
from specdecode.policy import AdaptiveK, FixedK
from specdecode.verify import Verdict


def _prompts(tok, n=3):
    texts = ["the cat sat on the mat and the cat", "hello world, hello", "a b c d e f g a b c"][:n]
    return [tok(t)["input_ids"] for t in texts]


def _decode(
    target, drafter, k, prompts, max_new=24, params=None, max_batch=8, policy=None, mode="rejection", seed=0
):
    dec = SpeculativeDecoder(target, drafter, policy or FixedK(k), max_batch=max_batch, verify_mode=mode)
    reqs = [
        GenerationRequest(p, params or SamplingParams(), max_new, seed=seed + i, id=str(i), ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    return dec.generate(reqs)


def _drafters(target, other):
    v, rows = target.vocab_size, target.model.info.vocab_size
    return {
        "ngram": NgramDrafter(),
        "ngram-tree": NgramDrafter(tree=True),
        "draft-other": DraftModelDrafter(other.model, v, rows),
        "draft-always-agrees": DraftModelDrafter(target.model, v, rows),
        "draft-never-agrees": ShiftedDrafter(target.model, v, rows),
    }


@pytest.mark.parametrize(
    "name", ["ngram", "ngram-tree", "draft-other", "draft-always-agrees", "draft-never-agrees"]
)
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_greedy_ar(tiny, tiny_drafter, name, k):
    prompts = _prompts(tiny.tokenizer)
    base = _decode(tiny, ARDrafter(), 0, prompts)
    spec = _decode(tiny, _drafters(tiny, tiny_drafter)[name], k, prompts)
    for b, s in zip(base, spec, strict=True):
        assert s.token_ids == b.token_ids
        assert len(s.token_ids) == 24
    if name == "draft-always-agrees":
        assert all(s.tau > k for s in spec)  # all accepted but the last, truncated step
        assert all(s.acceptance_per_position[j] == 1.0 for s in spec for j in range(k))
    if name == "draft-never-agrees":
        assert all(s.tau == 1.0 for s in spec)
        assert all(a == 0 for s in spec for a in s.accepted_per_position)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_greedy_ar_with_an_ngram_table(tiny, k, tree):
    """ngram-table drafts from a table of the target's own answers (here: to these prompts, so
    its walks are often right) and of random text (often wrong): greedy output stays ar's."""
    prompts = _prompts(tiny.tokenizer)
    base = _decode(tiny, ARDrafter(), 0, prompts)
    noise = torch.randint(0, tiny.vocab_size, (4, 300), generator=torch.Generator().manual_seed(0))
    own = [p + b.token_ids for p, b in zip(prompts, base, strict=True)]
    table = NgramTable.build([*own, *noise.tolist()], orders=(4, 3, 2), min_count=1)
    spec = _decode(tiny, NgramDrafter(table=table, tree=tree), k, prompts)
    for b, s in zip(base, spec, strict=True):
        assert s.token_ids == b.token_ids
    accepted = sum(sum(s.accepted_per_position) for s in spec)
    assert 0 < accepted < sum(s.num_drafted for s in spec)  # acceptances and rejections


def test_greedy_speculative_equals_greedy_ar_with_a_bf16_kv_cache(tiny, monkeypatch):
    """A bf16 cache under fp32 activations rounds each key and value once, however it was
    written (a step or a verify block), so greedy speculation still equals greedy ar."""
    monkeypatch.setattr(tiny.model, "kv_dtype", torch.bfloat16)
    prompts = _prompts(tiny.tokenizer)
    dec = SpeculativeDecoder(tiny, ARDrafter(), FixedK(0))
    reqs = [
        GenerationRequest(p, SamplingParams(), 24, seed=i, id=str(i), ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    base = dec.generate(reqs)
    assert dec.cache.kv.dtype == torch.bfloat16
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    for drafter in (NgramDrafter(), DraftModelDrafter(tiny.model, v, rows)):
        spec = _decode(tiny, drafter, 4, prompts)
        assert [s.token_ids for s in spec] == [b.token_ids for b in base]
    monkeypatch.setattr(tiny.model, "kv_dtype", None)
    fp32 = _decode(tiny, ARDrafter(), 0, prompts)
    same = sum(
        a == b for f, s in zip(fp32, base, strict=True) for a, b in zip(f.token_ids, s.token_ids, strict=True)
    )
    assert same >= 0.5 * sum(len(f.token_ids) for f in fp32)  # the same model, rounded


def test_adaptive_policy_is_exact_and_backs_off(tiny):
    prompts = _prompts(tiny.tokenizer)
    base = _decode(tiny, ARDrafter(), 0, prompts, max_new=40)
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    spec = _decode(
        tiny, ShiftedDrafter(tiny.model, v, rows), 4, prompts, max_new=40, policy=AdaptiveK(4, 0.3)
    )
    assert [s.token_ids for s in spec] == [b.token_ids for b in base]
    # With nothing ever accepted the policy stops drafting most of the time.
    assert all(sum(s.reached_per_position) < s.num_steps for s in spec)


def test_batch_equals_single_greedy_and_sampled(tiny, tiny_drafter):
    prompts = _prompts(tiny.tokenizer)
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=50)):
        d = DraftModelDrafter(tiny_drafter.model, tiny.vocab_size, tiny.model.info.vocab_size)
        batched = _decode(tiny, d, 3, prompts, params=params, max_batch=3)
        singles = [
            _decode(
                tiny,
                DraftModelDrafter(tiny_drafter.model, tiny.vocab_size, tiny.model.info.vocab_size),
                3,
                [p],
                params=params,
                seed=i,
            )[0]
            for i, p in enumerate(prompts)
        ]
        assert [r.token_ids for r in batched] == [r.token_ids for r in singles]


def test_continuous_refill_with_more_requests_than_slots(tiny):
    prompts = _prompts(tiny.tokenizer) * 2
    base = _decode(tiny, ARDrafter(), 0, prompts, max_new=10, max_batch=6)
    spec = _decode(tiny, NgramDrafter(), 3, prompts, max_new=10, max_batch=2)
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]


def test_stops_inside_an_accepted_block(tiny):
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    prompt = _prompts(tiny.tokenizer, 1)
    full = _decode(tiny, ARDrafter(), 0, prompt, max_new=30)[0]
    # max_new_tokens falls inside a block of 5 all-accepted drafts
    r = _decode(tiny, DraftModelDrafter(tiny.model, v, rows), 5, prompt, max_new=7)[0]
    assert r.token_ids == full.token_ids[:7] and r.finish_reason == "length"
    # an EOS inside the block: pretend the 4th greedy token is EOS
    dec = SpeculativeDecoder(tiny, DraftModelDrafter(tiny.model, v, rows), FixedK(5))
    dec.eos_ids = {full.token_ids[3]}
    first = full.token_ids.index(full.token_ids[3])
    r = dec.generate([GenerationRequest(prompt[0], max_new_tokens=30)])[0]
    assert r.token_ids == full.token_ids[:first] and r.finish_reason == "stop"
    # a stop string: text is cut before it, and nothing after it is streamed
    text = tiny.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    dec = SpeculativeDecoder(tiny, DraftModelDrafter(tiny.model, v, rows), FixedK(5))
    req = GenerationRequest(prompt[0], max_new_tokens=30, stop=(stop,), ignore_eos=True)
    events = list(dec.stream([req]))
    res = events[-1].result
    assert res.finish_reason == "stop" and stop not in res.text
    assert res.text == text[: text.find(stop)]
    assert "".join(e.text for e in events) == res.text


def test_sampled_spec_matches_ar_distribution(tiny, tiny_drafter):
    """T = 1: the first two tokens' joint distribution of speculative and ar decoding agree."""
    prompt = _prompts(tiny.tokenizer, 1)[0]
    params = SamplingParams(temperature=1.0, top_k=6)
    n = 1500

    def draw(drafter, k, base_seed):
        dec = SpeculativeDecoder(tiny, drafter, FixedK(k), max_batch=64)
        reqs = [
            GenerationRequest(prompt, params, 2, seed=base_seed + i, id=str(i), ignore_eos=True)
            for i in range(n)
        ]
        return collections.Counter(tuple(r.token_ids) for r in dec.generate(reqs))

    ar = draw(ARDrafter(), 0, 0)
    sd = draw(DraftModelDrafter(tiny_drafter.model, tiny.vocab_size, tiny.model.info.vocab_size), 3, 10**6)
    keys = [k for k in set(ar) | set(sd) if ar[k] + sd[k] >= 10]
    table = [[ar[k] for k in keys], [sd[k] for k in keys]]
    assert len(keys) >= 4
    assert chi2_contingency(table).pvalue > 1e-3


def test_bad_requests_are_clear(tiny):
    dec = SpeculativeDecoder(tiny, ARDrafter())
    with pytest.raises(Exception, match="prompt is empty"):
        dec.generate([GenerationRequest([])])
    ctx = tiny.model.info.max_position
    with pytest.raises(Exception, match="exceeds the model's context"):
        dec.generate([GenerationRequest([1] * (ctx - 2), max_new_tokens=10)])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft-self"])
def test_smollm2_greedy_equivalence(smollm2_dir, method):
    target = load_model(str(smollm2_dir), dtype="fp32", device="cpu")
    tok = target.tokenizer
    texts = ["Write a Python function that reverses a string.", "List three colors: red, green,"]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        for t in texts
    ]
    base = _decode(target, ARDrafter(), 0, prompts, max_new=32)
    drafter = (
        NgramDrafter()
        if method == "ngram"
        else DraftModelDrafter(target.model, target.vocab_size, target.model.info.vocab_size)
    )
    spec = _decode(target, drafter, 4, prompts, max_new=32)
    assert [s.token_ids for s in spec] == [b.token_ids for b in base]
    if method == "draft-self":
        assert all(s.tau > 3 for s in spec)


class SiblingTreeDrafter(DraftModelDrafter):
    """A tree: at every depth a wrong sibling (token + 1) is tried first, then the drafter's own
    chain token, which continues the path. Deterministic siblings (point masses)."""

    def propose(self, batch, num_draft):
        prop = super().propose(batch, num_draft)
        k = prop.max_k
        chain = prop.draft_ids  # [B, K]
        ids = torch.zeros(len(batch), 2 * k, dtype=torch.long)
        parents = torch.zeros(len(batch), 2 * k, dtype=torch.long)
        for j in range(k):  # node 2j: wrong sibling, node 2j+1: chain token; both children of chain j-1
            parent = 2 * j - 1 if j > 0 else -1
            ids[:, 2 * j] = (chain[:, j] + 1) % self.vocab_size
            ids[:, 2 * j + 1] = chain[:, j]
            parents[:, 2 * j] = parents[:, 2 * j + 1] = parent
        prop.extras["chain_len"] = prop.num_draft.clone()
        return Proposal(
            draft_ids=ids, num_draft=2 * prop.num_draft, parents=parents, tree_iid=False, extras=prop.extras
        )

    def advance(self, batch, proposal, verdicts, target_out):
        if proposal.parents is None:  # a step without drafts
            return super().advance(batch, proposal, verdicts, target_out)
        # Drafts the drafter fed itself are only valid along the chain (odd node indices).
        chain_verdicts = []
        for v in verdicts:
            run = 0
            for node in v.accepted_nodes:
                if node % 2 == 0:
                    break
                run += 1
            chain_verdicts.append(Verdict([0] * (run + 1), list(range(run + 1)), v.num_draft // 2, v.depth))
        chain = Proposal(draft_ids=proposal.draft_ids[:, 1::2], num_draft=proposal.extras["chain_len"])
        super().advance(batch, chain, chain_verdicts, target_out)


def test_tree_proposals_are_exact_and_accept_along_the_tree(tiny):
    prompts = _prompts(tiny.tokenizer)
    base = _decode(tiny, ARDrafter(), 0, prompts)
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    spec = _decode(tiny, SiblingTreeDrafter(tiny.model, v, rows), 3, prompts)
    assert [s.token_ids for s in spec] == [b.token_ids for b in base]
    assert all(s.tau > 3 for s in spec)  # every chain node accepted after its wrong sibling
    # Sampled decoding through trees runs and stays within the request's own random stream.
    params = SamplingParams(temperature=1.0)
    a = _decode(tiny, SiblingTreeDrafter(tiny.model, v, rows), 3, prompts, params=params)
    b = _decode(tiny, SiblingTreeDrafter(tiny.model, v, rows), 3, prompts, params=params, max_batch=1)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


class _PoisonSlot:
    """The target with non-finite logits for one cache slot from its `after`-th step on."""

    def __init__(self, model, slot, value, after=2):
        self._model, self.slot, self.value, self.after, self.calls = model, slot, value, after, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, ids, positions, cache, slots, **kw):
        out = self._model.forward(ids, positions, cache, slots, **kw)
        if out.logits is not None and ids.shape[1] > 0 and self.slot in slots:
            self.calls += 1
            if self.calls > self.after:
                out.logits[slots.index(self.slot), -1, 5] = self.value
        return out


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_failing_request_ends_alone(tiny, tiny_drafter, value, sampled):
    """Non-finite logits in one row end that request with an error; its neighbours decode exactly
    as they do without it (same tokens, same random streams)."""

    prompts = _prompts(tiny.tokenizer)
    params = SamplingParams(temperature=1.0) if sampled else SamplingParams()

    def drafter():
        return DraftModelDrafter(tiny_drafter.model, tiny.vocab_size, tiny.model.info.vocab_size)

    clean = _decode(tiny, drafter(), 3, prompts, params=params)
    poisoned = dataclasses.replace(tiny, model=_PoisonSlot(tiny.model, slot=0, value=value))
    out = _decode(poisoned, drafter(), 3, prompts, params=params)
    assert out[0].finish_reason == "error" and "not finite" in out[0].error
    assert len(out[0].token_ids) < 24
    assert all(0 <= t < tiny.vocab_size for t in out[0].token_ids)
    assert [r.token_ids for r in out[1:]] == [r.token_ids for r in clean[1:]]
    assert all(r.error is None and r.finish_reason == "length" for r in out[1:])


def test_tree_request_without_drafts_samples_the_same_in_a_batch(tiny):
    """A request that drafts nothing in a tree step (one token left) uses the same random stream
    as it does alone, where the step has no tree at all."""
    v, rows = tiny.vocab_size, tiny.model.info.vocab_size
    params = SamplingParams(temperature=1.0)
    long_prompt, short_prompt = _prompts(tiny.tokenizer, 2)
    seeds = range(100, 116)

    def run(reqs):
        drafter = SiblingTreeDrafter(tiny.model, v, rows)
        dec = SpeculativeDecoder(tiny, drafter, FixedK(3), max_batch=len(reqs))
        return {r.id: r.token_ids for r in dec.generate(reqs)}

    short = [GenerationRequest(short_prompt, params, 1, seed=s, id=f"s{s}", ignore_eos=True) for s in seeds]
    busy = GenerationRequest(long_prompt, params, 12, seed=1, id="busy", ignore_eos=True)
    batched = run([busy, *short])
    alone = {}
    for r in short:
        alone.update(run([r]))
    assert {k: batched[k] for k in alone} == alone
    assert len({tuple(t) for t in alone.values()}) > 1  # the seeds do sample different tokens


# ---- prefix sharing ----------------------------------------------------------------------------


class _HiddenRecorder(NgramDrafter):
    """An n-gram drafter that also reads the target's hidden states: records what `start` gets."""

    needs_hidden = (0, 1)

    def __init__(self):
        super().__init__()
        self.seen = {}

    def start(self, slot, prompt_ids, hidden=None):
        super().start(slot, prompt_ids, hidden)
        self.seen.setdefault(tuple(prompt_ids), []).append(hidden)


def _shared_prompts(tok):
    """Two prompts sharing a 20+ token prefix, and each of them twice (samples of one prompt)."""
    head = tok("the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat by the door")[
        "input_ids"
    ]
    a, b = head + tok(" and then it rains")["input_ids"], head + tok(" so we go home")["input_ids"]
    return [a, a, b, b]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)])
@pytest.mark.parametrize("drafter", ["ar", "ngram", "hidden"])
def test_prefix_sharing_decodes_as_without_it(tiny, params, drafter):
    """Requests that copy a shared prompt prefix (a sibling's whole prompt, or another's common
    head) give the tokens they give when every prompt is computed (fp32; greedy and sampled)."""
    prompts = _shared_prompts(tiny.tokenizer)
    make = {"ar": ARDrafter, "ngram": NgramDrafter, "hidden": _HiddenRecorder}[drafter]
    k = 0 if drafter == "ar" else 3
    runs = {}
    for share in (False, True):
        d = make()
        dec = SpeculativeDecoder(tiny, d, FixedK(k), max_batch=4, share_prefix=share)
        reqs = []
        for i, p in enumerate(prompts):
            reqs.append(GenerationRequest(p, params, 16, seed=i, id=str(i), ignore_eos=True))
        runs[share] = ([r.token_ids for r in dec.generate(reqs)], dec.shared_tokens, d)
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 0
    # The second sample of each prompt waits for the first and copies it whole (the first of the
    # second prompt does not wait for the head the first prompt is still computing).
    assert runs[True][1] == len(prompts[0]) - 1 + len(prompts[2]) - 1
    if drafter == "hidden":
        for key, alone in runs[False][2].seen.items():
            for h_shared, h_alone in zip(runs[True][2].seen[key], alone, strict=True):
                for layer in (0, 1):
                    assert h_shared[layer].shape == h_alone[layer].shape
                    torch.testing.assert_close(h_shared[layer], h_alone[layer], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("same", [True, False])
def test_prefix_is_copied_from_a_running_request(tiny, same):
    """A request admitted while another decodes copies the rows their prompts share at once (the
    whole prompt but its last token, or the common head) and decodes as it does alone."""
    first, _, other, _ = _shared_prompts(tiny.tokenizer)
    second = first if same else other
    alone = [_decode(tiny, ARDrafter(), 0, [p], max_new=12)[0].token_ids for p in (first, second)]
    dec = SpeculativeDecoder(tiny, ARDrafter(), FixedK(0), max_batch=2)
    dec.reserve(2, 128)
    dec.add_request(GenerationRequest(first, SamplingParams(), 12, seed=0, id="0", ignore_eos=True))
    out, copied = {}, []
    for step in range(40):
        if step == 3:
            dec.add_request(GenerationRequest(second, SamplingParams(), 12, seed=1, id="1", ignore_eos=True))
        before = dec.shared_tokens
        for ev in dec.step():
            if ev.result:
                out[ev.request_id] = ev.result.token_ids
        copied.append(dec.shared_tokens - before)
        if not dec.has_unfinished():
            break
    assert [out["0"], out["1"]] == alone
    head = next(i for i, (a, b) in enumerate(zip(first, other, strict=False)) if a != b)
    assert copied[3] == (len(first) - 1 if same else head)  # in one copy, at admission
    assert sum(copied) == copied[3]


def test_a_sharer_whose_source_is_aborted_prefills_alone(tiny):
    prompt = _shared_prompts(tiny.tokenizer)[0]
    short = _prompts(tiny.tokenizer, 1)[0]
    alone = _decode(tiny, ARDrafter(), 0, [prompt], max_new=10)[0].token_ids
    dec = SpeculativeDecoder(tiny, ARDrafter(), FixedK(0), max_batch=3, prefill_chunk=4)
    dec.reserve(3, 128)
    dec.add_request(GenerationRequest(short, SamplingParams(), 30, id="busy", ignore_eos=True))
    dec.step()  # "busy" decodes from now on: prompts are read 4 tokens a step beside it
    for i in range(2):
        dec.add_request(GenerationRequest(prompt, SamplingParams(), 10, seed=i, id=str(i), ignore_eos=True))
    dec.step()  # "1" waits for "0", which has read its first 4 tokens
    source, sharer = sorted(dec._prefilling, key=lambda r: r.req.id)
    assert sharer.share_from is source and source.num_prefilled == 4 and sharer.num_prefilled == 0
    assert dec.abort("0")
    out = {}
    while dec.has_unfinished():
        for ev in dec.step():
            if ev.result:
                out[ev.request_id] = ev.result.token_ids
    assert out["1"] == alone
    assert dec.shared_tokens == 0


def test_requests_without_detokenization_give_the_same_ids(tiny):
    prompts = _prompts(tiny.tokenizer)
    dec = SpeculativeDecoder(tiny, ARDrafter(), FixedK(0), max_batch=3)
    reqs = [GenerationRequest(p, SamplingParams(), 12, id=str(i)) for i, p in enumerate(prompts)]
    with_text = dec.generate(reqs)
    ids_only = dec.generate([dataclasses.replace(r, detokenize=False) for r in reqs])
    assert [r.token_ids for r in ids_only] == [r.token_ids for r in with_text]
    assert all(r.text == "" for r in ids_only) and any(r.text for r in with_text)
    with pytest.raises(SpecDecodeError, match="stop strings need text"):
        dec.add_request(GenerationRequest(prompts[0], stop=("x",), detokenize=False))
