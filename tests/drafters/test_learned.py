"""Every learned drafter (EAGLE-3, Medusa, MTP, distilled draft, DFlash, DSpark; chain and tree)
is lossless in the real loop."""

import collections
import json

import pytest
import torch
from fakes import decode_fixed_k, short_prompts
from scipy.stats import chi2_contingency

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters import build_drafter
from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.eagle import TreeSpec, load_eagle
from specdecode.drafters.medusa import load_medusa
from specdecode.drafters.mtp import load_mtp
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model
from specdecode.policy import FixedK

CASES = [
    ("eagle", False),
    ("eagle", True),
    ("medusa", False),
    ("medusa", True),
    ("mtp", False),
    ("draft", False),
    ("dflash", False),
    ("dspark", False),
]


def _drafter(method, trained, target, tree=False):
    out, _ = trained(method)
    if method == "eagle":
        return load_eagle(out, target, tree=TreeSpec(depth=4, topk=3, num_nodes=10) if tree else None)
    if method == "mtp":
        return load_mtp(out, target)
    if method in ("draft", "dflash", "dspark"):
        return build_drafter(method, target, str(out))
    return load_medusa(out, target, tree=tree, num_nodes=10)


@pytest.fixture
def kernel_target(tiny_llama_dir):
    """The tiny target (fp32) with our compiled kernels in its plan, so the drafters' one-call
    layers and chains apply; the test is skipped where the kernels cannot run."""
    from specdecode.models import kernels
    from specdecode.models.formats import BUCKETS, FormatPlan

    if kernels.fused() is None:
        pytest.skip(f"our kernels are not available here: {kernels.unavailable.get('cpu')}")
    target = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    target.model.use_formats(FormatPlan(("bf16w",) * len(BUCKETS)))
    return target


@pytest.mark.parametrize(("method", "tree"), CASES)
def test_greedy_learned_drafter_equals_greedy_ar(tiny, trained, method, tree):
    prompts = short_prompts(tiny.tokenizer)
    ar = decode_fixed_k(tiny, ARDrafter(), 0, prompts)
    k = 10 if tree else 3
    sd = decode_fixed_k(tiny, _drafter(method, trained, tiny, tree), k, prompts)
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    assert sum(r.tau for r in sd) / len(sd) > 1.2  # it really drafts and is accepted


@pytest.mark.parametrize("method", ["eagle", "mtp", "draft", "dflash", "dspark"])
def test_the_drafter_reads_the_prompt_at_prefill_only_where_it_may_draft(tiny, trained, method):
    """A drafter with a cache of its own runs the prompt through it when the request starts
    (`prefill`, the request's prefill time), not in its first drafting round: on a 1,754-token
    prompt that pass took EAGLE-3 ~90 ms, four or five target steps charged to decoding. After
    it the drafter's cache holds the prompt's rows (all but the last token, as the target's
    does) and greedy output is still ar's. A decoder that never drafts (K 0) skips it."""
    drafter = _drafter(method, trained, tiny)
    prompts = short_prompts(tiny.tokenizer)
    seen, real_prefill = [], drafter.prefill

    def prefill(slot, prompt_ids):
        real_prefill(slot, prompt_ids)
        cache = drafter.caches[0] if method == "mtp" else drafter.cache  # MTP: module 1
        seen.append((cache.lengths[slot], len(prompt_ids)))

    drafter.prefill = prefill
    sd = decode_fixed_k(tiny, drafter, 3, prompts)
    assert len(seen) == len(prompts) and all(rows == p - 1 > 0 for rows, p in seen)
    assert all(r.prefill_time_s > 0 for r in sd)
    ar = decode_fixed_k(tiny, ARDrafter(), 0, prompts)
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    seen.clear()
    plain = decode_fixed_k(tiny, drafter, 0, prompts)
    assert seen == [] and [r.token_ids for r in plain] == [r.token_ids for r in ar]


@pytest.mark.parametrize(("method", "tree"), CASES)
def test_a_prompt_read_while_others_decode_rides_and_stays_exact(tiny, trained, method, tree, monkeypatch):
    """Two slots, three requests: the third is admitted when the short first one ends, and its
    prompt rides in the second one's decode steps (its hidden states captured there). Greedy
    tokens stay those of ar, and the rider drafts as it does alone."""
    prompts = short_prompts(tiny.tokenizer)
    ar = decode_fixed_k(tiny, ARDrafter(), 0, prompts)
    rode = []
    real = type(tiny.model).forward_segments

    def spy(self, cache, segments):
        rode.append(len(segments) > 1 and segments[0].logits)  # a verify block with riders
        return real(self, cache, segments)

    monkeypatch.setattr(type(tiny.model), "forward_segments", spy)
    dec = SpeculativeDecoder(
        tiny, _drafter(method, trained, tiny, tree), FixedK(10 if tree else 3), max_batch=2
    )
    reqs = [
        GenerationRequest(p, SamplingParams(), n, seed=i, id=str(i), ignore_eos=True)
        for i, (p, n) in enumerate(zip(prompts, (6, 32, 32), strict=True))
    ]
    sd = dec.generate(reqs)
    assert any(rode)
    assert sd[0].token_ids == ar[0].token_ids[:6]
    assert [r.token_ids for r in sd[1:]] == [r.token_ids for r in ar[1:]]
    # The rider's drafter started from the states captured in those steps: it drafts as alone.
    alone = decode_fixed_k(
        tiny, _drafter(method, trained, tiny, tree), 10 if tree else 3, prompts[2:], seed=2
    )[0]
    assert sd[2].accepted_per_position == alone.accepted_per_position and alone.tau > 1


