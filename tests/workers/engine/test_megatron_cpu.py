"""The Megatron engine's CPU seams: config composition with upstream-style overrides, validation messages
before any worker starts, the lazy-import error, settings and THD packing."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from verl.workers.engine.megatron.packing import next_token_labels, pack_thd, unpack_thd
from verl.workers.engine.megatron.settings import read_settings, settings_problems

A = "actor_rollout_ref.actor"
M = A + ".megatron"
HAS_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


# ------------------------------------------------------------------------------------------ lazy import
@pytest.mark.skipif(HAS_MCORE, reason="megatron-core is installed here")
def test_engine_lookup_without_megatron_core_names_the_extra():
    from verl.workers.engine import EngineRegistry

    with pytest.raises(ImportError) as info:
        EngineRegistry.get_or_raise("megatron")
    assert "pip install -e .[mcore]" in str(info.value)
    assert "megatron-core" in str(info.value)
    # the CPU-side parts stay importable
    import verl.workers.engine.megatron as pkg

    assert pkg.read_settings if hasattr(pkg, "read_settings") else pkg.require_mcore


# ------------------------------------------------------------------------------------------ settings
def test_settings_defaults_and_aliases():
    s = read_settings({"tensor_model_parallel_size": 1, "sequence_parallel": True})
    assert (s.tp, s.pp, s.cp, s.ep, s.vpp) == (1, 1, 1, 1, None)
    assert s.sequence_parallel is False  # meaningless (and rejected by megatron-core) at TP 1
    assert read_settings({"tensor_model_parallel_size": 2}).sequence_parallel is True
    assert read_settings({}).use_remove_padding is True
    # model.use_remove_padding=false is the deprecated alias of the engine key
    assert read_settings({"use_remove_padding": True}, model_use_remove_padding=False).use_remove_padding is False
    s = read_settings({"param_offload": True, "grad_offload": True, "optimizer_offload": True, "dtype": "bf16"})
    assert (s.param_offload, s.grad_offload, s.optimizer_offload, s.dtype) == (True, True, True, "bfloat16")


@pytest.mark.parametrize("section, key", [
    ({"use_megatron_fsdp": True}, "use_megatron_fsdp"),
    ({"dynamic_context_parallel": True}, "dynamic_context_parallel"),
    ({"override_mcore_model_config": {"x": 1}}, "override_mcore_model_config"),
    ({"dist_checkpointing_prefix": "model."}, "dist_checkpointing_prefix"),
    ({"context_parallel_size": 2, "use_remove_padding": False}, "context_parallel_size"),
    ({"dtype": "float16"}, "dtype"),
    ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size"),
    ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size"),
    ({"override_ddp_config": {"use_megatron_fsdp": True}}, "override_ddp_config.use_megatron_fsdp"),
    ({"dist_checkpointing_path": "/ckpt"}, "dist_checkpointing_path"),
])
def test_unsupported_settings_are_refused_by_name(section, key):
    problems = settings_problems(section, prefix=M)
    assert any(f"{M}.{key}" in p for p in problems), problems
    with pytest.raises(ValueError, match=key.split(".")[0]):
        read_settings(section)


# ------------------------------------------------------------------------------------------ config
UPSTREAM_STYLE = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.name=hf",
    "trainer.nnodes=2",
    "trainer.n_gpus_per_node=8",
    "data.train_batch_size=32",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    f"{M}.tensor_model_parallel_size=2",
    f"{M}.pipeline_model_parallel_size=2",
    f"{M}.expert_model_parallel_size=1",
    f"{M}.context_parallel_size=1",
    f"{M}.sequence_parallel=true",
    f"{M}.param_offload=true",
    f"{M}.grad_offload=true",
    f"{M}.optimizer_offload=true",
    f"{M}.use_dist_checkpointing=false",
    f"{M}.use_remove_padding=true",
    f"{M}.override_transformer_config.recompute_granularity=full",
    f"{M}.override_transformer_config.recompute_method=uniform",
    f"{M}.override_transformer_config.recompute_num_layers=1",
    "actor_rollout_ref.ref.megatron.param_offload=true",
]


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    import transformers as tf

    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    path = tmp_path_factory.mktemp("qwen35_cfg")
    cfg = tf.Qwen3_5TextConfig(**tiny_text_config_kwargs())
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(path)
    return str(path)


def _load(overrides):
    from verl.trainer.main_ppo import load_config

    return load_config(["--config-name", "ppo_megatron_trainer", *overrides])


def test_ppo_megatron_trainer_composes_and_validates_with_upstream_overrides(qwen35_dir):
    cfg = _load(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}"])
    meg = cfg.actor_rollout_ref.actor.megatron
    assert cfg.actor_rollout_ref.actor.strategy == "megatron" and cfg.actor_rollout_ref.ref.strategy == "megatron"
    assert (meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size) == (2, 2)
    assert meg.grad_offload is True and meg.optimizer_offload is True
    assert meg.override_transformer_config.recompute_granularity == "full"
    ref = cfg.actor_rollout_ref.ref.megatron  # the reference follows the actor's layout
    assert (ref.tensor_model_parallel_size, ref.pipeline_model_parallel_size, ref.forward_only) == (2, 2, True)
    s = read_settings(meg)
    assert s.override_transformer_config["recompute_num_layers"] == 1 and s.sequence_parallel


def _problems(overrides):
    from verl.trainer.config import ConfigValidationError

    with pytest.raises(ConfigValidationError) as info:
        _load(overrides)
    return info.value.problems


def test_lora_actor_on_megatron_composes_and_merges_for_the_rollout(qwen35_dir):
    # upstream's Megatron LoRA spelling (model.lora.*, mcore module names); the rollout gets merged weights
    cfg = _load(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}", "actor_rollout_ref.model.lora.rank=8",
                                  "actor_rollout_ref.model.lora.alpha=16",
                                  "actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_proj]"])
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, list(model.target_modules)) == (8, 16, ["linear_qkv", "linear_proj"])
    assert model.lora.merge is True
    from verl.models.mcore.lora import lora_settings

    s = lora_settings(model)
    assert (s.rank, s.scaling, s.targets, s.a_init) == (8, 2.0, ("linear_qkv", "linear_proj"), "xavier")
    with pytest.warns(UserWarning, match="lora.merge=false with actor.strategy=megatron"):
        cfg = _load(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}", "actor_rollout_ref.model.lora_rank=8",
                                      "actor_rollout_ref.model.lora.merge=false"])
    assert cfg.actor_rollout_ref.model.lora.merge is True


def test_lora_critic_and_adapter_path_are_refused_on_megatron(qwen35_dir, tmp_path):
    problems = _problems(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}", "algorithm.adv_estimator=gae",
                                           "critic.strategy=megatron", "critic.model.lora_rank=8",
                                           f"critic.model.path={qwen35_dir}"])
    assert any("`critic.model.lora_rank` > 0 with critic.strategy=megatron" in p for p in problems), problems
    problems = _problems(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}",
                                           f"actor_rollout_ref.model.lora_adapter_path={tmp_path}"])
    assert any("`actor_rollout_ref.model.lora_adapter_path` with actor_rollout_ref.actor.strategy=megatron" in p
               for p in problems), problems


def test_router_aux_loss_is_refused_on_megatron(qwen35_dir):
    problems = _problems(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}",
                                           "actor_rollout_ref.model.enable_router_aux_loss=true"])
    assert any("`actor_rollout_ref.model.enable_router_aux_loss=true` with actor_rollout_ref.actor.strategy=megatron"
               in p for p in problems), problems


def test_mtp_is_refused_on_megatron(qwen35_dir):
    problems = _problems(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}",
                                           "actor_rollout_ref.model.mtp.enable=true"])
    assert any("`actor_rollout_ref.model.mtp.enable=true` with strategy=megatron" in p for p in problems), problems


def test_mbridge_config_is_refused(qwen35_dir):
    from omegaconf import OmegaConf

    from verl.workers.engine.megatron.validation import megatron_problems

    cfg = _load(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}"])
    assert megatron_problems(cfg) == []
    OmegaConf.update(cfg, "actor_rollout_ref.actor.checkpoint.mbridge_config", {"a": 1}, force_add=True)
    assert any("actor_rollout_ref.actor.checkpoint.mbridge_config" in p for p in megatron_problems(cfg))


def test_megatron_engine_settings_are_checked_at_validation(qwen35_dir):
    problems = _problems(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}",
                                           f"{M}.use_megatron_fsdp=true", f"{M}.context_parallel_size=2",
                                           f"{M}.use_remove_padding=false"])
    assert any(f"{M}.use_megatron_fsdp" in p for p in problems), problems
    assert any(p.startswith(f"{M}.context_parallel_size=2") and "needs packed sequences" in p for p in problems), problems
    # the reference follows the actor's section: the same refusal is said once, for both
    assert not any(p.startswith("actor_rollout_ref.ref.megatron.context_parallel_size") for p in problems), problems


def test_context_parallel_composes_at_validation(qwen35_dir):
    """CP is built for the Qwen3.5 spec (pp 2 x cp 2 on 16 GPUs); the ref follows the actor's size. TP x CP must
    divide the Gated DeltaNet heads (2 key heads on the tiny config): TP 2 x CP 2 is refused naming the key."""
    from verl.workers.engine.megatron.validation import megatron_problems

    cfg = _load(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}", f"{M}.context_parallel_size=2",
                                  f"{M}.tensor_model_parallel_size=1"])
    assert megatron_problems(cfg) == []
    assert cfg.actor_rollout_ref.ref.megatron.context_parallel_size == 2
    problems = _problems(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}", f"{M}.context_parallel_size=2"])
    assert any(f"{M}.context_parallel_size=2" in p and "linear_num_key_heads (2)" in p for p in problems), problems


@pytest.mark.parametrize("override, key, word", [
    (f"{M}.tensor_model_parallel_size=8", "tensor_model_parallel_size", "num_key_value_heads"),
    (f"{M}.pipeline_model_parallel_size=8", "pipeline_model_parallel_size", "num_hidden_layers"),
    (f"{M}.expert_model_parallel_size=2", "expert_model_parallel_size", "MoE"),
])
def test_parallel_sizes_are_checked_against_the_model(qwen35_dir, override, key, word):
    pytest.importorskip("verl.models.mcore.registry")
    problems = _problems([o for o in UPSTREAM_STYLE if "parallel_size" not in o]
                         + [f"actor_rollout_ref.model.path={qwen35_dir}", override])
    hits = [p for p in problems if f"{M}.{key}" in p]
    assert hits and any(word in p for p in hits), problems


# ------------------------------------------------------------------------------------------ packing
def test_pack_thd_round_trip_and_alignment():
    ids = torch.arange(1, 17).view(4, 4)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = pack_thd(ids, mask, pos, align=4)
    assert packed.input_ids.shape == (1, 12) and packed.num_real == 9
    assert packed.cu_seqlens.tolist() == [0, 3, 7, 9, 12]  # empty row dropped, 3-token alignment tail
    assert packed.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]
    # labels: the next token of the same row, 0 past its end
    labels = next_token_labels(ids, mask)
    back = unpack_thd(packed.labels.float(), packed)
    assert torch.equal(back[mask.bool()], labels[mask.bool()].float())
    assert torch.equal(unpack_thd(packed.input_ids, packed), ids * mask)


def test_pack_thd_mrope_positions():
    ids = torch.arange(6).view(2, 3)
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    pos = torch.stack([torch.arange(3)] * 3).unsqueeze(0).repeat(2, 1, 1)  # (B, C=3, L)
    packed = pack_thd(ids, mask, pos, align=2)
    assert packed.position_ids.shape == (3, 1, 6)


# ------------------------------------------------------------------------------------------ example scripts
def _script_overrides(path: str, env: dict) -> list[str]:
    """The main_ppo arguments of an example script, with its shell variables expanded."""
    import re
    import shlex

    text = open(path).read().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if "verl.trainer.main_ppo" in ln)
    defaults = re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}$", text, flags=re.M)
    for name, value in defaults + re.findall(r"^(\w+)=([\w.]+)$", text, flags=re.M):
        env.setdefault(name, value)
    args = shlex.split(line.split("verl.trainer.main_ppo", 1)[1].replace('"$@"', ""))
    return [re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


@pytest.mark.parametrize("script, shape", [
    ("examples/grpo_trainer/run_qwen3_5-35b-megatron.sh", "35b_a3b"),
    ("examples/grpo_trainer/run_qwen3_5-9b-megatron.sh", "9b"),
    ("examples/grpo_trainer/run_qwen3_5-0.8b-megatron-cp.sh", "0p8b"),
    ("examples/router_replay/run_qwen3_5-35b-a3b_megatron_r3.sh", "35b_a3b"),
])
def test_megatron_example_scripts_compose_and_validate(tmp_path, script, shape):
    """The scripts' overrides compose and pass validation, parallel sizes included, against a config.json of
    the model's shape (no weights; the published configs' head/expert/layer counts)."""
    pytest.importorskip("verl.models.mcore.registry")
    import transformers as tf

    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    shapes = {
        "35b_a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                        linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248320),
        "9b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                   head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                   linear_value_head_dim=128, intermediate_size=12288, vocab_size=248320),
        "0p8b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                     linear_value_head_dim=128, intermediate_size=3584, vocab_size=248320),
    }
    kw = tiny_text_config_kwargs(**shapes[shape])
    if shape == "35b_a3b":
        kw.pop("intermediate_size", None)
        cfg = tf.Qwen3_5MoeTextConfig(**kw)
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    else:
        cfg = tf.Qwen3_5TextConfig(**kw)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    args = _script_overrides(os.path.join(repo, script), {"MODEL_PATH": str(tmp_path), "DATA_DIR": str(tmp_path)})
    loaded = _load(args[2:] if args[:1] == ["--config-name"] else args)
    assert loaded.actor_rollout_ref.actor.strategy == "megatron"
    assert loaded.actor_rollout_ref.actor.megatron.use_remove_padding is True
    if shape == "0p8b":  # the context-parallel example: the reference follows the actor's CP size
        assert loaded.actor_rollout_ref.actor.megatron.context_parallel_size == 2
        assert loaded.actor_rollout_ref.ref.megatron.context_parallel_size == 2
    if "router_replay" in script:
        assert loaded.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"
        assert loaded.actor_rollout_ref.rollout.enable_rollout_routing_replay is True


def test_data_parallel_size_of_megatron_roles(qwen35_dir):
    """Each data-parallel replica is TP * PP * CP ranks, laid out pipeline-outermost (tp-cp-ep-dp-pp)."""
    from verl.trainer.main_ppo import build_role_specs, role_dp_layouts
    from verl.workers.engine_workers import ranks_per_dp_replica

    cfg = _load(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}"])
    assert ranks_per_dp_replica(cfg.actor_rollout_ref.actor) == 4  # TP 2 x PP 2
    assert ranks_per_dp_replica({"strategy": "fsdp2", "ulysses_sequence_parallel_size": 2}) == 2
    if HAS_MCORE:
        layouts = role_dp_layouts(cfg, build_role_specs(cfg, use_critic=False))
        assert {role: layout.dp_size for role, layout in layouts.items()} == {"actor_rollout": 4}
    # Without megatron-core too: the layout is pure Python. 16 ranks, TP 2 x PP 2: replica 0 is ranks 0, 1 on
    # stage 0 and 8, 9 on stage 1.
    from verl.workers.engine_workers import ActorRolloutRefWorker

    layout = role_dp_layouts(cfg, {"actor_rollout": (ActorRolloutRefWorker, (), {})})["actor_rollout"]
    assert [r for r in range(16) if layout.replica_of[r] == 0] == [0, 1, 8, 9]
    assert layout.collect_from == (8, 10, 12, 14)


def test_megatron_masters_are_seeded_only_where_loading_rounded():
    """``loses_precision`` decides which checkpoint tensors the Megatron engine keeps to seed its fp32 master
    weights: fp32 values off the bf16 grid, and nothing for a bf16 checkpoint or fp32 parameters."""
    import torch

    from verl.workers.engine.megatron.weights import loses_precision

    bf16_param = torch.zeros(8, dtype=torch.bfloat16)
    fp32 = torch.randn(8, generator=torch.Generator().manual_seed(0))
    assert loses_precision(fp32, bf16_param)
    assert not loses_precision(fp32.bfloat16().float(), bf16_param)  # fp32 storage, values on the bf16 grid
    assert not loses_precision(fp32.bfloat16(), bf16_param)
    assert not loses_precision(fp32, torch.zeros(8))  # fp32 parameters keep everything
    assert not loses_precision(torch.arange(8), bf16_param)  # integer buffers are not weights


def test_ddp_buffers_of_an_unwrapped_reference_model_are_none():
    """The reference model is not DDP-wrapped: its ``buffers`` is nn.Module's method, not DDP's list (taking it
    for one crashed ref.megatron.param_offload on the 4-GPU host)."""
    from types import SimpleNamespace

    from verl.utils.megatron_utils import ddp_buffers, offload_megatron_model_to_cpu

    plain = torch.nn.Linear(2, 2)
    assert ddp_buffers(plain) == []
    offload_megatron_model_to_cpu([plain])  # loose parameters only: already on the CPU, nothing to do
    wrapped = SimpleNamespace(buffers=["dense"], expert_parallel_buffers=["experts"])
    assert ddp_buffers(wrapped) == ["dense", "experts"]


def test_loose_parameters_offload_into_one_host_copy_each_reused_by_later_offloads():
    """The bookkeeping of the reference model's offload (here host to host: on a GPU the copies are pinned and
    asynchronous, test_megatron_qwen35_gpu.py): each parameter's contents land in a host copy kept on the
    parameter, which the next offload refills instead of allocating another."""
    from verl.utils.megatron_utils import _offload_loose

    layer = torch.nn.Linear(3, 2)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    _offload_loose(list(layer.parameters()))
    hosts = {n: p._verl_cpu for n, p in layer.named_parameters()}
    for n, p in layer.named_parameters():
        assert p.data.data_ptr() == hosts[n].data_ptr() and torch.equal(p.detach(), before[n])
    with torch.no_grad():
        layer.weight.data = layer.weight.data.clone().add_(1.0)  # "reloaded" and changed (a checkpoint load)
    _offload_loose(list(layer.parameters()))
    assert layer.weight._verl_cpu is hosts["weight"]  # refilled in place
    assert torch.equal(layer.weight.detach(), before["weight"] + 1.0)
    assert torch.equal(hosts["weight"], before["weight"] + 1.0)


@pytest.mark.parametrize("optimizer_offload", [True, False])
def test_offloaded_optimizer_state_is_on_the_gpu_only_around_the_step(monkeypatch, optimizer_offload):
    """With optimizer_offload the Adam state comes in for ``optimizer.step()`` alone: resident through the
    forward/backward it ran the 35B-A3B shape's second step out of memory on 4 x H100 (2026-11-26)."""
    from types import SimpleNamespace

    from verl.utils import megatron_utils as mu
    from verl.workers.engine.megatron.engine import MegatronEngine

    where = {"optimizer": "cpu"}
    monkeypatch.setattr(mu, "load_megatron_optimizer", lambda opt: where.update(optimizer="gpu"))
    monkeypatch.setattr(mu, "offload_megatron_optimizer", lambda opt: where.update(optimizer="cpu"))
    monkeypatch.setattr(mu, "load_megatron_model_to_gpu", lambda *a, **k: None)
    monkeypatch.setattr(mu, "offload_megatron_model_to_cpu", lambda *a, **k: None)
    seen_at_step = []

    class Optimizer:
        def step(self):
            seen_at_step.append(where["optimizer"])
            return True, 1.0, 0

    class Chunk:
        def train(self):
            pass

    eng = MegatronEngine.__new__(MegatronEngine)
    eng.settings = SimpleNamespace(param_offload=True, grad_offload=False, optimizer_offload=optimizer_offload)
    eng.forward_only, eng.optimizer, eng.model = False, Optimizer(), [Chunk()]
    eng._resident = {"model": False, "grad": True, "optimizer": False}
    monkeypatch.setattr(eng, "_grads_finite", lambda: True)
    with eng.train_mode():
        during_backward = where["optimizer"]
        assert eng.optimizer_step() == 1.0
        after_step = where["optimizer"]
    assert seen_at_step == ["gpu"]
    if optimizer_offload:
        assert (during_backward, after_step) == ("cpu", "cpu")
    else:
        assert (during_backward, after_step) == ("gpu", "gpu")
    assert where["optimizer"] == ("cpu" if optimizer_offload else "gpu")


