"""DFlash and DSpark: strict context visibility, inference == training packing, confidence
truncation stays lossless, STS calibration (pure functions and `specdecode calibrate`)."""

import json

import pytest
import torch
from fakes import decode_fixed_k, short_prompts

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafter import DraftRow
from specdecode.drafters import build_drafter
from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.dflash import DFlash, DFlashConfig, dflash_layers, load_dflash
from specdecode.drafters.dspark import DSpark, load_dspark
from specdecode.errors import SpecDecodeError
from specdecode.models import kernels
from specdecode.policy import FixedK
from specdecode.training.calibrate import auroc, ece, ece_floor, fit_sts, labels, report, survival
from specdecode.training.data import load_sequences
from specdecode.training.features import TargetFeatures
from specdecode.training.methods.dflash import block_batch


def test_feature_layers_follow_the_paper():
    assert dflash_layers(36) == (1, 9, 17, 25, 33)  # the paper's 36-layer example
    assert dflash_layers(30) == (1, 8, 14, 20, 27)  # SmolLM2-135M
    assert all(0 < i < 30 - 2 for i in dflash_layers(30))  # never the last two layers


def _tiny_net(layout="dflash"):
    torch.manual_seed(0)
    cfg = DFlashConfig(
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        feature_layers=(0, 1, 2, 3, 4),
        draft_vocab_size=50,
        target_vocab_size=50,
        num_layers=2,
        block_size=4,
        layout=layout,
    )
    net = DFlash(cfg).eval()
    with torch.no_grad():
        net.mask_emb.normal_()
    return net


