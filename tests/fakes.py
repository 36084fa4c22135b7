"""Drafters for tests that several test modules share."""

from specdecode.drafters.draft_model import DraftModelDrafter


class ShiftedDrafter(DraftModelDrafter):
    """Drafts the small model's greedy token plus one: a drafter that never agrees (point mass)."""

    def propose(self, batch, num_draft):
        prop = super().propose(batch, num_draft)
        prop.draft_ids = (prop.draft_ids + 1) % self.vocab_size
        prop.draft_probs = None
        return prop
