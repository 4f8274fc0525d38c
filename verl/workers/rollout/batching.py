"""Prompt batch (DataProto) -> engine requests, and engine outputs -> the trainer's tensors.

Shared by every engine so that padding, masks, position ids and rollout log-probs are laid out the same
way whichever engine generated them.
"""

from __future__ import annotations

import numpy as np
import torch

from verl.protocol import DataProto
from verl.workers.rollout.base import BaseRollout, GenerationRequest, SamplingParams


def sampling_params_from_config(rollout_cfg, meta_info: dict, eos_ids: list[int]) -> SamplingParams:
    """Training rollouts use the rollout config; ``meta_info['validate']`` switches to ``val_kwargs``."""
    if meta_info.get("validate", False):
        vk = rollout_cfg.val_kwargs
        do_sample = vk.get("do_sample", False)
        temperature, top_p, top_k = vk.temperature, vk.top_p, vk.top_k
    else:
        do_sample = meta_info.get("do_sample", rollout_cfg.get("do_sample", True))
        temperature, top_p, top_k = rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.top_k
    stop = [] if rollout_cfg.get("ignore_eos", False) else list(eos_ids)
    return SamplingParams(
        n=1,
        temperature=float(temperature) if do_sample else 0.0,
        top_p=float(top_p),
        top_k=int(top_k) if top_k is not None else -1,
        max_tokens=int(meta_info.get("response_length", rollout_cfg.response_length)),
        stop_token_ids=stop,
        seed=meta_info.get("seed"),
        # rollout.calculate_log_probs=false: the engine skips the sampled tokens' log-probs and the batch has no
        # rollout_log_probs (rollout correction and the rollout/trainer gap metrics need them).
        logprobs=bool(rollout_cfg.get("calculate_log_probs", True)),
    )


def requests_from_batch(prompts: DataProto) -> list[GenerationRequest]:
    ntb = prompts.non_tensor_batch
    if "raw_prompt_ids" in ntb:
        ids = [list(map(int, x)) for x in ntb["raw_prompt_ids"]]
    else:
        ids = [row[mask.bool()].tolist() for row, mask in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"])]
    mm = ntb.get("multi_modal_data")
    mm_inputs = ntb.get("multi_modal_inputs")
    reqs = []
    for i, p in enumerate(ids):
        data, expanded = None, None
        if mm is not None and mm[i]:
            data = dict(mm[i])
            if mm_inputs is not None and mm_inputs[i]:
                data["processor_outputs"] = mm_inputs[i]
                if mm_inputs[i].get("video_grid_thw") is not None:
                    # The processor's expansion of a video (timestamps + frame tokens) is only in input_ids.
                    mask = prompts.batch["attention_mask"][i].bool()
                    expanded = prompts.batch["input_ids"][i][mask].tolist()
        reqs.append(GenerationRequest(prompt_token_ids=p, multi_modal_data=data, expanded_prompt_token_ids=expanded))
    return reqs


def outputs_to_batch(prompts: DataProto, outputs, response_length: int, pad_token_id: int,
                     with_logprobs: bool = True) -> DataProto:
    """Right-pad responses, build full input_ids / attention_mask / position_ids and (``with_logprobs``) the
    rollout log-probs."""
    prompt_ids = prompts.batch["input_ids"]
    prompt_mask = prompts.batch["attention_mask"]
    prompt_pos = prompts.batch["position_ids"]
    bsz = prompt_ids.size(0)
    responses = torch.full((bsz, response_length), pad_token_id, dtype=prompt_ids.dtype)
    response_mask = torch.zeros((bsz, response_length), dtype=prompt_mask.dtype)
    rollout_lp = torch.zeros((bsz, response_length), dtype=torch.float32)
    finish = []
    for i, outs in enumerate(outputs):
        out = outs[0]
        toks = out.token_ids[:response_length]
        n = len(toks)
        responses[i, :n] = torch.tensor(toks, dtype=prompt_ids.dtype)
        response_mask[i, :n] = 1
        if out.log_probs is not None:
            rollout_lp[i, :n] = torch.tensor(out.log_probs[:n], dtype=torch.float32)
        finish.append(out.finish_reason)
    # Positions continue after each prompt's last position (all mRoPE rows advance together for text tokens).
    delta = torch.arange(1, response_length + 1, dtype=prompt_pos.dtype)
    if prompt_pos.dim() == 3:
        last = prompt_pos[..., -1:]
        response_pos = last + delta.view(1, 1, -1)
    else:
        response_pos = prompt_pos[:, -1:] + delta.view(1, -1)
    batch = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=-1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=-1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=-1),
    }
    if with_logprobs:
        batch["rollout_log_probs"] = rollout_lp
    routes = routes_to_batch(prompt_mask, response_length, [outs[0] for outs in outputs])
    if routes is not None:
        batch["routed_experts"] = routes
    return DataProto.from_dict(tensors=batch, non_tensors={"finish_reasons": np.array(finish, dtype=object)},
                               meta_info=dict(prompts.meta_info))


def routes_to_batch(prompt_mask: torch.Tensor, response_length: int, outputs) -> "torch.Tensor | None":
    """The engine's per-sequence routes (prompt + response tokens, moe_layers, top_k) laid out like
    ``input_ids`` (left-padded prompt, right-padded response): (B, P + R, moe_layers, top_k), upstream's
    ``routed_experts``; -1 at padding (the trainer's router keeps its own top-k there)."""
    if not outputs or all(o.routed_experts is None for o in outputs):
        return None
    if any(o.routed_experts is None for o in outputs):
        raise ValueError("router replay: some rollout outputs carry routed_experts and some do not")
    first = outputs[0].routed_experts
    bsz, plen = prompt_mask.shape
    out = torch.full((bsz, plen + response_length, *first.shape[1:]), -1, dtype=first.dtype)
    for i, o in enumerate(outputs):
        real = prompt_mask[i].bool().nonzero().squeeze(-1)  # the prompt's token positions (left padding)
        n_prompt = real.numel()
        r = o.routed_experts
        n_resp = min(len(o.token_ids), response_length)
        if r.shape[0] - len(o.token_ids) != n_prompt:  # the engine's prompt must be the batch's prompt tokens
            raise ValueError(f"router replay: {r.shape[0]} routed tokens for a {len(o.token_ids)}-token response "
                             f"after a prompt of {n_prompt} tokens in the batch")
        out[i, real] = r[:n_prompt]
        out[i, plen : plen + n_resp] = r[n_prompt : n_prompt + n_resp]
    return out


def generate_sequences(engine: BaseRollout, prompts: DataProto, rollout_cfg, eos_ids: list[int],
                       pad_token_id: int) -> DataProto:
    params = sampling_params_from_config(rollout_cfg, prompts.meta_info, eos_ids)
    outputs = engine.generate(requests_from_batch(prompts), params)
    return outputs_to_batch(prompts, outputs, params.max_tokens, pad_token_id, with_logprobs=params.logprobs)
