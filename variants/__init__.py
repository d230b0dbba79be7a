"""Variants of the step that plug in at a named seam of train.py's loop: DAPO's dynamic sampling (dynamic_sampling:
a round strategy that refills groups without a reward spread)."""
