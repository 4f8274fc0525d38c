"""Every role's ``optim`` keys reach the optimizer and the LR schedule its engine builds.

FSDP: the engine builds its optimizer and scheduler with ``build_optimizer`` / ``build_lr_scheduler``
(verl/workers/engine/fsdp/model_init.py) from the role's ``optim`` section; here those functions get the
section of a config composed with the key changed (actor and critic of ``ppo_trainer``, ``optim`` of
``sft_trainer_engine``), over a small linear layer, and the test checks the optimizer's settings or the LR
over steps. Megatron: megatron-core is not installed on the CPU runners, so its scheduler/optimizer
classes are replaced by recorders and the test checks which argument each key becomes (the GPU tests run
the real ones). The key names are spelled out so key_status.txt can point here.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from verl.trainer.config.checks import compose_config
from verl.workers.engine.fsdp.model_init import build_lr_scheduler, build_optimizer


def _section(key: str, value, *extra: str):
    """The ``optim`` section holding ``key`` after composing with ``key=value`` (and ``extra`` overrides)."""
    name = "sft_trainer_engine" if key.startswith("optim.") else "ppo_trainer"
    if "megatron" in extra:
        name, extra = "ppo_megatron_trainer", tuple(e for e in extra if e != "megatron")
    cfg = compose_config(name, [f"{key}={value}", *extra], validate=False)
    section = OmegaConf.select(cfg, key.rsplit(".", 1)[0])
    OmegaConf.resolve(section)
    return section


def _lrs(section, steps: int, total: int = 10) -> list[float]:
    with open_dict(section):
        section.total_training_steps = total  # set by the trainer at run time (main_ppo / the SFT trainer)
    opt = build_optimizer(torch.nn.Linear(3, 2), section)
    sched = build_lr_scheduler(opt, section)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


# ------------------------------------------------------------------------------------------ optimizer
@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.lr", "critic.optim.lr", "optim.lr"])
def test_lr(key):
    opt = build_optimizer(torch.nn.Linear(3, 2), _section(key, 0.125))
    assert opt.param_groups[0]["lr"] == 0.125


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.weight_decay", "critic.optim.weight_decay",
                                 "optim.weight_decay"])
def test_weight_decay(key):
    assert build_optimizer(torch.nn.Linear(3, 2), _section(key, 0.3)).param_groups[0]["weight_decay"] == 0.3


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.betas", "critic.optim.betas", "optim.betas"])
def test_betas(key):
    assert build_optimizer(torch.nn.Linear(3, 2), _section(key, "[0.5,0.75]")).param_groups[0]["betas"] == (0.5, 0.75)


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.optimizer", "critic.optim.optimizer",
                                 "optim.optimizer"])
def test_optimizer_class(key):
    assert type(build_optimizer(torch.nn.Linear(3, 2), _section(key, "Adagrad"))).__name__ == "Adagrad"
    with pytest.raises(ValueError, match="NoSuchOpt"):
        build_optimizer(torch.nn.Linear(3, 2), _section(key, "NoSuchOpt"))


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.optimizer_impl", "critic.optim.optimizer_impl",
                                 "optim.optimizer_impl"])
def test_optimizer_impl_is_the_module_the_class_comes_from(key, tmp_path, monkeypatch):
    (tmp_path / "my_optims.py").write_text(
        "import torch\nclass AdamW(torch.optim.SGD):\n"
        "    def __init__(self, params, lr, weight_decay=0.0, **kw):\n"
        "        super().__init__(params, lr=lr, weight_decay=weight_decay)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    opt = build_optimizer(torch.nn.Linear(3, 2), _section(key, "my_optims"))
    assert type(opt).__module__ == "my_optims" and isinstance(opt, torch.optim.SGD)
    with pytest.raises(ValueError, match="no_such_pkg"):
        build_optimizer(torch.nn.Linear(3, 2), _section(key, "no_such_pkg"))


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.override_optimizer_config",
                                 "critic.optim.override_optimizer_config", "optim.override_optimizer_config"])
def test_override_optimizer_config_adds_constructor_arguments(key):
    opt = build_optimizer(torch.nn.Linear(3, 2), _section(key, "{eps:0.25,amsgrad:true}"))
    assert opt.param_groups[0]["eps"] == 0.25 and opt.param_groups[0]["amsgrad"] is True


def test_cpu_parameters_get_the_multi_tensor_step_unless_overridden():
    """torch's default on CPU is the per-parameter loop; the engine asks for foreach there (same math)."""
    key = "actor_rollout_ref.actor.optim.override_optimizer_config"
    assert build_optimizer(torch.nn.Linear(3, 2), _section(key, "{}")).param_groups[0]["foreach"] is True
    opt = build_optimizer(torch.nn.Linear(3, 2), _section(key, "{foreach:false}"))
    assert opt.param_groups[0]["foreach"] is False


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.clip_grad", "critic.optim.clip_grad",
                                 "optim.clip_grad"])
