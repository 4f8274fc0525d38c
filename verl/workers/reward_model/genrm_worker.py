"""The generative reward model's role: a frozen causal LM (the judge) generating verdicts with the built-in rollout.

Upstream serves a GenRM with vLLM / SGLang behind ``reward_router_address``. Here the judge is loaded by the FSDP2
training engine (forward only, parameters sharded over the ranks, colocated with the policy) and generates
through the project's own ``hf`` rollout engine on that module, as the policy's rollout does. The controller's
router (:mod:`verl.workers.reward_model.genrm_router`) turns chat requests into token ids and calls
:meth:`GenerativeRewardModelWorker.generate_verdicts` with a batch of them.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from verl.protocol import DataProto
from verl.single_controller.decorator import Dispatch, register
from verl.single_controller.worker import Worker

__all__ = ["GenerativeRewardModelWorker", "check_judge_checkpoint", "pack_prompts", "unpack_verdicts"]


def check_judge_checkpoint(path: str, trust_remote_code: bool = False) -> None:
    """A judge generates text: a ``*ForSequenceClassification`` checkpoint (a discriminative reward model) has no
    LM head to generate with, so it is refused by name instead of being loaded with a random one."""
    from transformers import AutoConfig

    archs = list(getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), "architectures",
                         None) or [])
    if any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"reward.reward_model.model_path={path!r} is a {archs}: a generative reward model (the custom reward "
            "function gets reward_router_address) needs a causal LM judge. For a sequence-classification reward "
            "model, leave reward.custom_reward_function.path unset.")


def pack_prompts(prompts: list[list[int]], params) -> DataProto:
    """Token-id prompts as a right-padded batch (rows are what the data-parallel dispatch splits) and the sampling
    settings in ``meta_info``."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    sampling = {"n": params.n, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "max_tokens": params.max_tokens, "seed": params.seed}
    return DataProto.from_dict(tensors={"judge_prompt_ids": ids, "judge_prompt_lens": lens},
                               meta_info={"sampling": sampling})


def unpack_verdicts(out: DataProto) -> list[list[tuple[list[int], str]]]:
    """Per prompt, per choice: (generated token ids, finish reason)."""
    ids, lens, stop = out.batch["verdict_ids"], out.batch["verdict_lens"], out.batch["verdict_stopped"]
    return [[(ids[i, j, : int(lens[i, j])].tolist(), "stop" if bool(stop[i, j]) else "length")
             for j in range(ids.size(1))] for i in range(ids.size(0))]


class GenerativeRewardModelWorker(Worker):
    """``reward.reward_model`` section in; the judge's generated token ids out. One per rank of the policy's pool."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from verl.utils.tokenizer import load_tokenizer_and_processor
        from verl.workers.engine_workers import build_engine
        from verl.workers.reward_model.worker import engine_config_for
        from verl.workers.rollout.hf_rollout import HFRollout

        self.ensure_process_group()
        check_judge_checkpoint(self.config.model_path, bool(self.config.get("trust_remote_code", False)))
        role_cfg, model_cfg = engine_config_for(self.config)
        self.tokenizer, _ = load_tokenizer_and_processor(model_cfg, section="reward.reward_model")
        self.engine = build_engine(role_cfg, model_cfg, "genrm", trainable=False)
        self.engine.initialize()
        module = self.engine.hf_rollout_module()
        # The project's built-in engine whatever rollout.name says (as the discriminative path's forward): the
        # judge's sampling, slots and token budget come from reward.reward_model.rollout.
        self.rollout = HFRollout(config=self.config.rollout, model_config=model_cfg, tokenizer=self.tokenizer,
                                 module=module)
        eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        gen_eos = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
        eos.update(gen_eos if isinstance(gen_eos, (list, tuple)) else ([gen_eos] if gen_eos is not None else []))
        self.stop_ids = sorted(eos)
        return True

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_verdicts(self, data: DataProto) -> DataProto:
        from verl.workers.rollout.base import GenerationRequest, SamplingParams

        s = data.meta_info["sampling"]
        params = SamplingParams(n=int(s["n"]), temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                                top_k=int(s["top_k"]), max_tokens=int(s["max_tokens"]), seed=s.get("seed"),
                                stop_token_ids=list(self.stop_ids), logprobs=False)
        ids, lens = data.batch["judge_prompt_ids"], data.batch["judge_prompt_lens"]
        requests = [GenerationRequest(prompt_token_ids=ids[i, : int(lens[i])].tolist()) for i in range(len(lens))]
        outputs = self.rollout.generate(requests, params)
        width = params.max_tokens  # the same on every rank, so the ranks' outputs concatenate
        verdict_ids = torch.zeros((len(requests), params.n, width), dtype=torch.long)
        verdict_lens = torch.zeros((len(requests), params.n), dtype=torch.long)
        stopped = torch.zeros((len(requests), params.n), dtype=torch.bool)
        for i, outs in enumerate(outputs):
            for j, o in enumerate(outs):
                toks = list(o.token_ids)[:width]
                if toks and toks[-1] in self.stop_ids:  # the EOS that ended it is not part of the verdict text
                    toks = toks[:-1]
                verdict_ids[i, j, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                verdict_lens[i, j] = len(toks)
                stopped[i, j] = o.finish_reason == "stop"
        return DataProto.from_dict(tensors={"verdict_ids": verdict_ids, "verdict_lens": verdict_lens,
                                            "verdict_stopped": stopped})
