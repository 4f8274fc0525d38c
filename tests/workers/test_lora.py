"""LoRA on the FSDP2 actor (CPU, one gloo rank): targets on Qwen3.5, fused experts, adapter files, sync."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("dense")
    build_tiny_qwen3_5(str(path), kind="dense")
    return str(path)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("moe")
    build_tiny_qwen3_5(str(path), kind="moe")
    return str(path)


def model_cfg(path, **kw):
    base = OmegaConf.load(os.path.join(os.path.dirname(__file__), "../../verl/trainer/config/model/hf_model.yaml"))
    base.path = path
    base.enable_gradient_checkpointing = False
    for k, v in kw.items():
        base[k] = v
    return base


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def shard(cfg, role="actor"):
    from verl.workers.engine.fsdp.model_init import build_module

    return build_module(cfg, OmegaConf.create({"param_offload": False}), role=role)


def _randomize_b(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "lora_B" in n:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(torch.randn(local.shape, generator=g) * 0.05)


# ---------------------------------------------------------------------------------------------- targets
def test_all_linear_selects_qwen35_projections(dense_dir):
    from verl.models.qwen3_5.spec import QWEN35_ALL_LINEAR
    from verl.workers.lora import apply_lora

    m = apply_lora(load(dense_dir), model_cfg(dense_dir, lora_rank=4))
    adapted = {n.rsplit(".", 1)[-1] for n, mod in m.named_modules() if hasattr(mod, "lora_A") and mod.lora_A}
    assert adapted == set(QWEN35_ALL_LINEAR)
    names = [n for n, mod in m.named_modules() if hasattr(mod, "lora_A") and mod.lora_A]
    assert not any("conv1d" in n or "lm_head" in n or "embed" in n for n in names)
    # only adapter parameters are trainable
    assert all((".lora_" in n) == p.requires_grad for n, p in m.named_parameters())


def test_all_linear_on_moe_skips_router_and_experts(moe_dir):
    from verl.workers.lora import apply_lora

    m = apply_lora(load(moe_dir), model_cfg(moe_dir, lora_rank=4))
    names = [n for n, mod in m.named_modules() if hasattr(mod, "lora_A") and mod.lora_A]
    assert any(n.endswith("shared_expert.gate_proj") for n in names)
    assert any(n.endswith("linear_attn.in_proj_a") for n in names)
    assert not any(n.endswith("mlp.gate") or n.endswith("shared_expert_gate") or "experts" in n.split(".")[-1]
                   for n in names)


def test_explicit_list_and_exclude(dense_dir):
    from verl.workers.lora import apply_lora

    m = apply_lora(load(dense_dir), model_cfg(dense_dir, lora_rank=4, target_modules=["q_proj", "v_proj", "out_proj"],
                                              exclude_modules="model.layers.0.*"))
    names = [n for n, mod in m.named_modules() if hasattr(mod, "lora_A") and mod.lora_A]
    assert names and all(n.rsplit(".", 1)[-1] in {"q_proj", "v_proj", "out_proj"} for n in names)
    assert not any(".layers.0." in n for n in names)


def test_fused_experts_need_target_parameters(moe_dir):
    from verl.workers.lora import apply_lora

    with pytest.raises(ValueError, match="target_parameters"):
        apply_lora(load(moe_dir), model_cfg(moe_dir, lora_rank=4, target_modules=["mlp.experts.gate_up_proj"]))


def test_fused_experts_dropout_refused_with_documented_message(moe_dir):
    from verl.workers.lora import apply_lora

    cfg = model_cfg(moe_dir, lora_rank=4, target_parameters="all-experts", lora_dropout=0.1)
    with pytest.raises(ValueError) as e:
        apply_lora(load(moe_dir), cfg)
    msg = str(e.value)
    assert "lora_dropout=0" in msg and "target_parameters=null" in msg and "What works" in msg
    # dropout without experts is fine
    apply_lora(load(moe_dir), model_cfg(moe_dir, lora_rank=4, lora_dropout=0.1))


def test_target_parameters_on_dense_model_is_an_error(dense_dir):
    from verl.workers.lora import apply_lora

    with pytest.raises(ValueError, match="no fused MoE experts"):
        apply_lora(load(dense_dir), model_cfg(dense_dir, lora_rank=4, target_parameters="all-experts"))


# ------------------------------------------------------------------------------------- FSDP2 + reference
def test_reference_equals_base_and_only_adapter_changes(gloo, dense_dir):
    from verl.workers.lora import apply_lora  # noqa: F401

    built = shard(model_cfg(dense_dir, lora_rank=8, lora_alpha=16))
    m = built.module
    assert built.is_lora
    base = load(dense_dir)
    x = torch.randint(20, 100, (2, 12))
    with torch.no_grad():
        ref = base(input_ids=x).logits
        assert torch.allclose(m(input_ids=x).logits, ref, atol=1e-5)  # B starts at zero
    before = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        loss = m(input_ids=x).logits.float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in m.named_parameters():
        changed = not torch.equal(before[n], (p.to_local() if hasattr(p, "to_local") else p).detach())
        if ".lora_B" in n:
            assert changed, n
        elif ".lora_" not in n:
            assert not changed, n
    with torch.no_grad():
        assert not torch.allclose(m(input_ids=x).logits, ref, atol=1e-4)
        with m.disable_adapter():
            assert torch.allclose(m(input_ids=x).logits, ref, atol=1e-5)


def test_moe_fused_experts_train_under_fsdp2(gloo, moe_dir):
    built = shard(model_cfg(moe_dir, lora_rank=4, target_parameters=["mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj"]))
    m = built.module
    expert_lora = [n for n, p in m.named_parameters() if "experts" in n and ".lora_" in n]
    assert len(expert_lora) == 4 * 4  # 4 layers x (gate_up, down) x (A, B)
    x = torch.randint(20, 100, (2, 10))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.to_local().detach().clone() for n, p in m.named_parameters() if n in expert_lora}
    for _ in range(2):
        m(input_ids=x).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    assert any(not torch.equal(before[n], p.to_local()) for n, p in m.named_parameters() if ".lora_B" in n
               and n in before)


# ------------------------------------------------------------------------------ adapter files, merge, sync
def test_adapter_files_load_in_peft_and_merged_sync_matches(gloo, moe_dir, tmp_path):
    from peft import PeftModel

    from verl.workers.lora import iter_merged_weights, rollout_lora_mode, save_lora_adapter

    built = shard(model_cfg(moe_dir, lora_rank=4, lora_alpha=8, target_parameters="all-experts"))
    m = built.module
    _randomize_b(m)
    out = save_lora_adapter(m, str(tmp_path / "lora_adapter"))
    cfg = json.loads((tmp_path / "lora_adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and (tmp_path / "lora_adapter/adapter_model.safetensors").exists()
    x = torch.randint(20, 100, (2, 10))
    with torch.no_grad():
        want = m(input_ids=x).logits
        peft_model = PeftModel.from_pretrained(load(moe_dir), out)
        assert torch.allclose(peft_model(input_ids=x).logits, want, atol=1e-4)
        merged_ref = peft_model.merge_and_unload().state_dict()
    assert rollout_lora_mode(m) == "merged"
    merged = dict(iter_merged_weights(m))
    if m.config.tie_word_embeddings:  # tied: lm_head is embed_tokens, sent once
        merged_ref.pop("lm_head.weight")
    assert set(merged) == set(merged_ref)
    for k, v in merged_ref.items():
        assert torch.allclose(merged[k], v, atol=1e-5), k


def test_dense_sync_sends_adapter_tensors(gloo, dense_dir):
    from verl.workers.lora import rollout_lora_mode, rollout_sync

    m = shard(model_cfg(dense_dir, lora_rank=4)).module
    assert rollout_lora_mode(m) == "adapter"
    weights, kw = rollout_sync(m)
    names = [n for n, _ in weights]
    assert names and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
    assert kw["lora"]["peft_config"].r == 4


def test_adapter_path_sets_rank_and_alpha(gloo, dense_dir, tmp_path):
    from verl.workers.lora import apply_lora, save_lora_adapter

    src = apply_lora(load(dense_dir), model_cfg(dense_dir, lora_rank=6, lora_alpha=12, target_modules=["q_proj"]))
    _randomize_b(src, seed=3)
    save_lora_adapter(src, str(tmp_path / "ad"))
    cfg = model_cfg(dense_dir, lora_rank=0, lora_alpha=16, lora_adapter_path=str(tmp_path / "ad"))
    built = shard(cfg)
    assert built.is_lora and cfg.lora_rank == 6 and cfg.lora_alpha == 12
    m = built.module
    assert any(p.requires_grad for p in m.parameters())
    x = torch.randint(20, 100, (1, 9))
    with torch.no_grad():
        assert torch.allclose(m(input_ids=x).logits, src(input_ids=x).logits, atol=1e-5)


def test_vllm_with_dummy_load_format_is_refused():
    from verl.workers.lora import check_lora_rollout_config

    cfg = OmegaConf.create({"model": {"lora_rank": 8}, "rollout": {"name": "vllm", "load_format": "dummy"}})
    with pytest.raises(ValueError, match="load_format=safetensors"):
        check_lora_rollout_config(cfg)
    cfg.rollout.load_format = "safetensors"
    check_lora_rollout_config(cfg)
    cfg.rollout.name, cfg.rollout.load_format = "hf", "dummy"
    check_lora_rollout_config(cfg)  # the hf engine generates with the live actor


def test_copy_to_shm(tmp_path):
    from verl.utils.fs import copy_to_shm

    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text("{}")
    shm = tmp_path / "shm"
    shm.mkdir()
    dst = copy_to_shm(str(src), shm_root=str(shm))
    assert dst.startswith(str(shm)) and os.path.exists(os.path.join(dst, "config.json"))
    assert copy_to_shm(str(src), shm_root=str(shm)) == dst  # reused
    assert copy_to_shm(str(src), shm_root=str(tmp_path / "absent")) == str(src)


def test_hf_generate_uses_live_adapter_under_fsdp2(gloo, dense_dir):
    from verl.utils.fsdp_utils import gathered_for_inference

    m = shard(model_cfg(dense_dir, lora_rank=8, lora_alpha=64)).module
    x = torch.tensor([[30, 31, 32, 33]])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad(), gathered_for_inference(m):
        before = m.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
    _randomize_b(m, seed=1)
    with torch.no_grad(), gathered_for_inference(m):
        after = m.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
        with m.disable_adapter():
            base = m.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
    assert torch.equal(before, base) and not torch.equal(before, after)


def test_checkpoint_manager_writes_adapter_and_merged_hf(gloo, dense_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from verl.model_merger.fsdp_merger import merge_fsdp_checkpoint
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    m = shard(model_cfg(dense_dir, lora_rank=4, lora_alpha=8)).module
    _randomize_b(m, seed=5)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    mgr = FSDPCheckpointManager(m, opt, None, checkpoint_config={"save_contents": ["model", "optimizer", "extra",
                                                                                 "hf_model"]})
    mgr.save_checkpoint(str(tmp_path / "actor"))
    assert (tmp_path / "actor/lora_adapter/adapter_model.safetensors").exists()
    x = torch.randint(20, 100, (1, 9))
    with torch.no_grad():
        want = m(input_ids=x).logits
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "actor/huggingface"), dtype=torch.float32)
        assert torch.allclose(hf(input_ids=x).logits, want, atol=1e-4)
        merge_fsdp_checkpoint(str(tmp_path / "actor"), str(tmp_path / "merged"))
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        assert torch.allclose(merged(input_ids=x).logits, want, atol=1e-4)
    # resume: the sharded checkpoint restores the adapter
    _randomize_b(m, seed=9)
    mgr.load_checkpoint(str(tmp_path / "actor"))
    with torch.no_grad():
        assert torch.allclose(m(input_ids=x).logits, want, atol=1e-6)
