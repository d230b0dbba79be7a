"""The multi-GPU command line (see the package docstring): train under torchrun, export or evaluate sharded
checkpoints in one process."""

import sys

import eval as heldout
import multigpu
from multigpu import distributed, run, sharded_checkpoint


def load_sharded(path, base_model, dtype, device):
    """eval.py's reader of a sharded checkpoint: the weights as one plain model, LoRA merged."""
    return sharded_checkpoint.load_merged_model(path, base_model, dtype=dtype, device=device)


def main(argv):
    if argv[:1] in (["-h"], ["--help"]):
        return print(multigpu.__doc__.split("\n\n")[1])  # the three commands
    if argv[:1] == ["export"]:
        return sharded_checkpoint.main(argv[1:])
    if argv[:1] == ["eval"]:
        return heldout.main(argv[1:], load_sharded=load_sharded)
    if not distributed.launched_by_torchrun():
        raise ValueError("training runs under torchrun, e.g. torchrun --nproc-per-node 8 -m multigpu --preset e; "
                         "one process: python train.py")
    return distributed.run_main(run.main, argv)  # an error ends every rank; torchrun names the rank that failed


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        sys.exit(f"python -m multigpu: error: {error}")
