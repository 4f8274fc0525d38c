"""Router replay on the megatron-core Qwen3.5 MoE model (one GPU): the engine's driver
(``verl.workers.engine.megatron.router_replay.MegatronRouterReplay``) with megatron-core's own RouterReplay.

* Routes recorded from a forward of slightly perturbed router weights, replayed on the unperturbed model, are
  exactly the experts every router picks (read off each router's routing map), and the log-probs change.
* In a training pass with full activation recompute, micro-batches run forward, forward, backward, backward: the
  first passes and the recomputations in backward each route with their own micro-batch's routes.
* R3: the "rollout" (Hugging Face, bf16) records its routes; the trainer's bf16 log-probs with those routes
  replayed are closer to the rollout's than without.

Needs megatron-core and fla (marker ``gpu``); tiny models, about a minute. Not run yet at the time of writing.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (the mcore extra)")

import mcore_parity as mp  # noqa: E402

from verl.models.qwen3_5.tiny import build_tiny_qwen3_5  # noqa: E402
from verl.workers.engine.megatron.packing import pack_thd  # noqa: E402
from verl.workers.engine.megatron.router_replay import MegatronRouterReplay  # noqa: E402

EXPERTS, TOP_K = 16, 4
LENGTHS = [40, 23, 64, 9, 51]


@pytest.fixture(scope="module", autouse=True)
def _mcore():
    mp.init_single_process("cuda")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_replay")
    build_tiny_qwen3_5(path, kind="moe", seed=7, with_tokenizer=False, num_experts=EXPERTS,
                       num_experts_per_tok=TOP_K, tie_word_embeddings=False)
    return str(path)


def _batch(seed=0, lengths=LENGTHS):
    """A right-padded micro-batch dict as the engine's micro-batches are."""
    g = torch.Generator().manual_seed(seed)
    bsz, seqlen = len(lengths), max(lengths)
    mask = (torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(30, 120, (bsz, seqlen), generator=g) * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "position_ids": pos.cuda()}


def _routers(model):
    return [m for m in model.modules() if getattr(m, "router_replay", None) is not None]


def _watch(model, log):
    """Forward hooks on every router: the experts of each token, (T, k) sorted, per decoder layer."""
    def hook(module, args, output):
        routing_map = output[1]
        experts = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)
        log.append((module.layer_number, experts.sort(-1).values.cpu()))
    return [r.register_forward_hook(hook) for r in _routers(model)]


def _forward(model, hf_config, mb, driver=None, record=False, mb_index=0, train=False):
    from verl.models.mcore.registry import get_mcore_forward_fn

    packed = pack_thd(mb["input_ids"], mb["attention_mask"], mb["position_ids"])
    if driver is not None:
        driver.before_forward(model, mb_index, mb, packed, record)
    out = get_mcore_forward_fn(hf_config)(model, packed.input_ids, packed.position_ids,
                                          packed_seq_params=packed.packed_seq_params(), labels=packed.labels)
    if driver is not None:
        out = driver.after_forward(model, mb_index, out, record, forward_only=not train)
    return out, packed


def _record(model, hf_config, mb):
    drv = MegatronRouterReplay("R2", [model], TOP_K, sequence_parallel=False)
    drv.begin_batch()
    with torch.no_grad():
        _forward(model, hf_config, mb, drv, record=True)
    routes = drv.recorded_routes([mb])[0]
    drv.end_batch()
    return routes


def _expected(routes, packed, layer):
    """The replayed experts of MoE layer ``layer`` (0-based) in packed order, sorted."""
    flat = routes.reshape(-1, *routes.shape[2:])[packed.indices.cpu(), layer].long()
    return flat.sort(-1).values


def test_replayed_routes_are_the_experts_every_router_picks(checkpoint):
    model, hf_config = mp.build_mcore_from_hf(checkpoint, torch.float32, "cuda", moe_enable_routing_replay=True)
    mb = _batch()
    own = _record(model, hf_config, mb)
    with torch.no_grad():
        for r in _routers(model):  # a slightly different model: some near-tie tokens pick other experts
            r.weight.add_(torch.randn_like(r.weight) * 0.05 * r.weight.std())
    perturbed = _record(model, hf_config, mb)
    model, hf_config = mp.build_mcore_from_hf(checkpoint, torch.float32, "cuda", moe_enable_routing_replay=True)
    real = mb["attention_mask"].bool().cpu()
    flipped = (own[real].sort(-1).values != perturbed[real].sort(-1).values).any(-1).float().mean().item()
    assert flipped > 0, "the perturbation flipped no route: the test would show nothing"

    with torch.no_grad():
        free, _ = _forward(model, hf_config, mb)
        drv = MegatronRouterReplay("R3", [model], TOP_K, sequence_parallel=False)
        drv.begin_batch()
        log = []
        handles = _watch(model, log)
        replayed, packed = _forward(model, hf_config, {**mb, "routed_experts": perturbed.cuda()}, drv)
        for h in handles:
            h.remove()
        drv.end_batch()
    assert len(log) == len(_routers(model))
    for layer_number, experts in log:
        assert torch.equal(experts, _expected(perturbed, packed, layer_number - 1)), layer_number
    diff = (free["log_probs"] - replayed["log_probs"]).abs().max().item()
    print(f"[router replay] {flipped:.1%} of (token, layer) routes flipped by the perturbation; "
          f"replaying them moved log-probs by up to {diff:.3e}")
    assert diff > 1e-5


