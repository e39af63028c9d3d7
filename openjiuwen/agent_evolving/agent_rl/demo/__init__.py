"""`make demo`: the online-RL loop end to end on one CPU machine (see `run.py` and docs/demo.md)."""
