"""Loop-level losslessness at real draft lengths, for every method family.

Contract: for each drafter family (draft model, n-gram, Medusa chain and tree, MTP, EAGLE chain
and tree, DFlash, DSpark with and without confidence truncation, and the `scheduled` policy on
DSpark's confidences), the first DEPTH tokens emitted by the full speculative loop
(`SpeculativeDecoder`, K = 3 drafts or 5-node trees, hundreds of seeded requests per
`generate` call) follow the target's exact joint law, at T = 1 and at T = 0.7 with top-p 0.9:
a chi-square test (scipy.stats.chisquare, cells with expected count < 5 merged into one bin)
against the exact probability of every DEPTH-token continuation, enumerated by running the
target (in transformers) on every likely prefix (loop_stats.exact_law).

The target is a tiny random model whose law is concentrated on four tokens but depends
strongly on the context (loop_stats.write_peaked), and the drafters are built to agree with it
often (a noisy copy of the target; heads and learned drafters over a draft vocabulary of those
four tokens, some set up to copy the target), so every run sees multi-token acceptances,
recoveries and bonus tokens at K = 3; each test asserts that all of them occurred. Each test
then runs the same loop with a deliberately broken verifier (the token after a rejection
re-drawn from the target's p instead of the residual) and asserts that the chi-square test
rejects it. The correct loop's p-value must exceed P_PASS, the broken one's stay below P_FAIL;
seeds are fixed, so the outcome is deterministic. Point-mass chains (n-gram, Medusa) are
verified by sample-then-match on position-keyed uniforms, so their output is the target's own
sample for each seed. Tests over ~10 s are marked `heavy`; each prints (with -s) and records
its counts, p-values and time.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from loop_stats import VerifierSpy, chi_square, exact_law

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.dflash import BlockTree, DFlash, DFlashConfig, DFlashDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.dspark import DSpark, DSparkDrafter
from specdecode.drafters.eagle import Eagle3, EagleConfig, EagleDrafter, TreeSpec
from specdecode.drafters.layers import target_shape
from specdecode.drafters.medusa import Medusa, MedusaConfig, MedusaDrafter
from specdecode.drafters.mtp import MTP, MTPConfig, MTPDrafter
from specdecode.drafters.ngram import NgramDrafter, NgramTable
from specdecode.models import kernels
from specdecode.policy import FixedK, ScheduledK, StepCostModel
from specdecode.sampling import plain_temperature
from specdecode.tree import tree_from_paths

DEPTH = 4  # tokens of the joint law: K = 3 drafts and the bonus after them
K = 3
TREE_NODES = 5
MEDUSA_PATHS = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]  # rank paths: two candidates at the root
MAX_BATCH = 256
P_PASS = 1e-4  # a correct loop fails with probability 1e-4 per test (seeds are fixed)
P_FAIL = 1e-6
SETTINGS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7-top-p0.9": SamplingParams(temperature=0.7, top_p=0.9),
}


# ---- drafters that agree with the target often ----------------------------------------------------
def _d2t(peaked) -> torch.Tensor:
    return torch.tensor(peaked.support)  # draft vocabulary = the target's likely tokens


@contextlib.contextmanager
def _seeded(seed: int):
    """Seeded default initialisation of a drafter network, leaving the global RNG as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def _medusa(peaked, tree: bool):
    info = peaked.target.model.info
    with _seeded(0), torch.no_grad():
        net = Medusa(MedusaConfig(info.hidden_size, K, len(peaked.support), info.vocab_size))
        net.init_from_target(peaked.target.model.lm_head_weight(), _d2t(peaked))
        for blk in net.blocks:  # distinct heads (zero-initialised ones all copy the target's head)
            blk.weight.normal_(0.0, 0.2)
    shape = tree_from_paths(MEDUSA_PATHS) if tree else None
    return MedusaDrafter(net, peaked.target, tree=shape)


def _mtp(peaked):
    target = peaked.target
    cfg = MTPConfig(num_modules=K, **target_shape(target.model.info, target.config, len(peaked.support)))
    d = cfg.hidden_size
    with _seeded(1), torch.no_grad():
        net = MTP(cfg)
        net.d2t.copy_(_d2t(peaked))
        # Modules that nearly copy the target's state, so q_k ~ the target's p one position back,
        # sharpened (out_norm x 3) into an overconfident guess of its likeliest token.
        for mod in net.mods:
            mod.proj.weight[:, :d] = torch.eye(d)
            mod.proj.weight[:, d:] *= 0.1
            mod.attn.o_proj.weight *= 0.1
            mod.mlp.down_proj.weight *= 0.1
            mod.out_norm.weight.fill_(3.0)
    return MTPDrafter(net.eval(), target, start_depth=K)  # the law's first round drafts K


