"""When a cost-aware draft length takes a round its cost model does not choose, to measure what that model cannot
see otherwise.

While plain rounds lead, a short probe draft now and then re-measures acceptance, at growing intervals while probes
keep failing (and only where it can pay, which `Payoff` decides). While drafting leads, a plain round now and then
(after 16 drafted rounds, then ever more rarely while drafting keeps leading) measures the plain price anew: only
plain rounds measure it, and a price from another call's prior would otherwise never be corrected. A wider pass
measured below the plain price shows it stale at once (a one-token pass costs no more), and the next round is plain.

`Payoff` may veto a probe on prices that only drafted rounds measure, so a slow first draft (another process on the
cores) would keep a call plain to its end. Where acceptance says drafts run through, a probe comes back anyway after
`FIRST_REMEASURE_AFTER` plain rounds (then ever more rarely), and measures the draft prices anew.
"""

from __future__ import annotations


class Exploration:
    """Two probe clocks: rounds of plain decoding before a probe draft, and drafted rounds before a plain probe."""

    FIRST_PROBE_AFTER = 16  # plain rounds before the first probe; doubles after each failed probe
    LAST_PROBE_AFTER = 1024
    FREE_AFTER = 64  # a probe interval this long (two probes failed): plain rounds free the draft tier
    # plain rounds before a probe `Payoff` vetoed is taken anyway, to measure the draft prices anew; doubles each
    # time plain rounds still lead after it
    FIRST_REMEASURE_AFTER = 32
    LAST_REMEASURE_AFTER = 1024
    # drafted rounds before a plain round re-measures the plain price; doubles each time drafting still leads
    FIRST_PLAIN_PROBE_AFTER = 16
    LAST_PLAIN_PROBE_AFTER = 1024
    #: what is carried to the next call on the same model and settings (probes that kept failing in earlier calls
    #: are not repeated at the start of every call)
    ESTIMATES = ("probe_after", "plain_probe_after", "drafted_rounds")

    def __init__(self) -> None:
        self.plain_rounds, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
        # drafted rounds since the plain price was last measured, and when to measure it again (or at once, when a
        # wider pass was measured below it)
        self.drafted_rounds, self.plain_probing, self.plain_stale = 0, False, False
        self.plain_probe_after = self.FIRST_PLAIN_PROBE_AFTER
        self.remeasure_after, self.remeasuring = self.FIRST_REMEASURE_AFTER, False

    @property
    def frees_draft_tier(self) -> bool:
        """Whether probes failed so often that plain rounds need not keep the draft tier."""
        return self.probe_after >= self.FREE_AFTER

    def note_pass(self, width: int, accepted: list[int], below_plain_price: bool) -> None:
        """A measured round verified `width` tokens: a wider pass below the plain price shows it stale, a one-token
        round that accepted measured it."""
        if width > 1:
            self.plain_stale |= below_plain_price
        elif accepted:
            self.plain_stale = False

    def drafting_leads(self, drafted: int) -> bool:
        """The cost model chose to draft: whether to take a plain round instead, to measure the plain price."""
        self._end_plain_probe(drafting_leads=True)
        self.plain_rounds, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
        self.remeasure_after, self.remeasuring = self.FIRST_REMEASURE_AFTER, False
        self.drafted_rounds += bool(drafted)
        if self.drafted_rounds >= self.plain_probe_after or self.plain_stale:
            self.drafted_rounds, self.plain_probing, self.plain_stale = 0, True, False
            return True
        return False

    def plain_leads(self, drafted: int) -> bool:
        """The cost model chose a plain round: whether a probe draft is due (`start_probe` when it is taken)."""
        self._end_plain_probe(drafting_leads=False)
        if drafted:  # the drafted round just seen did not pay; if it was a probe, wait longer for the next
            if self.probing:
                self.probe_after = min(2 * self.probe_after, self.LAST_PROBE_AFTER)
            if self.remeasuring:
                self.remeasure_after = min(2 * self.remeasure_after, self.LAST_REMEASURE_AFTER)
            self.plain_rounds = 0
        self.probing = self.remeasuring = False
        self.plain_rounds += 1
        return self.plain_rounds > self.probe_after

    def start_probe(self) -> None:
        self.probing = True

    @property
    def remeasure_due(self) -> bool:
        """Whether plain rounds have led long enough that a vetoed probe is taken anyway (`start_remeasure`)."""
        return self.plain_rounds > self.remeasure_after

    def start_remeasure(self) -> None:
        """A probe whose round measures the draft prices anew."""
        self.probing = self.remeasuring = True

    def _end_plain_probe(self, drafting_leads: bool) -> None:
        """After a plain probe: drafting still leads (wait longer for the next), or plain rounds take over."""
        if self.plain_probing:
            self.plain_probing = False
            self.plain_probe_after = (
                min(2 * self.plain_probe_after, self.LAST_PLAIN_PROBE_AFTER)
                if drafting_leads
                else self.FIRST_PLAIN_PROBE_AFTER
            )