@pytest.mark.parametrize(("method", "tree"), CASES)
def test_sampled_batch_equals_single_and_matches_ar_distribution(tiny, trained, method, tree):
    prompts = short_prompts(tiny.tokenizer)
    params = SamplingParams(temperature=1.0, top_k=20)
    k = 10 if tree else 3
    batched = decode_fixed_k(
        tiny, _drafter(method, trained, tiny, tree), k, prompts, params=params, max_batch=3
    )
    singles = [
        decode_fixed_k(tiny, _drafter(method, trained, tiny, tree), k, [p], params=params, seed=i)[0]
        for i, p in enumerate(prompts)
    ]
    if not tree:
        # Trees keep the best-ranked nodes: near-ties can rank differently in a batch than alone
        # (float rounding), which changes which sample a seed gives, never the distribution.
        assert [r.token_ids for r in batched] == [r.token_ids for r in singles]

    n, prompt = 1200, prompts[0]
    params = SamplingParams(temperature=1.0, top_k=6)

    def draw(drafter, k, base):
        res = decode_fixed_k(
            tiny, drafter, k, [prompt] * n, params=params, max_batch=64, max_new=2, seed=base
        )
        return collections.Counter(tuple(r.token_ids) for r in res)

    ar, sd = draw(ARDrafter(), 0, 0), draw(_drafter(method, trained, tiny, tree), k, 10**6)
    keys = [key for key in set(ar) | set(sd) if ar[key] + sd[key] >= 10]
    assert len(keys) >= 4
    assert chi2_contingency([[ar[key] for key in keys], [sd[key] for key in keys]]).pvalue > 1e-3


def test_checkpoint_for_another_target_or_method_is_refused(trained, tiny_qwen2_dir, tiny):
    out, _ = trained("eagle")
    other = load_model(str(tiny_qwen2_dir), dtype="fp32", device="cpu")
    with pytest.raises(SpecDecodeError, match="trained for target"):
        load_eagle(out, other)
    with pytest.raises(SpecDecodeError, match="not a directory"):
        load_eagle(out / "nope", other)
    with pytest.raises(SpecDecodeError, match="holds a 'eagle' drafter"):
        load_medusa(out, tiny)
    with pytest.raises(SpecDecodeError, match="no medusa drafter ships"):
        build_drafter("medusa", tiny)


def test_cli_generate_with_a_trained_drafter_and_clear_errors(
    capsys, trained, tiny_llama_dir, tiny_qwen2_dir
):
    from specdecode.cli import main

    out, _ = trained("eagle")
    capsys.readouterr()  # what training the fixture printed, when this test is the first to need it
    base = ["generate", "--prompt", "the cat sat", "--max-new-tokens", "12", "--dtype", "fp32", "--json"]
    code = main(
        [
            *base,
            "--target",
            str(tiny_llama_dir),
            "--method",
            "eagle",
            "--drafter",
            str(out),
            "--policy",
            "fixed",
        ]
    )
    res, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(res.splitlines()[0])["num_new_tokens"] >= 1
    code = main([*base, "--target", str(tiny_qwen2_dir), "--method", "eagle", "--drafter", str(out)])
    assert code == 2 and "trained for target" in capsys.readouterr().err
    code = main([*base, "--target", str(tiny_llama_dir), "--method", "mtp", "--drafter", str(out)])
    assert code == 2 and "holds a 'eagle' drafter" in capsys.readouterr().err
    code = main([*base, "--target", str(tiny_llama_dir), "--method", "eagle"])
    assert code == 2 and "no eagle drafter ships" in capsys.readouterr().err


