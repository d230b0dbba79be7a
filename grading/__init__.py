"""What grades a completion besides rewards.py's own rules: the grader pool behind the accuracy reward (math-verify in
worker processes with a CPU-time limit per comparison and a verdict cache, grader.py), and a reward function of one's
own called as TRL calls it, under a time limit (trl_call.py)."""
