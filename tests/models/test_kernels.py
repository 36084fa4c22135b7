"""Our compiled CPU kernels: bf16w computes x @ w.T + b in fp32 arithmetic from bf16 weights, at
every shape its tiles cut differently (row and column remainders, K not a multiple of 16)."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import kernels


@pytest.fixture(scope="module")
def bf16w():
    op = kernels.bf16w()
    if op is None:
        pytest.skip(f"bf16w is not available here: {kernels.unavailable.get('bf16w')}")
    return op


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 17])
@pytest.mark.parametrize("n,k", [(96, 128), (7, 13), (13, 40), (5, 576)])
def test_bf16w_is_the_fp32_product_of_bf16_weights(bf16w, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen)
    ref = x.double() @ w.double().t() + b.double()  # what fp32 arithmetic approximates
    for bias in (b, None):
        y = bf16w(x, w, bias)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        want = ref if bias is not None else ref - b.double()
        # fp32 accumulation of k terms: a bf16 product would be ~100x further off
        assert (y.double() - want).abs().max() < 1e-5 * k**0.5 * want.abs().max().clamp(min=1)


def test_bf16w_reads_strided_inputs_and_refuses_wrong_ones(bf16w):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen)[::2]  # rows with a stride: copied, not misread
    w = torch.randn(12, 64, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(bf16w(x, w, None), x @ w.float().t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16w(x, w.float(), None)
    with pytest.raises(RuntimeError, match="disagree on K"):
        bf16w(x, w[:, :32].contiguous(), None)


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPECDECODE_NO_KERNELS", "1")
    kernels.bf16w.cache_clear()
    try:
        assert kernels.bf16w() is None and "SPECDECODE_NO_KERNELS" in kernels.unavailable["bf16w"]
    finally:
        kernels.bf16w.cache_clear()