def _eagle(peaked, tree: bool):
    target = peaked.target
    with _seeded(2), torch.no_grad():
        net = Eagle3(EagleConfig.for_target(target.model.info, target.config, len(peaked.support)))
        net.init_from_target(target.model.lm_head_weight(), _d2t(peaked))
    spec = TreeSpec(depth=K, topk=2, num_nodes=TREE_NODES, when_sampling="tree") if tree else None
    return EagleDrafter(net.eval(), target, tree=spec)


def _dflash_cfg(peaked, **kw):
    t = peaked.target
    return DFlashConfig.for_target(t.model.info, t.config, len(peaked.support), num_layers=2, **kw)


def _dflash(peaked):
    with _seeded(3), torch.no_grad():
        net = DFlash(_dflash_cfg(peaked, block_size=K + 1))  # slot 0 is the anchor: K drafts
        net.init_from_target(peaked.target.model.embed_tokens, _d2t(peaked))
    return DFlashDrafter(net.eval(), peaked.target)


def _dspark(peaked, threshold=None, tree=None):
    with _seeded(4), torch.no_grad():
        net = DSpark(_dflash_cfg(peaked, block_size=K, layout="dspark", markov_rank=8))
        net.init_from_target(peaked.target.model.embed_tokens, _d2t(peaked))
        d = net.cfg.hidden_size
        # A Markov head and confidences that matter: q_k and c_k depend on x_{k-1} (through W1)
        # and on the context (through h_k, without its constant coordinate 0).
        net.W1.weight.normal_(0.0, 1.0)
        net.W2.weight.normal_(0.0, 0.2)
        net.conf.weight[:, :d].normal_(0.0, 0.1)
        net.conf.weight[:, 0] = 0.0
        net.conf.weight[:, d:].normal_(0.0, 1.0)
        net.conf.bias.zero_()
    return DSparkDrafter(net.eval(), peaked.target, confidence_threshold=threshold, tree=tree)


@dataclass(frozen=True)
class Family:
    drafter: Callable  # Peaked -> Drafter
    # Requests per run, for the correct and the broken loop alike: chosen from the measured
    # strength of the broken verifier's effect (chi-square noncentrality per request) so that the
    # broken run's expected p-value is below 1e-10 at both settings.
    n: int
    policy: Callable = lambda: FixedK(K)
    max_new: int = DEPTH  # a tree's node budget is capped by the tokens left, so trees get more
    heavy: bool = False  # over ~10 s per test on 2 busy cores


def _scheduler():
    # Flat step cost plus a little per verified token: at a full batch only the most confident
    # drafts pay for a longer block, so how many a request keeps depends on the whole batch.
    return ScheduledK(K, StepCostModel.flat(step=1.0, per_token=3e-6, max_rows=MAX_BATCH))


def _draft_model(pk):
    return DraftModelDrafter(pk.draft.model, pk.target.vocab_size, pk.target.model.info.vocab_size)


def _random_table(pk):
    # random text over the target's likely tokens: every short context is in the table, so the
    # walk drafts whenever the prompt holds no match of two tokens or more
    g = torch.Generator().manual_seed(5)
    support = torch.tensor(pk.support)
    text = support[torch.randint(0, len(support), (2000,), generator=g)]
    return NgramTable.build([text.tolist()], orders=(2,), min_count=1, min_share=0.0)


def _tree_policy():
    return FixedK(TREE_NODES)


FAMILIES = {
    "draft": Family(_draft_model, n=768),
    "ngram": Family(lambda pk: NgramDrafter(), n=384),
    "ngram-tree": Family(lambda pk: NgramDrafter(tree=True), 192, _tree_policy, TREE_NODES + 1, heavy=True),
    "ngram-table": Family(lambda pk: NgramDrafter(table=_random_table(pk)), n=384),
    "medusa": Family(lambda pk: _medusa(pk, tree=False), n=384),
    "medusa-tree": Family(lambda pk: _medusa(pk, tree=True), 256, _tree_policy, TREE_NODES + 1, heavy=True),
    "mtp": Family(_mtp, n=192, heavy=True),
    "eagle": Family(lambda pk: _eagle(pk, tree=False), n=384),
    "eagle-tree": Family(lambda pk: _eagle(pk, tree=True), 192, _tree_policy, TREE_NODES + 1, heavy=True),
    "dflash": Family(_dflash, n=384),
    "dspark": Family(_dspark, n=384),
    "dspark-threshold": Family(lambda pk: _dspark(pk, threshold=0.3), n=384),
    # The DSpark scheduler on the drafter's confidences: bounds, then Algorithm 1's truncation
    # after drafting (its K from running statistics is fixed before drafting, lossless as FixedK).
    "scheduled": Family(_dspark, n=384, policy=_scheduler),
    # A new family joins at the end: each family's seeds come from its place in this dict.
    "ngram-table-tree": Family(
        lambda pk: NgramDrafter(table=_random_table(pk), tree=True),
        192,
        _tree_policy,
        TREE_NODES + 1,
        heavy=True,
    ),
    # DSpark's Markov tree (with prompt lookup's branch), drafted at both settings' temperatures.
    "dspark-tree": Family(
        lambda pk: _dspark(pk, tree=BlockTree(topk=2, lookup=True, max_temperature=1.0)),
        192,
        _tree_policy,
        TREE_NODES + 1,
        heavy=True,
    ),
}
N_MAX = max(f.n for f in FAMILIES.values())


