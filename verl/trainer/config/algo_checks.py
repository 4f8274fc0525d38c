"""Validation rules outside the roles: the algorithm (advantage estimator, KL in the reward, GDPO), the reward
manager, recipes (DAPO, rollout correction), settings another key owns (the MoE router switch), the profiler,
upstream keys that are not implemented here, and features left out of this project."""

from __future__ import annotations

import inspect

from .checker import UNSET, Checker, check_kl_name, is_interpolation, live_registry

__all__ = ["check_algorithm", "check_distillation", "check_key_status", "check_megatron", "check_out_of_scope", "check_owned_settings",
           "check_profiler", "check_recipes", "check_reward"]


def check_algorithm(c: Checker) -> None:
    g = "algorithm"
    adv = c.registered(f"{g}.adv_estimator", "adv")
    c.number(f"{g}.gamma", low=0, high=1)
    c.number(f"{g}.lam", low=0, high=1)
    if c.flag(f"{g}.use_kl_in_reward"):
        check_kl_name(c, f"{g}.kl_penalty")
        kind = c.choice(f"{g}.kl_ctrl.type", ("fixed", "adaptive"))
        c.number(f"{g}.kl_ctrl.kl_coef", low=0)
        if kind == "adaptive":
            c.integer(f"{g}.kl_ctrl.horizon", minimum=1)
            c.number(f"{g}.kl_ctrl.target_kl", low=0, low_open=True)
        if c.flag("actor_rollout_ref.actor.use_kl_loss"):
            c.warn("Both algorithm.use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss are on: "
                   "the KL to the reference policy is penalised twice.")
    keys, weights = c.get(f"{g}.gdpo_reward_keys"), c.get(f"{g}.gdpo_reward_weights")
    if adv == "gdpo":
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            c.fail(f"{g}.gdpo_reward_keys", f"is {keys!r} but adv_estimator=gdpo needs a non-empty list of the "
                                            "reward keys to normalise separately, e.g. [accuracy,format].")
        elif weights is not None and (not isinstance(weights, list) or len(weights) != len(keys)):
            c.fail(f"{g}.gdpo_reward_weights", f"is {weights!r}; give one weight per gdpo_reward_keys entry "
                                               f"({len(keys)}) or null for equal weights.")
    elif adv is not None:
        for key, value in (("gdpo_reward_keys", keys), ("gdpo_reward_weights", weights)):
            if value not in (None, UNSET):
                c.fail(f"{g}.{key}", f"is set but only algorithm.adv_estimator=gdpo reads it (got {adv}); "
                                     "set it to null or switch the estimator.")
    if adv in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        check_token_baseline(c, adv)
    enable = c.get("critic.enable")
    if adv == "gae" and enable is False:
        c.fail("critic.enable", "is false but algorithm.adv_estimator=gae needs a value model; "
                                "set critic.enable=null or pick a critic-free estimator such as grpo.")
    elif adv is not None and adv != "gae" and enable is True:
        c.warn(f"critic.enable=true trains a critic that algorithm.adv_estimator={adv} never uses.")




def check_token_baseline(c: Checker, adv: str) -> None:
    """The optimal token baseline weighs by sum_pi_squared, which only the actor's old-log-prob pass computes."""
    if not c.flag("actor_rollout_ref.actor.calculate_sum_pi_squared"):
        c.fail("algorithm.adv_estimator", f"is {adv}, which needs actor_rollout_ref.actor.calculate_sum_pi_squared="
                                          "true (the actor then returns sum_pi_squared with the old log-probs).")
    if c.flag("algorithm.rollout_correction.bypass_mode"):
        c.fail("algorithm.rollout_correction.bypass_mode", f"is true, which skips the actor's old-log-prob pass "
                                                           f"that computes sum_pi_squared for adv_estimator={adv}.")


def check_reward(c: Checker) -> None:
    source = c.choice("reward.reward_manager.source", ("register", "importlib"))
    manager = c.registered("reward.reward_manager.name", "reward_manager") if source == "register" else None
    kwargs = c.get("reward.reward_kwargs")
    if manager is not None and isinstance(kwargs, dict) and kwargs:
        init = live_registry("reward_manager").get_or_raise(manager).__init__
        params = inspect.signature(init).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            unknown = sorted(k for k in kwargs if k not in params)
            if unknown:
                c.fail("reward.reward_kwargs", f"has {unknown}, which reward manager {manager!r} does not take "
                                               f"(it takes {sorted(k for k in params if k != 'self')}); "
                                               "remove them or pick the manager they belong to.")
    if source == "importlib" and not c.get("reward.reward_manager.module.path"):
        c.fail("reward.reward_manager.module.path", "must name a Python file when reward_manager.source=importlib.")
    if c.flag("reward.reward_model.enable"):
        check_reward_model(c, manager)
    legacy, current = c.get("custom_reward_function.path"), c.get("reward.custom_reward_function.path")
    if legacy and current and legacy != current:
        c.fail("custom_reward_function.path", f"({legacy!r}) conflicts with reward.custom_reward_function.path "
                                              f"({current!r}); keep only the latter.")


