"""The built-in engine: sampling with the training model itself, so weight sync is free.

Qwen3.5 (dense, MoE, VL) runs this project's own decode loop (``verl.workers.rollout.hf_engine``): packed
prefill into preallocated slots, a CUDA-graph decode step, sampling on the device, continuous batching. Other
architectures use HF ``generate`` on left-padded batches (position ids follow the attention mask so that
full-attention layers see the same positions as in training).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterable

import torch
import torch.distributed as dist

from verl.utils.fsdp_utils import gathered_for_inference
from verl.workers.rollout.base import BaseRollout, GenerationOutput, GenerationRequest, SamplingParams
from verl.workers.rollout.hf_engine.runner import runner_class
from verl.workers.rollout.vision_tokens import expand_vision_tokens, vision_placeholder_ids


class HFRollout(BaseRollout):
    generates_with_training_module = True

    def __init__(self, config, model_config, tokenizer, module: torch.nn.Module = None, processor=None):
        if module is None:
            raise ValueError("the hf rollout engine generates with the actor's module; none was given")
        self.config = config
        self.model_config = model_config  # its mtp section turns on speculative decoding (mtp.enable_rollout)
        self.module = module
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.micro_batch_size = int(config.get("micro_batch_size") or 0) or None
        # The decode engine runs models whose spec names a decode runner; everything else goes through `generate`.
        self.decode_engine = runner_class(module.config) is not None
        if not self.decode_engine:
            arch = (getattr(module.config, "architectures", None) or [type(module).__name__])[0]
            warnings.warn(f"no hf-engine decode runner for {arch} (its model spec names none): the hf rollout "
                          "generates with module.generate (no slot batching or CUDA graphs)", stacklevel=2)
        self.last_stats: dict = {}

    @property
    def chunk_pipeline_class(self):
        """Chunks in flight share the decode loop's session: only where the decode runner runs the model."""
        if not self.decode_engine:
            return None
        from verl.workers.rollout.pipelined import ChunkPipeline

        return ChunkPipeline

    @property
    def engine_metrics(self) -> dict:
        """The decode loop's figures for the last ``generate`` on this rank (seconds in all, capturing graphs,
        prefilling; decode steps, slot-steps, slots, whether CUDA graphs ran; speculative decoding's acceptance):
        where a rollout's time goes. Speculative decoding's per-request means also go out under upstream's
        names, ``rollout/spec_accept_rate`` and ``rollout/spec_accept_length`` (mean over ranks)."""
        out = {}
        for k, v in self.last_stats.items():
            if k.startswith("spec_request_"):
                out["rollout/spec_" + k[len("spec_request_"):]] = float(v)
            else:
                out[f"perf/hf_engine/{k}"] = float(v)  # max over ranks
        return out

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], **kwargs) -> None:
        # Generation uses the live training module; nothing to copy.
        for _ in weights:
            pass

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        if self.decode_engine:
            from verl.workers.rollout.hf_engine.entry import generate_with_engine

            return generate_with_engine(self, requests, params)
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
        prompts = [expand_vision_tokens(r, self.module.config) for r in requests]
        max_len = max(len(p) for p in prompts)
        bsz = len(requests)
        input_ids = torch.full((bsz, max_len), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((bsz, max_len), dtype=torch.long)
        for i, p in enumerate(prompts):
            n = len(p)
            input_ids[i, max_len - n :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, max_len - n :] = 1
        extra = _merge_processor_outputs(requests)
        if extra:
            # The model derives its mRoPE positions from these (0 text, 1 image, 2 video), like the processor's.
            extra["mm_token_type_ids"] = _mm_token_type_ids(input_ids, self.module.config).to(device)
            extra = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
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
        suppress = vision_placeholder_ids(self.module.config)
        if suppress:
            # A sampled <|image_pad|> would be a placeholder without pixels in the training forward.
            gen_kwargs["suppress_tokens"] = suppress
        if do_sample:
            gen_kwargs.update(temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k if params.top_k > 0 else None)
        if not stop_ids:
            gen_kwargs["min_new_tokens"] = params.max_tokens  # ignore_eos: always run to max_tokens
        rng = torch.random.fork_rng(devices=[]) if params.seed is not None else contextlib.nullcontext()
        with rng, gathered_for_inference(self.module):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            if extra:
                _prepare_fsdp_root_for_vision(self.module)
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


def _mm_token_type_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    types = torch.zeros_like(input_ids, dtype=torch.int)
    for value, name in ((1, "image_token_id"), (2, "video_token_id")):
        tid = getattr(config, name, None)
        if tid is not None:
            types[input_ids == tid] = value
    return types


def _prepare_fsdp_root_for_vision(module: torch.nn.Module) -> None:
    """``generate()`` encodes images (``get_image_features``) before its first forward, i.e. outside the FSDP
    root's forward hooks. So do what the root's pre-forward would: settle which FSDP state is the root (else the
    vision blocks, running first, would each claim to be one) and gather the root-owned weights (patch
    embedding, merger) for the vision tower. ``gathered_for_inference`` reshards them afterwards."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return
    module._get_fsdp_state()._lazy_init()  # no-op once the root has run a forward
    module.unshard()