# ---- running the loop -----------------------------------------------------------------------------
def _sample(peaked, family: str, params: SamplingParams, seed: int, broken: bool, monkeypatch):
    """(Counter of the first DEPTH tokens over the family's n seeded requests, decoded in one
    generate() call, the verifier spy) with a correct or a broken verifier."""
    fam = FAMILIES[family]
    with monkeypatch.context() as m:
        spy = VerifierSpy(broken=broken).install(m)
        dec = SpeculativeDecoder(peaked.target, fam.drafter(peaked), fam.policy(), max_batch=MAX_BATCH)
        reqs = [
            GenerationRequest(peaked.prompt, params, fam.max_new, seed=seed + i, id=str(i), ignore_eos=True)
            for i in range(fam.n)
        ]
        results = dec.generate(reqs)
    return collections.Counter(tuple(r.token_ids[:DEPTH]) for r in results), spy


@pytest.fixture(scope="module")
def laws(peaked):
    """Exact DEPTH-token laws per sampling setting (every cell of probability >= 5 / N_MAX)."""
    out = {}
    for name, params in SETTINGS.items():
        law, margin = exact_law(
            peaked.reference, peaked.prompt, params, peaked.target.vocab_size, DEPTH, 5 / N_MAX
        )
        assert margin > 1e-4, "a top-p cut is too close to call between implementations"
        assert 0.5 < sum(law.values()) <= 1.0 + 1e-9 and len(law) >= 10, "the law is too concentrated"
        out[name] = law
    return out


def _params(family: str):
    marks = [pytest.mark.heavy] if FAMILIES[family].heavy else []
    return [pytest.param(family, setting, marks=marks, id=f"{family}-{setting}") for setting in SETTINGS]


@pytest.mark.parametrize(("family", "setting"), [p for f in FAMILIES for p in _params(f)])
def test_loop_matches_exact_target_law(peaked, laws, monkeypatch, record_property, family, setting):
    params, law, n = SETTINGS[setting], laws[setting], FAMILIES[family].n
    seed = 100_000 * list(FAMILIES).index(family)  # independent samples per family
    t0 = time.perf_counter()
    counts, spy = _sample(peaked, family, params, seed, False, monkeypatch)
    p_ok, bins = chi_square(counts, law, n)
    t1 = time.perf_counter()
    bad_counts, bad_spy = _sample(peaked, family, params, seed + 50_000, True, monkeypatch)
    p_bad, _ = chi_square(bad_counts, law, n)
    report = (
        f"{family} {setting}: N={n} bins={bins} {spy.summary()} p={p_ok:.3g} | broken p={p_bad:.3g} "
        f"{bad_spy.summary()} | {t1 - t0:.1f}s + {time.perf_counter() - t1:.1f}s"
    )
    print("\n" + report)  # shown with -s
    record_property("loop_distribution", report)  # and in --junitxml reports
    assert spy.calls > 0, "the loop no longer calls specdecode.decode.verify_*: update VerifierSpy"
    if kernels.fused() is not None and plain_temperature(params, peaked.target.vocab_size):
        # plain-temperature chains and trees run on our CPU kernel: this is its losslessness test
        assert spy.native > 0, "no chain or tree went through verify_native's kernel"
    assert spy.accepted > 0 and spy.recovered > 0 and spy.bonus > 0, spy.summary()
    assert spy.multi > 0 and max(spy.drafts) >= K, spy.summary()  # real draft lengths, accepted
    assert p_ok > P_PASS, f"{family} at {setting} does not follow the target's law (p = {p_ok:.3g})"
    assert p_bad < P_FAIL, f"the test cannot see a broken verifier for {family} (p = {p_bad:.3g})"
