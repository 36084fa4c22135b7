"""Tests for specdecode.sampling: table cases, slow reference, robustness, seeded determinism."""

from __future__ import annotations

import pytest
import reference_verify as ref
import torch
from scipy import stats

from specdecode.config import MIN_TEMPERATURE, MIN_TOP_P, SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.sampling import (
    draw_uniforms,
    finite_rows,
    process_logits,
    process_logits_batch,
    sample,
    seeded_generator,
)

LOG3 = torch.log(torch.tensor([0.5, 0.3, 0.2]))


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.5, 0.3, 0.2]),
        (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0.0]),
        (SamplingParams(temperature=1.0, top_k=1), [1.0, 0.0, 0.0]),
        (SamplingParams(temperature=1.0, top_k=9), [0.5, 0.3, 0.2]),
        (SamplingParams(temperature=1.0, top_p=0.7), [0.625, 0.375, 0.0]),  # 0.5 + 0.3 reaches 0.7
        (SamplingParams(temperature=1.0, top_p=0.79), [0.625, 0.375, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.81), [0.5, 0.3, 0.2]),
        (SamplingParams(temperature=1.0, top_p=0.5), [1.0, 0.0, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.1), [1.0, 0.0, 0.0]),  # always keeps the top id
        (SamplingParams(temperature=0.5), [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]),
        (SamplingParams(temperature=0.5, top_k=2, top_p=0.9), [0.25 / 0.34, 0.09 / 0.34, 0.0]),
        (SamplingParams(temperature=0.0), [1.0, 0.0, 0.0]),
        (SamplingParams(temperature=0.0, top_k=2, top_p=0.3), [1.0, 0.0, 0.0]),
    ],
)
def test_process_logits_table(params, expected):
    probs = process_logits(LOG3, params)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.tensor(expected), atol=1e-6, rtol=0)


def test_top_p_applies_after_temperature():
    # T = 2 flattens [0.5, 0.3, 0.2] to ~[0.41, 0.32, 0.26]: top_p 0.7 now needs all three ids.
    probs = process_logits(LOG3, SamplingParams(temperature=2.0, top_p=0.75))
    assert (probs > 0).all()


def test_padded_ids_get_zero_probability():
    logits = torch.tensor([[1.0, 2.0, 0.5, 9.0, 8.0]])  # ids 3, 4 are padded head rows
    for params in [SamplingParams(1.0), SamplingParams(0.0), SamplingParams(0.7, top_k=4, top_p=0.95)]:
        probs = process_logits(logits, params, vocab_size=3)
        assert probs[0, 3:].abs().sum() == 0
        torch.testing.assert_close(probs.sum(-1), torch.ones(1))
    assert process_logits(logits, SamplingParams(0.0), vocab_size=3).argmax().item() == 1


def test_bf16_logits_and_leading_dims():
    logits = torch.randn(2, 3, 4, 11, generator=torch.Generator().manual_seed(0)).bfloat16()
    probs = process_logits(logits, SamplingParams(0.8, top_k=5, top_p=0.9), vocab_size=10)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, 4))
    assert ((probs > 0).sum(-1) <= 5).all()


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.7])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (1, 1.0), (3, 1.0), (0, 0.6), (4, 0.9), (50, 0.95)])
@pytest.mark.parametrize("vocab_size", [None, 9])
def test_process_logits_matches_reference(temperature, top_k, top_p, vocab_size):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = 2.0 * torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(7))
    probs = process_logits(logits, params, vocab_size)
    expected = torch.tensor(
        [[ref.ref_process_logits(row, params, vocab_size) for row in m] for m in logits.tolist()]
    )
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


def test_process_logits_batch_per_request_params():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 3, 10, generator=g)
    params = [
        SamplingParams(0.7, top_k=3),
        SamplingParams(0.0),
        SamplingParams(0.7, top_k=3),
        SamplingParams(1.0, top_p=0.8),
        SamplingParams(1.0),
    ]
    out = process_logits_batch(logits, params, vocab_size=9)
    for b, p in enumerate(params):
        torch.testing.assert_close(out[b], process_logits(logits[b], p, vocab_size=9), atol=0, rtol=0)
    same = process_logits_batch(logits, [params[0]] * 5)
    torch.testing.assert_close(same, process_logits(logits, params[0]), atol=0, rtol=0)
    with pytest.raises(ValueError, match="one SamplingParams per row"):
        process_logits_batch(logits, params[:2])


def test_sample_table():
    probs = torch.tensor([0.2, 0.0, 0.5, 0.3]).expand(6, 4)
    u = torch.tensor([0.0, 0.1999, 0.2, 0.69, 0.7, 0.9999999])
    assert sample(probs, u).tolist() == [0, 0, 2, 2, 3, 3]


def test_sample_unnormalised_and_rounding_robust():
    # Trailing zero-probability ids and a total that rounds below 1: never a zero-probability id.
    probs = torch.tensor([[0.3, 0.0, 0.7 - 1e-6, 0.0, 0.0], [0.0, 2.0, 6.0, 0.0, 0.0]])
    u = torch.tensor([[1.0 - 2.0**-24], [1.0 - 2.0**-24]]).expand(2, 3).contiguous()
    ids = sample(probs[:, None].expand(2, 3, 5), u)
    assert ids.tolist() == [[2, 2, 2], [2, 2, 2]]
    assert sample(probs, torch.tensor([0.0, 0.0])).tolist() == [0, 1]
    # fp64 uniforms just below 1 that round to 1.0 in fp32
    assert sample(probs, torch.tensor([1 - 1e-12, 1 - 1e-12], dtype=torch.float64)).tolist() == [2, 2]


