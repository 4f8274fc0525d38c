"""GPU checks of speculative decoding with the MTP head (mtp.enable_rollout) in the hf engine: on CUDA the
verification's Gated DeltaNet steps go through this package's Triton recurrent kernel (tiny dims it takes) and the
bonus / plain draws through the fused sampler kernel; greedy output must still equal the plain loop's (CUDA graphs
on, and eager), for dense and MoE, in fp32. Run with ``pytest -m gpu`` (scripts/gpu_rollout.sh does)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FUSED_DIMS = dict(linear_key_head_dim=32, linear_value_head_dim=64)  # dims the Triton decode kernels take


def _run(model, prompts, k, graphs, temperature=0.0, max_new=16):
    from verl.workers.rollout.hf_engine.engine import DecodeEngine, EngineOptions, SeqRequest
    from verl.workers.rollout.hf_engine.runner import PrefillSeq, runner_class
    from verl.workers.rollout.hf_engine.sampling import SamplerConfig

    seqs = [SeqRequest(PrefillSeq(p), key=1000 + i, max_new=max_new) for i, p in enumerate(prompts)]
    opt = EngineOptions(max_num_seqs=3, use_cuda_graph=graphs, num_speculative_tokens=k)
    engine = DecodeEngine(runner_class(model.config)(model, "auto"), SamplerConfig(temperature), [], opt)
    return engine.run(seqs), dict(opt.stats)


@cuda
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_speculative_equals_plain_on_cuda(kind):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5, make_mtp_head_exact

    model = build_tiny_qwen3_5(None, kind=kind, seed=0, with_tokenizer=False, initializer_range=0.2,
                               mtp_num_hidden_layers=1, **FUSED_DIMS).cuda().eval()
    make_mtp_head_exact(model, 0.05)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(30, 120, (n,), generator=g).tolist() for n in (5, 11, 1, 8, 3)]
    base, _ = _run(model, prompts, 0, graphs=True)
    for k in (1, 2):
        spec, stats = _run(model, prompts, k, graphs=True)  # speculative steps run eagerly (a warning)
        assert stats["cuda_graphs"] == 0 and stats["spec_accepted_tokens"] > 0
        for a, b in zip(base, spec):
            assert a.tokens == b.tokens
            assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) < 1e-3
    sampled, stats = _run(model, prompts, 2, graphs=False, temperature=1.0)
    assert all(len(r.tokens) == 16 for r in sampled) and 0 < stats["spec_accept_rate"] <= 1


if __name__ == "__main__":  # the device image may lack pytest
    for kind in ("dense", "moe"):
        test_greedy_speculative_equals_plain_on_cuda(kind)
        print(kind, "ok")
