"""How the draft tier drafts: the draft model's float type and matmul layout (`draft_model.py`,
`draft_matmul.py`), proposers of tokens to verify (`proposers.py`), and drafting with a proposer's tokens
(`proposed.py`)."""
