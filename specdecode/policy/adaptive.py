"""`AdaptiveK`: per-request K from the request's own acceptance rate and the measured costs.

Contract: it estimates the request's per-token acceptance rate alpha (decayed counts: `decay` a
round for greedy requests, whose acceptance moves with the text, the longer memory `sampled_decay`
for sampled ones, whose rounds add the draws' own noise) and picks
the K in [0, K_max] that maximises the expected speed-up
    E[tau](K) / (verify_cost[K] + [K > 0] * draft_fixed + K * draft_cost),
(or verify_cost[K] + draft_curve[K] where a round's cost was measured as a curve over K),
with E[tau](K) = (1 - alpha^(K+1)) / (1 - alpha) (docs/methods.md, "Speculative sampling"),
verify_cost[K] the cost of a target forward of K+1 tokens relative to one token (measured:
`profile.py`; with `verify_curves`, the measured seconds at several context lengths, it is read at
the request's own context: a verify block's attention grows with its rows times the context, so a
long RAG prompt makes K extra tokens dearer than a short chat), draft_cost the cost of one draft
token and draft_fixed what a drafting round costs beyond its tokens (a block drafter's one
forward, catching up on committed context), both relative to a target step (measured once per
machine for learned drafters: `build.py`). A request that samples (T > 0) adds `sampled_extra[K]`:
what drafting q and verifying by rejection cost beyond a greedy step with the same K, beyond
what plain sampled decoding pays too (measured with the round costs), and its K is bounded by
`sampled_k_max` where the drafter gives sampled rounds fewer drafts than greedy ones (an EAGLE-2
tree drafts a chain of at most its depth at T > 0: E[tau] of K > depth would be a promise the
round cannot keep). When acceptance is poor
it falls to K = 0 (plain decoding) and probes with K = 1 now and then (backing off) so it can
recover when the text becomes predictable again. Where the measured costs say that even perfect
acceptance would not pay, it never drafts. Decisions depend only on the request's
own history and fixed constants, never on wall-clock timings, so a seeded run is reproducible
and a request decodes the same alone or in a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.errors import SpecDecodeError
from specdecode.policy.base import DraftPolicy, PolicyState, expected_tau
from specdecode.policy.profile import interp

CONTEXT_BUCKET = 64  # contexts are read in steps of this many tokens (a cache of verify curves)


class AdaptiveK(DraftPolicy):
    MIN_GAIN = 0.05  # drafting must promise at least a 5 % speed-up at perfect acceptance
    MARGIN = 0.05  # a round must promise 5 % over plain decoding at the estimated acceptance

    def __init__(
        self,
        k_max: int,
        draft_cost: float = 0.0,
        verify_cost: float | Sequence[float] = 0.03,
        decay: float = 0.9,
        probe_every: int = 8,
        sampled_decay: float = 0.95,
        draft_fixed: float = 0.0,
        draft_curve: Sequence[float] | None = None,
        verify_curves: dict[int, Sequence[float]] | None = None,
        sampled_extra: Sequence[float] | None = None,
        sampled_k_max: int | None = None,
    ):
        """verify_cost: relative cost per extra verified token, or the measured curve
        [t(1), t(2), ..., t(k_max + 1)] / t(1) of target forwards of n tokens; draft_curve:
        a round's measured cost for K = 1..k_max (in target steps), read instead of
        draft_fixed + K * draft_cost (a tree's cost is not a line in K); verify_curves:
        {context: [t(1), ..., t(k_max + 1)] seconds} measured at several committed-context
        lengths (`profile.step_cost_curves`): the verify cost of a request is then read at its
        context, each t(n) piecewise linear in the context between the measured ones, held at the
        shortest below it and extended linearly past the longest (attention is linear in it).
        The drafting costs stay relative to a one-token step at the shortest context (a drafter's
        own attention grows with the context too)."""
        if k_max < 0:
            raise SpecDecodeError(f"--num-draft-tokens must be >= 0, got {k_max}")
        if isinstance(verify_cost, (int, float)):
            self.verify_cost = [1.0 + verify_cost * k for k in range(k_max + 1)]
        else:
            self.verify_cost = [float(c) for c in verify_cost]
            if len(self.verify_cost) < k_max + 1:
                raise ValueError(
                    f"verify_cost needs {k_max + 1} entries (n = 1..K+1), got {len(self.verify_cost)}"
                )
        self.k_max, self.draft_cost, self.draft_fixed = k_max, draft_cost, draft_fixed
        self.draft_curve = None if draft_curve is None else [float(c) for c in draft_curve]
        if self.draft_curve is not None and len(self.draft_curve) < k_max:
            raise ValueError(f"draft_curve needs {k_max} entries (K = 1..K_max), got {len(self.draft_curve)}")
        self.decay, self.probe_every, self.sampled_decay = decay, probe_every, sampled_decay
        self.sampled_extra = None if sampled_extra is None else [float(c) for c in sampled_extra]
        if self.sampled_extra is not None and len(self.sampled_extra) < k_max + 1:
            n = len(self.sampled_extra)
            raise ValueError(f"sampled_extra needs {k_max + 1} entries (K = 0..K_max), got {n}")
        if sampled_k_max is not None and sampled_k_max < 1:
            raise ValueError(f"sampled_k_max must be >= 1 (or None), got {sampled_k_max}")
        self.sampled_k_max = k_max if sampled_k_max is None else min(k_max, sampled_k_max)
        self.verify_curves = None
        if verify_curves:
            curves = {int(c): [float(t) for t in v] for c, v in sorted(verify_curves.items())}
            if any(len(v) < k_max + 1 for v in curves.values()):
                raise ValueError(f"verify_curves need {k_max + 1} entries (n = 1..K+1) at every context")
            # A longer context never makes a forward cheaper: each t(n) non-decreasing over the
            # contexts (noise in a measurement must not extrapolate to a falling t(1)).
            prev = None
            for c in curves:
                if prev is not None:
                    curves[c] = [max(t, p) for t, p in zip(curves[c], prev, strict=False)]
                prev = curves[c]
            self.verify_curves = curves
        self._at_context: dict[int, list[float]] = {}
        # If even perfect acceptance cannot pay for drafting on this machine, never draft (and
        # never probe): speculation is then exactly plain decoding plus nothing.
        best_case = max((k + 1) / self.round_cost(k) for k in range(k_max + 1))
        self.enabled = best_case > 1.0 + self.MIN_GAIN

    def verify_at(self, context: int | None) -> list[float]:
        """[t(1), ..., t(k_max + 1)] / t(1) at a request's context (`verify_cost` without curves)."""
        if self.verify_curves is None or context is None:
            return self.verify_cost
        ctx = max(context, 0) // CONTEXT_BUCKET * CONTEXT_BUCKET
        got = self._at_context.get(ctx)
        if got is None:
            xs = list(self.verify_curves)
            at = max(ctx, xs[0])  # never cheaper than the shortest context measured
            t = [interp(xs, [self.verify_curves[x][n] for x in xs], at) for n in range(self.k_max + 1)]
            got = self._at_context[ctx] = [max(tn, t[0]) / t[0] for tn in t]
        return got

    def round_cost(self, k: int, context: int | None = None, sampled: bool = False) -> float:
        """A step that drafts k tokens, in target one-token steps (at that committed context; a
        sampled request's extra included)."""
        verify = self.verify_at(context)
        extra = self.sampled_extra[k] if sampled and self.sampled_extra is not None else 0.0
        if k == 0:
            return verify[0]
        if self.draft_curve is not None:
            return verify[k] + self.draft_curve[k - 1] + extra
        return verify[k] + self.draft_fixed + k * self.draft_cost + extra

    def best_k(self, alpha: float, context: int | None = None, sampled: bool = False) -> int:
        top = self.sampled_k_max if sampled else self.k_max
        speedups = [expected_tau(alpha, k) / self.round_cost(k, context, sampled) for k in range(top + 1)]
        k = max(range(top + 1), key=lambda k: (speedups[k], -k))
        return k if speedups[k] >= 1.0 + self.MARGIN else 0

    def choose(self, states: list[PolicyState]) -> list[int]:
        if not self.enabled:
            return [0] * len(states)
        ks = []
        for st in states:
            k = self.best_k(st.accepted / max(st.tried, 1e-6), st.context_len or None, st.sampled)
            if k == 0 and self.k_max > 0:
                # Probe with one draft now and then; each probe that does not lift the estimate
                # doubles the interval (up to 64 steps), so a hopeless request costs ~nothing.
                st.probe_every = st.probe_every or self.probe_every
                st.steps_at_zero += 1
                if st.steps_at_zero >= st.probe_every:
                    k, st.steps_at_zero = 1, 0
                    st.probe_every = min(2 * st.probe_every, 64)
            else:
                st.steps_at_zero, st.probe_every = 0, 0
            ks.append(k)
        return ks

    def observe(self, state: PolicyState, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        tried = min(num_accepted + 1, num_draft)
        # At T > 0 a round's acceptance is a few Bernoulli draws: with the greedy memory (~10
        # rounds) a request at alpha ~0.45 dips under the drafting threshold often and then
        # waits for a probe at K = 1 to climb back (DSpark on chat at T = 1 spent about half its
        # steps at K = 0: benchmarks/results/policy-sampled-decay-dspark-t1)
        decay = self.sampled_decay if state.sampled else self.decay
        state.accepted = decay * state.accepted + num_accepted
        state.tried = decay * state.tried + tried