def test_blocks_see_context_strictly_before_the_anchor_and_their_whole_block():
    net = _tiny_net()
    T, a = 12, 7
    ctx = torch.randn(1, T, 32)
    emb = torch.randn(1, 1, 4, 32)
    pos = (a + torch.arange(4))[None, None]
    visible = (torch.arange(T) < a)[None, None]

    def run(c, e):
        return net.block_states(e, pos, net.context_kv(c, torch.arange(T)[None]), visible)

    base = run(ctx, emb)
    later = ctx.clone()
    later[:, a:] = torch.randn(1, T - a, 32)  # the anchor's own features and everything after it
    torch.testing.assert_close(run(later, emb), base)
    before = ctx.clone()
    before[:, a - 1] += 1.0
    assert not torch.allclose(run(before, emb), base)
    last = emb.clone()
    last[:, :, -1] += 1.0  # the last slot changes the first one: attention is non-causal in a block
    assert not torch.allclose(run(ctx, last)[:, :, 0], base[:, :, 0])


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_inference_cache_and_block_equal_the_training_packing(tiny, trained, regen_dir, method):
    """The drafter's context rows (built incrementally during real decoding) and its block states
    equal what training computes for the same anchor."""
    out, _ = trained(method)
    drafter = build_drafter(method, tiny, str(out))
    net = drafter.net.float()
    seq = load_sequences(regen_dir, "train", 512)[0].input_ids
    n = 15
    prompt = seq[:n].tolist()
    dec = SpeculativeDecoder(tiny, drafter, FixedK(3), max_batch=1)
    res = dec.generate([GenerationRequest(prompt, SamplingParams(), 12, ignore_eos=True)])[0]
    full = torch.tensor(prompt + res.token_ids)
    feats = TargetFeatures(tiny, net.cfg.feature_layers)(
        {"input_ids": full[None], "lengths": torch.tensor([len(full)])}
    )
    ctx = net.fuse(torch.cat([feats[i] for i in net.cfg.feature_layers], -1).float())
    L = drafter.cache.lengths[0]
    assert len(full) - 12 <= L < len(full)  # context = every committed token before the anchor
    kv = net.context_kv(ctx, torch.arange(len(full))[None])
    for layer, (k, v) in enumerate(kv):
        torch.testing.assert_close(
            drafter.cache.k[layer][0, :, :L].transpose(0, 1), k[0, :L], atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(
            drafter.cache.v[layer][0, :, :L].transpose(0, 1), v[0, :L], atol=1e-4, rtol=1e-4
        )
    # Block states at anchor L (the drafter's view) == the training packing with that anchor.
    row = DraftRow(0, full[: L + 1].tolist(), SamplingParams(), torch.Generator())
    got = drafter._block_states([row], [0])[0]
    torch.manual_seed(0)
    mask = torch.zeros(1, len(full), dtype=torch.long)
    mask[0, L + 1] = 1  # the only anchor candidate is L
    packed = block_batch(net, ctx, tiny.model.embed, full[None], mask, torch.tensor([len(full)]), 4)
    first = net.cfg.first_draft_slot
    torch.testing.assert_close(got[first:], packed["states"][0, 0], atol=1e-4, rtol=1e-4)


def _random_dspark() -> DSpark:
    """A tiny DSpark (Vd 50, rank 8) with every parameter drawn from N(0, 1), seeded."""
    torch.manual_seed(0)
    cfg = _tiny_net("dspark").cfg
    cfg.markov_rank = 8
    net = DSpark(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
    return net


def test_confidence_tables_give_the_confidence_head():
    net = _random_dspark()
    h, prev = torch.randn(6, 32), torch.tensor([0, 3, 49, 50, 7, 7])  # 50 = "outside the draft vocabulary"
    w, row = net.confidence_tables()
    torch.testing.assert_close(h @ w + row[prev], net.confidence_logit(h, prev), rtol=1e-5, atol=1e-5)


def test_markov_table_gives_the_markov_head():
    net = _random_dspark()
    U, prev = torch.randn(6, 50), torch.tensor([0, 3, 49, 50, 7, 7])  # 50 = "outside the draft vocabulary"
    table = net.markov_table()
    assert table.shape == (51, 50)
    torch.testing.assert_close(U + table[prev], net.markov_logits(U, prev), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dspark_drafts_alike_with_and_without_the_markov_table(trained, tiny, monkeypatch, temperature):
    """The drafter gathers Markov rows from the table (in one compiled call, greedy or sampled,
    or slot by slot in Python), or multiplies by W2 when the table would not fit its memory
    budget: same drafts, confidences and q, same outputs."""
    import specdecode.drafters.dspark.drafter as dspark_drafter

    out, _ = trained("dspark")
    prompts = [tiny.tokenizer(t)["input_ids"] for t in ("the cat sat on the mat", "hello world, hello")]
    runs, chained = [], []
    table_bytes = dspark_drafter.MARKOV_TABLE_BYTES
    for budget, op in ((table_bytes, True), (table_bytes, False), (0, True)):
        monkeypatch.setattr(dspark_drafter, "MARKOV_TABLE_BYTES", budget)
        drafter = load_dspark(out, tiny)
        assert (drafter.markov is None) == (budget == 0)
        if not op:  # the per-slot loop (a greedy round in one call: test_learned)
            drafter._chain_op = lambda U, sampled=False: None
            drafter._round_op = lambda states, rows: None
        chained.append(bool(drafter._chain_op(torch.zeros(1, 1, 1), sampled=temperature > 0)))
        proposals, inner = [], drafter.propose

        def propose(batch, num_draft, inner=inner, proposals=proposals):
            proposals.append(inner(batch, num_draft))
            return proposals[-1]

        drafter.propose = propose
        res = decode_fixed_k(tiny, drafter, 4, prompts, SamplingParams(temperature=temperature), max_new=24)
        runs.append(([r.token_ids for r in res], proposals))
    if kernels.fused() is not None:
        assert chained == [True, False, False]  # the compiled pass ran where it applies
    (tokens_t, table), *others = runs
    for tokens_o, other in others:
        assert tokens_t == tokens_o and len(table) == len(other) > 2
    for a, b in ((a, b) for _, other in others for a, b in zip(table, other, strict=True)):
        assert torch.equal(a.draft_ids, b.draft_ids) and torch.equal(a.num_draft, b.num_draft)
        torch.testing.assert_close(a.extras["confidences"], b.extras["confidences"])
        assert (a.draft_probs is None) == (b.draft_probs is None) == (temperature == 0)
        if temperature > 0:
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-4, atol=1e-5)


def test_one_block_per_request_equals_the_training_layout():
    """draft_states (inference: cache-layout keys, a per-request context mask) == block_states."""
    net = _tiny_net()
    T, lens = 9, torch.tensor([9, 5])
    ctx = torch.randn(2, T, 32)
    emb = torch.randn(2, 1, 4, 32)
    pos = (lens[:, None] + torch.arange(4))[:, None]  # [2, 1, 4]
    visible = torch.arange(T)[None] < lens[:, None]  # [2, T]
    kv = net.context_kv(ctx, torch.arange(T)[None].expand(2, T))
    want = net.block_states(emb, pos, kv, visible[:, None])[:, 0]
    cache_kv = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kv]  # [S, Hk, T, D]
    torch.testing.assert_close(net.draft_states(emb[:, 0], pos[:, 0], cache_kv, visible), want)
    one = net.draft_states(emb[:1, 0], pos[:1, 0], [(k[:1], v[:1]) for k, v in cache_kv], None)
    torch.testing.assert_close(one, want[:1])  # no mask: every context row visible


def test_wrong_checkpoint_kind_is_refused(tiny, trained):
    out, _ = trained("dflash")
    with pytest.raises(SpecDecodeError, match="holds a 'dflash' drafter"):
        load_dspark(out, tiny)
    with pytest.raises(SpecDecodeError, match="only used by --method dspark"):
        build_drafter("dflash", tiny, str(out), options={"confidence_threshold": 0.5})
    sp, _ = trained("dspark")
    with pytest.raises(SpecDecodeError, match=r"in \[0, 1\]"):
        load_dspark(sp, tiny, confidence_threshold=1.5)
    assert load_dflash(out, tiny).net.cfg.layout == "dflash"


def test_confidence_truncation_drafts_less_and_stays_exact(tiny, trained):
    out, _ = trained("dspark")
    prompts = short_prompts(tiny.tokenizer)
    ar = decode_fixed_k(tiny, ARDrafter(), 0, prompts)
    drafted = {}
    for thr in (None, 0.3, 1.0):
        drafter = load_dspark(out, tiny, confidence_threshold=thr)
        counts = []
        inner = drafter.propose

        def propose(batch, num_draft, inner=inner, counts=counts):
            prop = inner(batch, num_draft)
            counts.extend(prop.num_draft.tolist())
            assert prop.extras["confidences"].shape == prop.draft_ids.shape
            return prop

        drafter.propose = propose
        sd = decode_fixed_k(tiny, drafter, 4, prompts)
        assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
        drafted[thr] = sum(counts) / len(counts)
    assert drafted[1.0] == 0.0 < drafted[0.3] < drafted[None]


def test_truncated_sampling_matches_the_target_distribution(tiny, trained):
    from scipy.stats import chi2_contingency

    out, _ = trained("dspark")
    prompt = tiny.tokenizer("the cat sat on the mat")["input_ids"]
    params = SamplingParams(temperature=1.0, top_k=6)
    n = 1200

    def draw(drafter, k, base):
        res = decode_fixed_k(
            tiny, drafter, k, [prompt] * n, params=params, max_new=2, max_batch=64, seed=base
        )
        return {tuple(r.token_ids) for r in res}, [tuple(r.token_ids) for r in res]

    _, a = draw(ARDrafter(), 0, 0)
    _, b = draw(load_dspark(out, tiny, confidence_threshold=0.3, threshold_on="confidence"), 4, 10**6)
    keys = [k for k in set(a) | set(b) if a.count(k) + b.count(k) >= 10]
    assert len(keys) >= 4
    assert chi2_contingency([[a.count(k) for k in keys], [b.count(k) for k in keys]]).pvalue > 1e-3


def test_dspark_loss_counts_the_target_mass_outside_the_draft_vocabulary():
    """With the full-vocabulary log-sum-exp, the acceptance label is 1 - TV over the full
    vocabulary (the drafter puts no mass outside its vocabulary); without it, p_t is
    renormalised on the draft vocabulary."""
    from specdecode.drafters.dspark.model import DSpark
    from specdecode.training.methods.dspark import dspark_loss, dspark_terms, target_on_draft_vocab

    torch.manual_seed(0)
    cfg = DFlashConfig(
        16, 2, 1, 8, 32, (0, 1), 6, 10, num_layers=1, block_size=2, layout="dspark", markov_rank=4
    )
    net = DSpark(cfg)
    head_full = torch.randn(10, 16)  # [V, d]
    d2t = torch.tensor([0, 1, 2, 3, 4, 5])  # the draft vocabulary: ids 0..5
    head_w = head_full[d2t]
    t2d = torch.full((10,), 6, dtype=torch.long)
    t2d[d2t] = torch.arange(6)
    S, A, K = 1, 1, 2
    states = torch.randn(S, A, K, 16)
    h_t = 0.2 * torch.randn(S * A * K, 16)  # the target's states before each label (flat p_t)
    packed = {
        "states": states,
        "labels": torch.tensor([[[1, 2]]]),
        "prev": torch.tensor([[[0, 1]]]),
        "weight": torch.ones(S, A, K),
    }
    tgt, lse = target_on_draft_vocab(h_t, lambda x: x @ head_full.T, d2t, chunk=1)
    tgt, lse = tgt.view(S, A, K, 6), lse.view(S, A, K)
    assert torch.allclose(tgt, (h_t @ head_w.T).view(S, A, K, 6))
    assert torch.allclose(lse, torch.logsumexp(h_t @ head_full.T, -1).view(S, A, K), atol=1e-5)
    _, logs = dspark_loss(dspark_terms(net, head_w, t2d, packed, tgt, lse))
    p_full = torch.softmax(h_t @ head_full.T, -1).view(S, A, K, 10)
    with torch.no_grad():
        p_d = torch.softmax(net.markov_logits(net.logits(states, head_w), t2d[packed["prev"]]), -1)
    p_d_full = torch.zeros_like(p_full)
    p_d_full[..., :6] = p_d
    tv = 0.5 * (p_d_full - p_full).abs().sum(-1)  # [S, A, K]
    assert logs["accept_0"] == pytest.approx(float(1 - tv[0, 0, 0]), abs=1e-5)
    assert float(p_full[0, 0, 0, 6:].sum()) > 0.05  # the case is not trivial
    _, renorm = dspark_loss(dspark_terms(net, head_w, t2d, packed, tgt))  # renormalised: over-states it
    assert renorm["accept_0"] > logs["accept_0"]


def test_ece_and_auroc():
    p = torch.tensor([0.1, 0.4, 0.35, 0.8])
    y = torch.tensor([0, 0, 1, 1])
    assert auroc(p, y) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)
    # 2 bins: [0.1, 0.4, 0.35] -> |0.2833 - 1/3|; [0.8] -> |0.8 - 1|
    assert ece(p, y, bins=2) == pytest.approx((3 * abs(0.85 / 3 - 1 / 3) + 0.2) / 4)
    assert ece(torch.tensor([1.0, 0.0]), torch.tensor([1, 0])) == 0.0