def test_sample_never_zero_probability_randomised():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4000, 9, generator=g)
    probs = process_logits(logits, SamplingParams(1.0, top_k=3, top_p=0.8))
    u = torch.rand(4000, generator=g)
    u[:100] = 0.0
    u[100:200] = 1.0 - 2.0**-24
    ids = sample(probs, u)
    assert ((ids >= 0) & (ids < 9)).all()
    assert (probs.gather(-1, ids[:, None]) > 0).all()
    expected = [ref.ref_sample(probs[i].double().tolist(), float(u[i])) for i in range(4000)]
    assert ids.tolist() == expected


def test_sample_distribution_chi_square():
    probs = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.3])
    g = torch.Generator().manual_seed(11)
    ids = sample(probs.expand(100_000, 5), torch.rand(100_000, generator=g))
    counts = torch.bincount(ids, minlength=5)
    assert counts[1] == 0
    support = probs > 0
    expected = probs[support].double() / probs[support].double().sum() * 100_000
    res = stats.chisquare(counts[support].double().numpy(), expected.numpy())
    assert res.pvalue > 1e-4


def test_draw_uniforms_per_request_generators():
    def gens(*seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    u = draw_uniforms(gens(1, 2, 3), 5)
    assert u.shape == (3, 5) and ((u >= 0) & (u < 1)).all()
    # A request's row does not depend on the batch it is in.
    torch.testing.assert_close(draw_uniforms(gens(2), 5)[0], u[1], atol=0, rtol=0)
    torch.testing.assert_close(draw_uniforms(gens(3, 9), 5)[0], u[2], atol=0, rtol=0)
    # Successive draws advance each request's own generator.
    g = gens(4)
    a, b = draw_uniforms(g, 3), draw_uniforms(g, 3)
    assert not torch.equal(a, b)
    torch.testing.assert_close(torch.cat([a, b], 1), draw_uniforms(gens(4), 6), atol=0, rtol=0)
    assert draw_uniforms([], 4).shape == (0, 4)


def test_top_p_large_vocab_widens_candidates():
    # A flat row needs far more than the first 256 candidates to reach top_p; a peaked row few.
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 3000, generator=g) * torch.tensor([[0.1], [8.0], [1.0]])
    for params in [SamplingParams(1.0, top_p=0.9), SamplingParams(0.8, top_p=0.5)]:
        probs = process_logits(logits, params, vocab_size=2990)
        expected = torch.tensor([ref.ref_process_logits(row, params, 2990) for row in logits.tolist()])
        torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
        assert ((probs > 0).sum(-1)[0] > 256).all()


# ---- adversarial values: nothing a request can send turns into NaN or an id out of range ----
def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token():
    assert SamplingParams(temperature=1e-300).temperature == 0.0
    assert SamplingParams(temperature=MIN_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    assert SamplingParams(temperature=1.0, top_p=1e-46).top_p == MIN_TOP_P
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0]])
    for params in (SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=1e-46)):
        probs = process_logits(logits, params)
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
        assert sample(probs, torch.tensor([0.999])).item() == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -1.0, "0.5"])
def test_sampling_params_reject_non_finite_values(bad):
    with pytest.raises(SpecDecodeError, match="temperature"):
        SamplingParams(temperature=bad)
    if bad != -float("inf"):
        with pytest.raises(SpecDecodeError, match="top_p"):
            SamplingParams(temperature=1.0, top_p=bad)


def test_adversarial_logits_give_finite_probabilities_and_ids_in_range():
    gen = torch.Generator().manual_seed(0)
    V = 64
    for trial in range(300):
        x = torch.randn(4, V, generator=gen) * 10 ** float(torch.randint(0, 31, (1,), generator=gen))
        x[torch.rand(4, V, generator=gen) < 0.9] = -float("inf")  # mostly masked rows
        x[:, trial % V] = float(torch.randn(1, generator=gen)) * 1e30  # at least one finite logit
        t = 10 ** float(torch.empty(1).uniform_(-5, 3, generator=gen))
        p = 10 ** float(torch.empty(1).uniform_(-46, 0, generator=gen))
        k = int(torch.randint(0, V + 2, (1,), generator=gen))
        params = SamplingParams(temperature=t if trial % 7 else 1e-300, top_k=k, top_p=min(p, 1.0))
        assert finite_rows(x[:, None]).all()
        probs = process_logits(x, params, vocab_size=V - trial % 3)
        assert torch.isfinite(probs).all(), (trial, params)
        assert torch.allclose(probs.sum(-1), torch.ones(4), atol=1e-5), (trial, params)
        ids = sample(probs, torch.rand(4, generator=gen))
        assert ((ids >= 0) & (ids < V - trial % 3)).all()
        assert (probs.gather(-1, ids[:, None]) > 0).all()


def test_invalid_rows_are_flagged_and_sample_stays_in_range():
    x = torch.zeros(4, 2, 8)
    x[1, 1, 3] = float("nan")
    x[2, 0] = -float("inf")  # a position with nothing to sample
    x[3, 1, 0] = float("inf")
    assert finite_rows(x).tolist() == [True, False, False, False]
    for probs in (torch.full((3, 8), float("nan")), torch.zeros(3, 8), torch.full((3, 8), float("inf"))):
        ids = sample(probs, torch.tensor([0.0, 0.5, 0.999]))
        assert ((ids >= 0) & (ids < 8)).all()


def test_seeds_use_64_bits():
    def draws(seed, stream=0):
        return torch.rand(8, generator=seeded_generator(seed, stream)).tolist()

    assert draws(1) == draws(1)
    assert draws(1) != draws(1 + 2**32)  # torch's manual_seed alone would make these equal
    assert draws(2**63 + 5) != draws(5)
    assert draws(7, stream=0) != draws(7, stream=1)
    assert draws(-3) == draws(2**64 - 3)  # seeds are taken modulo 2**64
