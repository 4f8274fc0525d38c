"""The built-in rollout engine and the weight sync under every FSDP option a user can set, on CPU.

Each case builds the actor engine the way its worker does (the real composed config with the options set),
takes one optimizer step, then

* **syncs**: the weight stream an external rollout engine loads (``get_rollout_weights``; for LoRA the adapter
  tensors plus the base weights) rebuilds an *unwrapped* Hugging Face model holding every parameter, equal to
  the same step taken under the default options;
* **generates** with the built-in engine on the live (sharded, wrapped, offloaded) module, greedy and sampled,
  and gets exactly the tokens the built-in engine produces on that unwrapped model;
* trains again afterwards (the rollout leaves every unit sharded, with the ``reshard_after_forward`` it had).

The options: wrap policy by size (``min_num_params=1`` wraps the attention modules themselves, as
``Qwen35Runner`` once failed on) or by class, ``reshard_after_forward=false``, ``optimizer_offload``, LoRA, and a
MoE model. Mixed precision and FSDP2's ``CPUOffloadPolicy`` (``param_offload`` / ``offload_policy``) take effect
on accelerators only (the engine ignores them on CPU, see test_keys_fsdp_gpu.py); the second test applies them
to the same model with ``apply_fsdp2`` directly, so their generation and sync paths run on CPU too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import open_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.engine_utils import arr_config, make_engine
from verl.protocol import DataProto
from verl.workers.rollout.base import GenerationRequest, SamplingParams

WRAP = "actor_rollout_ref.actor.fsdp_config.wrap_policy"
FSDP = "actor_rollout_ref.actor.fsdp_config"
LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]

# name -> (model kind, overrides); each is compared with the default options on the same kind (and LoRA or not),
# which are themselves covered by tests/workers/rollout/test_hf_engine.py and tests/workers/test_lora*.py.
CASES = {
    "wrap_by_size_1": ("dense", [f"{WRAP}.min_num_params=1"]),
    "wrap_by_class": ("dense", [f"+{WRAP}.transformer_layer_cls_to_wrap=[Qwen3_5Attention,Qwen3_5GatedDeltaNet,"
                                "Qwen3_5MLP]"]),
    "wrap_by_size_1_no_reshard": ("dense", [f"{WRAP}.min_num_params=1", f"{FSDP}.reshard_after_forward=false"]),
    "wrap_by_class_optimizer_offload": ("dense", [f"{WRAP}.transformer_layer_cls_to_wrap=[Qwen3_5DecoderLayer]",
                                                  f"{FSDP}.optimizer_offload=true"]),
    "lora_wrap_by_size_1": ("dense", LORA + [f"{WRAP}.min_num_params=1"]),
    "lora_wrap_by_class_no_reshard": ("dense", LORA + [f"{WRAP}.transformer_layer_cls_to_wrap=[Qwen3_5Attention]",
                                                       f"{FSDP}.reshard_after_forward=false"]),
    "moe_wrap_by_size_1": ("moe", [f"{WRAP}.min_num_params=1"]),
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    out = {}
    for kind in ("dense", "moe"):
        path = tmp_path_factory.mktemp(f"matrix_{kind}")
        # A wide init: greedy decoding then walks through many different tokens.
        build_tiny_qwen3_5(str(path), kind=kind, seed=0, initializer_range=0.3)
        out[kind] = str(path)
    return out


def _batch(n=8, prompt=6, response=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, 120, (n, prompt + response), generator=g)
    mask = torch.ones(n, prompt + response, dtype=torch.long)
    for i in range(n):
        mask[i, : i % 3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, prompt:],
                 "response_mask": mask[:, prompt:].clone(), "old_log_probs": -torch.rand(n, response, generator=g),
                 "advantages": torch.randn(n, response, generator=g)},
        meta_info={"temperature": 1.0, "micro_batch_size": 4})


# Plain SGD with momentum (an update to compare across cases, and optimizer state to offload).
SGD = ["actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.lr=1.0",
       "actor_rollout_ref.actor.optim.weight_decay=0.0",
       "+actor_rollout_ref.actor.optim.override_optimizer_config.momentum=0.9"]
_BASE_CONFIGS: dict = {}


def test_every_case_is_a_valid_command_line(model_dirs):
    """The overrides are what a user types: the config accepts them (composing is slow, so this composes every
    key once, and the cases below apply their overrides to one composed config)."""
    by_key = {}
    for _, overrides in CASES.values():
        for override in overrides:
            by_key.setdefault(override.lstrip("+").split("=", 1)[0], override)
    cfg = arr_config(model_dirs["dense"], SGD + list(by_key.values()))
    assert cfg.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap == [
        "Qwen3_5Attention", "Qwen3_5GatedDeltaNet", "Qwen3_5MLP"]


def _config(model_dir, overrides):
    """``arr_config(model_dir, SGD + overrides)``, composed once per model and updated per case."""
    import yaml
    from omegaconf import OmegaConf

    if model_dir not in _BASE_CONFIGS:
        _BASE_CONFIGS[model_dir] = arr_config(model_dir, SGD)
    cfg = OmegaConf.create({"actor_rollout_ref": copy.deepcopy(_BASE_CONFIGS[model_dir])})
    for override in overrides:
        key, value = override.lstrip("+").split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg.actor_rollout_ref


def _trained_engine(model_dir, overrides):
    """The actor engine with ``overrides``, after one optimizer step."""
    from verl.workers.actor.ppo_actor import PolicyLoss

    cfg = _config(model_dir, overrides)
    with open_dict(cfg.actor):
        cfg.actor.entropy_coeff = 0.0
    torch.manual_seed(0)  # LoRA's A matrices start random: the same in every case
    engine = make_engine(cfg.actor, cfg.model, role="actor")
    engine.train_batch(_batch(), PolicyLoss(cfg.actor))
    return engine, cfg


def _plain_model(model_dir, weights: dict | None = None):
    """An unwrapped HF model holding ``weights`` (every parameter; a tied LM head comes with its embedding);
    without weights, the checkpoint as saved."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if weights is None:
        return model.eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not unexpected and set(missing) == tied, (missing, unexpected)
    return model.eval()


