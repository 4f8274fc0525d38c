"""The FSDP engine keys that only act on an accelerator: the compute dtype (``dtype``: FSDP2's mixed-precision
policy over ``model_dtype`` master weights) and ``param_offload`` / ``offload_policy`` (FSDP2's CPUOffloadPolicy), for
every role.

On CPU the engine computes in the master dtype and parameters are in host memory anyway, so these run on a
CUDA machine: pytest -m gpu tests/workers/engine/test_keys_fsdp_gpu.py. The key names are spelled out so
key_status.txt can point here.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from test_keys_fsdp import build  # noqa: E402  (rootdir-relative import, like the other engine tests)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def nccl():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("keys_fsdp_gpu")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0)
    return str(path)


def _shard_kwargs(model_dir, key, value, monkeypatch):
    import verl.utils.fsdp_utils as fsdp_utils

    seen = []
    real = fsdp_utils.fully_shard
    monkeypatch.setattr(fsdp_utils, "fully_shard", lambda module, **kw: (seen.append(kw), real(module, **kw))[1])
    engine = build(model_dir, key, value)
    monkeypatch.setattr(fsdp_utils, "fully_shard", real)
    return engine, seen


def _batch(n=2, length=8):
    from verl.protocol import DataProto

    ids = torch.randint(10, 100, (n, length))
    mask = torch.ones_like(ids)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
                                        "responses": ids[:, -3:]}, meta_info={"temperature": 1.0, "micro_batch_size": 2})


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.dtype", "actor_rollout_ref.ref.fsdp_config.dtype",
                                 "critic.fsdp.dtype", "engine.dtype"])
def test_dtype_is_the_compute_dtype(nccl, model_dir, key, monkeypatch):
    engine, seen = _shard_kwargs(model_dir, key, "bfloat16", monkeypatch)
    assert {kw["mp_policy"].param_dtype for kw in seen} == {torch.bfloat16}
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}  # master weights: model_dtype
    out = engine.infer_batch(_batch(), outputs=("values",) if key.startswith("critic") else ("log_probs",))
    assert all(torch.isfinite(v).all() for v in out.values())
    engine, seen = _shard_kwargs(model_dir, key, "float32", monkeypatch)
    assert all("mp_policy" not in kw for kw in seen)  # compute in the master dtype: no cast
    out = engine.infer_batch(_batch(), outputs=("values",) if key.startswith("critic") else ("log_probs",))
    assert all(torch.isfinite(v).all() for v in out.values())


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.param_offload",
                                 "actor_rollout_ref.ref.fsdp_config.param_offload", "critic.fsdp.param_offload",
                                 "engine.param_offload", "actor_rollout_ref.actor.fsdp_config.offload_policy",
                                 "actor_rollout_ref.ref.fsdp_config.offload_policy", "critic.fsdp.offload_policy",
                                 "engine.offload_policy"])
def test_param_offload_keeps_parameters_in_host_memory(nccl, model_dir, key, monkeypatch):
    from torch.distributed.fsdp import CPUOffloadPolicy

    engine, seen = _shard_kwargs(model_dir, key, True, monkeypatch)
    assert seen and all(isinstance(kw.get("offload_policy"), CPUOffloadPolicy) for kw in seen)
    assert {p.device.type for p in engine.module.parameters()} == {"cpu"}
    out = engine.infer_batch(_batch(), outputs=("values",) if key.startswith("critic") else ("log_probs",))
    assert all(torch.isfinite(v).all() for v in out.values())
    engine, seen = _shard_kwargs(model_dir, key, False, monkeypatch)
    assert all("offload_policy" not in kw for kw in seen)
    assert {p.device.type for p in engine.module.parameters()} == {"cuda"}
