"""Bridges from other training frameworks to the PODS selection in pods.py (optional: nothing in the core imports
this folder). trl_pods: TRL's GRPOTrainer with PODS; trl_demo: the offline demo run through it."""