def _synced_model(engine, model_dir):
    """What an external rollout engine would hold after the sync, as a plain HF model."""
    weights, kwargs = engine.get_rollout_weights(bucket_megabytes=0.05)  # many small buckets
    weights = {k: v.clone() for k, v in weights}
    if "lora" not in kwargs:
        return _plain_model(model_dir, weights), weights
    # Adapter mode: the engine loads the base weights once, then the adapter on top (as vLLM does).
    from peft import get_peft_model, set_peft_model_state_dict
    from verl.workers.weight_sync import iter_hf_weights

    base = {k: v.clone() for k, v in iter_hf_weights(engine.module, lora_mode="base")}
    peft = get_peft_model(_plain_model(model_dir, base), copy.deepcopy(kwargs["lora"]["peft_config"]))
    adapter = {k.replace("base_model.model.", "", 1): v for k, v in weights.items()}
    result = set_peft_model_state_dict(peft, adapter)
    assert not result.unexpected_keys
    merged = {k: v.clone() for k, v in engine.get_per_tensor_param()}
    return peft.merge_and_unload().eval(), merged


def _generate(module, model_dir):
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from verl.models.tiny import tiny_vocab
    from verl.workers.rollout.hf_rollout import HFRollout

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(30, 120, (n,), generator=g).tolist() for n in (6, 11, 4)]
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=tiny_vocab()["<|im_end|>"])
    rollout = HFRollout(OmegaConf.create({"enforce_eager": True, "max_num_seqs": 2}), None, tok, module=module)
    out = []
    for params in (SamplingParams(temperature=0.0, max_tokens=8),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=2, logprobs=True)):
        res = rollout.generate([GenerationRequest(p) for p in prompts], params)
        out.append([[o.token_ids for o in r] for r in res])
    return out


_BASELINES: dict = {}


