"""Validation rules of the roles: trainer layout, data, the actor, its rollout, the reference policy and the
critic (batch-size arithmetic as upstream enforces it in its trainer and config dataclasses, parallel sizes,
registry-backed names). Each ``check_*`` records problems on a :class:`~.checker.Checker`."""

from __future__ import annotations

import functools
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .checker import (
    CONFIG_DIR,
    UNSET,
    Checker,
    check_kl_name,
    is_interpolation,
    loss_agg_modes,
    need_critic,
    need_reference_policy,
    train_strategy,
)

__all__ = ["check_actor", "check_critic", "check_data", "check_model", "check_ref", "check_rollout",
           "check_trainer"]

# Estimators whose baseline comes from the other samples of the same prompt (a warning with rollout.n=1).
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "grpo_passk", "rloo_vectorized", "grpo_vectorized",
                    "reinforce_plus_plus_baseline", "gdpo")
TRUNCATION = ("error", "left", "right", "middle")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def check_trainer(c: Checker) -> Optional[int]:
    nnodes = c.integer("trainer.nnodes", minimum=1)
    per_node = c.integer("trainer.n_gpus_per_node", minimum=1)
    c.integer("trainer.total_epochs", minimum=1)
    c.integer("trainer.total_training_steps", minimum=1, allow_none=True)
    launcher = c.choice("trainer.launcher", ("ray", "local"))
    if launcher == "local" and nnodes is not None and nnodes != 1:
        c.fail("trainer.nnodes", f"is {nnodes} but trainer.launcher=local runs on one node; use launcher=ray.")
    mode = c.choice("trainer.resume_mode", ("auto", "disable", "resume_path"))
    if mode == "resume_path" and not c.get("trainer.resume_from_path"):
        c.fail("trainer.resume_from_path", "must point at a checkpoint when trainer.resume_mode=resume_path.")
    c.choice("trainer.device", ("cuda", "npu", "cpu"))
    c.integer("trainer.critic_warmup", minimum=0)
    c.choice("trainer.on_nonfinite", ("skip", "error"))
    c.number("trainer.esi_redundant_time", low=0)
    if nnodes is None or per_node is None:
        return None
    return nnodes * per_node


def check_data(c: Checker) -> None:
    c.integer("data.train_batch_size", minimum=1)
    c.integer("data.max_prompt_length", minimum=1)
    c.integer("data.max_response_length", minimum=1)
    c.choice("data.truncation", TRUNCATION)
    c.integer("data.val_batch_size", minimum=1, allow_none=True)  # batches validation (null: one batch)


def check_model(c: Checker, prefix: str) -> None:
    from .lora_section import lora_section_conflicts

    for section_key, flat_key in lora_section_conflicts(c.cfg):
        if section_key.startswith(prefix + "."):
            c.fail(section_key, f"is {c.get(section_key)!r} but `{flat_key}` is {c.get(flat_key)!r}: they are one "
                                "setting (upstream's new and old spelling); set one of them.")
    from verl.workers.lora_init import LORA_A_INITS, LORA_B_INITS

    for key, allowed in (("lora_A_init_method", LORA_A_INITS), ("lora_B_init_method", LORA_B_INITS)):
        if c.get(f"{prefix}.lora.{key}") is not UNSET:
            c.choice(f"{prefix}.lora.{key}", allowed, allow_none=True)
    rank = c.integer(f"{prefix}.lora_rank", minimum=0)
    if rank:
        c.number(f"{prefix}.lora_alpha", low=0, low_open=True)
    c.choice(f"{prefix}.fused_kernel_options.impl_backend", ("torch", "triton"))
    from .mtp_section import mtp_problems

    role = "critic" if prefix.startswith("critic.") else "actor_rollout_ref.actor"
    c.problems.extend(mtp_problems(c.get, prefix, c.get(f"{role}.strategy"), value_model=role == "critic"))


