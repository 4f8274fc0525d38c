"""The keys that decide where ``main_ppo`` starts its workers: ``trainer.nnodes`` / ``n_gpus_per_node`` (the
Ray resource pool, one bundle per device on each node) and ``ray_kwargs.ray_init.*`` (what Ray is started
with), plus ``trainer.device``, which the SFT trainer checks against the host and main_ppo's workers announce when the
host lacks it.

``launch_workers`` runs for real with Ray's entry points replaced by recorders (starting a Ray cluster is
what test_ray_multinode.py does). The key names are spelled out so key_status.txt can point here.
"""

from __future__ import annotations

import pytest

from verl.trainer.config.checks import compose_config


def _launch(monkeypatch, *overrides):
    import ray

    import verl.single_controller.ray as vray
    from verl.trainer import main_ppo

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.setdefault("init", kw))
    monkeypatch.setattr(vray, "create_ray_worker_groups",
                        lambda pool, specs, env=None, dp_layouts=None: seen.setdefault("pool", pool) and {})
    cfg = compose_config("ppo_trainer", ["trainer.launcher=ray", *overrides], validate=False)
    main_ppo.launch_workers(cfg, {})
    return seen


def test_nnodes_and_n_gpus_per_node_shape_the_resource_pool(monkeypatch):
    pool = _launch(monkeypatch, "trainer.nnodes=3", "trainer.n_gpus_per_node=2")["pool"]
    assert pool.process_on_nodes == [2, 2, 2] and pool.world_size == 6
    assert _launch(monkeypatch, "trainer.nnodes=1", "trainer.n_gpus_per_node=4")["pool"].process_on_nodes == [4]


def test_launcher_local_runs_in_process(monkeypatch):
    import verl.single_controller.worker_group as wg
    from verl.trainer import main_ppo

    monkeypatch.setattr(wg, "create_local_worker_groups", lambda specs, dp_layouts=None: {"local": specs})
    cfg = compose_config("ppo_trainer", ["trainer.launcher=local", "trainer.n_gpus_per_node=1"], validate=False)
    assert main_ppo.launch_workers(cfg, {}) == {"local": {}}  # no Ray
    assert "pool" in _launch(monkeypatch, "trainer.launcher=ray")


def test_local_launcher_needs_one_node(monkeypatch):
    from verl.trainer import main_ppo

    cfg = compose_config("ppo_trainer", ["trainer.launcher=local", "trainer.nnodes=2"], validate=False)
    with pytest.raises(ValueError, match="trainer.launcher=local runs one process"):
        main_ppo.launch_workers(cfg, {})


def test_ray_init_num_cpus_and_runtime_env_reach_ray(monkeypatch):
    init = _launch(monkeypatch, "ray_kwargs.ray_init.num_cpus=3")["init"]
    assert init["num_cpus"] == 3
    assert "num_cpus" not in _launch(monkeypatch)["init"]  # null: left to Ray
    init = _launch(monkeypatch, "++ray_kwargs.ray_init.runtime_env.env_vars.MY_FLAG=yes")["init"]
    assert init["runtime_env"]["env_vars"]["MY_FLAG"] == "yes"
    # Hydra types these as int, float and bool; Ray accepts only strings
    env = _launch(monkeypatch, "++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_USE_V1=1",
                  "++ray_kwargs.ray_init.runtime_env.env_vars.RATIO=0.5",
                  "++ray_kwargs.ray_init.runtime_env.env_vars.NCCL_DEBUG_ON=true")["init"]["runtime_env"]["env_vars"]
    assert (env["VLLM_USE_V1"], env["RATIO"], env["NCCL_DEBUG_ON"]) == ("1", "0.5", "true")
    assert all(isinstance(v, str) for v in env.values())
    init = _launch(monkeypatch, "ray_kwargs.ray_init.runtime_env.py_executable=/opt/py/bin/python")["init"]
    assert init["runtime_env"]["py_executable"] == "/opt/py/bin/python"


def test_sft_trainer_device_must_be_the_hosts():
    from verl.trainer.config.checks import ConfigValidationError
    from verl.trainer.sft_trainer import compose_sft_config, validate_sft_config
    from verl.utils.device import get_device_name

    host = get_device_name()
    other = "npu" if host != "npu" else "cuda"
    cfg, strategy = compose_sft_config(["model.path=/m", f"trainer.device={host}", "data.train_files=x"])
    validate_sft_config(cfg, strategy)
    cfg, strategy = compose_sft_config(["model.path=/m", f"trainer.device={other}", "data.train_files=x"])
    with pytest.raises(ConfigValidationError, match=f"trainer.device={other}"):
        validate_sft_config(cfg, strategy)


def test_ppo_workers_announce_a_trainer_device_the_host_lacks(caplog):
    """main_ppo's workers run on the device they see; a different trainer.device is named in a warning."""
    from verl.utils.device import get_device_name
    from verl.workers.engine_workers import ActorRolloutRefWorker

    host = get_device_name()
    other = "npu" if host != "npu" else "cuda"
    for device, warned in ((host, False), (other, True)):
        cfg = compose_config("ppo_trainer", [f"trainer.device={device}"], validate=False)
        caplog.clear()
        with caplog.at_level("WARNING", logger="verl.utils.device"):
            worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, full_config=cfg)
        assert worker.device == host
        assert (f"trainer.device={other}" in caplog.text) is warned