# ------------------------------------------------------------------------------------------ expert layouts
def test_expert_layouts_with_pipelines_are_accepted():
    """Ranks are laid out pipeline-outermost, so expert * expert-tensor parallelism need not equal TP with PP > 1
    (upstream's Qwen3.5-35B script: TP 2, PP 2, EP 8, ETP 1; Qwen3-30B-A3B: TP 4, PP 2, VPP 2, EP 2)."""
    assert settings_problems({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                              "expert_model_parallel_size": 8, "expert_tensor_parallel_size": 1}) == []
    s = read_settings({"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2,
                       "virtual_pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2})
    assert (s.tp, s.pp, s.vpp, s.ep, s.etp) == (4, 2, 2, 2, None)


def test_expert_layout_must_divide_the_world(qwen35_dir):
    # 16 GPUs, PP 2: EP 16 * ETP 1 * PP 2 = 32 ranks per expert replica cannot fit.
    problems = _problems(UPSTREAM_STYLE + [f"actor_rollout_ref.model.path={qwen35_dir}",
                                           f"{M}.expert_model_parallel_size=16", f"{M}.expert_tensor_parallel_size=1"])
    hits = [p for p in problems if f"{M}.expert_model_parallel_size" in p and "must divide the world size" in p]
    assert hits and "(16 * 1 * 2)" in hits[0], problems


def test_checkpoint_rank_order_is_recorded_and_checked(tmp_path):
    """Per-rank optimizer / RNG files are keyed by global rank: a checkpoint of the old dp-outermost order is
    refused where the orders number ranks differently (PP > 1 and DP > 1), accepted where they agree."""
    import json

    from verl.workers.engine.megatron.checkpoint import check_rank_order, write_rank_order

    new = tmp_path / "new"
    new.mkdir()
    write_rank_order(str(new))
    assert json.loads((new / "rank_order.json").read_text()) == {"order": "tp-cp-ep-dp-pp"}
    check_rank_order(str(new), pp=2, dp=2)
    old = tmp_path / "old"
    old.mkdir()
    (old / "optim_rank_0.pt").write_bytes(b"")
    check_rank_order(str(old), pp=1, dp=4)  # one stage: both orders number ranks alike
    check_rank_order(str(old), pp=2, dp=1)
    with pytest.raises(ValueError, match="rank order 'tp-cp-ep-pp-dp'"):
        check_rank_order(str(old), pp=2, dp=2)
    (old / "rank_order.json").write_text(json.dumps({"order": "pp-dp-tp"}))
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=1"):
        check_rank_order(str(old), pp=1, dp=1)


def test_the_build_timer_prints_each_phase_once_on_rank_0(capsys, monkeypatch):
    from verl.workers.engine.megatron import build

    clock = iter([1.5, 4.0, 4.5])
    timer = build.BuildTimer("actor built")
    timer._clock, timer._t = lambda: next(clock), 0.0  # started at 0
    for phase in ("model", "weights", "optimizer"):
        timer.lap(phase)
    assert [p for p, _ in timer.phases] == ["model", "weights", "optimizer"]
    timer.report()  # no process group: a lone process prints
    assert capsys.readouterr().out == "[verl.megatron] actor built in 4.5 s (model 1.5, weights 2.5, optimizer 0.5)\n"
    monkeypatch.setattr(build.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(build.dist, "get_rank", lambda: 1)
    timer.report()
    assert capsys.readouterr().out == ""