# reward.reward_model.rollout keys a generative judge reads (request defaults and limits), with upstream's defaults.
_JUDGE_ONLY_KEYS = {"temperature": 1.0, "top_k": -1, "top_p": 1, "do_sample": True, "prompt_length": 2048,
                    "response_length": 2048}


def check_reward_model(c: Checker, manager: str | None = None) -> None:
    """reward.reward_model.enable=true, colocated: a discriminative (sequence-classification) reward model, or, with
    a custom reward function (upstream's GenRM route), a generative judge the function queries."""
    rm = "reward.reward_model"
    generative = bool(c.get("reward.custom_reward_function.path") or c.get("custom_reward_function.path"))
    if not c.get(f"{rm}.model_path"):
        c.fail(f"{rm}.model_path", "must name the reward model when reward.reward_model.enable is true (a "
                                   "sequence-classification checkpoint, or a causal LM judge with "
                                   "reward.custom_reward_function.path).")
    if c.flag(f"{rm}.enable_resource_pool"):
        c.fail(f"{rm}.enable_resource_pool", "is true, but a reward model on its own GPUs is not implemented here: "
                                             "the reward model runs colocated with the policy; set it to false.")
    name = c.get(f"{rm}.rollout.name")
    if name not in ("hf", "vllm", "sglang"):
        shown = "not set" if name in (None, UNSET) else f"{name!r}"
        c.fail(f"{rm}.rollout.name", f"is {shown}; upstream requires it with a reward model (vllm or sglang): "
                                     "set hf, vllm or sglang. Here the reward model runs on the training engine "
                                     "(and a generative judge on the built-in hf rollout) whichever engine is named.")
    if generative and manager is not None:
        # The judge's address reaches the scoring function through the reward manager's constructor.
        params = inspect.signature(live_registry("reward_manager").get_or_raise(manager).__init__).parameters
        if "reward_router_address" not in params and not any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            c.fail("reward.reward_manager.name", f"is {manager!r}, whose manager does not take "
                                                 "reward_router_address: with a generative reward model (a custom "
                                                 "function and reward.reward_model.enable) use naive, dapo or gdpo.")
    if not generative:
        for key, default in _JUDGE_ONLY_KEYS.items():
            value = c.get(f"{rm}.rollout.{key}")
            if value not in (UNSET, None) and value != default:
                c.warn(f"{rm}.rollout.{key}={value!r} has no effect on a discriminative reward model (it scores with "
                       "a forward pass); it sets a generative judge's requests (with a custom reward function).")
    if c.get("algorithm.adv_estimator") == "remax":
        c.fail("algorithm.adv_estimator", "is remax with reward.reward_model.enable=true: the greedy baseline is "
                                          "scored by the reward function only here; pick another estimator.")