def test_clip_grad_is_the_engines_gradient_clip(key):
    from verl.workers.engine.fsdp.engine import FSDPEngine

    section = _section(key, 0.375)
    engine = FSDPEngine({}, {}, section, role="sft" if key.startswith("optim.") else "actor")
    assert engine._clip_grad() == 0.375


# ------------------------------------------------------------------------------------------ schedule
@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.lr_warmup_steps", "critic.optim.lr_warmup_steps",
                                 "optim.lr_warmup_steps"])
def test_lr_warmup_steps(key):
    lrs = _lrs(_section(key, 4, f"{key.rsplit('.', 1)[0]}.lr=1.0"), 6)
    assert lrs == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0])


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
                                 "critic.optim.lr_warmup_steps_ratio", "optim.lr_warmup_steps_ratio"])
def test_lr_warmup_steps_ratio_applies_when_warmup_steps_is_unset(key):
    lrs = _lrs(_section(key, 0.2, f"{key.rsplit('.', 1)[0]}.lr=1.0"), 4, total=10)  # 0.2 * 10 = 2 steps
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 1.0])


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.lr_scheduler_type", "critic.optim.lr_scheduler_type",
                                 "optim.lr_scheduler_type", "actor_rollout_ref.actor.optim.warmup_style",
                                 "critic.optim.warmup_style", "optim.warmup_style"])
def test_cosine_schedule(key):
    prefix = key.rsplit(".", 1)[0]
    # warmup_style is the legacy name, used when lr_scheduler_type is unset
    legacy = [f"{prefix}.lr_scheduler_type=null"] if key.endswith("warmup_style") else []
    lrs = _lrs(_section(key, "cosine", f"{prefix}.lr=1.0", *legacy), 5, total=4)
    assert lrs == pytest.approx([1.0, 0.853553, 0.5, 0.146447, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match="lr_scheduler_type='nope'"):
        _lrs(_section(key, "nope", *legacy), 1)


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.min_lr_ratio", "critic.optim.min_lr_ratio",
                                 "optim.min_lr_ratio"])
def test_min_lr_ratio_is_the_cosine_floor(key):
    prefix = key.rsplit(".", 1)[0]
    lrs = _lrs(_section(key, 0.25, f"{prefix}.lr=1.0", f"{prefix}.lr_scheduler_type=cosine"), 5, total=4)
    assert lrs[-1] == pytest.approx(0.25) and lrs[2] == pytest.approx(0.25 + 0.75 * 0.5)


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.num_cycles", "critic.optim.num_cycles",
                                 "optim.num_cycles"])
def test_num_cycles(key):
    prefix = key.rsplit(".", 1)[0]
    lrs = _lrs(_section(key, 1.0, f"{prefix}.lr=1.0", f"{prefix}.lr_scheduler_type=cosine"), 5, total=4)
    assert lrs == pytest.approx([1.0, 0.5, 0.0, 0.5, 1.0], abs=1e-6)  # one full cosine period


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.zero_indexed_step", "critic.optim.zero_indexed_step",
                                 "optim.zero_indexed_step"])
def test_zero_indexed_step_false_counts_cosine_steps_from_one(key):
    prefix = key.rsplit(".", 1)[0]
    on = [f"{prefix}.lr=1.0", f"{prefix}.lr_scheduler_type=cosine", f"{prefix}.lr_warmup_steps=2"]
    assert _lrs(_section(key, True, *on), 4, total=4) == pytest.approx([0.0, 0.5, 1.0, 0.5], abs=1e-6)
    # torchtitan's convention: the first step already takes the second warm-up value
    assert _lrs(_section(key, False, *on), 4, total=4) == pytest.approx([0.5, 1.0, 0.5, 0.0], abs=1e-6)


# ------------------------------------------------------------------------------------------ megatron
class _Recorder:
    calls: list[dict] = []

    def __init__(self, *args, **kwargs):
        type(self).calls.append(kwargs)


@pytest.fixture
def fake_mcore(monkeypatch):
    """megatron.core's scheduler, optimizer config and optimizer factory as recorders."""
    _Recorder.calls = []
    mods = {name: types.ModuleType(name) for name in (
        "megatron", "megatron.core", "megatron.core.optimizer_param_scheduler", "megatron.core.optimizer")}
    mods["megatron.core.optimizer_param_scheduler"].OptimizerParamScheduler = _Recorder

    class OptimizerConfig:
        __dataclass_fields__ = dict.fromkeys(["optimizer", "lr", "min_lr", "weight_decay", "adam_beta1",
                                              "adam_beta2", "clip_grad", "bf16", "fp16", "params_dtype",
                                              "use_distributed_optimizer", "adam_eps"])

        def __init__(self, **kw):
            self.kw = kw

    mods["megatron.core.optimizer"].OptimizerConfig = OptimizerConfig
    mods["megatron.core.optimizer"].get_megatron_optimizer = lambda config, chunks: config.kw
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    import verl.workers.engine.megatron.build as build  # imports megatron-core inside its functions only

    return build


