"""Runs main_ppo's run_ppo in this process with a trainer that records each trained batch (for
tests/trainer/test_reward_model_e2e.py and test_genrm_e2e.py): ``python rm_e2e_driver.py OUT.json [overrides...]``.
A discriminative reward model's ``rm_scores`` and a generative one's verdict columns are recorded when present."""

from __future__ import annotations

import json
import sys

from verl.trainer.main_ppo import load_config, run_ppo
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

RECORDS: list[dict] = []


class RecordingTrainer(RayPPOTrainer):
    def _train_on_batch(self, batch, timing, metrics):
        batch = super()._train_on_batch(batch, timing, metrics)
        resp = batch.batch["responses"]
        valid = batch.batch["attention_mask"][:, -resp.size(-1):].sum(-1)
        extras = [k for k in ("genrm_response", "genrm_verdict", "extra_info") if k in batch.non_tensor_batch]
        for i in range(len(batch)):
            record = {
                "step": self.global_steps,
                "raw_prompt": [dict(m) for m in batch.non_tensor_batch["raw_prompt"][i]],
                "response_ids": resp[i, : int(valid[i])].tolist(),
                "token_level_scores": batch.batch["token_level_scores"][i].tolist(),
                "advantages": batch.batch["advantages"][i].tolist(),
                "uid": str(batch.non_tensor_batch["uid"][i]),
                **{k: batch.non_tensor_batch[k][i] for k in extras},
            }
            if "rm_scores" in batch.batch.keys():
                record["rm_scores"] = batch.batch["rm_scores"][i].tolist()
            RECORDS.append(record)
        return batch


if __name__ == "__main__":
    out, argv = sys.argv[1], sys.argv[2:]
    result = run_ppo(load_config(argv), make_trainer=RecordingTrainer)
    with open(out, "w") as f:
        json.dump({"records": RECORDS}, f, default=str)
