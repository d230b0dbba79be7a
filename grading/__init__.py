"""The grader pool behind the accuracy reward (rewards.py): math-verify in worker processes with a CPU-time limit
per comparison and a verdict cache (grader.py)."""
