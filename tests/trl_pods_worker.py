"""One rank of the 2-process PODSGRPOTrainer run of test_trl_pods_distributed.py (CPU, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/trl_pods_worker.py OUT_DIR

One training step, one prompt of 4 generations per process, 2 kept per prompt; each rank saves what it selected
and trained on (OUT_DIR/rank_R.pt), and the refusal a group spread over the two processes gets."""

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from integrations import trl_pods  # noqa: E402
from test_trl_pods import char_reward, char_tokenizer, dataset, settings, tiny_qwen2  # noqa: E402


class RecordingTrainer(trl_pods.PODSGRPOTrainer):
    """Keeps the kept batch the update receives."""

    def _downsample(self, batch, local_size):
        self.kept_batch = super()._downsample(batch, local_size)
        return self.kept_batch


def main(out_dir):
    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    args = trl_pods.PODSConfig(**settings(out_dir / "run", per_device_train_batch_size=4, num_generations_kept=2,
                                          max_steps=1))
    model = tiny_qwen2()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = RecordingTrainer(model=model, reward_funcs=char_reward, args=args, train_dataset=dataset(),
                               processing_class=char_tokenizer())
    trainer.train()
    rank, processes = trainer.accelerator.process_index, trainer.accelerator.num_processes
    try:  # (a second config resets accelerate's state: read the ranks above first)
        trl_pods.PODSConfig(**settings(out_dir / "spread", per_device_train_batch_size=2, num_generations_kept=2))
        refusal = None
    except ValueError as error:
        refusal = str(error)
    selection = trainer.last_selection
    torch.save({"rank": rank, "processes": processes,
                "rewards": selection.rewards, "kept": selection.kept, "advantages": selection.advantages,
                "local_rows": selection.local_rows, "kept_advantages": trainer.kept_batch["advantages"].cpu(),
                "kept_tokens": int(trainer.kept_batch["completion_mask"].sum()),
                "num_items_in_batch": int(trainer.kept_batch["num_items_in_batch"]),
                "initial": initial, "final": {n: p.detach().cpu() for n, p in trainer.model.named_parameters()},
                "refusal": refusal}, out_dir / f"rank_{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
