"""The Megatron engine's router-replay driver (``MegatronRouterReplay``) on CPU, against a stand-in of
megatron-core's ``RouterReplay`` contract (megatron-core does not import here; the GPU test
tests/models/mcore/test_mcore_router_replay_gpu.py runs the real one).

The stand-in keeps the contract the driver relies on: per-router actions RECORD / REPLAY_FORWARD /
REPLAY_BACKWARD; ``set_target_indices`` sets the forward's targets and queues them for a recomputation in backward,
which pops the oldest. A toy MoE layer under reentrant activation checkpointing (as megatron's recompute) runs the
micro-batches in a 1F1B order: every forward and every recomputation must route with its own micro-batch's routes.
"""

import enum
import sys
import types

import pytest
import torch

E, K, H = 6, 2, 4


class Action(enum.Enum):
    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


class StandInReplay:
    def __init__(self):
        self.target, self.recorded, self.queue, self.router_replay_action = None, None, [], None

    def set_target_indices(self, t):
        self.target = t
        self.queue.append(t)

    def get_recorded_indices(self):
        return self.recorded

    def clear_indices(self):
        self.target, self.recorded, self.queue = None, None, []

    def set_router_replay_action(self, a):
        self.router_replay_action = a

    def clear_router_replay_action(self):
        self.router_replay_action = None

    def topk(self, logits):
        if self.router_replay_action == Action.REPLAY_FORWARD:
            return self.target
        if self.router_replay_action == Action.REPLAY_BACKWARD:
            return self.queue.pop(0)
        idx = logits.topk(K, dim=-1).indices
        if self.router_replay_action == Action.RECORD:
            self.recorded = idx
        return idx


class ToyMoE(torch.nn.Module):
    def __init__(self, layer_number, log):
        super().__init__()
        self.layer_number, self.log = layer_number, log
        self.router = torch.nn.Parameter(torch.randn(H, E))
        self.experts = torch.nn.Parameter(torch.randn(E, H, H) / 2)
        self.router_replay = StandInReplay()

    def _inner(self, x):
        logits = x @ self.router
        idx = self.topk_logged(logits)
        probs = torch.softmax(logits.gather(-1, idx), -1)
        out = torch.einsum("th,tkhg->tkg", x, self.experts[idx])
        return x + (probs[..., None] * out).sum(1)

    def topk_logged(self, logits):
        idx = self.router_replay.topk(logits)
        self.log.append((self.layer_number, self.router_replay.router_replay_action, idx.clone()))
        return idx

    def forward(self, x):
        if torch.is_grad_enabled():  # megatron's recompute: reentrant checkpoint (no-grad first pass)
            return torch.utils.checkpoint.checkpoint(self._inner, x, use_reentrant=True)
        return self._inner(x)


@pytest.fixture
def driver(monkeypatch):
    """``MegatronRouterReplay`` with the stand-in installed as megatron-core (world size 1)."""
    ps = types.SimpleNamespace(get_pipeline_model_parallel_world_size=lambda: 1,
                               get_tensor_model_parallel_rank=lambda: 0,
                               get_tensor_model_parallel_world_size=lambda: 1)
    rr_mod = types.SimpleNamespace(RouterReplay=StandInReplay, RouterReplayAction=Action)
    core = types.ModuleType("megatron.core")
    core.parallel_state = ps
    for name, mod in {"megatron": types.ModuleType("megatron"), "megatron.core": core,
                      "megatron.core.transformer": types.ModuleType("t"),
                      "megatron.core.transformer.moe": types.ModuleType("m"),
                      "megatron.core.transformer.moe.router_replay": rr_mod}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    from verl.workers.engine.megatron.router_replay import MegatronRouterReplay

    return MegatronRouterReplay


def _batch(seed, bsz=2, seqlen=5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(bsz, seqlen, dtype=torch.long)
    mask[1, 3:] = 0
    routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(bsz * seqlen * 2)])
    routes = routes.view(bsz, seqlen, 2, K).to(torch.int16)
    routes[~mask.bool()] = -1
    ids = torch.randint(1, 50, (bsz, seqlen), generator=g) * mask
    x = torch.randn(bsz * seqlen, H, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "routed_experts": routes}, x


