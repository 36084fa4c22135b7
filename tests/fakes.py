"""Drafters and loop helpers that several test modules share."""

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.policy import FixedK


class ShiftedDrafter(DraftModelDrafter):
    """Drafts the small model's greedy token plus one: a drafter that never agrees (point mass)."""

    def propose(self, batch, num_draft):
        prop = super().propose(batch, num_draft)
        prop.draft_ids = (prop.draft_ids + 1) % self.vocab_size
        prop.draft_probs = None
        return prop


def decode_fixed_k(target, drafter, k, prompts, params=None, max_batch=8, max_new=32, seed=0):
    """Speculative decoding of `prompts` at a fixed K, one seed a request, EOS ignored."""
    dec = SpeculativeDecoder(target, drafter, FixedK(k), max_batch=max_batch)
    reqs = [
        GenerationRequest(p, params or SamplingParams(), max_new, seed=seed + i, id=str(i), ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    return dec.generate(reqs)


def short_prompts(tok):
    """Three short prompts, tokenized."""
    return [
        tok(t)["input_ids"] for t in ("the cat sat on the mat", "hello world, hello", "tell me about the sea")
    ]
