"""How long to draft: draft-length schedules (`draft_length.py`) and the cost model, exploration and payoff a
cost-aware one decides from (`round_costs.py`, `exploration.py`, `payoff.py`), how many proposed tokens to check
(`proposal_length.py`), the running measures they read (`measures.py`), and what a model's calls carry to the next
(`priors.py`). They change only speed, never output.

`priors_for(model)` is what cost-aware schedules measured on `model`, per settings; `priors_for(model).forget()`
makes its next call explore afresh.
"""

from .priors import SchedulePriors, priors_for

__all__ = ["SchedulePriors", "priors_for"]