def test_ece_floor_is_the_noise_of_the_estimator_itself():
    """A perfectly calibrated head reads an ECE near the floor (its sampling noise), which
    shrinks as rounds grow; a mis-calibrated head reads well above it."""
    g = torch.Generator().manual_seed(3)
    few, many = 0.1 + 0.8 * torch.rand(500, generator=g), 0.1 + 0.8 * torch.rand(50_000, generator=g)
    floor_few, floor_many = ece_floor(few, draws=50), ece_floor(many, draws=20)
    assert floor_few > 0.02 and floor_many < 0.01  # ~1/sqrt(N)
    calibrated = torch.bernoulli(many, generator=g)
    assert ece(many, calibrated) < 2 * floor_many
    assert ece(many, torch.bernoulli(many**2, generator=g)) > 10 * floor_many


def _sequential_labels(p, g):
    """Accepted counts when position k survives with probability p[:, k] given k-1 did."""
    N, K = p.shape
    acc = torch.zeros(N, dtype=torch.long)
    alive = torch.ones(N, dtype=torch.bool)
    for k in range(K):
        alive &= torch.rand(N, generator=g, dtype=torch.float64) < p[:, k]
        acc += alive.long()
    return acc


def test_sts_recovers_over_confident_positions():
    """Labels drawn from sigmoid(z / 2): raw confidences are over-confident, STS finds t ~ 2."""
    g = torch.Generator().manual_seed(0)
    N, K = 20000, 3
    z = torch.randn(N, K, generator=g, dtype=torch.float64) * 3 + 1
    acc = _sequential_labels(torch.sigmoid(z / 2), g)
    drafted = torch.ones(N, K, dtype=torch.bool)
    temps, biases = fit_sts(z, drafted, acc)
    assert all(1.6 < t < 2.5 for t in temps) and biases == [0.0] * K
    before, after = report(z, drafted, acc, [1.0] * K), report(z, drafted, acc, temps)
    assert all(a["ece"] < 0.02 < b["ece"] for a, b in zip(after, before, strict=True))
    assert labels(torch.tensor([0, 2]), 3).tolist() == [[False, False, False], [True, True, False]]
    assert survival(torch.zeros(1, 2), [1.0, 1.0]).tolist() == [[0.5, 0.25]]