def check_distillation(c: Checker) -> None:
    """On-policy distillation (``distillation.*``, verl/trainer/distillation): one colocated teacher, a
    KL-estimator loss from the live registry, upstream's own refusals (k1 back-propagated directly, a policy loss
    other than vanilla)."""
    g = "distillation"
    if not c.flag(f"{g}.enabled"):
        return
    nnodes = c.get(f"{g}.nnodes")
    if nnodes not in (0, None, UNSET):
        c.fail(f"{g}.nnodes", f"is {nnodes}: a separate teacher resource pool (upstream serves the teacher there "
                              "with an inference engine) is not implemented; the teacher runs colocated with the "
                              "actor on the reference's engine settings. Set it to 0.")
    teachers = c.get(f"{g}.teacher_models")
    extra = sorted(k for k in (teachers or {}) if k != "teacher_model") if isinstance(teachers, dict) else []
    if extra:
        c.fail(f"{g}.teacher_models.{extra[0]}", f"adds a teacher ({', '.join(extra)}): multi-teacher "
                                                 "distillation (routing by distillation.teacher_key) is not "
                                                 "implemented; configure distillation.teacher_models.teacher_model only.")
    t = f"{g}.teacher_models.teacher_model"
    if not c.get(f"{t}.model_path"):
        c.fail(f"{t}.model_path", "must name the teacher checkpoint when distillation.enabled=true.")
    ld = f"{g}.distillation_loss"
    mode = c.registered(f"{ld}.loss_mode", "kl")
    pg_form = c.flag(f"{ld}.use_policy_gradient")
    if mode is not None and not pg_form and live_registry("kl").canonical(mode) == "k1":
        c.fail(f"{ld}.loss_mode", f"is {mode!r} with use_policy_gradient=false: the gradient of k1 does not depend "
                                  "on the teacher, so back-propagating it directly is wrong (upstream refuses it "
                                  "too); use k3 / low_var_kl, or set use_policy_gradient=true.")
    c.number(f"{ld}.distillation_loss_coef", low=0)
    clamp = c.get(f"{ld}.loss_max_clamp")
    if clamp is not None:
        c.number(f"{ld}.loss_max_clamp", low=0, low_open=True)
    if pg_form:
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            c.number(f"{ld}.{key}", low=0)
    # The serving engine's name, dtype and temperature follow the rollout's; set apart they would select an
    # inference server this teacher does not run (it runs on the ref's engine, at temperature 1 as upstream's).
    for key in ("name", "dtype", "temperature"):
        if not is_interpolation(c.cfg, f"{t}.inference.{key}"):
            c.warn(f"{t}.inference.{key} is set, but the teacher here runs on the reference's training engine "
                   "(actor_rollout_ref.ref.*), not on an inference server, so it is not read.")
    # Upstream's teacher context check: the prompt, the whole response and one generated token.
    inf = f"{t}.inference"
    max_len = c.get(f"{inf}.max_model_len")
    prompt, response = c.get(f"{inf}.prompt_length"), c.get(f"{inf}.response_length")
    if isinstance(max_len, int) and isinstance(prompt, int) and isinstance(response, int):
        if prompt + response + 1 > max_len:
            c.fail(f"{inf}.max_model_len", f"is {max_len}, but the teacher reads the student's prompt ({prompt}), "
                                           f"its whole response ({response}) and one more token: "
                                           f"{prompt + response + 1} tokens. Raise it or set it to null.")


def check_key_status(c: Checker) -> None:
    """Upstream keys that are not implemented here (key_status.txt) keep their defaults."""
    from .key_status import check_key_status

    problems, notes = check_key_status(c.cfg)
    c.problems.extend(problems)
    c.notes.extend(notes)


def check_profiler(c: Checker) -> None:
    from verl.utils.profiler.config import check_profiler_config

    c.problems.extend(check_profiler_config(c.cfg))
    if c.get("global_profiler.tool") == "torch_memory" and not c.get("global_profiler.steps"):
        c.warn("global_profiler.tool=torch_memory without global_profiler.steps takes no snapshot here (upstream "
               "also dumps one when CUDA runs out of memory; that observer is not built): list steps, e.g. [1].")


def check_out_of_scope(c: Checker) -> None:
    """Upstream features selected by a combination of keys rather than by one key."""
    strategies = {c.get("actor_rollout_ref.actor.strategy"), c.get("critic.strategy")}
    if "megatron" in strategies and c.get("trainer.device") == "npu":
        c.fail("trainer.device", "is npu with a megatron strategy, which upstream runs through MindSpeed (Megatron "
                                 "on Ascend): this project does not implement MindSpeed. Use an FSDP strategy "
                                 "(model_engine=dp) on NPU.")


