"""Confidence-scheduled speculation (DSpark Algorithm 1; docs/methods.md, "DSpark").

Contract:
- `ScheduledK` is a draft-length policy for the whole batch (the `DraftPolicy`
  interface: `choose(states)`, `observe(state, num_draft, num_accepted)`, plus
  `bounds(states)` and `truncate(states, confidences, num_draft)` for drafters that report
  per-position confidences in `Proposal.extras["confidences"]` ([B, K], c_k = P(draft k accepted
  | drafts 1..k-1 accepted), known before draft k is drawn).
  Candidates (request q, position j) carry prefix survival a_{q,j} = prod_{i<=j} c_{q,i}; they are
  sorted by a descending (ties: earlier position, then row); starting from one token per request
  (tau = R), a candidate is admitted while Theta = tau x SPS(B) grows, and the scan stops at the
  first candidate that does not raise Theta. `variant="production"`: the number of draft tokens
  is the unconstrained best count found on the confidences of two drafting rounds earlier (per
  request, scaled to the current batch), and this step admits the top ones by current survival.
- Drafters without confidences: c_{q,j} is estimated from running statistics, per request and
  per position (decayed counts), shrunk towards the batch-wide per-position rate (statistics are
  already from earlier steps, so both variants schedule them the same way); a request
  stuck at K = 0 probes one draft now and then (backing off) where the measured costs say a
  draft could pay at the current load. If even perfect acceptance cannot pay (the costs of this
  machine, load and context), no request drafts: speculation turns itself off.
- Drafters with confidences draft before the schedule is known, so whether to run the drafter
  at all is decided first (`bounds`): from the decayed mean of each request's earlier
  survivals (the confidences it reported), a drafting round must promise MIN_GAIN over plain
  decoding once its own cost is paid. Otherwise nobody drafts this step (the drafter does not
  run) and a probe round fires now and then (backing off to every 64 steps) so the estimates
  follow the text. In `truncate` the round is already paid: only verification costs count.
- Online costs (`online=True`, what `api.load` uses): `observe_step` compares each step's
  measured verify time with the profile's prediction (a decayed ratio per block length, applied
  to the profile, starting from 1) and measures a drafting round in target steps (decayed, per
  number of drafted positions, starting from the declared cost; catch-up on context excluded).
  Corrections not refreshed drift back to the profile and the declared cost, so one slow step
  cannot switch speculation off for good. Timings then steer K (never a draft's
  admission given its own token), so a seeded run with a stochastic drafter may take other
  K from run to run; the output distribution is the target's either way.
- Lossless: every decision depends on statistics of earlier steps, or on a confidence c_{q,j}
  that is known before x_{q,j} is drawn; the early stop (exact) and the position tie-break
  (production) keep a draft's admission independent of its own token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from specdecode.errors import SpecDecodeError
from specdecode.policy.base import DraftPolicy, PolicyState
from specdecode.policy.costs import StepCostModel, fill_gaps


class ScheduledK(DraftPolicy):
    """DSpark's hardware-aware prefix scheduler as a draft-length policy (see module docstring)."""

    PRIOR = 0.5  # per-position acceptance before anything is observed
    PRIOR_WEIGHT = 2.0  # pseudo-counts of the batch-wide rate in a request's estimate
    MIN_GAIN = 1.05  # a statistics-based schedule must promise 5 % over plain decoding (noisy estimates)

    def __init__(
        self,
        k_max: int,
        cost: StepCostModel,
        draft_cost: float | None = None,
        variant: str = "exact",
        decay: float = 0.9,
        probe_every: int = 8,
        online: bool = False,
    ):
        if k_max < 0:
            raise SpecDecodeError(f"--num-draft-tokens must be >= 0, got {k_max}")
        if variant not in ("exact", "production"):
            raise SpecDecodeError(f"unknown scheduler variant {variant!r}; choose exact or production")
        if draft_cost is not None:
            cost.draft_cost = draft_cost
        self.k_max, self.cost, self.variant = k_max, cost, variant
        self.decay, self.probe_every = decay, probe_every
        self.global_reached = [0.0] * k_max  # batch-wide decayed counts per position
        self.global_accepted = [0.0] * k_max
        self._budgets: deque[float] = deque(maxlen=2)  # production: draft tokens per request
        self.last_budget = 0  # draft tokens the last schedule admitted (for metrics)
        self._time_memo: dict[tuple[int, int], list[float]] = {}
        self.online = online
        # Online corrections: measured / profiled verify time per block length (index = block),
        # and a drafting round's measured cost in target steps per number of drafted positions.
        self.verify_scale: list[float | None] = [None] * (k_max + 2)
        self.round_steps: list[float | None] = [None] * (k_max + 1)
        # Confidence drafters: batch-wide decayed mean survival per position (prior for new
        # requests), and the probing interval while the drafter is idle.
        self.global_survival: list[float | None] = [None] * k_max
        self._idle_steps, self._idle_every = 0, probe_every

    CONTEXT_BUCKET = 64  # step times are looked up per 64 tokens of context
    ONLINE_DECAY = 0.9  # weight of the past in the online cost corrections
    ONLINE_RELAX = 0.005  # per step, how far an unrefreshed correction moves back to the prior

    def _target_times(self, rows: int, context: int) -> list[float]:
        """[0, target(rows, 1), ..., target(rows, k_max + 1)] seconds from the profile (memoised)."""
        key = (rows, context // self.CONTEXT_BUCKET)
        times = self._time_memo.get(key)
        if times is None:
            if len(self._time_memo) > 4096:
                self._time_memo.clear()
            ctx = key[1] * self.CONTEXT_BUCKET
            times = [0.0] + [self.cost.target_time(rows, b, ctx) for b in range(1, self.k_max + 2)]
            self._time_memo[key] = times
        return times

    def _verify_times(self, rows: int, context: int) -> list[float]:
        """Target forward seconds per block length, corrected by the measured ratios."""
        times = self._target_times(rows, context)
        scale = fill_gaps(self.verify_scale[1:], default=1.0)
        return [0.0] + [t * c for t, c in zip(times[1:], scale, strict=True)]

    def _round_cost(self, drafted: int, unit: float) -> float:
        """Seconds of a drafting round of `drafted` positions; unit = one target step."""
        if drafted <= 0:
            return 0.0
        known = [k for k in range(1, len(self.round_steps)) if self.round_steps[k] is not None]
        if not known:
            return drafted * self.cost.draft_cost * unit
        if drafted > known[-1]:  # past the longest measured round: in proportion to positions
            return self.round_steps[known[-1]] * drafted / known[-1] * unit
        return fill_gaps(self.round_steps, default=0.0, first=0.0)[drafted] * unit

    def _step_times(self, rows: int, context: int, round_positions: int | None = None) -> list[float]:
        """[0, time(1), ..., time(k_max + 1)]: verify time plus drafting. round_positions None:
        a block pays for drafting its own block - 1 positions (a drafter whose cost grows with K);
        otherwise every block with drafts pays one round of that many positions, whatever it
        admits (0: the drafts exist already, their cost is sunk)."""
        times = self._verify_times(rows, context)
        if round_positions is None:
            return [t + self._round_cost(b - 1, times[1]) for b, t in enumerate(times)]
        extra = self._round_cost(round_positions, times[1])
        return times[:2] + [t + extra for t in times[2:]]

    def observe_step(
        self, rows: int, block: int, context: int, drafted: int, draft_s: float, verify_s: float
    ) -> None:
        """Online costs: one decode step's measured times (ignored unless `online`)."""
        if not self.online or rows <= 0:
            return
        d, r = self.ONLINE_DECAY, self.ONLINE_RELAX
        raw = self._target_times(rows, context)
        for b, old in enumerate(self.verify_scale):  # unrefreshed ratios relax towards 1
            if old is not None and b != block:
                self.verify_scale[b] = old + r * (1.0 - old)
        for k, old in enumerate(self.round_steps):
            if old is not None and k != drafted:
                self.round_steps[k] = old + r * (k * self.cost.draft_cost - old)
        if 1 <= block <= self.k_max + 1 and verify_s > 0:
            ratio = min(max(verify_s / raw[block], 0.1), 10.0)
            old = self.verify_scale[block]
            self.verify_scale[block] = d * (1.0 if old is None else old) + (1 - d) * ratio
        if 1 <= drafted <= self.k_max:
            unit = self._verify_times(rows, context)[1]
            steps = min(draft_s / unit, 10.0 * drafted)
            old = self.round_steps[drafted]
            prior = drafted * self.cost.draft_cost
            self.round_steps[drafted] = d * (prior if old is None else old) + (1 - d) * steps

    # -- statistics ---------------------------------------------------------------------------
    def _rate(self, st: PolicyState, j: int) -> float:
        """Estimated P(draft j+1 accepted | drafts 1..j accepted) for this request."""
        g_r, g_a = self.global_reached[j], self.global_accepted[j]
        prior = (g_a + self.PRIOR * self.PRIOR_WEIGHT) / (g_r + self.PRIOR_WEIGHT)
        r = st.pos_reached[j] if j < len(st.pos_reached) else 0.0
        a = st.pos_accepted[j] if j < len(st.pos_accepted) else 0.0
        return (a + prior * self.PRIOR_WEIGHT) / (r + self.PRIOR_WEIGHT)

    def observe(self, state: PolicyState, num_draft: int, num_accepted: int) -> None:
        # A position asked for but not proposed (an n-gram without a match) yields nothing while
        # its padded column is paid for: it counts as a rejection, so survival estimates
        # P(proposed and accepted), the quantity the expected tokens need.
        asked = max(num_draft, state.last_k)
        state.last_k = 0
        if asked <= 0:
            return
        while len(state.pos_reached) < self.k_max:
            state.pos_reached.append(0.0)
            state.pos_accepted.append(0.0)
        for j in range(min(asked, self.k_max)):
            reached = j <= num_accepted
            # Decay only the positions that got a new observation, so rarely reached ones keep
            # their evidence.
            if reached:
                ok = float(j < num_accepted)
                state.pos_reached[j] = self.decay * state.pos_reached[j] + 1.0
                state.pos_accepted[j] = self.decay * state.pos_accepted[j] + ok
                self.global_reached[j] = 0.99 * self.global_reached[j] + 1.0
                self.global_accepted[j] = 0.99 * self.global_accepted[j] + ok

    # -- scheduling ---------------------------------------------------------------------------
    def _caps(self, states: list[PolicyState]) -> list[int]:
        return [self.k_max if st.room is None else max(0, min(self.k_max, st.room)) for st in states]

    def bounds(self, states: list[PolicyState]) -> list[int]:
        """Upper bounds before drafting, for drafters that report confidences: everyone's cap
        when a drafting round is expected to pay (or a probe is due), else nobody drafts."""
        self.last_budget = 0
        caps = self._caps(states)
        if not self._may_pay(states):
            return [0] * len(states)
        survival = []
        for st, cap in zip(states, caps, strict=True):
            row = []
            for j in range(cap):
                mine = st.conf_survival[j] if j < len(st.conf_survival) else None
                prior = self.global_survival[j]
                row.append(mine if mine is not None else (1.0 if prior is None else prior))
            survival.append(row)
        # The whole round is paid whatever the schedule admits afterwards.
        ks, theta, base = self._scan(survival, states, early_stop=False, round_positions=max(caps))
        if theta > base * self.MIN_GAIN and any(ks):
            self._idle_steps, self._idle_every = 0, self.probe_every
            return caps
        self._idle_steps += 1
        if self._idle_steps >= self._idle_every:  # a probe round refreshes the estimates
            self._idle_steps, self._idle_every = 0, min(2 * self._idle_every, 64)
            return caps
        return [0] * len(states)

    def _may_pay(self, states: list[PolicyState]) -> bool:
        """Could any schedule beat plain decoding at this load and context, even at acceptance 1?"""
        if self.k_max == 0 or not states:
            return False
        rows = len(states)
        step_time = self._step_times(rows, max(st.context_len for st in states))
        base = rows / step_time[1]
        caps = self._caps(states)
        for block in range(2, self.k_max + 2):
            tau = rows + sum(min(c, block - 1) for c in caps)
            if tau / step_time[block] > base * self.MIN_GAIN:
                return True
        return False

    def choose(self, states: list[PolicyState]) -> list[int]:
        """K per request from running acceptance statistics (no confidences needed)."""
        self.last_budget = 0
        if not self._may_pay(states):
            return [0] * len(states)
        survival = []
        for st, cap in zip(states, self._caps(states), strict=True):
            a, row = 1.0, []
            for j in range(cap):
                a *= self._rate(st, j)
                row.append(a)
            survival.append(row)
        # Statistics are fixed before drafting, so no decision here can depend on a draft token:
        # the scan may look past a non-increase (a new block length costs a whole padded column
        # at once, and the following candidates of that column are free).
        ks, theta, base = self._scan(survival, states, early_stop=False)
        if theta <= base * self.MIN_GAIN:
            ks = [0] * len(states)
        self._probe(states, ks)
        for st, k in zip(states, ks, strict=True):
            st.last_k = k
        self.last_budget = sum(ks)
        return ks

    def truncate(self, states: list[PolicyState], confidences, num_draft: Sequence[int]) -> list[int]:
        """K per request from the proposal's confidences ([B, K] tensor), at most num_draft[b]."""
        conf = confidences.float().clamp(0.0, 1.0).cpu().cumprod(dim=1).tolist()  # [B, K] survival
        caps = self._caps(states)
        survival = [row[: min(int(n), c)] for row, n, c in zip(conf, num_draft, caps, strict=True)]
        self._remember_survival(states, survival)
        if self.variant == "exact":
            ks, _, _ = self._scan(survival, states, early_stop=True, round_positions=0)
        else:
            rows = len(states)
            budget = round(self._budgets[0] * rows) if len(self._budgets) == 2 else None
            # The unconstrained best count on today's confidences is the budget two steps on.
            best, _, _ = self._scan(survival, states, early_stop=False, round_positions=0)
            self._budgets.append(sum(best) / max(rows, 1))
            if budget is None:  # no history yet: this step's exact schedule
                ks, _, _ = self._scan(survival, states, early_stop=True, round_positions=0)
            else:
                ks = [0] * rows
                for _, j, q in self._sorted(survival)[:budget]:
                    ks[q] = max(ks[q], j + 1)
        for st, k in zip(states, ks, strict=True):
            st.last_k = k
        self.last_budget = sum(ks)
        return ks

    def _remember_survival(self, states: list[PolicyState], survival: list[list[float]]) -> None:
        """Decayed means of the reported survivals (what `bounds` predicts the next round from)."""
        d = self.decay
        for st, row in zip(states, survival, strict=True):
            while len(st.conf_survival) < len(row):
                st.conf_survival.append(None)
            for j, a in enumerate(row):
                old = st.conf_survival[j]
                st.conf_survival[j] = a if old is None else d * old + (1 - d) * a
        for j in range(self.k_max):  # the batch-wide prior: once per round, over the rows
            vals = [row[j] for row in survival if j < len(row)]
            if vals:
                a, g = sum(vals) / len(vals), self.global_survival[j]
                self.global_survival[j] = a if g is None else 0.8 * g + 0.2 * a

    @staticmethod
    def _sorted(survival: list[list[float]]) -> list[tuple[float, int, int]]:
        # Survival never grows along a request, so the position tie-break keeps prefixes whole.
        cands = [(a, j, q) for q, row in enumerate(survival) for j, a in enumerate(row)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        return cands

    def _scan(
        self,
        survival: list[list[float]],
        states: list[PolicyState],
        early_stop: bool,
        round_positions: int | None = None,
    ) -> tuple[list[int], float, float]:
        """Admit candidates by survival; returns (K per request, Theta reached, Theta of K = 0).

        early_stop (Algorithm 1): stop at the first candidate that does not raise
        Theta = tau x SPS(B). Otherwise keep the prefix of the sorted list with the best Theta.
        round_positions: how drafting is charged (see `_step_times`).
        """
        rows = len(survival)
        context = max((st.context_len for st in states), default=0)
        step_time = self._step_times(rows, context, round_positions)
        tau, block = float(rows), 1
        theta = base = best = tau / step_time[1]
        admitted: list[tuple[int, int]] = []
        best_n = 0
        for a, j, q in self._sorted(survival):
            nb = max(block, j + 2)
            th = (tau + a) / step_time[nb]
            if early_stop and th <= theta:
                break
            tau, block, theta = tau + a, nb, th
            admitted.append((q, j))
            if th > best:
                best, best_n = th, len(admitted)
        ks = [0] * rows
        for q, j in admitted[:best_n]:
            ks[q] = max(ks[q], j + 1)
        return ks, best, base

    def _probe(self, states: list[PolicyState], ks: list[int]) -> None:
        """A request held at K = 0 tries one draft now and then, so its estimate can recover.

        Probes ride along when the step verifies drafts anyway (the padded block is paid for);
        otherwise they fire only where one more token per request costs under 25 % of a step.
        """
        due = []
        for q, st in enumerate(states):
            if ks[q] > 0 or (st.room is not None and st.room < 1):
                st.steps_at_zero, st.probe_every = 0, 0
                continue
            st.probe_every = st.probe_every or self.probe_every
            st.steps_at_zero += 1
            if st.steps_at_zero >= st.probe_every:
                due.append(q)
        if not due:
            return
        step_time = self._step_times(len(states), max(st.context_len for st in states))
        if max(ks) == 0 and step_time[2] > 1.25 * step_time[1]:
            return
        for q in due:
            st = states[q]
            ks[q], st.steps_at_zero = 1, 0
            st.probe_every = min(2 * st.probe_every, 64)