def test_a_constant_offset_needs_the_opt_in_bias():
    """Labels from sigmoid(z - 1.5): no temperature fixes a shifted logit; temperature + bias does."""
    from specdecode.training.calibrate import BIAS_GRID

    g = torch.Generator().manual_seed(1)
    N, K = 20000, 2
    z = torch.randn(N, K, generator=g, dtype=torch.float64) * 2 + 1
    acc = _sequential_labels(torch.sigmoid(z - 1.5), g)
    drafted = torch.ones(N, K, dtype=torch.bool)
    t_only = report(z, drafted, acc, *fit_sts(z, drafted, acc))
    temps, biases = fit_sts(z, drafted, acc, bias_grid=BIAS_GRID)
    both = report(z, drafted, acc, temps, biases)
    assert t_only[0]["ece"] > 0.03 and all(r["ece"] < 0.02 for r in both)
    assert -2.0 < biases[0] < -1.0


def test_calibrate_cli_writes_temperatures_into_the_checkpoint(
    capsys, trained, tiny, tiny_llama_dir, regen_dir
):
    import shutil

    from specdecode.cli import main

    src, _ = trained("dspark")
    out = src.parent / "dspark-calibrated"
    shutil.copytree(src, out, dirs_exist_ok=True)
    args = ["calibrate", "--target", str(tiny_llama_dir), "--drafter", str(out), "--data", str(regen_dir)]
    code = main([*args, "--num-prompts", "4", "--max-new-tokens", "24", "--dtype", "fp32"])
    text, err = capsys.readouterr()
    assert code == 0, err
    assert "ECE raw" in text and (out / "reliability.png").exists()
    res = json.loads((out / "calibration.json").read_text())
    assert res["rounds_fit"] > 0 and len(res["sts_temperature"]) == 4 and res["sts_bias"] == [0.0] * 4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["calibration"]["sts_temperature"] == res["sts_temperature"]
    loaded = load_dspark(out, tiny).net.sts_temperature.float().tolist()
    assert loaded == pytest.approx(res["sts_temperature"], rel=1e-2)
    assert main([*args, "--num-prompts", "4", "--max-new-tokens", "16", "--dtype", "fp32", "--bias"]) == 0
    capsys.readouterr()
    assert json.loads((out / "calibration.json").read_text())["method"] == "sts+bias"
    assert main([*args, "--eval-fraction", "1.5"]) == 2
    assert "--eval-fraction" in capsys.readouterr().err
    code = main(
        ["calibrate", "--target", str(tiny_llama_dir), "--drafter", str(src.parent), "--data", str(regen_dir)]
    )
    assert code == 2


