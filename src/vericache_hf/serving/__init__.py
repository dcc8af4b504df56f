"""Serving many requests at once: the engine and its request queue (`engine.py`), cohorts that decode requests in
shared passes (`cohort.py`), and admission by device memory (`admission.py`). Built on the core; nothing below
imports it."""