def _baseline(model_dirs, kind, lora):
    if (kind, lora) not in _BASELINES:
        engine, _ = _trained_engine(model_dirs[kind], LORA if lora else [])
        _BASELINES[kind, lora] = {k: v.clone() for k, v in engine.get_per_tensor_param()}
    return _BASELINES[kind, lora]


def _reshard_flags(module):
    from verl.utils.fsdp_utils import fsdp_param_groups

    groups = [fsdp_param_groups(m._get_fsdp_state()) for m in module.modules() if isinstance(m, FSDPModule)]
    return [g[0].post_forward_mesh_info is not None for g in groups if g]


@pytest.mark.parametrize("case", sorted(CASES))
def test_builtin_engine_generates_and_syncs_under_fsdp_options(gloo, model_dirs, case):
    from verl.workers.actor.ppo_actor import PolicyLoss

    kind, overrides = CASES[case]
    model_dir = model_dirs[kind]
    lora = any("lora_rank" in o for o in overrides)
    engine, cfg = _trained_engine(model_dir, overrides)
    units = [m for m in engine.module.modules() if isinstance(m, FSDPModule)]
    if any("min_num_params=1" in o for o in overrides):  # the attention modules are FSDP units of their own
        assert any(type(m).__name__.endswith("Attention") for m in units), [type(m).__name__ for m in units]

    # Sync: the stream rebuilds an unwrapped model with every parameter, equal to the default-options step.
    plain, synced = _synced_model(engine, model_dir)
    baseline = _baseline(model_dirs, kind, lora)
    assert set(synced) == set(baseline)
    for name, tensor in synced.items():
        torch.testing.assert_close(tensor, baseline[name], rtol=1e-5, atol=1e-6, msg=f"{case}: {name}")
    initial = _plain_model(model_dir).state_dict()
    assert any(not torch.equal(synced[k], initial[k]) for k in synced), "the step changed no weight"

    # Generate: the built-in engine on the live FSDP module == the built-in engine on the unwrapped model.
    flags = _reshard_flags(engine.module)
    live = _generate(engine.hf_rollout_module(), model_dir)
    assert live == _generate(plain, model_dir), case
    assert all(isinstance(p, DTensor) for p in engine.module.parameters())  # resharded after the rollout
    assert _reshard_flags(engine.module) == flags  # reshard_after_forward as configured, not reset
    if any("reshard_after_forward=false" in o for o in overrides):
        assert not any(flags)

    # And training goes on through FSDP's hooks.
    metrics = engine.train_batch(_batch(seed=1), PolicyLoss(cfg.actor))
    assert torch.isfinite(torch.tensor(metrics["grad_norm"]))


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16_params"])
@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "cpu_offload_policy"])
@pytest.mark.parametrize("wrap", [{"min_num_params": 1}, {"transformer_layer_cls_to_wrap": ["Qwen3_5Attention"]}],
                         ids=["by_size", "by_class"])
def test_mixed_precision_and_offload_policy_generate_and_sync(gloo, model_dirs, mixed_precision, offload, wrap):
    """FSDP2's MixedPrecisionPolicy (bf16 compute) and CPUOffloadPolicy, as the engine applies them on
    accelerators: the built-in engine generates what the unwrapped model does with the same (bf16-cast)
    parameters, and the sync streams the fp32 master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    from verl.utils.fsdp_utils import apply_fsdp2, create_device_mesh
    from verl.workers.weight_sync import iter_hf_weights

    model_dir = model_dirs["dense"]
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    sharded = apply_fsdp2(copy.deepcopy(plain), create_device_mesh(1, -1, "cpu"), mp, param_offload=offload,
                          wrap_policy=wrap)
    synced = dict(iter_hf_weights(sharded, bucket_megabytes=0.05))
    want = {k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"}
    assert set(synced) == set(want)
    for k, v in synced.items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k]), k
    reference = copy.deepcopy(plain)
    if mixed_precision:  # what the policy computes with: parameters in bf16, buffers (rotary table) as they are
        for p in reference.parameters():
            p.data = p.data.to(torch.bfloat16)
    assert _generate(sharded, model_dir) == _generate(reference, model_dir)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
