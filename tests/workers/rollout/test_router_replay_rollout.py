"""The hf rollout records MoE routes (actor_rollout_ref.rollout.enable_rollout_routing_replay): the experts its
own forwards (packed prefill, decode steps, slot moves, shared prefills) chose must be the router's top-k of a
plain HF forward over the same tokens, laid out like input_ids in the batch."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
from verl.models.tiny import tiny_vocab
from verl.protocol import DataProto
from verl.workers.rollout.base import GenerationRequest, SamplingParams
from verl.workers.rollout.batching import generate_sequences
from verl.workers.rollout.hf_rollout import HFRollout

VOCAB = tiny_vocab()


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe():
    return build_tiny_qwen3_5(None, kind="moe", seed=0, with_tokenizer=False, initializer_range=0.3)


def _rollout(model, **cfg):
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=VOCAB["<|im_end|>"])
    conf = {"enforce_eager": True, "enable_rollout_routing_replay": True, **cfg}
    return HFRollout(OmegaConf.create(conf), None, tok, module=model)


def hf_topk(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), moe_layers, k): what each MoE layer's router picked in a plain HF forward (the indices output
    of transformers' router, read with this test's own hooks)."""
    picked = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda m, a, out: picked.append(out[2])) for g in gates]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1)


def test_recorded_routes_equal_the_routers_topk(moe):
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(30, 120, (n,), generator=g).tolist() for n in (5, 11, 3, 8, 6)]
    # 3 slots for 10 sequences: refills, slot moves and prefills shared by the n=2 samples of a prompt
    outs = _rollout(moe, max_num_seqs=3).generate([GenerationRequest(p) for p in ps],
                                                  SamplingParams(n=2, temperature=1.0, max_tokens=9, seed=3))
    n_layers = sum(hasattr(layer.mlp, "gate") for layer in moe.model.layers)
    checked = 0
    for p, samples in zip(ps, outs):
        for o in samples:
            seq = p + o.token_ids
            r = o.routed_experts
            assert r.shape == (len(seq), n_layers, 2)
            want = hf_topk(moe, seq)
            # every token the engine fed to the model; the last sampled token never was (-1)
            assert torch.equal(r[:-1].sort(-1).values.long(), want[:-1].sort(-1).values)
            assert (r[-1] == -1).all()
            checked += len(seq) - 1
    assert checked > 60


def test_routes_off_by_default(moe):
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=VOCAB["<|im_end|>"])
    ro = HFRollout(OmegaConf.create({"enforce_eager": True}), None, tok, module=moe)
    out = ro.generate([GenerationRequest([40, 50, 60])], SamplingParams(temperature=0.0, max_tokens=4))
    assert out[0][0].routed_experts is None


def test_batch_layout_follows_input_ids(moe):
    """routed_experts (B, P + R, layers, k) sits where the tokens sit: left-padded prompt, right-padded
    response; -1 on padding and on the last response token."""
    lens, plen, rlen = (3, 6), 6, 5
    ids = torch.zeros(2, plen, dtype=torch.long)
    mask = torch.zeros(2, plen, dtype=torch.long)
    g = torch.Generator().manual_seed(2)
    for i, n in enumerate(lens):
        ids[i, plen - n:] = torch.randint(30, 120, (n,), generator=g)
        mask[i, plen - n:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                                  meta_info={"response_length": rlen})
    cfg = OmegaConf.create({"enforce_eager": True, "enable_rollout_routing_replay": True, "temperature": 1.0,
                            "top_p": 1.0, "top_k": -1, "response_length": rlen, "do_sample": True})
    ro = _rollout(moe)
    out = generate_sequences(ro, prompts, cfg, eos_ids=[], pad_token_id=0)
    routes = out.batch["routed_experts"]
    assert routes.shape[:2] == out.batch["input_ids"].shape
    for i in range(2):
        real = out.batch["attention_mask"][i].bool()
        seq = out.batch["input_ids"][i][real].tolist()
        want = hf_topk(moe, seq)
        got = routes[i][real]
        assert torch.equal(got[:-1].sort(-1).values.long(), want[:-1].sort(-1).values)
        assert (got[-1] == -1).all() and (routes[i][~real] == -1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recording_inside_cuda_graph_decode():
    """The decode step with recording captured as CUDA graphs (grouped_mm experts route on the device): the
    routes still equal a plain HF forward's top-k (fp32 model, so the two paths agree on every choice)."""
    model = build_tiny_qwen3_5(None, kind="moe", seed=0, with_tokenizer=False, initializer_range=0.3).to("cuda")
    model.set_experts_implementation("grouped_mm")
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(30, 120, (n,), generator=g).tolist() for n in (5, 11, 3, 8, 6)]
    ro = _rollout(model, max_num_seqs=4, enforce_eager=False)
    outs = ro.generate([GenerationRequest(p) for p in ps], SamplingParams(n=2, temperature=1.0, max_tokens=9, seed=3))
    assert ro.last_stats["cuda_graphs"] == 1 and ro.last_stats["graphs"] >= 1
    for p, samples in zip(ps, outs):
        for o in samples:
            seq = p + o.token_ids
            want = hf_topk(model, seq).cpu()
            assert torch.equal(o.routed_experts[:-1].sort(-1).values.long(), want[:-1].sort(-1).values)
