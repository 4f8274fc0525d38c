"""The Megatron engine's weight export (verl/workers/engine/megatron/weights.py) on CPU ranks (gloo, megatron-core's
parallel state): routed experts move over the expert-parallel group in runs of consecutive tensors, one
collective per run (over expert-TP too), and the HF tensors that come out equal the checkpoint's exactly whatever
the run size, at EP 2, PP 2 x EP 2 and TP 2 x EP 2. Needs megatron-core (skipped where it does not import: the
CPU CI; runs on the GPU machine and on a CPU with megatron-core's source on PYTHONPATH)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the mcore extra)")



def _module_with(state: dict) -> torch.nn.Module:
    """A module whose named_parameters are ``state``'s names, in its order (what the walk reads of a chunk)."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(tensor.clone(), requires_grad=False))
    return root


def _rank(rank: int, world: int, port: int, sizes: dict, ckpt: str, out: str) -> None:
    import safetensors.torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from verl.models.mcore.registry import get_mcore_weight_converter
    from verl.workers.engine.megatron import weights

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"],
                                 expert_model_parallel_size=sizes["ep"])
    config = AutoConfig.from_pretrained(ckpt)
    conv = get_mcore_weight_converter(config)
    layout = conv.ParallelLayout(tp=sizes["tp"], pp=sizes["pp"], ep=sizes["ep"])
    state = safetensors.torch.load_file(os.path.join(ckpt, "model.safetensors"))
    tp, pp, ep = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), \
        ps.get_expert_model_parallel_rank()
    assert ps.get_expert_tensor_parallel_rank() == tp  # the shards below cut experts by the TP rank
    shard = conv.hf_to_mcore_shards(state, config, layout)[(pp, 0, tp, ep)]
    engine = SimpleNamespace(converter=conv, hf_config=config, model=[_module_with(shard)],
                             settings=SimpleNamespace(tp=sizes["tp"], pp=sizes["pp"], ep=sizes["ep"], etp=None,
                                                      vpp=None),
                             role_spec=SimpleNamespace(value_head=False))
    ep_group, etp_group = ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    real_all_gather, results = dist.all_gather, {}
    # every expert tensor alone (the old walk), runs of two that split a layer's experts, one run per layer
    # (a run's bytes count its tensors gathered over expert-TP: TP x this rank's shard)
    pair = 2 * sizes["tp"] * max(t.numel() * t.element_size() for n, t in shard.items() if conv.is_expert_param(n))
    for cap in (0, pair, 1 << 30):
        counts = {"ep": 0, "etp": 0}

        def counting(parts, tensor, group=None, **kw):
            counts["ep"] += group is ep_group
            counts["etp"] += group is etp_group and sizes["tp"] > 1
            return real_all_gather(parts, tensor, group=group, **kw)

        weights.EXPERT_RUN_BYTES = cap
        dist.all_gather = counting
        try:
            got = {n: t.clone() for n, t in weights.iter_hf_weights(engine)}
        finally:
            dist.all_gather = real_all_gather
        results[len(results)] = dict(tensors=got, ep_gathers=counts["ep"], etp_gathers=counts["etp"])
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("moe")
    model = build_tiny_qwen3_5(path, kind="moe", seed=3, with_tokenizer=False, tie_word_embeddings=False)
    # the export's layout is the HF module's (experts fused per layer), what a rollout copy loads
    return str(path), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("sizes", [dict(tp=1, pp=1, ep=2), dict(tp=1, pp=2, ep=2), dict(tp=2, pp=1, ep=2)],
                         ids=lambda s: f"tp{s['tp']}pp{s['pp']}ep{s['ep']}")
def test_export_in_expert_runs_reproduces_the_checkpoint(moe_checkpoint, sizes, tmp_path):
    import torch.multiprocessing as tmp

    ckpt, want = moe_checkpoint
    world = sizes["tp"] * sizes["pp"] * sizes["ep"]  # experts (ETP = TP) x EP x PP cover every rank once
    ctx = tmp.get_context("spawn")
    port = 29300 + os.getpid() % 300
    procs = [ctx.Process(target=_rank, args=(r, world, port, sizes, ckpt, str(tmp_path / "r")))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    assert [p.exitcode for p in procs] == [0] * world
    for rank in range(world):
        results = torch.load(tmp_path / f"r.{rank}")
        for cap, r in results.items():
            got = r["tensors"]
            assert set(got) == set(want), (rank, cap)
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor), (rank, cap, name)
        # one gather over EP per expert tensor; half as many in pairs; one per layer (4 layers / PP stages)
        counts = [results[i]["ep_gathers"] for i in range(3)]
        assert counts == [16 // sizes["pp"], 8 // sizes["pp"], 4 // sizes["pp"]], counts
        # the same runs over expert-TP where it splits the experts
        etp = [results[i]["etp_gathers"] for i in range(3)]
        assert etp == (counts if sizes["tp"] > 1 else [0, 0, 0]), etp