def test_replay_in_forward_and_in_recompute_under_1f1b(driver):
    log = []
    chunk = torch.nn.Sequential(ToyMoE(1, log), ToyMoE(2, log))
    rp = driver("R3", [chunk], top_k=K, sequence_parallel=False)
    mbs = [_batch(s) for s in range(3)]
    outs = {}
    rp.begin_batch()

    def forward(i):
        mb, x = mbs[i]
        rp.before_forward(chunk, i, mb, None, record=False)
        # unpacked: the router sees [S, B] flattened, so feed the tokens in that order
        order = torch.arange(x.shape[0]).view(2, 5).t().reshape(-1)
        out = chunk(x[order].requires_grad_())
        outs[i] = rp.after_forward(chunk, i, out, record=False, forward_only=False)

    def backward(i):
        outs[i].sum().backward()

    for step in (lambda: forward(0), lambda: forward(1), lambda: backward(0), lambda: forward(2),
                 lambda: backward(1), lambda: backward(2)):
        step()
    rp.end_batch()
    # 3 micro-batches x 2 layers x (first pass + recompute); each saw its own micro-batch's routes
    assert len(log) == 12
    expected_mb = [0, 0, 1, 1, 0, 0, 2, 2, 1, 1, 2, 2]
    for (layer, action, idx), i in zip(log, expected_mb):
        mb, _ = mbs[i]
        want = mb["routed_experts"].transpose(0, 1).reshape(-1, 2, K)[:, layer - 1].long()
        want[mb["attention_mask"].t().reshape(-1) == 0] = torch.arange(K)  # padding: the filler
        assert torch.equal(idx, want), (layer, action, i)
    actions = [a for _, a, _ in log]
    assert actions.count(Action.REPLAY_BACKWARD) == 6 and actions.count(Action.REPLAY_FORWARD) == 6
    assert all(not m.router_replay.queue and m.router_replay.router_replay_action is None for m in chunk)


def test_record_returns_own_routes_in_the_batch_layout(driver):
    log = []
    chunk = torch.nn.Sequential(ToyMoE(1, log), ToyMoE(2, log))
    rp = driver("R2", [chunk], top_k=K, sequence_parallel=False)
    mbs = [_batch(s) for s in range(2)]
    rp.begin_batch()
    with torch.no_grad():
        for i, (mb, x) in enumerate(mbs):
            mb = {k: v for k, v in mb.items() if k != "routed_experts"}
            rp.before_forward(chunk, i, mb, None, record=True)
            order = torch.arange(x.shape[0]).view(2, 5).t().reshape(-1)
            rp.after_forward(chunk, i, chunk(x[order]), record=True, forward_only=True)
        got = rp.recorded_routes([mb for mb, _ in mbs])
    rp.end_batch()
    for i, (mb, _) in enumerate(mbs):
        own = [idx for (layer, _, idx) in log[2 * i: 2 * i + 2]]  # [S*B, K] per layer, position-major
        want = torch.stack(own, 1).view(5, 2, 2, K).transpose(0, 1).to(torch.int16)
        want[mb["attention_mask"] == 0] = -1
        assert torch.equal(got[i], want)


def test_a_dense_model_is_refused(driver):
    with pytest.raises(ValueError, match="needs a MoE model"):
        driver("R3", [torch.nn.Linear(2, 2)], top_k=K, sequence_parallel=False)


def test_the_engine_reads_the_mode_and_turns_on_megatron_core_replay():
    """``actor_rollout_ref.actor.megatron.router_replay.mode`` -> the engine's mode (which the actor reads to send
    ``routed_experts`` along) and the TransformerConfig fields that build routers with a RouterReplay."""
    from omegaconf import OmegaConf

    from verl.trainer.config.checks import compose_config
    from verl.workers.engine.megatron.router_replay import read_mode, replay_transformer_overrides

    cfg = compose_config("ppo_megatron_trainer", ["actor_rollout_ref.actor.megatron.router_replay.mode=R2"],
                         validate=False)
    assert read_mode(cfg.actor_rollout_ref.actor.megatron) == "R2"
    assert read_mode(cfg.actor_rollout_ref.ref.megatron) == "disabled"
    assert read_mode(OmegaConf.create({})) == "disabled"
    with pytest.raises(ValueError, match="R1"):
        read_mode(OmegaConf.create({"router_replay": {"mode": "R1"}}))
    over = replay_transformer_overrides({"moe_router_topk": 2}, "actor_rollout_ref.actor.megatron")
    assert over == {"moe_router_topk": 2, "moe_enable_routing_replay": True, "moe_router_fusion": False}
    with pytest.raises(ValueError, match="moe_router_fusion"):
        replay_transformer_overrides({"moe_router_fusion": True}, "actor_rollout_ref.actor.megatron")
