"""A rollout engine shared by consecutive ranks (vLLM tensor parallelism under its external launcher) must be
handed the same prompts on every rank of its block, whatever data-parallel replica each rank serves for the
actor; each rank still gets back exactly the rows it was dispatched."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, replica_of, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from verl.protocol import DataProto
    from verl.single_controller.dp_layout import DataParallelLayout
    from verl.workers.sp_regroup import compute_in_group, consecutive_group

    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = DataParallelLayout(tuple(replica_of), (0, 1))
    group = consecutive_group(2)  # engines over ranks {0, 1} and {2, 3}
    rows = 2 + layout.replica_of[rank]  # replicas hand out chunks of different sizes
    prompts = DataProto.from_dict(tensors={"prompt": torch.full((rows, 3), 10 * layout.replica_of[rank])},
                                  meta_info={"response_length": 4})
    seen = []

    def generate(batch):  # deterministic "engine": the response is the prompt + 1
        seen.append(batch.batch["prompt"].clone())
        return DataProto.from_dict(tensors={"responses": batch.batch["prompt"] + 1}, meta_info=dict(batch.meta_info))

    out = compute_in_group(prompts, group, layout, generate)
    engine_inputs = [None] * world
    dist.all_gather_object(engine_inputs, seen[0].tolist())
    out_q.put((rank, engine_inputs, out.batch["responses"].tolist(), out.meta_info))
    dist.destroy_process_group()


def test_ranks_of_one_engine_see_one_batch_and_keep_their_own_rows():
    # Megatron's pipeline-outermost order at TP=1, PP=2 on 4 ranks: replicas (0, 1, 0, 1), so the engine block
    # {0, 1} spans two replicas and {2, 3} the same two.
    replica_of = [0, 1, 0, 1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 4, port, replica_of, q)) for r in range(4)]
    for p in procs:
        p.start()
    got = {r: (inputs, out, meta) for r, inputs, out, meta in (q.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    inputs = got[0][0]
    assert inputs[0] == inputs[1] and inputs[2] == inputs[3]  # one batch per engine block
    assert inputs[0] == [[0] * 3] * 2 + [[10] * 3] * 3  # replica 0's 2 rows, then replica 1's 3
    for rank, replica in enumerate(replica_of):
        out, meta = got[rank][1], got[rank][2]
        assert out == [[10 * replica + 1] * 3] * (2 + replica)  # exactly this rank's rows, in order
        assert meta["response_length"] == 4


def test_vllm_engines_under_the_external_launcher_span_tp_times_pp_ranks():
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.vllm_rollout.engine_args import spmd_ranks

    assert BaseRollout.spmd_ranks == 1
    assert spmd_ranks({"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 2}) == 2
    assert spmd_ranks({"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 2,
                       "pipeline_parallel_size": 2}) == 4
    assert spmd_ranks({"tensor_parallel_size": 1}) == 1  # one process's own engine