def test_calibrate_refits_from_saved_rounds_without_decoding(
    capsys, trained, tiny_llama_dir, regen_dir, tmp_path, monkeypatch
):
    """--rounds FILE: the first run decodes and saves the rounds; a second run (here with --bias)
    refits from them without decoding; rounds of other settings or weights are refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    import specdecode.training.calibrate as cal
    from specdecode.cli import main

    src, _ = trained("dspark")
    out = tmp_path / "dspark-rounds"
    shutil.copytree(src, out)
    rounds = tmp_path / "rounds.safetensors"
    args = ["calibrate", "--target", str(tiny_llama_dir), "--drafter", str(out), "--data", str(regen_dir)]
    args += ["--num-prompts", "4", "--dtype", "fp32", "--rounds", str(rounds)]
    assert main([*args, "--max-new-tokens", "24"]) == 0
    first = json.loads((out / "calibration.json").read_text())
    capsys.readouterr()

    def no_decoding(*a, **k):
        raise AssertionError("the rounds were collected again")

    monkeypatch.setattr(cal, "collect", no_decoding)
    assert main([*args, "--max-new-tokens", "24", "--bias"]) == 0  # temperatures written meanwhile
    second = json.loads((out / "calibration.json").read_text())
    assert second["method"] == "sts+bias"
    assert (second["rounds_fit"], second["rounds_eval"]) == (first["rounds_fit"], first["rounds_eval"])
    assert [r["n"] for r in second["before"]] == [r["n"] for r in first["before"]]
    capsys.readouterr()
    assert main([*args, "--max-new-tokens", "16"]) == 2
    assert "collected with another max_new_tokens" in capsys.readouterr().err
    other = tmp_path / "other"
    shutil.copytree(src, other)

    w = load_file(str(other / "model.safetensors"))
    name = next(k for k in sorted(w) if not k.startswith("sts_") and w[k].is_floating_point())
    w[name] = w[name] + 1
    save_file(w, str(other / "model.safetensors"))
    args[args.index(str(out))] = str(other)
    assert main([*args, "--max-new-tokens", "24"]) == 2
    assert "collected with another drafter_weights" in capsys.readouterr().err


def test_calibration_rows_are_the_served_rounds(trained, tiny, regen_dir):
    """`collect` keeps one row per request and drafting round: the logits of the confidences the
    drafter proposed (0 past the round's drafts) and the number of those drafts accepted."""
    from specdecode.training.calibrate import collect, heldout_prompts

    src, _ = trained("dspark")
    drafter = load_dspark(src, tiny)
    proposed, inner = [], drafter.propose

    def propose(batch, num_draft):
        out = inner(batch, num_draft)
        proposed.append((out.num_draft.tolist(), out.extras["confidences"].clone()))
        return out

    drafter.propose = propose
    prompts = heldout_prompts(regen_dir, tiny, 3)
    z, drafted, accepted = collect(tiny, drafter, prompts, max_new_tokens=16, max_batch=2)
    expect = [
        torch.logit(c[b, :n].double(), eps=1e-9) for nd, c in proposed for b, n in enumerate(nd) if n > 0
    ]
    assert len(z) == len(expect) > 3 and drafted.shape == z.shape
    for row, d, e in zip(z, drafted, expect, strict=True):
        assert int(d.sum()) == len(e) and bool(d[: len(e)].all())
        torch.testing.assert_close(row[: len(e)], e)
        assert not row[len(e) :].any()
    assert bool(((accepted >= 0) & (accepted <= drafted.sum(dim=1))).all())


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_training_with_qk_norm_and_a_mask_token_gives_an_exportable_drafter(
    tiny, regen_dir, train_cfg, method_kw, tmp_path, method
):
    """`specdecode train dflash|dspark --qk-norm --mask-token-id N` reaches the task; the network
    trains with per-head q/k norms and mask slots that read the target's embedding of N."""
    from safetensors.torch import load_file

    from specdecode.cli import build_parser
    from specdecode.cli.train import _task_options
    from specdecode.interop import export_drafter, import_drafter
    from specdecode.training.run import run_training

    argv = ["train", method, "--target", "t", "--data", "d", "--out", "o"]
    argv += ["--qk-norm", "--mask-token-id", "5"]
    opts = _task_options(build_parser().parse_args(argv))
    assert opts["qk_norm"] is True and opts["mask_token_id"] == 5
    default = _task_options(build_parser().parse_args(argv[:8]))
    assert default["qk_norm"] is True and default["mask_token_id"] == "auto"  # exportable by default
    plain = _task_options(build_parser().parse_args([*argv[:8], "--no-qk-norm", "--mask-token-id", "none"]))
    assert plain["qk_norm"] is False and plain["mask_token_id"] is None  # the learned mask vector
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv[:8], "--mask-token-id", "mask"])

    out = tmp_path / method
    kw = {**method_kw[method], "qk_norm": True, "mask_token_id": 5}
    run_training(method, tiny, regen_dir, out, train_cfg(out, 4, eval_prompts=0), kw, progress=False)
    arch = json.loads((out / "config.json").read_text())["arch"]
    assert arch["qk_norm"] is True and arch["mask_token_id"] == 5
    w = load_file(str(out / "model.safetensors"))
    assert "mask_emb" not in w and "layers.0.attn.q_norm.weight" in w
    k_norm = w["layers.0.attn.k_norm.weight"]
    assert not torch.equal(k_norm, torch.ones_like(k_norm))  # trained
    exported = export_drafter(out, tmp_path / "spec", target=tiny)
    assert import_drafter(exported, tiny)[0] == method
    drafter = build_drafter(method, tiny, str(out))
    res = decode_fixed_k(tiny, drafter, 3, [[1, 2, 3, 4]], max_new=12)[0]
    assert len(res.token_ids) == 12