def check_optim(c: Checker, prefix: str, strategy: Optional[str]) -> None:
    c.number(f"{prefix}.lr", low=0)
    c.number(f"{prefix}.lr_warmup_steps_ratio", low=0, high=1)
    if strategy == "fsdp2":
        c.choice(f"{prefix}.lr_scheduler_type", ("constant", "cosine"))
        c.choice(f"{prefix}.warmup_style", ("constant", "cosine"), allow_none=True,
                 hint=f" It is deprecated; prefer {prefix}.lr_scheduler_type.")


def check_checkpoint(c: Checker, prefix: str) -> None:
    for key in ("save_contents", "load_contents"):
        value = c.get(f"{prefix}.{key}")
        if value in (None, UNSET):
            continue
        bad = [v for v in value if v not in CHECKPOINT_CONTENTS]
        if bad:
            c.fail(f"{prefix}.{key}", f"has unknown entries {bad}; allowed: {', '.join(CHECKPOINT_CONTENTS)}.")


def _parallel_dp_size(c: Checker, section: str, strategy: str, world: int) -> Optional[int]:
    """Data-parallel size of an actor/critic section, or None after reporting a problem. The ranks of one replica
    are the product of the engine's registered ``replica_keys`` (the formula the workers use too)."""
    from verl.workers.engine.sections import engine_sections

    keys = engine_sections(strategy).replica_keys
    sizes = [c.integer(f"{section}.{k}", minimum=1) for k in keys]
    if None in sizes:
        return None
    replica = functools.reduce(lambda x, y: x * y, sizes, 1)
    if strategy == "megatron" and c.get(f"{section}.megatron.virtual_pipeline_model_parallel_size") not in (
            None, UNSET) and sizes[1] < 2:
        c.fail(f"{section}.megatron.virtual_pipeline_model_parallel_size",
               "needs pipeline_model_parallel_size > 1; set it to null.")
    if world % replica:
        others = " * ".join(k.rsplit(".", 1)[-1] for k in keys[1:])
        what = f"* {others} ({replica})" if others else f"({replica})"
        c.fail(f"{section}.{keys[0]}", f"{what} must divide the world size ({world}).")
        return None
    if strategy == "megatron" and not _expert_layout_fits(c, section, sizes[0], sizes[1], world):
        return None
    return world // replica


def _expert_layout_fits(c: Checker, section: str, tp: int, pp: int, world: int) -> bool:
    """megatron-core splits every pipeline stage of the expert layers into expert-tensor * expert parallel groups
    (the rest is their data parallelism), so that product times the pipeline size must divide the world."""
    m = f"{section}.megatron"
    ep = c.integer(f"{m}.expert_model_parallel_size", minimum=1)
    etp = c.get(f"{m}.expert_tensor_parallel_size")
    etp = tp if etp in (None, UNSET) else c.integer(f"{m}.expert_tensor_parallel_size", minimum=1)
    if ep is None or etp is None:
        return False
    if world % (etp * ep * pp):
        c.fail(f"{m}.expert_model_parallel_size",
               f"* expert_tensor_parallel_size * pipeline_model_parallel_size ({ep} * {etp} * {pp}) must divide "
               f"the world size ({world}).")
        return False
    return True


def sequence_parallel_size(c: Checker, section: str, packing_key: str, packing_name: str, engine: str):
    """``<section>.ulysses_sequence_parallel_size`` (FSDP2), which needs packed sequences; returns it. Its new
    upstream home, ``<section>.<engine>.ulysses_sequence_parallel_size``, was moved there by
    ``settle_sequence_parallel`` unless both are set."""
    sp = c.get(f"{section}.ulysses_sequence_parallel_size", 1)
    engine_sp = c.get(f"{section}.{engine}.ulysses_sequence_parallel_size", 1)
    if isinstance(engine_sp, int) and engine_sp > 1 and engine_sp != sp:
        c.fail(f"{section}.{engine}.ulysses_sequence_parallel_size",
               f"is {engine_sp} but `{section}.ulysses_sequence_parallel_size` is {sp}; set one of them.")
    if isinstance(sp, int) and sp > 1 and not c.flag(packing_key):
        c.fail(f"{section}.ulysses_sequence_parallel_size",
               f"is {sp} but sequence parallelism needs `{packing_name}=true`.")
    return sp