def _scheduler_kwargs(build, key, value, *extra):
    section = _section(key, value, "megatron", *extra)
    with open_dict(section):
        section.total_training_steps = 100
    build.build_scheduler(object(), section)
    return _Recorder.calls[-1]


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "critic"])
def test_megatron_schedule_keys(fake_mcore, role):
    build = fake_mcore
    kw = _scheduler_kwargs(build, f"{role}.optim.lr", 0.5)
    assert (kw["max_lr"], kw["init_lr"], kw["lr_decay_steps"], kw["lr_decay_style"]) == (0.5, 0.5, 100, "constant")
    assert _scheduler_kwargs(build, f"{role}.optim.lr_decay_steps", 40)["lr_decay_steps"] == 40
    assert _scheduler_kwargs(build, f"{role}.optim.lr_decay_style", "cosine")["lr_decay_style"] == "cosine"
    assert _scheduler_kwargs(build, f"{role}.optim.min_lr", 0.01)["min_lr"] == 0.01
    # lr_warmup_init is where warm-up starts; it only matters with warm-up steps
    kw = _scheduler_kwargs(build, f"{role}.optim.lr_warmup_init", 0.1, f"{role}.optim.lr_warmup_steps=5")
    assert (kw["init_lr"], kw["lr_warmup_steps"]) == (0.1, 5)
    assert _scheduler_kwargs(build, f"{role}.optim.lr_wsd_decay_steps", 7)["wsd_decay_steps"] == 7
    assert _scheduler_kwargs(build, f"{role}.optim.lr_wsd_decay_style", "linear")["lr_wsd_decay_style"] == "linear"
    kw = _scheduler_kwargs(build, f"{role}.optim.weight_decay_incr_style", "linear")
    assert kw["wd_incr_style"] == "linear"
    kw = _scheduler_kwargs(build, f"{role}.optim.use_checkpoint_opt_param_scheduler", True)
    assert kw["use_checkpoint_opt_param_scheduler"] is True and kw["override_opt_param_scheduler"] is False


def test_megatron_key_names_spelled_out(fake_mcore):
    # One call per key name, so each name appears in this file as the key it is (see the module docstring).
    build = fake_mcore
    for key, arg, value in [
        ("actor_rollout_ref.actor.optim.lr_decay_steps", "lr_decay_steps", 40),
        ("critic.optim.lr_decay_steps", "lr_decay_steps", 40),
        ("actor_rollout_ref.actor.optim.lr_decay_style", "lr_decay_style", "cosine"),
        ("critic.optim.lr_decay_style", "lr_decay_style", "cosine"),
        ("actor_rollout_ref.actor.optim.min_lr", "min_lr", 0.01),
        ("critic.optim.min_lr", "min_lr", 0.01),
        ("actor_rollout_ref.actor.optim.lr_wsd_decay_steps", "wsd_decay_steps", 7),
        ("critic.optim.lr_wsd_decay_steps", "wsd_decay_steps", 7),
        ("actor_rollout_ref.actor.optim.lr_wsd_decay_style", "lr_wsd_decay_style", "linear"),
        ("critic.optim.lr_wsd_decay_style", "lr_wsd_decay_style", "linear"),
        ("actor_rollout_ref.actor.optim.weight_decay_incr_style", "wd_incr_style", "linear"),
        ("critic.optim.weight_decay_incr_style", "wd_incr_style", "linear"),
        ("actor_rollout_ref.actor.optim.use_checkpoint_opt_param_scheduler", "use_checkpoint_opt_param_scheduler",
         True),
        ("critic.optim.use_checkpoint_opt_param_scheduler", "use_checkpoint_opt_param_scheduler", True),
    ]:
        assert _scheduler_kwargs(build, key, value)[arg] == value, key
    for key in ("actor_rollout_ref.actor.optim.lr_warmup_init", "critic.optim.lr_warmup_init"):
        assert _scheduler_kwargs(build, key, 0.1, f"{key.rsplit('.', 1)[0]}.lr_warmup_steps=5")["init_lr"] == 0.1


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "critic"])
def test_megatron_optimizer_keys(fake_mcore, role):
    from verl.workers.engine.megatron.settings import MegatronSettings

    build = fake_mcore
    tf = types.SimpleNamespace(bf16=True, params_dtype=torch.bfloat16)
    section = _section(f"{role}.optim.min_lr", 0.02, "megatron")
    with open_dict(section):  # (an empty mapping in the Megatron YAML: set after composing)
        section.override_optimizer_config = {"adam_eps": 0.5}
    kw = build.build_optimizer([], section, tf, MegatronSettings())
    assert kw["min_lr"] == 0.02 and kw["adam_eps"] == 0.5
    with open_dict(section):
        section.override_optimizer_config = {"not_a_field": 1}
    with pytest.raises(ValueError, match="not_a_field"):
        build.build_optimizer([], section, tf, MegatronSettings())
