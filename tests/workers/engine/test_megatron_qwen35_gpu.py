"""MegatronEngine on the Qwen3.5 mcore model (one GPU, packed THD): log-probs against Hugging Face per sequence,
the HF export reproducing the checkpoint, offload -> reload -> train step equal to no offload (the Gated
DeltaNet layers' parameters and gradients live in the DDP buffers), exact checkpoint resume, and the hf
rollout's synced copy (also after releasing its memory). Needs megatron-core, fla and CUDA:
``pytest -m gpu tests/workers/engine/``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("fla")

from omegaconf import OmegaConf  # noqa: E402

import megatron_standin as util  # noqa: E402  (rootdir-relative import, like tests/models)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    paths = {}
    for kind in ("dense", "moe"):
        path = tmp_path_factory.mktemp(f"qwen35_{kind}")
        build_tiny_qwen3_5(path, kind=kind, seed=1)
        paths[kind] = str(path)
    return paths


def make_engine(path, dtype="float32", role="actor", **engine_kw):
    from verl.workers.engine.megatron import MegatronEngine

    torch.manual_seed(0)
    engine_cfg = OmegaConf.create({"use_remove_padding": True, "dtype": dtype, "seed": 7,
                                   "override_transformer_config": {}, **engine_kw})
    optim = OmegaConf.create({"lr": 1e-3, "clip_grad": 1.0, "weight_decay": 0.0, "total_training_steps": 10})
    eng = MegatronEngine(OmegaConf.create({"path": path}), engine_cfg, optim,
                         OmegaConf.create({"save_contents": ["model", "optimizer", "extra"]}), role=role)
    eng.initialize()
    return eng


def qwen_batch(path, seed=0):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    return util.batch(seed=seed, bsz=6, length=20, vocab=vocab, low=3, micro_batch_size=4)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_log_probs_match_hf(checkpoints, kind):
    from transformers import AutoModelForCausalLM

    path = checkpoints[kind]
    eng = make_engine(path)
    data = qwen_batch(path)
    out = eng.infer_batch(data, outputs=("log_probs", "entropy"))["log_probs"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    worst = 0.0
    with torch.no_grad():
        for i in range(len(data)):
            m = data.batch["attention_mask"][i].bool()
            ids = data.batch["input_ids"][i][m].cuda()
            logp = torch.log_softmax(hf(input_ids=ids[None]).logits[0].float(), -1)
            ref = logp[:-1].gather(-1, ids[1:, None])[:, 0].cpu()
            got = out[i][m][:-1]
            worst = max(worst, (got - ref).abs().max().item())
    print(f"[megatron] {kind} engine packed log-probs vs HF per sequence: max |diff| {worst:.2e} (fp32 weights)")
    # The fla kernels on both sides may use TF32 dot products, so the bound is looser than pure fp32 math;
    # a packing or alignment error would show up as O(1) differences.
    assert worst < 1e-3


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hf_export_reproduces_the_checkpoint(checkpoints, kind):
    from transformers import AutoModelForCausalLM

    path = checkpoints[kind]
    eng = make_engine(path)
    exported = {k: v.cpu() for k, v in eng.get_per_tensor_param()}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = dict(hf.named_parameters())
    assert set(exported) == set(expected), (sorted(set(exported) ^ set(expected)))[:10]
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[name].detach()), name


def test_offload_reload_train_step_equals_no_offload(checkpoints):
    path = checkpoints["dense"]
    plain = make_engine(path, dtype="bfloat16")
    off = make_engine(path, dtype="bfloat16", param_offload=True, grad_offload=True, optimizer_offload=True)
    norms = []
    for step in range(3):
        data = qwen_batch(path, seed=step)
        a = plain.train_batch(data, util.nll_loss)["grad_norm"]
        b = off.train_batch(data, util.nll_loss)["grad_norm"]
        norms.append((a, b))
        off.to("device")
        off.to("cpu")
    print(f"[megatron] Qwen3.5 offload/reload grad norms (no offload, offload): {norms}")
    off.to("device")
    assert all(a == b for a, b in norms)
    assert torch.equal(util.flat_params(plain), util.flat_params(off))


def test_reference_with_param_offload_reuses_pinned_copies_and_gives_the_same_log_probs(checkpoints):
    """A forward-only engine (the reference role) with param_offload: none of its parameters live in a DDP
    buffer, so they move one by one, through pinned CPU copies allocated once. Its log-probs equal a resident
    engine's over two offload cycles, and an offload hands the parameters' device memory back."""
    path = checkpoints["moe"]
    resident = make_engine(path, dtype="bfloat16", role="ref")
    off = make_engine(path, dtype="bfloat16", role="ref", param_offload=True)
    assert off.forward_only
    params = [p for m in off.model for p in m.parameters()]
    assert all(p.device.type == "cpu" and p.is_pinned() for p in params)
    first = {id(p): p._verl_cpu.data_ptr() for p in params}
    nbytes = sum(p.numel() * p.element_size() for p in params)
    data = qwen_batch(path)
    want = resident.infer_batch(data, outputs=("log_probs",))["log_probs"]
    for _ in range(2):
        off.to("device")
        torch.cuda.synchronize()
        on_device = torch.cuda.memory_allocated()
        off.to("cpu")
        assert on_device - torch.cuda.memory_allocated() >= nbytes
        got = off.infer_batch(data, outputs=("log_probs",))["log_probs"]  # reloads and offloads again
        assert torch.equal(got, want)
    assert {id(p): p._verl_cpu.data_ptr() for p in params} == first  # the same pinned buffers every time


def test_checkpoint_resume_is_exact_and_hf_copy_follows(checkpoints, tmp_path):
    path = checkpoints["dense"]
    a = make_engine(path, dtype="bfloat16")
    a.train_batch(qwen_batch(path, 1), util.nll_loss)
    a.lr_scheduler_step()
    a.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    m_a = a.train_batch(qwen_batch(path, 2), util.nll_loss)
    b = make_engine(path, dtype="bfloat16")
    b.load_checkpoint(str(tmp_path / "ckpt"))
    m_b = b.train_batch(qwen_batch(path, 2), util.nll_loss)
    assert m_a["grad_norm"] == m_b["grad_norm"]
    assert torch.equal(util.flat_params(a), util.flat_params(b))
    # the hf rollout's copy carries exactly the trained weights after a sync
    module = b.hf_rollout_module()
    b.sync_hf_rollout_module()
    exported = dict(b.get_per_tensor_param())
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), exported[name].to(p.dtype)), name
    # the HF export written with the checkpoint loads as a plain HF model
    assert (tmp_path / "ckpt" / "huggingface" / "config.json").exists()


def test_hf_copy_released_between_generations_comes_back_with_the_trained_weights(checkpoints):
    """rollout.free_cache_engine on Megatron: the HF copy's parameter memory goes back to the trainer after a
    generation and the next sync re-allocates and refills every parameter (a train step in between)."""
    path = checkpoints["moe"]
    eng = make_engine(path, dtype="bfloat16")
    module = eng.hf_rollout_module()
    held = sum(p.numel() * p.element_size() for p in module.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert eng.release_hf_rollout_module() is True
    assert before - torch.cuda.memory_allocated() >= held
    eng.train_batch(qwen_batch(path, 1), util.nll_loss)
    eng.sync_hf_rollout_module()
    exported = dict(eng.get_per_tensor_param())
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), exported[name].to(p.dtype)), name


def test_fp32_checkpoint_seeds_the_fp32_master_weights(checkpoints):
    """An fp32 checkpoint in bf16 parameters: the optimizer's fp32 masters hold the checkpoint's own values
    (as FSDP's fp32 parameters do), not the bf16-rounded parameters; the parameters are their bf16 rounding."""
    import glob
    import os

    from safetensors.torch import load_file

    path = checkpoints["dense"]
    hf = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        hf.update(load_file(f))
    embed = hf["model.embed_tokens.weight"]
    assert embed.dtype == torch.float32 and not torch.equal(embed.to(torch.bfloat16).float(), embed)
    embed = embed.flatten()
    eng = make_engine(path, dtype="bfloat16")
    eng.to("device")
    emb = next(p for n, p in eng.model[0].named_parameters() if n.endswith("embedding.word_embeddings.weight"))
    opt = eng.optimizer
    pairs = []  # (model param, its fp32 master, the master's slice of the flattened param)
    for o in getattr(opt, "chained_optimizers", [opt]):
        if hasattr(o, "shard_fp32_from_float16_groups"):  # distributed optimizer: masters are shards
            for mg, sg in zip(o.model_float16_groups, o.shard_fp32_from_float16_groups):
                for p, m in zip(mg, sg):
                    r = o._get_model_param_range_map(p)["param"]
                    pairs.append((p, m, slice(r.start, r.end)))
        else:
            for mg, sg in zip(o.float16_groups, o.fp32_from_float16_groups):
                pairs += [(p, m, slice(None)) for p, m in zip(mg, sg)]
    assert pairs
    seen_embedding = 0
    for p, m, sl in pairs:
        master = m.detach().view(-1)
        assert torch.equal(master.to(torch.bfloat16), p.detach().view(-1)[sl])
        if p is emb:
            assert torch.equal(master.cpu(), embed[sl])
            seen_embedding += 1
    assert seen_embedding == 1
