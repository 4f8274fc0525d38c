"""The reward-model role: a frozen sequence-classification model scoring each (prompt, response) pair.

Upstream serves its reward model with a rollout engine (vLLM / SGLang ``classify``) and sends it the chat the
policy saw plus the decoded response, rendered by the *reward model's* chat template. Here the same text goes
through a training engine's forward-only pass, batched and packed as the reference policy's log-prob pass is
(dynamic micro-batches of at most ``rollout.max_num_batched_tokens`` tokens, remove-padding where the model's
spec packs). The score lands on each response's last valid token in ``rm_scores`` (B, response_length), which the
reward managers hand on as the token-level score.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from verl.protocol import DataProto
from verl.single_controller.decorator import Dispatch, register
from verl.single_controller.worker import Worker

__all__ = ["RewardModelWorker", "build_rm_inputs", "engine_config_for"]


def engine_config_for(rm_cfg: DictConfig, use_remove_padding: bool = True) -> tuple[DictConfig, DictConfig]:
    """``(role section, model section)`` of the reward model's FSDP2 engine, derived from ``reward.reward_model``:
    weights in ``rollout.dtype`` for compute (fp32 master copy as every frozen role here), no optimizer."""
    rollout = rm_cfg.get("rollout") or {}
    role = OmegaConf.create({
        "strategy": "fsdp2",
        "ulysses_sequence_parallel_size": 1,
        "fsdp_config": {"dtype": str(rollout.get("dtype") or "bfloat16"), "param_offload": False},
    })
    model = OmegaConf.create({"path": rm_cfg.model_path, "use_remove_padding": bool(use_remove_padding),
                              "trust_remote_code": bool(rm_cfg.get("trust_remote_code", False))})
    return role, model


def _chat_of(raw_prompt) -> list[dict]:
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [dict(m) for m in list(raw_prompt)]


def build_rm_inputs(data: DataProto, policy_tokenizer, rm_tokenizer) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Token ids the reward model scores, one row per response (right-padded), and their texts.

    As upstream: the response is decoded with the policy's tokenizer (its EOS text removed), appended to the
    prompt's chat as the assistant turn, and the chat is rendered with the reward model's template (a leading BOS
    text dropped, since tokenizing adds it back). So a reward model with another tokenizer or template sees its own
    format, never the policy's token ids."""
    if "raw_prompt" not in data.non_tensor_batch:
        raise ValueError("reward.reward_model needs the prompts' chats: set data.return_raw_chat=true "
                         "(the reward model re-renders prompt + response with its own chat template)")
    if getattr(rm_tokenizer, "chat_template", None) is None:
        raise ValueError("the reward model's tokenizer (reward.reward_model.model_path) has no chat template; "
                         "the prompt + response are rendered with it as upstream does")
    responses = data.batch["responses"]
    resp_len = responses.size(-1)
    valid = data.batch["attention_mask"][:, -resp_len:].sum(-1)
    texts, rows = [], []
    eos = policy_tokenizer.eos_token
    bos = getattr(rm_tokenizer, "bos_token", None)
    for i in range(len(data)):
        text = policy_tokenizer.decode(responses[i, : int(valid[i])].tolist())
        if eos:
            text = text.replace(eos, "")
        chat = _chat_of(data.non_tensor_batch["raw_prompt"][i]) + [{"role": "assistant", "content": text}]
        rendered = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
        if bos and rendered.startswith(bos):
            rendered = rendered[len(bos):]
        texts.append(rendered)
        rows.append(rm_tokenizer(rendered, add_special_tokens=True)["input_ids"])
    width = max(len(r) for r in rows)
    pad = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, : len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}, texts


class RewardModelWorker(Worker):
    """``reward.reward_model`` section in, ``rm_scores`` out. Colocated with the policy's workers (one per rank)."""

    def __init__(self, config: DictConfig, policy_model: DictConfig):
        super().__init__()
        self.config = config
        self.policy_model = policy_model  # actor_rollout_ref.model: the tokenizer the responses are in

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from verl.utils.tokenizer import load_tokenizer_and_processor
        from verl.workers.engine_workers import build_engine

        self.ensure_process_group()
        role_cfg, model_cfg = engine_config_for(self.config, bool(self.policy_model.get("use_remove_padding", True)))
        self.policy_tokenizer, _ = load_tokenizer_and_processor(self.policy_model)
        self.rm_tokenizer, _ = load_tokenizer_and_processor(model_cfg, section="reward.reward_model")
        self.engine = build_engine(role_cfg, model_cfg, "reward_model", trainable=False)
        self.engine.initialize()
        self.max_tokens = int((self.config.get("rollout") or {}).get("max_num_batched_tokens") or 8192)
        return True

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        tensors, _ = build_rm_inputs(data, self.policy_tokenizer, self.rm_tokenizer)
        longest = int(tensors["attention_mask"].sum(-1).max())
        view = DataProto.from_dict(tensors=tensors, meta_info={
            # Micro-batches of at most max_num_batched_tokens real tokens (vLLM's per-batch budget upstream);
            # a row longer than that runs alone.
            "use_dynamic_bsz": True, "max_token_len": max(self.max_tokens, longest),
            "max_token_len_key": "reward.reward_model.rollout.max_num_batched_tokens"})
        per_token = self.engine.infer_batch(view, outputs=("values",))["values"]
        last = tensors["attention_mask"].sum(-1) - 1
        scores = per_token[torch.arange(len(last)), last].float()
        resp_len = data.batch["responses"].size(-1)
        valid = data.batch["attention_mask"][:, -resp_len:].sum(-1)
        rm_scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        rm_scores[torch.arange(len(valid)), (valid - 1).clamp(min=0)] = scores
        return DataProto.from_dict(tensors={"rm_scores": rm_scores})