def check_fsdp_precision(c: Checker, section: str) -> None:
    """``<section>.mixed_precision.{param,reduce,buffer}_dtype`` of an FSDP engine section: null or a dtype name."""
    from verl.workers.engine.fsdp.model_init import DTYPES

    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        key = f"{section}.mixed_precision.{name}"
        if c.get(key) not in (None, UNSET):
            c.choice(key, sorted(DTYPES))


def check_actor(c: Checker, world: Optional[int]) -> None:
    a = "actor_rollout_ref.actor"
    strategy = train_strategy(c, f"{a}.strategy")
    mini = c.integer(f"{a}.ppo_mini_batch_size", minimum=1)
    c.integer(f"{a}.ppo_epochs", minimum=1)
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        c.number(f"{a}.{key}", low=0, low_open=True)
    c.number(f"{a}.clip_ratio_c", low=1, low_open=True)
    c.choice(f"{a}.loss_agg_mode", loss_agg_modes())
    check_loss_mode_keys(c, a, c.registered(f"{a}.policy_loss.loss_mode", "policy_loss"))
    c.number(f"{a}.entropy_coeff")
    if c.flag(f"{a}.use_prefix_grouper"):
        c.fail(f"{a}.use_prefix_grouper", PREFIX_GROUPER_WHY)
    if c.flag(f"{a}.calculate_sum_pi_squared"):
        if strategy == "megatron":
            c.fail(f"{a}.calculate_sum_pi_squared", "is true, but sum_pi_squared is computed by the FSDP engine only "
                                                    "here (the Megatron head's vocab-parallel pass does not return "
                                                    "it); use strategy=fsdp2.")
        if c.flag("actor_rollout_ref.model.use_fused_kernels"):
            c.fail(f"{a}.calculate_sum_pi_squared", "is true, but model.use_fused_kernels never materialises the "
                                                    "token distribution sum_pi_squared sums over; set "
                                                    "use_fused_kernels=false.")
    if c.flag(f"{a}.use_kl_loss"):
        check_kl_name(c, f"{a}.kl_loss_type")
        c.number(f"{a}.kl_loss_coef", low=0)
    check_optim(c, f"{a}.optim", strategy)
    check_checkpoint(c, f"{a}.checkpoint")

    if strategy == "fsdp2":
        sequence_parallel_size(c, a, f"{a}.use_remove_padding", "actor_rollout_ref.model.use_remove_padding",
                               "fsdp_config")
        check_fsdp_precision(c, f"{a}.fsdp_config")

    # The parallel layout must fit the world whatever the batch sizing (a user-registered engine lays ranks out
    # its own way: only the checks here apply to it).
    dp = _parallel_dp_size(c, a, strategy, world) if world is not None and strategy in ("fsdp2", "megatron") else None
    if c.flag(f"{a}.use_dynamic_bsz"):
        c.integer(f"{a}.ppo_max_token_len_per_gpu", minimum=1)
        return
    c.micro_batch_pair(a, "ppo_micro_batch_size", "use_dynamic_bsz")
    train_bs = c.get("data.train_batch_size")
    n = c.get("actor_rollout_ref.rollout.n")
    if not all(isinstance(v, int) and v > 0 for v in (train_bs, n)) or mini is None or strategy is None:
        return
    if train_bs < mini:
        c.fail(f"{a}.ppo_mini_batch_size",
               f"({mini}) must be <= data.train_batch_size ({train_bs}); lower it or raise the batch size.")
    elif train_bs % mini:
        c.fail(f"{a}.ppo_mini_batch_size",
               f"({mini}) must divide data.train_batch_size ({train_bs}) so every PPO step gets whole mini-batches.")
    if dp is None:
        return
    per_gpu = c.get(f"{a}.ppo_micro_batch_size_per_gpu")
    if strategy == "megatron":
        if not isinstance(per_gpu, int):
            return  # already reported by micro_batch_pair
        minimal = dp * per_gpu
    else:
        minimal = world
    if (train_bs * n) % minimal:
        c.fail("data.train_batch_size",
               f"* rollout.n = {train_bs * n} must be divisible by {minimal} "
               f"({'data-parallel size * ppo_micro_batch_size_per_gpu' if strategy == 'megatron' else 'world size'}).")
    mini_total = mini * n
    if mini_total % dp:
        c.fail(f"{a}.ppo_mini_batch_size",
               f"* rollout.n = {mini_total} must be divisible by the data-parallel size ({dp}).")
    elif isinstance(per_gpu, int) and per_gpu > 0 and (mini_total // dp) % per_gpu:
        c.fail(f"{a}.ppo_micro_batch_size_per_gpu",
               f"({per_gpu}) must divide the per-GPU mini-batch ({mini_total // dp} = "
               f"ppo_mini_batch_size * rollout.n / data-parallel size).")
    legacy = c.get(f"{a}.ppo_micro_batch_size")
    if isinstance(legacy, int) and legacy > 0:
        if mini % legacy:
            c.fail(f"{a}.ppo_micro_batch_size", f"({legacy}) must divide ppo_mini_batch_size ({mini}).")
        sp = c.get(f"{a}.ulysses_sequence_parallel_size", 1) if strategy != "megatron" else 1
        if isinstance(sp, int) and legacy * sp < world:
            c.fail(f"{a}.ppo_micro_batch_size",
                   f"({legacy}) * ulysses_sequence_parallel_size ({sp}) must be >= the world size ({world}).")


# Why actor.use_prefix_grouper=true is refused rather than built.
PREFIX_GROUPER_WHY = (
    "is true, but the shared-prefix forward is not implemented: it runs a GRPO group's prompt once and lets every "
    "response attend to that one copy, while packed sequences here give each sequence its own attention block "
    "(flash-attn varlen / cu_seqlens) and each Gated DeltaNet layer a recurrent state that restarts at every "
    "sequence, so a response cannot read another row's prefix without a custom mask and a state hand-off the "
    "packed kernels do not offer. It changes speed, not results: set it to false.")


def check_loss_mode_keys(c: Checker, a: str, mode: Optional[str]) -> None:
    """The settings a built-in loss mode reads (a user's own loss reads what it likes)."""
    if mode == "sapo":
        for key in ("tau_pos", "tau_neg"):
            c.number(f"{a}.{key}", low=0, low_open=True)
    elif mode == "dro":
        beta = c.get(f"{a}.policy_loss.dro_beta")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
            c.fail(f"{a}.policy_loss.dro_beta", f"is {beta!r}, but policy_loss.loss_mode=dro needs a positive number "
                                                 "(the weight of its squared log-ratio penalty).")


def check_rollout(c: Checker, world: Optional[int]) -> None:
    r = "actor_rollout_ref.rollout"
    name = c.registered(f"{r}.name", "rollout")
    c.choice(f"{r}.mode", ("async",), hint=" The sync rollout mode was removed upstream.")
    n = c.integer(f"{r}.n", minimum=1)
    c.number(f"{r}.temperature", low=0)
    c.number(f"{r}.top_p", low=0, high=1, low_open=True)
    c.integer(f"{r}.top_k", minimum=-1)
    c.number(f"{r}.gpu_memory_utilization", low=0, high=1, low_open=True)
    c.integer(f"{r}.val_kwargs.n", minimum=1)
    if c.flag(f"{r}.val_kwargs.do_sample"):
        temp = c.get(f"{r}.val_kwargs.temperature")
        if not isinstance(temp, (int, float)) or temp <= 0:
            c.fail(f"{r}.val_kwargs.temperature",
                   f"is {temp!r} but val_kwargs.do_sample=true needs a temperature > 0 "
                   "(or set val_kwargs.do_sample=false for greedy validation).")
    max_len = c.get(f"{r}.max_model_len")
    prompt, response = c.get(f"{r}.prompt_length"), c.get(f"{r}.response_length")
    if isinstance(max_len, int) and isinstance(prompt, int) and isinstance(response, int):
        if max_len < prompt + response:
            c.fail(f"{r}.max_model_len", f"({max_len}) is smaller than prompt_length + response_length "
                                         f"({prompt} + {response}); raise it or set it to null.")
    if name in ("vllm", "sglang") and world is not None and c.flag("actor_rollout_ref.hybrid_engine", True):
        sizes = [c.integer(f"{r}.{k}", minimum=1) for k in
                 ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")]
        if None not in sizes and world % (sizes[0] * sizes[1] * sizes[2]):
            c.fail(f"{r}.tensor_model_parallel_size",
                   f"* data_parallel_size * pipeline_model_parallel_size ({sizes[0] * sizes[1] * sizes[2]}) "
                   f"must divide the world size ({world}).")
    if name == "hf":
        _check_hf_parallel_sizes(c, r)
    c.micro_batch_pair(r, "log_prob_micro_batch_size", "log_prob_use_dynamic_bsz")

    mt = f"{r}.multi_turn"
    # The parser and agent-loop registries import the agent loop (about a second), so with multi-turn off a
    # name is looked up only when it differs from the shipped default (a built-in name): a wrong name is
    # refused whether or not multi-turn is on.
    enabled = c.flag(f"{mt}.enable")
    for key, kind in ((f"{mt}.format", "tool_parser"), (f"{r}.agent.default_agent_loop", "agent_loop")):
        if enabled or c.get(key) != _rollout_default(key[len(r) + 1:]):
            c.registered(key, kind)
    if not enabled:
        _check_tools_without_multi_turn(c, mt)
    c.choice(f"{mt}.tool_response_truncate_side", ("left", "right", "middle"))
    c.choice(f"{mt}.tokenization_sanity_check_mode", ("strict", "ignore_strippable", "disable"))
    c.integer(f"{mt}.max_parallel_calls", minimum=1)
    c.integer(f"{r}.agent.num_workers", minimum=1)
    if n == 1 and c.get("algorithm.adv_estimator") in GROUP_ESTIMATORS:
        c.warn(f"algorithm.adv_estimator={c.get('algorithm.adv_estimator')} compares samples of the same prompt, "
               "but actor_rollout_ref.rollout.n=1: every advantage will be zero. Set rollout.n > 1.")


def check_ref(c: Checker, world: Optional[int] = None) -> None:
    if not need_reference_policy(c.cfg):
        return
    f = "actor_rollout_ref.ref"
    if train_strategy(c, f"{f}.strategy") == "fsdp2":
        check_fsdp_precision(c, f"{f}.fsdp_config")
        # The reference may run its own Ulysses size (its worker regroups the actor-layout data for it), except
        # under LoRA, where it is the actor's module with the adapters off and so keeps the actor's layout.
        sp = sequence_parallel_size(c, f, "actor_rollout_ref.model.use_remove_padding",
                                    "actor_rollout_ref.model.use_remove_padding", "fsdp_config")
        actor_sp = c.get("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1)
        if isinstance(sp, int) and sp > 1 and world and world % sp:
            c.fail(f"{f}.ulysses_sequence_parallel_size", f"({sp}) must divide the world size ({world}).")
        lora = (c.get("actor_rollout_ref.model.lora_rank", 0) or 0) > 0 or c.get("actor_rollout_ref.model.lora_adapter_path")
        if lora and isinstance(sp, int) and sp != actor_sp:
            c.fail(f"{f}.ulysses_sequence_parallel_size", f"is {sp} but the actor's is {actor_sp}: with LoRA the "
                                                          "reference is the actor's own model (adapters off) and "
                                                          "runs in its layout; leave it at the actor's.")
    c.micro_batch_pair(f, "log_prob_micro_batch_size", "log_prob_use_dynamic_bsz")


def check_critic(c: Checker, world: Optional[int]) -> None:
    try:
        used = need_critic(c.cfg)
    except OmegaConfBaseException:
        used = True
    if not used:
        return
    k = "critic"
    strategy = train_strategy(c, f"{k}.strategy")
    c.number(f"{k}.cliprange_value", low=0, low_open=True)
    if not is_interpolation(c.cfg, f"{k}.loss_agg_mode"):  # inherited values were checked on the actor
        c.choice(f"{k}.loss_agg_mode", loss_agg_modes())
    check_optim(c, f"{k}.optim", strategy)
    check_model(c, f"{k}.model")
    check_checkpoint(c, f"{k}.checkpoint")
    if strategy == "fsdp2":
        check_fsdp_precision(c, f"{k}.fsdp")
        sp = sequence_parallel_size(c, k, f"{k}.model.use_remove_padding", "critic.model.use_remove_padding", "fsdp")
        if world is not None and isinstance(sp, int) and sp > 0 and world % sp:
            c.fail(f"{k}.ulysses_sequence_parallel_size", f"({sp}) must divide the world size ({world}).")
    if c.flag(f"{k}.use_dynamic_bsz"):
        return
    c.micro_batch_pair(k, "ppo_micro_batch_size", "use_dynamic_bsz")
    mini = c.integer(f"{k}.ppo_mini_batch_size", minimum=1)
    train_bs = c.get("data.train_batch_size")
    if isinstance(train_bs, int) and mini is not None and train_bs < mini:
        c.fail(f"{k}.ppo_mini_batch_size", f"({mini}) must be <= data.train_batch_size ({train_bs}).")
    legacy = c.get(f"{k}.ppo_micro_batch_size")
    if isinstance(legacy, int) and legacy > 0 and mini and mini % legacy:
        c.fail(f"{k}.ppo_micro_batch_size", f"({legacy}) must divide critic.ppo_mini_batch_size ({mini}).")


@functools.lru_cache(maxsize=None)
def _rollout_defaults() -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "rollout" / "rollout.yaml"), resolve=False)


def _rollout_default(key: str):
    """The default of ``actor_rollout_ref.rollout.<key>`` as rollout/rollout.yaml ships it."""
    node = _rollout_defaults()
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


# Parallel layout of a vLLM / SGLang replica. The hf engine (verl/workers/rollout/hf_engine) generates on
# every rank with the training module itself, so it reads none of them.
HF_IGNORED_SIZES = ("tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size",
                    "pipeline_model_parallel_size")


def _check_hf_parallel_sizes(c: Checker, r: str) -> None:
    """With rollout.name=hf, each size may be 1 (what hf does) or the shipped default: a composed config cannot
    tell a default from the same value typed on the command line, and tensor_model_parallel_size defaults to 2
    (for vLLM), so refusing the default would refuse every hf run. Any other value was meant for another
    engine and would be silently ignored."""
    for key in HF_IGNORED_SIZES:
        value = c.get(f"{r}.{key}")
        if value is UNSET or value in (1, _rollout_default(key)):
            continue
        c.fail(f"{r}.{key}", f"is {value!r}, but rollout.name=hf generates with the training module on every "
                             f"rank and has no {key.replace('_size', '').replace('_', ' ')}, so the value would be "
                             f"ignored; set it to 1, or use rollout.name=vllm for a parallel inference engine.")


def _check_tools_without_multi_turn(c: Checker, mt: str) -> None:
    """Tool files are loaded by the agent loop, which runs here only with multi_turn.enable=true (upstream
    loads them in every agent-loop worker and offers them to samples whose agent_name is tool_agent). With
    multi-turn off a tool file would be silently unused, so it is an error rather than a warning: either the
    user meant multi-turn on, or the key is leftover."""
    keys = [f"{mt}.tool_config_path", f"{mt}.function_tool_path"]
    for key in ("data.tool_config_path", "data.function_tool_path"):  # mirrors unless set on their own
        if not is_interpolation(c.cfg, key):
            keys.append(key)
    for key in keys:
        value = c.get(key)
        if value not in (None, UNSET, ""):
            c.fail(key, f"is {value!r}, but {mt}.enable=false: tools are offered only by the multi-turn agent "
                        f"loop. Set `{mt}.enable=true` to use them, or set this key to null.")


def check_router_replay(c: Checker) -> None:
    """MoE router replay: the actor engine's router_replay.mode (upstream's actor.megatron.router_replay.mode,
    and this project's FSDP twin actor.fsdp_config.router_replay.mode) and rollout.enable_rollout_routing_replay.
    The block of the engine the actor does not run on keeps its default."""
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    megatron = c.get(f"{a}.strategy") == "megatron"
    mode_key = f"{a}.megatron.router_replay.mode" if megatron else f"{a}.fsdp_config.router_replay.mode"
    mode = c.choice(mode_key, ("disabled", "R2", "R3")) if c.get(mode_key) not in (None, UNSET) else None
    record = c.flag(f"{r}.enable_rollout_routing_replay")
    if record:
        if c.get(f"{r}.name") not in ("hf", "vllm"):
            c.fail(f"{r}.enable_rollout_routing_replay", f"=true needs a rollout engine that records the routes "
                                                         f"(hf, or vllm through enable_return_routed_experts), not "
                                                         f"{c.get(f'{r}.name')!r}.")
        if c.flag(f"{r}.multi_turn.enable"):
            c.fail(f"{r}.enable_rollout_routing_replay", "=true with multi_turn.enable=true is not implemented (the "
                                                         "agent loop does not carry routes).")
    if mode in (None, "disabled"):
        return
    if mode == "R3" and not record:
        c.fail(mode_key, f"=R3 replays the rollout's routes: set {r}.enable_rollout_routing_replay=true.")
    if mode == "R2":
        if record:
            c.fail(mode_key, f"=R2 records routes in the old-log-prob pass; {r}.enable_rollout_routing_replay=true "
                             "is for R3 (upstream refuses both together too).")
        if c.flag("algorithm.rollout_correction.bypass_mode"):
            c.fail(mode_key, "=R2 records in the old-log-prob pass, which algorithm.rollout_correction."
                             "bypass_mode=true skips.")
    if megatron:
        # the Megatron engine replays through megatron-core's unfused top-k
        if c.get(f"{a}.megatron.override_transformer_config.moe_router_fusion") is True:
            c.fail(f"{a}.megatron.override_transformer_config.moe_router_fusion",
                   f"=true bypasses megatron-core's router replay, which {mode_key}={mode} uses; set it to false.")
        cp = c.get(f"{a}.megatron.context_parallel_size")
        if isinstance(cp, int) and cp > 1:  # the routes' token layout is built for whole packed rows only
            c.fail(mode_key, f"={mode} with megatron.context_parallel_size > 1 is not implemented (the replayed "
                             "routes are laid out for the whole packed row, not a context-parallel rank's chunks).")
        return
    sp = c.get(f"{a}.ulysses_sequence_parallel_size") or c.get(f"{a}.fsdp_config.ulysses_sequence_parallel_size")
    if isinstance(sp, int) and sp > 1:
        c.fail(mode_key, f"={mode} with ulysses_sequence_parallel_size > 1 is not implemented.")
