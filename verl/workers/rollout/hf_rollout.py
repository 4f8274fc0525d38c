"""The built-in engine: batched sampling with the training model itself (HF ``generate``).

It shares the actor's module, so weight sync is free. Batches are left-padded; position ids follow the
attention mask so that full-attention layers see the same positions as in training, and the patched
Qwen3.5 layers keep pad positions out of the Gated DeltaNet conv and recurrent states.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist

from verl.utils.fsdp_utils import gathered_for_inference
from verl.workers.rollout.base import BaseRollout, GenerationOutput, GenerationRequest, SamplingParams


class HFRollout(BaseRollout):
    def __init__(self, config, model_config, tokenizer, module: torch.nn.Module = None, processor=None):
        if module is None:
            raise ValueError("the hf rollout engine generates with the actor's module; none was given")
        self.config = config
        self.module = module
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.micro_batch_size = int(config.get("micro_batch_size") or 0) or None

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], **kwargs) -> None:
        # Generation uses the live training module; nothing to copy.
        for _ in weights:
            pass

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        results: list[list[GenerationOutput]] = [[] for _ in requests]
        chunk = self.micro_batch_size or len(requests)
        for _ in range(params.n):
            for start in range(0, len(requests), chunk):
                part = requests[start : start + chunk]
                for j, out in enumerate(self._generate_batch(part, params)):
                    results[start + j].append(out)
        return results

    def _generate_batch(self, requests: list[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        device = next(self.module.parameters()).device
        max_len = max(len(r.prompt_token_ids) for r in requests)
        bsz = len(requests)
        input_ids = torch.full((bsz, max_len), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((bsz, max_len), dtype=torch.long)
        for i, r in enumerate(requests):
            n = len(r.prompt_token_ids)
            input_ids[i, max_len - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            attention_mask[i, max_len - n :] = 1
        extra = _merge_processor_outputs(requests)
        stop_ids = list(params.stop_token_ids)
        do_sample = not params.greedy
        gen_kwargs = dict(
            max_new_tokens=params.max_tokens,
            do_sample=do_sample,
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
            synced_gpus=dist.is_initialized() and dist.get_world_size() > 1,
        )
        if do_sample:
            gen_kwargs.update(temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k if params.top_k > 0 else None)
        if not stop_ids:
            gen_kwargs["min_new_tokens"] = params.max_tokens  # ignore_eos: always run to max_tokens
        rng = torch.random.fork_rng(devices=[]) if params.seed is not None else contextlib.nullcontext()
        with rng, gathered_for_inference(self.module):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            was_training = self.module.training
            self.module.eval()
            out = self.module.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                       generation_config=_plain_generation_config(self.module), **gen_kwargs, **extra)
            self.module.train(was_training)
        seqs = out.sequences[:, max_len:].cpu()
        # Log-probs after temperature, like vLLM's processed log-probs and like the trainer computes them.
        temp = params.temperature if do_sample else 1.0
        logits = torch.stack(out.logits, dim=1).float().cpu() / temp
        lps = torch.log_softmax(logits, dim=-1).gather(-1, seqs.unsqueeze(-1)).squeeze(-1)
        outputs = []
        for i in range(bsz):
            toks = seqs[i].tolist()
            n, reason = len(toks), "length"
            for k, t in enumerate(toks):
                if t in stop_ids:
                    n, reason = k + 1, "stop"
                    break
            outputs.append(GenerationOutput(token_ids=toks[:n], log_probs=lps[i, :n].tolist(), finish_reason=reason))
        return outputs


def _plain_generation_config(module):
    """A generation config free of the checkpoint's own sampling defaults, so only our parameters apply."""
    from transformers import GenerationConfig

    cfg = GenerationConfig()
    cfg.bos_token_id = getattr(module.config, "bos_token_id", None)
    return cfg


def _merge_processor_outputs(requests: list[GenerationRequest]) -> dict:
    outs = [r.multi_modal_data.get("processor_outputs") for r in requests if r.multi_modal_data]
    outs = [o for o in outs if o]
    if not outs:
        return {}
    return {k: torch.cat([o[k] for o in outs if k in o], dim=0) for k in outs[0]}
