"""The study machinery behind `python study.py ...`: running the arms (studyrun), the PODS vs GRPO study
(pods_study), the committed data files (studydata) and the paired-bootstrap statistics (bootstrap)."""
