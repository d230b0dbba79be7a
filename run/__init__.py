"""The run around the training step: flags and presets (config, presets), the run folder's safety (runfolder),
checkpoints (checkpoint), the metrics line and its sinks (report), the completions log (completions) and the signals
a run stops on (signals). None of it is the paper's method; train.py's loop calls it between steps."""
