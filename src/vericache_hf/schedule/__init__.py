"""How long to draft: draft-length schedules (`draft_length.py`), how many proposed tokens to check
(`proposal_length.py`), and the running measures both decide from (`measures.py`). They change only speed, never
output."""