def test_recompute_in_backward_replays_each_micro_batch(checkpoint):
    model, hf_config = mp.build_mcore_from_hf(
        checkpoint, torch.float32, "cuda", moe_enable_routing_replay=True, recompute_granularity="full",
        recompute_method="uniform", recompute_num_layers=1)
    model.train()
    mbs = [_batch(seed=s, lengths=lens) for s, lens in ((1, [30, 12]), (2, [7, 41, 20]))]
    with torch.no_grad():
        model.eval()
        routes = [_record(model, hf_config, mb) for mb in mbs]
        model.train()
    # replay routes that are not the model's own, so a router that fell back to its top-k would show
    routes = [(r.long() + 1 + i) % EXPERTS for i, r in enumerate(routes)]
    for r, mb in zip(routes, mbs):
        r[~mb["attention_mask"].bool().cpu()] = -1
    drv = MegatronRouterReplay("R3", [model], TOP_K, sequence_parallel=False)
    drv.begin_batch()
    log, outs, packs = [], {}, {}
    handles = _watch(model, log)
    phases = []

    def forward(i):
        phases.append(("F", i, len(log)))
        outs[i], packs[i] = _forward(model, hf_config, {**mbs[i], "routed_experts": routes[i].cuda()}, drv,
                                     mb_index=i, train=True)

    def backward(i):
        phases.append(("B", i, len(log)))
        (-outs[i]["log_probs"].sum()).backward()

    forward(0), forward(1), backward(0), backward(1)
    phases.append(("end", None, len(log)))
    for h in handles:
        h.remove()
    # every queued target was popped by a recomputation
    assert all(not r.router_replay.replay_backward_list for r in _routers(model))
    drv.end_batch()
    n = len(_routers(model))
    for (kind, i, start), (_, _, stop) in zip(phases[:-1], phases[1:]):
        assert stop - start == n, (kind, i, stop - start)  # one routing per MoE layer: first pass or recompute
        for layer_number, experts in log[start:stop]:
            assert torch.equal(experts, _expected(routes[i], packs[i], layer_number - 1)), (kind, i, layer_number)


def test_r3_shrinks_the_rollout_trainer_gap(checkpoint):
    """The rollout (HF bf16) records routes; the trainer (mcore bf16) replays them: its log-probs move toward the
    rollout's wherever a near-tie routed differently."""
    import transformers as tf

    from verl.models.transformers.router_replay import RouterTape

    hf = getattr(tf, tf.AutoConfig.from_pretrained(checkpoint).architectures[0]).from_pretrained(
        checkpoint, dtype=torch.bfloat16).cuda().eval()
    tape = RouterTape(hf)
    mb = _batch(seed=3, lengths=[64, 64, 48, 64, 33, 64])
    bsz, seqlen = mb["input_ids"].shape
    routes = torch.full((bsz, seqlen, tape.shape[0], TOP_K), -1, dtype=torch.int16)
    rollout_lp = torch.zeros(bsz, seqlen)
    with torch.no_grad():
        for b in range(bsz):
            n = int(mb["attention_mask"][b].sum())
            ids = mb["input_ids"][b:b + 1, :n]
            with tape.recording():
                logits = hf(input_ids=ids).logits.float()
            routes[b, :n] = tape.stacked().to(torch.int16).cpu()
            rollout_lp[b, : n - 1] = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()
    tape.remove()

    model, hf_config = mp.build_mcore_from_hf(checkpoint, torch.bfloat16, "cuda", moe_enable_routing_replay=True)
    own = _record(model, hf_config, mb)
    with torch.no_grad():
        free, packed = _forward(model, hf_config, mb)
        drv = MegatronRouterReplay("R3", [model], TOP_K, sequence_parallel=False)
        drv.begin_batch()
        replayed, _ = _forward(model, hf_config, {**mb, "routed_experts": routes.cuda()}, drv)
        drv.end_batch()
    scored = mb["attention_mask"].bool().cpu().clone()
    scored[torch.arange(bsz), mb["attention_mask"].sum(-1).cpu() - 1] = False  # a last token predicts nothing

    def gap(out):
        lp = torch.zeros(bsz * seqlen)
        lp[packed.indices.cpu()] = out["log_probs"][0, : packed.num_real].float().cpu()
        return (lp.view(bsz, seqlen) - rollout_lp).abs()[scored]

    real = mb["attention_mask"].bool().cpu()
    flips = (own[real].sort(-1).values != routes[real].sort(-1).values).any(-1).float().mean().item()
    g_free, g_replay = gap(free), gap(replayed)
    print(f"[router replay] bf16 HF rollout vs bf16 mcore trainer: {flips:.2%} of (token, layer) routes differ; "
          f"|dlogp| max {g_free.max():.3e} -> {g_replay.max():.3e} with R3 "
          f"({g_free.max() / g_replay.max().clamp_min(1e-12):.2f}x), mean {g_free.mean():.3e} -> {g_replay.mean():.3e}")
    assert flips > 0, "no route differed between the rollout and the trainer: nothing for replay to remove"
    assert g_replay.max() < g_free.max()
    assert g_replay.mean() <= g_free.mean()
