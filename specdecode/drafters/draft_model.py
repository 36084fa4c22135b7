"""Classic draft model (Leviathan et al. 2023; Chen et al. 2023).

Contract: an independent small causal LM with the target's tokenizer drafts K tokens
autoregressively with its own per-slot KV cache; drafts are sampled from the drafter's
processed distribution q (same temperature / top-k / top-p as the target), which is returned
for rejection sampling. The drafter's cache always holds a prefix of the committed sequence:
each round it first feeds the committed tokens it has not seen (after a full accept that
includes its own last draft), and after verification it keeps the rows of accepted drafts
and rolls the rest back by not advancing.

The distilled draft model (`specdecode train draft`, training/methods/draft.py) is this drafter
over a few-layer `NativeDecoder` made from the target's config: its checkpoint stores only the
layers and the final norm; the embedding and the head are the target's own tensors.
`load_distilled(path, target)` builds it (or refuses a checkpoint made for another target).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from specdecode.drafter import Drafter, DraftRow, Method, Proposal, empty_proposal
from specdecode.drafters.checkpoint import drafter_dtype, is_checkpoint, load_checkpoint, shipped_drafter
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model, same_tokenizer
from specdecode.models.native import NativeDecoder
from specdecode.sampling import process_logits_batch, sample
from specdecode.verify import Verdict


class DraftModelDrafter(Drafter):
    name = "draft"
    deterministic = False

    def __init__(
        self,
        drafter_model,
        vocab_size: int,
        target_vocab_rows: int,
        cost_per_token: float = 0.1,
        fingerprint: str = "",
    ):
        """drafter_model: a CausalLM; vocab_size: tokenizer size; target_vocab_rows: target head rows."""
        self.model = drafter_model
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.target_vocab_rows = target_vocab_rows
        self.cost_per_token = cost_per_token
        self.cache = None
        self._base_len: dict[int, int] = {}  # slot -> committed length after this round's catch-up

    def setup(self, num_slots: int, max_len: int) -> None:
        self.cache = self.model.new_cache(num_slots, max_len)

    def start(self, slot: int, prompt_ids: list[int], hidden: dict | None = None) -> None:
        self.cache.reset(slot)

    def prefill(self, slot: int, prompt_ids: list[int]) -> None:
        if len(prompt_ids) > 1 and self.cache.lengths[slot] == 0:  # the prompt but its last token
            self._forward([list(prompt_ids[:-1])], [slot])
            self.cache.commit(slot, len(prompt_ids) - 1)

    def _forward(self, tokens: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Feed each row's tokens after its committed rows; return logits at each row's last token."""
        device = self.model.info.device
        lens = [len(t) for t in tokens]
        n = max(lens)
        input_ids = torch.zeros(len(tokens), n, dtype=torch.long)  # [B, N]
        positions = torch.zeros(len(tokens), n, dtype=torch.long)  # [B, N]
        for b, (t, slot) in enumerate(zip(tokens, slots, strict=True)):
            input_ids[b, : len(t)] = torch.tensor(t, dtype=torch.long)
            start = self.cache.lengths[slot]
            positions[b] = torch.arange(start, start + n)
        num_new = torch.tensor(lens, dtype=torch.long)
        # Only each row's last position needs logits: run the LM head on those states alone
        # (the catch-up after a prompt can be hundreds of tokens).
        out = self.model.forward(
            input_ids.to(device),
            positions.to(device),
            self.cache,
            slots,
            num_new=lens if min(lens) != n else None,
            capture=(-1,),
            logits=False,
        )
        h = out.hidden[-1]  # [B, N, d] final normed states
        last = (num_new - 1).to(h.device)
        return self.model.lm_head(h[torch.arange(len(tokens), device=h.device), last])  # [B, V]

    def propose(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        rows = [b for b, k in enumerate(num_draft) if k > 0]
        if not rows:
            return empty_proposal(len(batch))
        max_k = max(num_draft[b] for b in rows)
        slots = [batch[b].slot for b in rows]
        params = [batch[b].params for b in rows]
        # 1. Catch up on committed tokens the drafter has not seen (at least the last one).
        pending = [batch[b].token_ids[self.cache.lengths[batch[b].slot] :] for b in rows]
        logits = self._forward(pending, slots)  # [B', V]
        for b, p in zip(rows, pending, strict=True):
            self.cache.commit(batch[b].slot, len(p))
            self._base_len[batch[b].slot] = self.cache.lengths[batch[b].slot]
        draft_ids = torch.zeros(len(batch), max_k, dtype=torch.long)  # [B, K]
        draft_probs = torch.zeros(len(batch), max_k, self.target_vocab_rows)  # [B, K, V]
        # 2. Draft K tokens, one batched forward per position.
        for j in range(max_k):
            q = process_logits_batch(logits[:, None, :].float(), params, self.vocab_size)[:, 0]  # [B', V']
            u = torch.stack(
                [
                    torch.rand((), generator=batch[b].generator) if j < num_draft[b] else torch.zeros(())
                    for b in rows
                ]
            )
            x = sample(q, u.to(q.device))  # [B']
            q = (
                F.pad(q, (0, self.target_vocab_rows - q.shape[-1]))
                if q.shape[-1] < self.target_vocab_rows
                else q
            )
            idx = torch.tensor(rows)
            draft_ids[idx, j] = x.cpu()
            draft_probs[idx, j] = q[:, : self.target_vocab_rows].cpu()
            if j + 1 < max_k:
                logits = self._forward([[int(t)] for t in x.tolist()], slots)
                for s in slots:
                    self.cache.commit(s, 1)  # provisional; rolled back in advance()
        num = torch.tensor([max(k, 0) for k in num_draft], dtype=torch.long)
        return Proposal(draft_ids=draft_ids, num_draft=num, draft_probs=draft_probs)

    def advance(self, batch: list[DraftRow], proposal: Proposal, verdicts: list[Verdict], target_out) -> None:
        for b, row in enumerate(batch):
            if row.slot not in self._base_len:
                continue
            base = self._base_len.pop(row.slot)
            fed = proposal.max_k - 1  # drafts x_1..x_{K-1} were written to the draft cache
            self.cache.lengths[row.slot] = base + min(verdicts[b].num_accepted, fed)


# ---- the distilled draft model (`specdecode train draft`): layers + norm from a checkpoint ----
def _embed_weight(target) -> torch.Tensor:
    m = target.model
    return m.embed_tokens if hasattr(m, "embed_tokens") else m.model.get_input_embeddings().weight


def small_config(target_config, num_layers: int):
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    return cfg


def _drafter(
    target, state: dict, num_layers: int, dtype: torch.dtype, fingerprint: str = ""
) -> DraftModelDrafter:
    tensors = dict(state)
    tensors["model.embed_tokens.weight"] = _embed_weight(target)
    if not getattr(target.config, "tie_word_embeddings", False):
        tensors["lm_head.weight"] = target.model.lm_head_weight()
    small = NativeDecoder.from_hf(
        small_config(target.config, num_layers), tensors, dtype, target.model.info.device
    )
    return DraftModelDrafter(small, target.vocab_size, target.model.info.vocab_size, fingerprint=fingerprint)


def load_distilled(path, target) -> DraftModelDrafter:
    arch, state = load_checkpoint(path, "draft", target)
    return _drafter(target, state, arch["num_layers"], drafter_dtype(target), fingerprint=f"draft:{path}")


# Default drafter model per target alias for the classic draft-model method.
DEFAULT_DRAFT_MODEL = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


def load_draft_model(variant: str, target, spec, dtype="auto", device=None) -> Drafter:
    """`--drafter MODEL` (alias, directory or hub id with the target's tokenizer) or a distilled
    checkpoint; else the target's default drafter model or its shipped distilled drafter."""
    spec = spec or DEFAULT_DRAFT_MODEL.get(target.name) or shipped_drafter("draft", target)
    if spec is not None and is_checkpoint(spec):  # a draft model distilled by `specdecode train draft`
        return load_distilled(spec, target)
    if spec is None:
        raise SpecDecodeError(
            f"--method draft needs a drafter model for target {target.name!r}: pass --drafter MODEL "
            "(an alias, a Hugging Face directory or hub id of a smaller model with the same tokenizer)"
        )
    small = load_model(spec, dtype=dtype, device=device)
    if not same_tokenizer(small.tokenizer, target.tokenizer):
        raise SpecDecodeError(
            f"drafter {spec!r} uses a different tokenizer than target {target.name!r}; "
            "a draft model must share the target's tokenizer (same vocabulary and special tokens)"
        )
    # cost_per_token is measured by the adaptive policy's profile (build.py), keyed by this
    # fingerprint; FixedK ignores it.
    return DraftModelDrafter(
        small.model, target.vocab_size, target.model.info.vocab_size, fingerprint=small.fingerprint
    )


METHOD = Method(
    name="draft",
    variants={"draft": 5},
    load=load_draft_model,
    task="draft",
    train_options={"draft_vocab_size": 8192, "num_layers": 4},
    summary="a smaller LM with the target's tokenizer, or a distilled few-layer copy of the target",
)
