"""The distillation loss of the learned drafters (drafters/layers.py: shifted_kl, SoftTargets)."""

import pytest
import torch

from specdecode.drafters.layers import SoftTargets, shifted_kl


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