def test_cli_train_refuses_bad_input(capsys, tiny_llama_dir, tiny_qwen2_dir, regen_dir, tmp_path):
    from specdecode.cli import main

    args = [
        "train",
        "eagle",
        "--target",
        str(tiny_llama_dir),
        "--dtype",
        "fp32",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main([*args, "--data", str(tmp_path / "missing")]) == 2
    assert "no regenerated data" in capsys.readouterr().err
    assert main([*args, "--data", str(regen_dir), "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert (
        main(["train", "hydra", "--target", str(tiny_llama_dir), "--data", str(regen_dir), "--out", "x"]) == 2
    )
    assert "trainable methods" in capsys.readouterr().err
    assert main([*args, "--data", str(regen_dir), "--target", str(tiny_qwen2_dir)]) == 2
    assert "regenerated by" in capsys.readouterr().err


def test_adaptive_policy_times_a_learned_drafters_rounds_once(trained, tiny, tmp_path, monkeypatch):
    from specdecode import build as build_mod

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    out, _ = trained("eagle")
    opts = build_mod.LoadOptions(target=tiny, method="eagle", drafter=str(out), num_draft_tokens=3)
    pol = build_mod.build(opts).decoder.policy
    assert pol.draft_fixed > 0 or pol.draft_cost > 0  # measured, not the class default
    assert pol.draft_cost != build_mod.build_drafter("eagle", tiny, str(out)).cost_per_token
    (rec,) = (tmp_path / "profiles").glob("draft-*.json")
    timed = json.loads(rec.read_text())
    assert {"fixed_s", "per_token_s"} <= set(timed) and set(timed["rounds_s"]) == {"1", "3"}
    c1, c2, c3 = pol.draft_curve  # timed at K = 1 and 3, linear between
    rounds = timed["rounds_s"]
    assert c2 == pytest.approx((c1 + c3) / 2) and c3 / c1 == pytest.approx(rounds["3"] / rounds["1"])
    calls = []
    monkeypatch.setattr(build_mod, "_round_seconds", lambda *a, **k: calls.append(a) or 1.0)
    monkeypatch.setattr(build_mod, "_step_timer", lambda *a, **k: lambda n, t: calls.append((n, t)) or 1.0)
    again = build_mod.build(opts).decoder.policy  # cached: the same decisions, nothing timed
    assert not calls and (again.draft_fixed, again.draft_cost) == (pol.draft_fixed, pol.draft_cost)
    assert again.draft_curve == pol.draft_curve and len(pol.draft_curve) == 3
    assert pol.sampled_k_max == 3  # a chain drafter drafts what it is asked at any temperature
    tree_opts = build_mod.LoadOptions(target=tiny, method="eagle-tree", drafter=str(out), num_draft_tokens=8)
    tree = build_mod.build(tree_opts)
    depth = tree.decoder.drafter.tree.depth
    assert 1 < depth < 8 and tree.decoder.policy.sampled_k_max == depth  # sampled rounds: chains


def test_served_tau_is_evaluated_on_a_prompt_sets_heldout_split(
    tiny, regen_dir, prompts_dir, train_cfg, method_kw, tmp_path
):
    """Regenerated data without a held-out split (only train regenerated so far) evaluates the
    served tau on the held-out prompts of `eval_data`, a prompt set."""
    import shutil

    from specdecode.training.run import run_training

    data = tmp_path / "regen-train-only"
    data.mkdir()
    for name in ("meta.json", "train.jsonl"):
        shutil.copy(regen_dir / name, data / name)
    out = tmp_path / "medusa"
    cfg = train_cfg(out, 2, eval_prompts=2)
    skipped = run_training("medusa", tiny, data, out, cfg, method_kw["medusa"], progress=False)
    assert "eval_tau" not in skipped
    out2 = tmp_path / "medusa-eval"
    summary = run_training(
        "medusa", tiny, data, out2, train_cfg(out2, 2, eval_prompts=2), method_kw["medusa"], progress=False,
        eval_data=prompts_dir,
    )  # fmt: skip
    assert summary["eval_tau"] >= 1.0 and len(summary["eval_acceptance"]) > 0


@pytest.mark.parametrize("method", ["eagle", "medusa", "dspark"])
def test_offline_accuracy_beside_served_acceptance(
    tiny, trained, regen_dir, prompts_dir, tmp_path, train_cfg, method_kw, method
):
    """`specdecode train --offline-vs-served`: teacher-forced accuracy per draft position on the
    held-out regenerated answers beside the served acceptance; a trained drafter scores above
    an untrained one, and a run directory without trainer.pt is refused."""
    from specdecode.training.compare import offline_accuracy
    from specdecode.training.data import load_sequences
    from specdecode.training.run import make_task, run_comparison

    out, _ = trained(method)
    cfg, kw = train_cfg(out, 80), method_kw[method]
    res = run_comparison(method, tiny, regen_dir, out, cfg, kw, eval_data=prompts_dir)
    rows = res["rows"]
    assert rows[0]["position"] == 0 and all(0 <= r["offline"] <= 1 for r in rows)
    r0 = rows[0]
    assert r0["served"] is not None and abs(r0["gap"] - 100 * (r0["offline"] - r0["served"])) <= 0.1
    assert res["sequences"] > 0 and res["prompts"] == 4
    train_seqs = load_sequences(regen_dir, "train", cfg.max_len, tiny.fingerprint)
    fresh = make_task(method, tiny, train_seqs, tmp_path, cfg, kw)
    heldout = load_sequences(regen_dir, "heldout", cfg.max_len, tiny.fingerprint)
    assert offline_accuracy(fresh, tiny, heldout, cfg.tokens_per_batch, 8)[0] < rows[0]["offline"]
    with pytest.raises(SpecDecodeError, match="trainer.pt"):
        run_comparison(method, tiny, regen_dir, tmp_path, cfg, kw, eval_data=prompts_dir)


@pytest.mark.parametrize(
    ("method", "max_batch"), [("eagle", 8), ("eagle", 1), ("dspark", 8), ("dflash", 8), ("mtp", 8)]
)
def test_drafter_layers_in_one_call_draft_as_their_modules(
    kernel_target, trained, method, max_batch, monkeypatch
):
    """With our kernels in the target's plan, an EAGLE-3 chain step (and, one request at a time,
    its causal catch-up on committed context), an MTP module's rows and a DFlash/DSpark block run
    each drafter layer as one `decode_layer` call: greedy output stays ar's, and the drafts are
    the ones the Python modules make (same math; only RoPE/attention rounding differs)."""
    target = kernel_target
    prompts = short_prompts(target.tokenizer)
    ar = decode_fixed_k(target, ARDrafter(), 0, prompts)
    drafter = _drafter(method, trained, target)
    fast = "_run_whole" if method in ("eagle", "mtp") else "_block_whole"
    real, used = getattr(type(drafter), fast), []

    def counted(self, *a, **kw):
        out = real(self, *a, **kw)
        used.append(out is not None)
        return out

    monkeypatch.setattr(type(drafter), fast, counted)
    if method == "eagle":  # the per-token loop (the one-call chain is tested against it below)
        monkeypatch.setattr(type(drafter), "_chain_args", lambda self: None)
    whole = decode_fixed_k(target, drafter, 3, prompts, max_batch=max_batch)
    monkeypatch.setattr(type(drafter), fast, lambda self, *a, **kw: None)
    modules = decode_fixed_k(target, _drafter(method, trained, target), 3, prompts, max_batch=max_batch)
    assert [r.token_ids for r in whole] == [r.token_ids for r in ar] == [r.token_ids for r in modules]
    assert [r.accepted_per_position for r in whole] == [r.accepted_per_position for r in modules]
    assert any(used)  # the one-call layers served the rounds (per-head q/k norms included)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_dflash_block_in_one_call_equals_the_modules(kernel_target, trained, method, monkeypatch):
    """One request's block through `_block_whole` (its input: the anchor's embedding, then the
    mask vector; RoPE rows of the block's positions) gives the final states the network's modules
    give for the same anchor and context, at two anchors."""
    from specdecode.drafter import DraftRow

    drafter = _drafter(method, trained, kernel_target)
    prompt = short_prompts(kernel_target.tokenizer)[0]
    dec = SpeculativeDecoder(kernel_target, drafter, FixedK(3), max_batch=1)
    out = dec.generate([GenerationRequest(prompt, SamplingParams(), 12, ignore_eos=True)])[0]
    ids = prompt + out.token_ids
    L = drafter.cache.lengths[0]  # context rows: every committed token before the anchor
    used = []
    for anchor in (L, L - 1):
        drafter.cache.lengths[0] = anchor
        row = DraftRow(0, ids[: anchor + 1], SamplingParams(), torch.Generator())
        real = type(drafter)._block_whole
        fast = drafter._block_states([row], [0])
        used.append(real(drafter, 0, anchor, ids[anchor]) is not None)
        with monkeypatch.context() as m:
            m.setattr(type(drafter), "_block_whole", lambda self, *a, **kw: None)
            modules = drafter._block_states([row], [0])
        torch.testing.assert_close(fast, modules, rtol=1e-4, atol=1e-4)
    assert all(used)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_dflash_catch_up_in_one_call_writes_the_rows_of_the_python_path(
    kernel_target, trained, method, monkeypatch
):
    """One slot's catch-up through `kernels`' context_rows (fusion, key/value product, key norms,
    RoPE and the cache writes in one call) leaves the drafter's cache holding, bit for bit, what
    the Python path (`fuse`, `_context_kv`, writes through views) leaves, and drafts alike."""
    prompts = short_prompts(kernel_target.tokenizer)[:2]
    drafter = _drafter(method, trained, kernel_target)
    real, used = type(drafter)._context_rows, []

    def counted(self, *a, **kw):
        used.append(real(self, *a, **kw))
        return used[-1]

    monkeypatch.setattr(type(drafter), "_context_rows", counted)
    caches, outs = [], []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(type(drafter), "_context_rows", lambda self, *a, **kw: False)
        d = drafter if one_call else _drafter(method, trained, kernel_target)
        outs.append([r.token_ids for r in decode_fixed_k(kernel_target, d, 3, prompts, max_batch=1)])
        n = d.cache.lengths[0]  # the last request's committed context rows
        caches.append(d.cache.kv[:, :, 0, :, :n].clone())
    assert outs[0] == outs[1]
    assert caches[0].shape == caches[1].shape and torch.equal(caches[0], caches[1])
    assert used and all(used)  # every catch-up ran as one call


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_round_in_one_call_drafts_as_the_python_path(kernel_target, trained, method, temperature):
    """A DFlash round through `kernels`' head_rows (head product, every slot's argmax or draw with
    the Python path's uniforms) and a DSpark round through markov_draft (head product, Markov
    chain, greedy or sampled, and the slots' confidences in one call) propose the drafts of the
    Python path (DSpark's per-slot loop), with its q and confidences up to rounding, and generate
    the same tokens."""
    prompts = short_prompts(kernel_target.tokenizer)
    params = SamplingParams(temperature=temperature)
    runs = []
    for one_call in (True, False):
        drafter = _drafter(method, trained, kernel_target)
        if method == "dspark":
            temp, bias = drafter.net.sts_temperature, drafter.net.sts_bias  # [Bk]: distinct per slot
            with torch.no_grad():
                temp.copy_(torch.linspace(0.6, 1.8, len(temp)))
                bias.copy_(torch.linspace(-0.5, 0.5, len(bias)))
        op = "_round_op" if method == "dspark" else "_head_op"
        if one_call:
            assert getattr(drafter, op)(torch.zeros(1, 3, 4), 3) is not None  # it applies here
        else:
            setattr(drafter, op, lambda states, rows: None)
            drafter._chain_op = lambda U, sampled=False: None  # DSpark: the per-slot loop
        proposals, inner = [], drafter.propose

        def propose(batch, num_draft, inner=inner, proposals=proposals):
            proposals.append(inner(batch, num_draft))
            return proposals[-1]

        drafter.propose = propose
        res = decode_fixed_k(kernel_target, drafter, 4, prompts, params, max_batch=8)
        runs.append(([r.token_ids for r in res], proposals))
    (tokens_a, props_a), (tokens_b, props_b) = runs
    assert tokens_a == tokens_b and len(props_a) == len(props_b) > 2
    for a, b in zip(props_a, props_b, strict=True):
        assert torch.equal(a.draft_ids, b.draft_ids) and torch.equal(a.num_draft, b.num_draft)
        if method == "dspark":
            conf_a, conf_b = a.extras["confidences"], b.extras["confidences"]
            torch.testing.assert_close(conf_a, conf_b, rtol=1e-5, atol=1e-6)
        assert (a.draft_probs is None) == (b.draft_probs is None) == (temperature == 0)
        if temperature > 0:
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_dflash_context_rows_in_one_product_equal_the_modules(kernel_target, trained, qk_norm):
    """A DFlash / DSpark catch-up with our kernels: every layer's context keys and values from
    one product, the per-head key norms and RoPE by the kernels, are what the network's modules
    give (`DFlash.context_kv`), at the rows' own positions."""
    import dataclasses

    from specdecode.drafters.dflash import DFlash, DFlashDrafter
    from specdecode.drafters.layers import cpu_plan, use_formats

    cfg = dataclasses.replace(_drafter("dflash", trained, kernel_target).net.cfg, qk_norm=qk_norm)
    torch.manual_seed(0)
    net = DFlash(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.5)
    drafter = DFlashDrafter(use_formats(net, cpu_plan(kernel_target)), kernel_target)
    assert drafter._kv_product() is not None  # the one-product path serves this drafter
    ctx = torch.randn(5, cfg.hidden_size)  # [N, d]
    # [N] positions (not consecutive, not from 0), and one request's consecutive rows as a range
    for rows in (torch.tensor([3, 4, 5, 6, 40]), range(37, 42)):
        fast = drafter._context_kv(ctx, rows)
        modules = net.context_kv(ctx[None], torch.as_tensor(rows)[None])
        assert len(fast) == len(modules) == cfg.num_layers
        for (k, v), (k_ref, v_ref) in zip(fast, modules, strict=True):
            torch.testing.assert_close(k, k_ref[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, v_ref[0], rtol=1e-5, atol=1e-5)


def test_mtp_rows_in_one_call_equal_the_modules(kernel_target, trained, monkeypatch):
    """An MTP module over N rows as one decode_layer call computes the Python modules' states
    (causal over the new rows: a row never sees a later one), for N = 1 and N = 5."""
    import torch

    target = kernel_target
    drafter = _drafter("mtp", trained, target)
    drafter.setup(1, 64)
    gen = torch.Generator().manual_seed(0)
    d = drafter.net.cfg.hidden_size
    for n in (1, 5):
        h = torch.randn(n, d, generator=gen)
        tok = torch.randint(0, 400, (n,), generator=gen).tolist()
        outs = []
        for whole in (True, False):
            if not whole:
                monkeypatch.setattr(type(drafter), "_run_whole", lambda self, *a, **kw: None)
            drafter.start(0, [1])
            outs.append(drafter._run(2, 0, h, tok, 0, commit=0))
        monkeypatch.undo()
        torch.testing.assert_close(outs[0], outs[1], atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_eagle_chain_in_one_call_drafts_as_the_loop(kernel_target, trained, monkeypatch, temperature):
    """An EAGLE-3 round of one request is one `eagle_chain` call (greedy) or `eagle_chain_sampled`
    call (a plain temperature) when the target's plan runs our kernels: the same draft ids round by
    round as the per-token loop (whose layers are one decode_layer call each), the same drawn
    distributions q up to rounding (the same uniforms, from the request's generator in the same
    order), the same output."""
    from specdecode.drafters.eagle.drafter import EagleDrafter

    target = kernel_target
    prompts = short_prompts(target.tokenizer)
    params = SamplingParams(temperature=temperature)
    real = EagleDrafter._chain
    runs = []
    for chained in (True, False):
        drafter, calls, proposals = _drafter("eagle", trained, target), [], []
        if chained:
            counted = lambda self, *a, c=calls: c.append(1) or real(self, *a)  # noqa: E731
            monkeypatch.setattr(EagleDrafter, "_chain", counted)
        else:
            monkeypatch.setattr(EagleDrafter, "_chain_args", lambda self: None)
        inner = drafter.propose
        drafter.propose = lambda batch, k, inner=inner, p=proposals: p.append(inner(batch, k)) or p[-1]
        res = decode_fixed_k(target, drafter, 4, prompts, params=params, max_batch=1)
        qs = [p.draft_probs for p in proposals]
        runs.append(([r.token_ids for r in res], [p.draft_ids.tolist() for p in proposals], len(calls), qs))
        monkeypatch.undo()
    (tokens_c, drafts_c, calls_c, qs_c), (tokens_l, drafts_l, calls_l, qs_l) = runs
    assert calls_c == len(drafts_c) > 3 and calls_l == 0  # every round of the first run chained
    assert tokens_c == tokens_l and drafts_c == drafts_l
    for q_c, q_l in zip(qs_c, qs_l, strict=True):
        assert (q_c is None) == (q_l is None) == (temperature == 0)
        if q_c is not None:
            torch.testing.assert_close(q_c, q_l, atol=1e-5, rtol=1e-4)
            assert torch.allclose(q_c.sum(-1), torch.ones(()), atol=1e-4)


class _Counted:
    """The compiled ops, counting the calls of MTP's two (`calls`: name -> calls)."""

    def __init__(self, ops, calls: collections.Counter):
        self.ops, self.calls = ops, calls

    def __getattr__(self, name):
        op = getattr(self.ops, name)
        if name not in ("mtp_module", "head_draft"):
            return op
        return lambda *a, **kw: self.calls.update([name]) or op(*a, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_mtp_compiled_calls_draft_as_its_modules(kernel_target, trained, monkeypatch, temperature):
    """With our kernels in the target's plan, an MTP module's rows are one `mtp_module` call and
    each draft one `head_draft` call: the same draft ids round by round as the Python modules and
    head, the same drawn distributions q up to rounding (the same uniforms from the request's
    generator), the same output; every module drafts (the depth starts at 3)."""
    from specdecode.drafters.mtp.drafter import MTPDrafter
    from specdecode.models import kernels

    target = kernel_target
    prompts = short_prompts(target.tokenizer)
    params = SamplingParams(temperature=temperature)
    runs, ops = [], kernels.fused()
    for compiled in (True, False):
        drafter, calls, proposals = _drafter("mtp", trained, target), collections.Counter(), []
        drafter.start_depth = 3
        monkeypatch.setattr(kernels, "fused", lambda c=calls: _Counted(ops, c))
        if not compiled:
            monkeypatch.setattr(MTPDrafter, "_module_args", lambda self, k, n: None)
            monkeypatch.setattr(MTPDrafter, "_head_args", lambda self: None)
        inner = drafter.propose
        drafter.propose = lambda batch, k, inner=inner, p=proposals: p.append(inner(batch, k)) or p[-1]
        res = decode_fixed_k(target, drafter, 3, prompts, params=params, max_batch=1)
        qs = [p.draft_probs for p in proposals]
        calls["drafts"] = sum(int(p.num_draft.sum()) for p in proposals)
        runs.append(([r.token_ids for r in res], [p.draft_ids.tolist() for p in proposals], calls, qs))
        monkeypatch.undo()
    (tokens_c, drafts_c, calls_c, qs_c), (tokens_l, drafts_l, calls_l, qs_l) = runs
    assert calls_c["head_draft"] == calls_c["drafts"] > 2 * len(drafts_c)  # rounds of 3 drafts
    assert calls_c["mtp_module"] > len(drafts_c) and set(calls_l) == {"drafts"}
    assert tokens_c == tokens_l and drafts_c == drafts_l
    for q_c, q_l in zip(qs_c, qs_l, strict=True):
        assert (q_c is None) == (q_l is None) == (temperature == 0)
        if q_c is not None:
            torch.testing.assert_close(q_c, q_l, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle", "dspark"])
def test_a_greedy_request_drafts_beside_a_sampled_one_that_drafts_nothing(kernel_target, trained, method):
    """A batch mixes a greedy request with a sampled one that has no room left to draft: the greedy
    one drafts alone in the per-position loop (not the sampled compiled pass, which needs T > 0),
    and decodes exactly as plain greedy decoding. (The target runs our kernels, so the compiled
    passes apply where they may.)"""
    tiny = kernel_target
    prompts = short_prompts(tiny.tokenizer)[:2]
    alone = decode_fixed_k(tiny, ARDrafter(), 0, prompts[:1], max_new=20)[0].token_ids
    dec = SpeculativeDecoder(tiny, _drafter(method, trained, tiny), FixedK(4), max_batch=2)
    hot = SamplingParams(temperature=1.0)
    reqs = [
        GenerationRequest(prompts[0], SamplingParams(), 20, seed=0, id="greedy", ignore_eos=True),
        GenerationRequest(prompts[1], hot, 6, seed=1, id="sampled", ignore_eos=True),
    ]
    greedy, sampled = dec.generate(reqs)
    assert greedy.error is None and sampled.error is None
    assert greedy.token_ids == alone and len(sampled.token_ids) == 6


def test_mtp_deep_modules_catch_up_only_when_a_round_drafts_deep(tiny, trained, monkeypatch):
    """A round that drafts K tokens catches up MTP modules 1..K alone; a deeper module catches
    up on every row it skipped when a later round drafts that deep. Its drafts are those of a
    drafter that kept every module caught up (same ids round by round, sampled included)."""
    from specdecode.drafters.mtp.drafter import MTPDrafter
    from specdecode.policy.base import DraftPolicy

    class Cycle(DraftPolicy):  # K 1, 1, 1, 3, 1, 2, 3, ... the same sequence for every request
        k_max, ks = 3, [1, 1, 1, 3, 1, 2, 3, 1, 1, 1, 1, 3]

        def choose(self, states):
            for st in states:
                st.steps_at_zero += 1
            return [self.ks[(st.steps_at_zero - 1) % len(self.ks)] for st in states]

    def run(drafter, params):
        seen = []
        real = drafter.propose

        def propose(batch, num_draft):
            p = real(batch, num_draft)
            seen.append((p.draft_ids.tolist(), [int(drafter.caches[2].lengths[r.slot]) for r in batch]))
            return p

        drafter.propose = propose
        dec = SpeculativeDecoder(tiny, drafter, Cycle(), max_batch=3)
        prompts = short_prompts(tiny.tokenizer)
        reqs = [
            GenerationRequest(p, params, 24, seed=i, id=str(i), ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        return [r.token_ids for r in dec.generate(reqs)], seen

    full = MTPDrafter._catch_up
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        lazy_out, lazy = run(_drafter("mtp", trained, tiny), params)
        with monkeypatch.context() as m:
            m.setattr(MTPDrafter, "_catch_up", lambda self, row, depth: full(self, row, len(self.net.mods)))
            eager_out, eager = run(_drafter("mtp", trained, tiny), params)
        assert lazy_out == eager_out and [ids for ids, _ in lazy] == [ids for ids, _ in eager]
        lag = [
            a < b for (_, la), (_, le) in zip(lazy, eager, strict=True) for a, b in zip(la, le, strict=True)
        ]
        assert any(lag)  # module 3 did wait in some rounds


def test_mtp_drafts_one_module_deeper_once_its_depth_is_accepted_often(tiny, trained):
    """A request's first round drafts with module 1 alone; it goes one module deeper (up to D,
    as far as K allows) once the rounds drafted at its depth were fully accepted often enough:
    (fully accepted + 1) / (rounds + 2) >= GROW_AT, counted afresh at each depth. A module below
    that depth never runs: its cache stays empty (no catch-up over a long prompt for modules a
    weak drafter never reaches)."""
    from specdecode.drafters.mtp.drafter import GROW_AT

    drafter = _drafter("mtp", trained, tiny)
    # slot -> [drafts, accepted, deeper modules' lengths, the drafter's depth after the round]
    rounds = collections.defaultdict(list)
    real_propose, real_advance = drafter.propose, drafter.advance

    def propose(batch, num_draft):
        deeper = [[int(c.lengths[r.slot]) for c in drafter.caches[1:]] for r in batch]
        p = real_propose(batch, num_draft)
        for b, r in enumerate(batch):
            rounds[r.slot].append([int(p.num_draft[b]), None, deeper[b], None])
        return p

    def advance(batch, proposal, verdicts, target_out):
        real_advance(batch, proposal, verdicts, target_out)
        for r, v in zip(batch, verdicts, strict=True):
            if rounds[r.slot] and rounds[r.slot][-1][1] is None:
                rounds[r.slot][-1][1], rounds[r.slot][-1][3] = v.num_accepted, drafter.reach[r.slot]

    drafter.propose, drafter.advance = propose, advance
    prompts = [tiny.tokenizer(t)["input_ids"] for t in ("the cat", "the dog ran to the", "the cat sat")]
    out = decode_fixed_k(tiny, drafter, 3, prompts, max_new=40)
    assert [r.token_ids for r in out] == [
        r.token_ids for r in decode_fixed_k(tiny, ARDrafter(), 0, prompts, max_new=40)
    ]
    stayed = 0  # rounds fully accepted at a depth that did not (yet) earn the next one
    for seen in rounds.values():
        depth, full, tried = 1, 0, 0
        for k, accepted, deeper, reach in seen:
            assert k <= depth  # K 3 asked for every round: the depth bounds it (fewer: too early)
            assert all(n == 0 for n in deeper[depth - 1 :])  # modules below the depth never ran
            if k == depth < 3:
                full, tried = full + (accepted == k), tried + 1
                if (full + 1) / (tried + 2) >= GROW_AT:
                    depth, full, tried = depth + 1, 0, 0
                else:
                    stayed += accepted == k
            assert reach == depth  # the drafter's own depth follows the rule round by round
    assert stayed > 0  # one fully accepted round alone did not always earn a module
    assert max(r[0] for seen in rounds.values() for r in seen) == 3  # the tiny drafter gets there
    assert min(max(r[0] for r in seen) for seen in rounds.values()) < 3  # and not always


def test_a_small_eagle_tree_grows_only_as_deep_as_it_keeps(tiny, trained, monkeypatch):
    """An EAGLE-2 round asked for K < num_nodes nodes keeps the best K, none deeper than K (a
    kept node's ancestors are kept), so it grows min(K, depth) levels: the very drafts of a
    full-depth growth, with depth - min(K, depth) fewer layer passes a round."""
    from specdecode.drafters.eagle.drafter import EagleDrafter

    prompts = short_prompts(tiny.tokenizer)
    real_grow, real_run = EagleDrafter._grow_tree, EagleDrafter._run
    for k in (1, 2, 3):
        runs = []
        for full in (False, True):
            count = collections.Counter()
            drafter = _drafter("eagle", trained, tiny, tree=True)
            depth = drafter.tree.depth
            levels = depth if full else None

            def grow(self, row, budget, c=count, lv=levels, d=depth, **kw):
                c["rounds"] += 1
                c["saved"] += d - min(d, budget)  # K, or fewer where max_new_tokens caps it
                return real_grow(self, row, budget, lv, **kw)

            def run(self, *a, c=count):
                c["passes"] += 1
                return real_run(self, *a)

            monkeypatch.setattr(EagleDrafter, "_grow_tree", grow)
            monkeypatch.setattr(EagleDrafter, "_run", run)
            props = []
            inner = drafter.propose
            drafter.propose = lambda batch, n, inner=inner, p=props: p.append(inner(batch, n)) or p[-1]
            res = decode_fixed_k(tiny, drafter, k, prompts, max_batch=1)
            drafts = [(p.draft_ids.tolist(), p.parents.tolist()) for p in props if p.parents is not None]
            tally = count["rounds"], count["passes"], count["saved"]
            runs.append(([r.token_ids for r in res], drafts, *tally))
            monkeypatch.undo()
        (tok_s, drafts_s, rounds, passes_s, saved), (tok_f, drafts_f, rounds_f, passes_f, _) = runs
        assert tok_s == tok_f and drafts_s == drafts_f and rounds == rounds_f > 3
        assert passes_f - passes_s == saved >= rounds * (depth - k) // 2


def test_an_eagle_lookup_tree_holds_the_context_match_and_stays_exact(tiny, trained):
    """eagle-tree-lookup: the continuation of the context's latest n-gram match joins the
    EAGLE-2 tree within the same node budget (its first token scores LOOKUP_LOGP, above all but
    at most one node per depth, so it always hangs off the root); greedy output stays ar's."""
    import numpy as np

    from specdecode.drafters.ngram import lookup_prefix

    prompts = [p + p for p in short_prompts(tiny.tokenizer)]  # the second half matches the first
    ar = decode_fixed_k(tiny, ARDrafter(), 0, prompts)
    out, _ = trained("eagle")
    drafter = load_eagle(out, tiny, tree=TreeSpec(depth=4, topk=3, num_nodes=10, lookup=True))
    seen = []  # (contexts, proposal) per round
    inner = drafter.propose
    drafter.propose = lambda batch, n: (
        seen.append(([list(r.token_ids) for r in batch], inner(batch, n))) or seen[-1][1]
    )
    sd = decode_fixed_k(tiny, drafter, 10, prompts, max_batch=1)
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    matched = 0
    for ctxs, prop in seen:
        n = int(prop.num_draft[0])
        toks, pars = prop.draft_ids[0, :n].tolist(), prop.parents[0, :n].tolist()
        assert n <= 10 and all(q < i for i, q in enumerate(pars))
        cont, _ = lookup_prefix(np.asarray(ctxs[0]), 4)
        if cont is not None:
            matched += 1
            assert int(cont[0]) in [t for t, q in zip(toks, pars, strict=True) if q == -1]
    assert matched > 5


@pytest.mark.parametrize("when_sampling", ["chain", "tree"])
def test_an_eagle_tree_drafts_sampled_rounds_as_chains_unless_told_otherwise(tiny, trained, when_sampling):
    """Greedy rounds grow trees; a round with a sampling request drafts a sampled chain of at most
    `depth` drafts (with q for rejection sampling) by default, a tree with `when_sampling="tree"`."""
    out, _ = trained("eagle")
    spec = TreeSpec(depth=3, topk=3, num_nodes=10, when_sampling=when_sampling)
    prompts = short_prompts(tiny.tokenizer)
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        drafter = load_eagle(out, tiny, tree=spec)
        props = []
        inner = drafter.propose
        drafter.propose = lambda batch, n, inner=inner, p=props: p.append(inner(batch, n)) or p[-1]
        decode_fixed_k(tiny, drafter, 10, prompts[:1], params=params, max_batch=1, max_new=16)
        props = [p for p in props if p.max_k > 0]
        assert props
        if params.greedy or when_sampling == "tree":
            assert all(p.parents is not None for p in props)
            assert max(p.max_k for p in props) > spec.depth  # trees: more nodes than levels
        else:
            assert all(p.parents is None and p.draft_probs is not None for p in props)
            assert max(p.max_k for p in props) == spec.depth  # chains, cut at the tree's depth
        # ... and says so to the policy, which then prices no sampled round past the cut
        assert drafter.sampled_k_max == (spec.depth if when_sampling == "chain" else None)
    with pytest.raises(ValueError, match="when_sampling"):
        TreeSpec(when_sampling="sometimes")