def test_auto_mask_token_is_a_special_token_of_the_target(tiny):
    """'auto' picks the tokenizer's mask, unk or pad token, else the smallest eos id, always a row of
    the target's embedding."""
    from types import SimpleNamespace

    from specdecode.training.methods.dflash import default_mask_token

    rows = tiny.model.info.vocab_size

    def target(**tok):
        return SimpleNamespace(model=tiny.model, tokenizer=SimpleNamespace(**tok), eos_token_ids=(7, 3))

    assert default_mask_token(target(mask_token_id=9, unk_token_id=0)) == 9
    assert default_mask_token(target(mask_token_id=None, unk_token_id=4, pad_token_id=2)) == 4
    assert default_mask_token(target(pad_token_id=2)) == 2
    assert default_mask_token(target(mask_token_id=rows, pad_token_id=rows + 1)) == 3  # not rows: eos


def test_qk_norm_gains_fit_the_targets_queries_and_keys(tiny, regen_dir):
    """For a target without q/k norms the drafter's norms start from least-squares gains: on the
    target's own inputs RMSNorm(q) * g is closer to q than with unit gains, and training from the
    target's layers starts from them."""
    from specdecode.models.loader import open_checkpoint
    from specdecode.training.methods.dflash import DFlashTask, qk_norm_gains

    seqs = load_sequences(regen_dir, "train", 512)
    task = DFlashTask(
        tiny, seqs, num_layers=2, block_size=4, draft_vocab_size=64, qk_norm=True, mask_token_id=5
    )
    cfg, ids = task.net.cfg, task.layers_from
    src = open_checkpoint(tiny.path)
    pre = "model." if "model.embed_tokens.weight" in src else ""
    sample = [[1 + (7 * i + j) % 90 for j in range(40)] for i in range(4)]
    gains = qk_norm_gains(tiny, src, pre, ids, sample, cfg)
    assert set(gains) == {f"layers.{j}.attn.{w}_norm.weight" for j in range(2) for w in "qk"}
    # the fit, measured on the target's inputs to its layer ids[0] over the same sample
    layer = ids[0]
    ln = src[f"{pre}layers.{layer}.input_layernorm.weight"].float()
    wq = src[f"{pre}layers.{layer}.self_attn.q_proj.weight"].float()
    qs = []
    for seq in sample:
        cache = tiny.model.new_cache(1, len(seq) + 1)
        h = tiny.model.forward(torch.tensor([seq]), None, cache, [0], logits=False, capture=(layer - 1,))
        x = torch.nn.functional.rms_norm(
            h.hidden[layer - 1][0].float(), (cfg.hidden_size,), ln, cfg.rms_norm_eps
        )
        qs.append((x @ wq.T).view(-1, cfg.head_dim))
    q = torch.cat(qs)
    unit = torch.nn.functional.rms_norm(q, (cfg.head_dim,), eps=cfg.rms_norm_eps)
    err_ones = (unit - q).pow(2).sum()
    err_gain = (unit * gains["layers.0.attn.q_norm.weight"] - q).pow(2).sum()
    assert err_gain < 0.9 * err_ones  # the least-squares gains beat unit gains on their own data
    net_gain = task.net.layers[0].attn.q_norm.weight.detach()
    assert not torch.equal(net_gain, torch.ones_like(net_gain))  # the task used them


