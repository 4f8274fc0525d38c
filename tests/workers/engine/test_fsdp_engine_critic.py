"""The critic on the FSDP engine: critic.ulysses_sequence_parallel_size and critic.use_dynamic_bsz work.

An SP=2 critic (two gloo ranks, one data-parallel group) with a dynamic token budget computes the same values
and takes the same SGD step as a one-rank critic with fixed micro-batches."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def critic_batch(n=6, prompt=5, response=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, 100, (n, prompt + response), generator=g)
    mask = torch.ones(n, prompt + response, dtype=torch.long)
    for i in range(n):
        mask[i, : i % 3] = 0
        mask[i, prompt + response - (i % 4):] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:].clone(), "values": torch.randn(n, response, generator=g) * 0.1,
            "returns": torch.randn(n, response, generator=g)}


def critic_config(model_dir, sp, dynamic):
    from omegaconf import open_dict

    from verl.trainer.config.checks import compose_config

    cfg = compose_config("ppo_trainer", [f"critic.model.path={model_dir}", "critic.model.enable_gradient_checkpointing=false",
                                         f"critic.ulysses_sequence_parallel_size={sp}",
                                         f"critic.use_dynamic_bsz={dynamic}", "critic.ppo_max_token_len_per_gpu=20",
                                         "actor_rollout_ref.rollout.name=hf"], validate=False).critic
    with open_dict(cfg):
        cfg.ppo_mini_batch_size = 6
        cfg.ppo_micro_batch_size_per_gpu = 2
        cfg.forward_micro_batch_size_per_gpu = 4
        cfg.optim.optimizer = "SGD"
        cfg.optim.lr = 1.0
        cfg.optim.weight_decay = 0.0
    return cfg


def _worker(rank, world, sp, dynamic, port, model_dir, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    from tests.engine_utils import leave_process_group
    from verl.protocol import DataProto
    from verl.workers.critic.ppo_critic import PPOCritic
    from verl.workers.engine_workers import build_engine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = critic_config(model_dir, sp, dynamic)
    engine = build_engine(cfg, cfg.model, "critic", trainable=True)
    engine.initialize()
    assert engine.use_remove_padding and engine.sp_size == sp
    critic = PPOCritic(cfg, engine)
    data = DataProto.from_dict(tensors=critic_batch())
    values = critic.compute_values(data)
    before = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}
    metrics = critic.update_critic(data)
    after = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}
    delta = {k: (before[k] - after[k]).numpy() for k in before}
    out_q.put((rank, metrics, values.numpy(), delta if rank == 0 else None))
    leave_process_group()


def _run(world, sp, dynamic, model_dir):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, sp, dynamic, port, model_dir, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((q.get(timeout=600) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("critic_model")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0, with_tokenizer=True)
    return str(path)


def test_critic_sp2_with_dynamic_bsz_matches_one_rank(model_dir):
    one = _run(1, 1, False, model_dir)
    two = _run(2, 2, True, model_dir)
    _, m1, v1, d1 = one[0]
    mask = critic_batch()["response_mask"].bool()
    # The value head starts at zero; the step moves it, so the update and the gradient are compared too.
    assert any(abs(v).max() > 0 for v in d1.values())
    for rank, m, v, _ in two:
        torch.testing.assert_close(torch.from_numpy(v)[mask], torch.from_numpy(v1)[mask], rtol=1e-4, atol=1e-6)
        assert m["critic/vf_loss"][0] == pytest.approx(m1["critic/vf_loss"][0], rel=1e-4, abs=1e-6)
        assert m["critic/grad_norm"][0] == pytest.approx(m1["critic/grad_norm"][0], rel=1e-4)
    d2 = two[0][3]
    for k in d1:
        torch.testing.assert_close(torch.from_numpy(d2[k]), torch.from_numpy(d1[k]), rtol=1e-4, atol=1e-6,
                                   msg=lambda s, k=k: f"{k}: {s}")


def test_value_head_runs_in_fp32_when_the_weights_arrive_in_bf16():
    """Under FSDP2 mixed precision the root unit's parameters, the value head's included, are cast to bf16 for
    the forward while the backbone's last hidden state may be bf16 or fp32; the head computes in fp32 either way
    (the GPU critic with the default bf16 compute dtype failed on this before)."""
    import torch

    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.workers.critic.value_model import ValueModel

    torch.manual_seed(0)
    vm = ValueModel(build_tiny_qwen3_5(None, kind="dense", with_tokenizer=False))
    torch.nn.init.normal_(vm.value_head.weight)
    ids = torch.randint(3, 100, (2, 6))
    ref = vm(ids)
    vm.value_head.to(torch.bfloat16)  # what FSDP2's param_dtype=bf16 hands the root unit in forward
    out = vm(ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.sum().backward()
    assert vm.value_head.weight.grad is not None and vm.value_head.weight.grad.dtype == torch.bfloat16
