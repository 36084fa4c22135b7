"""drafters/layers.py: the distillation loss of the learned drafters (shifted_kl, SoftTargets)
and their inference products in the target's formats (use_formats)."""

import pytest
import torch
from torch import nn

from specdecode.drafters.layers import (
    DraftAttention,
    PlannedLinear,
    SoftTargets,
    SwiGLU,
    rope_table,
    shifted_kl,
    signed_rope,
    signed_rope_table,
    use_formats,
)
from specdecode.models.formats import BUCKETS, FormatPlan, forced_plan


def reference_kl(draft_logits, target_logits, loss_mask, lengths, shift):
    """The loss written out over every row with a mask: KL(p_t at t+shift || q at t) averaged
    over the rows whose token t+shift+1 is a response token inside the sequence."""
    B, T, _ = draft_logits.shape
    total, n, hits = 0.0, 0, 0
    for b in range(B):
        for t in range(T):
            if t + shift + 1 >= int(lengths[b]) or not loss_mask[b, t + shift + 1]:
                continue
            p = torch.softmax(target_logits[b, t + shift], -1)
            logq = torch.log_softmax(draft_logits[b, t], -1)
            total = total + (p * (torch.log(p) - logq)).sum()
            hits += int(logq.argmax() == p.argmax())
            n += 1
    return total / n, hits / n


@pytest.mark.parametrize("shift", [0, 1, 3])
def test_shifted_kl_is_the_masked_mean_kl_with_its_gradient(shift):
    g = torch.Generator().manual_seed(shift)
    B, T, d, V = 3, 12, 8, 20
    states = torch.randn(B, T, d, generator=g, requires_grad=True)
    head = torch.randn(V, d, generator=g)
    target_logits = 3 * torch.randn(B, T, V, generator=g)
    loss_mask = (torch.rand(B, T, generator=g) > 0.3).long()
    lengths = torch.tensor([12, 9, 7])

    soft = SoftTargets(target_logits)
    loss, acc = shifted_kl(states, soft, loss_mask, lengths, shift, head=lambda x: x @ head.T)
    (grad,) = torch.autograd.grad(loss, states)
    ref, ref_acc = reference_kl(states @ head.T, target_logits, loss_mask, lengths, shift)
    (ref_grad,) = torch.autograd.grad(ref, states)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert float(acc) == pytest.approx(ref_acc)
    # logits in, target logits in: the same figures
    loss2, _ = shifted_kl((states @ head.T).detach(), target_logits, loss_mask, lengths, shift)
    torch.testing.assert_close(loss2, ref.detach(), rtol=1e-5, atol=1e-6)


def test_shifted_kl_is_zero_for_a_perfect_drafter_and_survives_an_empty_batch():
    logits = torch.randn(2, 6, 10)
    mask = torch.ones(2, 6, dtype=torch.long)
    loss, acc = shifted_kl(logits[:, 1:], logits[:, 1:], mask[:, 1:], torch.tensor([5, 5]), shift=0)
    assert float(loss) == pytest.approx(0.0, abs=1e-6) and float(acc) == 1.0
    x = torch.randn(2, 6, 10, requires_grad=True)
    empty, _ = shifted_kl(x, logits, torch.zeros(2, 6, dtype=torch.long), torch.tensor([6, 6]), shift=1)
    empty.backward()  # no rows: a zero loss that still reaches the parameters
    assert float(empty.detach()) == 0.0 and x.grad is not None


def test_use_formats_swaps_every_linear_and_keeps_the_parameters():
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(SwiGLU(16, 40), nn.RMSNorm(16, eps=1e-5), nn.Linear(16, 7, bias=True))
    attn = DraftAttention(16, 16, num_heads=4, num_kv_heads=2, head_dim=4, qk_norm=True)
    for p in [*net.parameters(), *attn.parameters()]:
        p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(2, 5, 16, generator=g)
    cos, sin = rope_table(torch.arange(5)[None].expand(2, 5), 4, 10000.0)
    want, keys = net(x), set(net.state_dict())
    want_qkv, want_kv, attn_keys = attn.qkv(x, cos, sin), attn.kv(x, cos, sin), set(attn.state_dict())
    lone = nn.Linear(16, 3)
    want_lone = lone(x)
    plan = forced_plan("fp32")
    for m in (net, attn, lone):
        use_formats(m, plan)
    assert sum(isinstance(m, PlannedLinear) for m in net.modules()) == 4
    assert not any(type(m) in (nn.Linear, nn.RMSNorm) for m in [*net.modules(), *attn.modules()])
    assert set(net.state_dict()) == keys and set(attn.state_dict()) == attn_keys  # checkpoints as before
    assert attn.fused_qkv is not None and attn.fused_kv is not None and net[0].fused_gate_up is not None
    assert torch.equal(lone(x), want_lone)  # fp32: the same product as nn.Linear, any leading shape
    # fused q/k/v and gate/up products, the one-pass norm and SiLU kernels: rounding only
    torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-4)
    for got, ref in zip([*attn.qkv(x, cos, sin), *attn.kv(x, cos, sin)], [*want_qkv, *want_kv], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_planned_linear_runs_each_row_count_in_its_bucket_kernel():
    # bf16 for one-row products, fp32 for the rest: a row is rounded like a bf16 product there
    plan = FormatPlan(("bf16",) + ("fp32",) * (len(BUCKETS) - 1))
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(32, 8, bias=False)
    lin.weight.data = torch.randn(8, 32, generator=g)
    x = torch.randn(3, 32, generator=g)
    planned = PlannedLinear.of(lin, plan)
    one = x[:1].bfloat16() @ lin.weight.bfloat16().t()
    assert torch.equal(planned(x[:1]), one.float())
    assert torch.equal(planned(x), x @ lin.weight.t())


def test_signed_rope_table_reads_the_rows_signed_rope_gives():
    """The cached signed table gives signed_rope(rope_table(.)) for any positions, also past the
    end of the table first built (it grows), and keeps the positions' shape."""
    for positions in (torch.tensor([0, 1, 7]), torch.arange(3)[None] + torch.tensor([[5], [9000]])):
        got = signed_rope_table(positions, 8, 10000.0)
        assert got.shape == (*positions.shape, 2, 8)
        assert torch.equal(got, signed_rope(*rope_table(positions, 8, 10000.0)))