@pytest.mark.parametrize("ranking", ["markov", "slots", "markov-compiled"])
def test_block_tree_keeps_the_best_nodes_of_the_markov_head(ranking):
    """block_tree == brute force: every path of top-`topk` children (each ranked by the Markov
    head given its own parent, or by the slot alone as DFlash's; or by `kernels`' markov_topk,
    DSpark's compiled ranking) scored by cumulative log q; the `budget` best, parents first."""
    from specdecode.drafters.dflash.drafter import block_tree
    from specdecode.drafters.layers import DraftVocab
    from specdecode.models import kernels

    torch.manual_seed(1)
    Bk, Vd, topk, budget = 3, 12, 3, 9
    U, table = torch.randn(Bk, Vd) * 2, torch.randn(Vd + 1, Vd) * 2  # [Bk, Vd], [Vd + 1, Vd]
    vocab = DraftVocab(torch.arange(Vd), Vd)
    if ranking == "slots":
        table = torch.zeros_like(table)
    correction = (lambda x: table[x]) if ranking != "slots" else None
    children = None
    if ranking == "markov-compiled":
        ops = kernels.fused()
        if ops is None:
            pytest.skip(f"no compiled kernels here: {kernels.unavailable.get('cpu')}")

        def children(u, tok, k):
            vals, ids = ops.markov_topk(u, table, tok, None, k)
            return vals.tolist(), ids.tolist()

    toks, pars, scores, depths = block_tree(U, correction, vocab, Vd, budget, topk, children)
    assert len(toks) == budget and all(p < i for i, p in enumerate(pars))
    paths = []  # (score, depth, path of draft ids) of every node of the full top-k tree
    frontier = [((), 0.0, Vd)]
    for k in range(Bk):
        nxt = []
        for path, score, prev in frontier:
            top = torch.log_softmax(U[k] + table[prev], -1).topk(topk)
            for s, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                nxt.append((path + (t,), score + s, t))
        paths += [(score, k + 1, path) for path, score, _ in nxt]
        frontier = nxt
    best = sorted(paths, key=lambda p: (-p[0], p[1]))[:budget]

    def path_of(i):
        return () if i < 0 else path_of(pars[i]) + (toks[i],)

    assert [path_of(i) for i in range(budget)] == [p for _, _, p in best]
    assert scores == pytest.approx([s for s, _, _ in best]) and depths == [d for _, d, _ in best]


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_a_block_tree_stays_greedy_exact_and_samples_chains(trained, tiny, method):
    """dspark-tree(-lookup), dflash-tree(-lookup): greedy rounds propose trees of up to K nodes
    (more than the block's slots), with the context's n-gram continuation in the lookup variant;
    output == ar's, alone and in a batch. Sampled rounds at T <= max_temperature draft the same
    point-mass trees (at most a block's worth of nodes), hotter ones the chain with its q."""
    import numpy as np

    from specdecode.drafters.dflash import BlockTree
    from specdecode.drafters.ngram import lookup_prefix

    out, _ = trained(method)
    load = load_dspark if method == "dspark" else load_dflash
    prompts = [p + p for p in short_prompts(tiny.tokenizer)]  # the second half matches the first
    ar = decode_fixed_k(tiny, ARDrafter(), 0, prompts)
    for lookup in (False, True):
        drafter = load(out, tiny, tree=BlockTree(topk=3, lookup=lookup))
        slots = drafter.net.cfg.num_drafts
        assert not drafter.provides_confidences and drafter.sampled_k_max == slots
        seen, inner = [], drafter.propose
        drafter.propose = lambda batch, n, inner=inner, seen=seen: (
            seen.append(([list(r.token_ids) for r in batch], inner(batch, n))) or seen[-1][1]
        )
        sd = decode_fixed_k(tiny, drafter, 10, prompts, max_batch=1)
        assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
        assert max(p.max_k for _, p in seen) > slots  # more nodes than the block has slots
        matched = 0
        for ctxs, prop in seen:
            n = int(prop.num_draft[0])
            toks, pars = prop.draft_ids[0, :n].tolist(), prop.parents[0, :n].tolist()
            assert all(q < i for i, q in enumerate(pars)) and prop.draft_probs is None
            cont, _ = lookup_prefix(np.asarray(ctxs[0]), 4)
            if lookup and cont is not None:
                matched += 1
                assert int(cont[0]) in [t for t, q in zip(toks, pars, strict=True) if q == -1]
        assert matched > 5 or not lookup
        batched = decode_fixed_k(tiny, drafter, 10, prompts)  # all three requests in one batch
        assert [r.token_ids for r in batched] == [r.token_ids for r in ar]
    for temperature in (0.7, 1.0):
        drafter = load(out, tiny, tree=BlockTree(topk=3))
        seen, inner = [], drafter.propose
        drafter.propose = lambda batch, n, inner=inner, seen=seen: seen.append(inner(batch, n)) or seen[-1]
        params = SamplingParams(temperature=temperature)
        decode_fixed_k(tiny, drafter, 10, prompts[:1], params, max_batch=1, max_new=16)
        props = [p for p in seen if p.max_k > 0]
        assert props
        if temperature <= 0.7:  # point masses (the loop's K here is fixed, past a block)
            assert all(p.parents is not None and p.draft_probs is None for p in props)
        else:
            assert all(p.parents is None and p.draft_probs is not None and p.max_k <= slots for p in props)
    assert BlockTree(max_temperature=1.0).drafts_tree([SamplingParams(temperature=1.0), SamplingParams()])
    assert not BlockTree().drafts_tree([SamplingParams(temperature=0.8), SamplingParams()])
    with pytest.raises(ValueError, match="max_temperature"):
        BlockTree(max_temperature=float("nan"))
