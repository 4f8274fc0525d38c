"""LoRA on the Megatron engine (one GPU, Qwen3.5 mcore model): only the adapters train, the reference engine shares
the actor's chunks with the adapters off (its log-probs stay the base model's), the exported and rollout-synced
weights are the merged ones (the HF model loaded with them gives the actor's log-probs), and a checkpoint resumes
the adapters exactly. Needs megatron-core, fla and CUDA: ``pytest -m gpu tests/workers/engine/``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("fla")

from omegaconf import OmegaConf  # noqa: E402

import megatron_standin as util  # noqa: E402


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    p = tmp_path_factory.mktemp("qwen35_lora")
    build_tiny_qwen3_5(p, kind="dense", seed=1)
    return str(p)


def _engines(path, dtype="float32"):
    from verl.workers.engine.megatron import MegatronEngine

    torch.manual_seed(0)
    engine_cfg = {"use_remove_padding": True, "dtype": dtype, "seed": 7, "override_transformer_config": {}}
    model_cfg = OmegaConf.create({"path": path, "lora_rank": 8, "lora_alpha": 16, "target_modules": "all-linear"})
    optim = OmegaConf.create({"lr": 1e-2, "clip_grad": 1.0, "weight_decay": 0.0, "total_training_steps": 10})
    actor = MegatronEngine(model_cfg, OmegaConf.create(engine_cfg), optim,
                           OmegaConf.create({"save_contents": ["model", "optimizer", "extra"]}), role="actor")
    actor.initialize()
    ref = MegatronEngine(model_cfg, OmegaConf.create({**engine_cfg, "forward_only": True}), None, None, role="ref",
                         share_module_with=actor)
    ref.initialize()
    return actor, ref


def _batch(path, seed=0):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    return util.batch(seed=seed, bsz=6, length=20, vocab=vocab, low=3, micro_batch_size=4)


def test_lora_actor_trains_adapters_only_and_ref_stays_the_base(path, tmp_path):
    from transformers import AutoModelForCausalLM

    actor, ref = _engines(path)
    assert actor.is_lora and ref.model is actor.model
    before = {n: p.detach().clone() for c in actor.model for n, p in c.named_parameters()}
    data = _batch(path)
    base_lp = ref.infer_batch(data)["log_probs"]
    for step in range(3):
        actor.train_batch(_batch(path, seed=step), util.nll_loss)
        actor.lr_scheduler_step()
    after = {n: p.detach() for c in actor.model for n, p in c.named_parameters()}
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert moved and all(n.endswith(("lora_A", "lora_B")) for n in moved), moved[:5]
    assert ref.infer_batch(data)["log_probs"].sub(base_lp).abs().max().item() == 0.0  # the base is untouched
    actor_lp = actor.infer_batch(data)["log_probs"]
    m = data.batch["attention_mask"].bool()
    gap_to_base = (actor_lp - base_lp)[m].abs().max().item()
    assert gap_to_base > 1e-3, f"3 updates moved the actor's log-probs by only {gap_to_base:.2e}"
    # merged export == the actor: an HF model loaded with the exported weights scores like the adapted actor
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    exported = dict(actor.get_per_tensor_param())
    assert set(exported) == set(dict(hf.named_parameters())), "the adapters must not leak into the HF names"
    hf.load_state_dict({k: v.cpu() for k, v in exported.items()}, strict=False)
    hf = hf.cuda().eval()
    worst = 0.0
    with torch.no_grad():
        for i in range(len(data)):
            mask = data.batch["attention_mask"][i].bool()
            ids = data.batch["input_ids"][i][mask].cuda()
            ref_lp = torch.log_softmax(hf(input_ids=ids[None]).logits[0].float(), -1)[:-1].gather(-1, ids[1:, None])
            worst = max(worst, (actor_lp[i][mask][:-1] - ref_lp[:, 0].cpu()).abs().max().item())
    print(f"[megatron lora] actor vs HF with merged weights: max |dlogp| {worst:.2e}; actor moved {gap_to_base:.2e}")
    assert worst < 1e-3
    # resume: the adapters come back exactly
    actor.save_checkpoint(str(tmp_path / "ckpt"), global_step=3)
    other, _ = _engines(path)
    other.load_checkpoint(str(tmp_path / "ckpt"))
    for (n, p), (_, q) in zip(actor.model[0].named_parameters(), other.model[0].named_parameters()):
        assert torch.equal(p, q), n