def check_recipes(c: Checker) -> None:
    """DAPO (filter_groups, gen_batch_size, the dapo reward manager's overlong buffer) and rollout correction."""
    from verl.trainer.ppo import rollout_corr

    c.integer("data.gen_batch_size", minimum=1, allow_none=True)
    fg = "algorithm.filter_groups"
    if c.flag(f"{fg}.enable"):
        c.integer(f"{fg}.max_num_gen_batches")
        if not isinstance(c.get(f"{fg}.metric"), str) or not c.get(f"{fg}.metric"):
            c.fail(f"{fg}.metric", "must name the score ('reward') or a per-sample reward_extra_info key (e.g. 'acc').")
        if c.get("actor_rollout_ref.rollout.n") == 1:
            c.warn("algorithm.filter_groups.enable=true with rollout.n=1: a group of one response cannot be "
                   "filtered, every prompt is kept.")
    rc = "algorithm.rollout_correction"
    c.choice(f"{rc}.rollout_is", rollout_corr.IS_LEVELS, allow_none=True)
    if c.get(f"{rc}.rollout_is") is not None:
        try:
            rollout_corr.parse_is_threshold(c.get(f"{rc}.rollout_is_threshold"))
        except ValueError as err:
            c.fail(f"{rc}.rollout_is_threshold", f"is invalid: {err}.")
    rs = c.get(f"{rc}.rollout_rs")
    if rs is not None:
        try:
            options = rollout_corr.parse_rs(rs)
            rollout_corr.parse_rs_thresholds(options, c.get(f"{rc}.rollout_rs_threshold"))
        except ValueError as err:
            c.fail(f"{rc}.rollout_rs", f"/ rollout_rs_threshold are invalid: {err}.")
    c.choice(f"{rc}.loss_type", rollout_corr.BYPASS_LOSS_TYPES)
    if c.flag(f"{rc}.bypass_mode"):
        mode = c.get("actor_rollout_ref.actor.policy_loss.loss_mode")
        if mode not in ("vanilla", "bypass_mode"):
            c.fail(f"{rc}.bypass_mode", f"replaces the policy loss, but actor.policy_loss.loss_mode={mode!r}; "
                                        "use loss_mode=vanilla or turn bypass_mode off.")
    elif c.get(f"{rc}.loss_type") == "reinforce":
        c.fail(f"{rc}.loss_type", "=reinforce applies only with rollout_correction.bypass_mode=true.")
    uses = [k for k in ("rollout_is", "rollout_rs") if c.get(f"{rc}.{k}") is not None]
    uses += ["bypass_mode"] if c.flag(f"{rc}.bypass_mode") else []
    if uses and not c.flag("actor_rollout_ref.rollout.calculate_log_probs", True):
        c.fail("actor_rollout_ref.rollout.calculate_log_probs",
               f"is false, but algorithm.rollout_correction.{uses[0]} needs the rollout's log-probs; set it to true.")
    kwargs = c.get("reward.reward_kwargs") or {}
    if not isinstance(kwargs, dict):
        return
    name = c.get("reward.reward_manager.name")
    if name != "dapo" and ({"overlong_buffer_cfg", "max_resp_len"} & set(kwargs)):
        c.fail("reward.reward_kwargs.overlong_buffer_cfg", f"is read only by the dapo reward manager (got "
                                                          f"reward.reward_manager.name={name!r}); set it to dapo.")
    ob = kwargs.get("overlong_buffer_cfg") or {}
    if name == "dapo" and isinstance(ob, dict) and ob.get("enable"):
        max_len, buf = kwargs.get("max_resp_len"), ob.get("len")
        if not isinstance(max_len, int) or max_len < 1:
            c.fail("reward.reward_kwargs.max_resp_len", "must be set (usually data.max_response_length) when "
                                                        "overlong_buffer_cfg.enable=true.")
        elif not isinstance(buf, int) or not 0 < buf <= max_len:
            c.fail("reward.reward_kwargs.overlong_buffer_cfg.len", f"must be in 1..max_resp_len ({max_len}).")


def check_owned_settings(c: Checker) -> None:
    """Values that another key owns, so setting them here would be silently overwritten.

    ``override_config.output_router_logits``: verl/models/moe_router.py turns the HF router logits off on
    every loaded model and back on (training forwards of the actor only) under
    ``actor_rollout_ref.model.enable_router_aux_loss``. Upstream passes override_config to the HF config, where
    ``output_router_logits=true`` makes the model compute the load-balancing loss; this project's key for that
    is enable_router_aux_loss, so ``true`` is an error naming it rather than a warning (the run would
    otherwise train without the loss the user asked for). ``false`` is what happens anyway and passes."""
    for model in ("actor_rollout_ref.model", "critic.model"):
        key = f"{model}.override_config.output_router_logits"
        if c.get(key) not in (None, UNSET, False):
            target = ("set `actor_rollout_ref.model.enable_router_aux_loss=true` (the actor's training forwards "
                      "then add router_aux_loss_coef * aux_loss)" if model.startswith("actor")
                      else "the critic never trains its router with an aux loss; remove it")
            c.fail(key, f"is {c.get(key)!r}, but the router-logit switch is owned by "
                        f"actor_rollout_ref.model.enable_router_aux_loss and this value would be overwritten: "
                        f"{target}.")
    if c.flag("critic.model.enable_router_aux_loss"):
        c.fail("critic.model.enable_router_aux_loss", "is for the actor only; the critic's router gets no aux loss.")


def check_megatron(c: Checker) -> None:
    """Roles on strategy=megatron: engine settings, parallel sizes against the model, unsupported features.
    The rules live with the engine (no megatron-core import)."""
    from verl.workers.engine.megatron.validation import megatron_problems

    c.problems.extend(megatron_problems(c.cfg))

