"""benchmarks/step_profile.py (kernel classes, profiled step, memory at the peak) and the benchmarks' smoke runs
with the options scripts/gpu_perf.sh uses (--shapes, --profile), on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import step_profile as sp  # noqa: E402

# Kernel names as they appear in the H200 traces of 2026-11-27 (docs/advance/performance.md)
NAMES = {
    "nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT": "gemm",
    "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal": "gemm",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<256, cutlass": "attention",
    "_fwd_kernel": "log-prob / LM head",
    "_bwd_dlogits_kernel": "log-prob / LM head",
    "kernel_kernel": "gated deltanet",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "gated deltanet",
    "causal_conv1d_bwd_kernel": "gated deltanet",
    "_gdn_decode_step": "gated deltanet",
    "_decode_attn_chunk": "attention",  # an H200 trace of 2026-11-27 (gpu_perf.sh rollout9b)
    "_decode_attn_merge": "attention",
    "_add_rms_norm": "norm",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)":
        "copy / fill",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>":
        "copy / fill",
    "Memcpy DtoD (Device -> Device)": "copy / fill",
    "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::TensorIteratorBase&)":
        "elementwise / other",
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_kernel_class(name):
    assert sp.kernel_class(name) == NAMES[name]


def test_by_class_sums_time_and_launches():
    rows = [{"name": "nvjet_a", "us": 30.0, "count": 3}, {"name": "nvjet_b", "us": 10.0, "count": 1},
            {"name": "_add_rms_norm", "us": 60.0, "count": 6}]
    out = sp.by_class(rows, 100.0)
    assert [(c["class"], c["us"], c["count"]) for c in out] == [("norm", 60.0, 6), ("gemm", 40.0, 4)]
    assert out[0]["share"] == pytest.approx(0.6)


def test_profile_kernels_writes_a_trace_and_tables(tmp_path):
    w = torch.randn(64, 64, requires_grad=True)

    def step():
        (torch.relu(torch.randn(32, 64) @ w) ** 2).sum().backward()

    prof = sp.profile_kernels(step, torch.device("cpu"), str(tmp_path), "tiny", top=5)
    assert Path(prof["trace"]).exists() and prof["trace"].endswith(".json.gz")
    assert prof["summary"]["kind"] == "cpu_op" and 0 < len(prof["summary"]["rows"]) <= 5
    assert "aten::" in prof["table"] and "device time by kernel class" in prof["class_table"]
    mem = sp.memory_at_peak(step, torch.device("cpu"))  # no allocator history on the CPU: runs and says so
    assert mem["sites"] == [] and "CPU" in mem["table"]


def _run(args, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_actor_bench_shapes_and_profiles(tmp_path):
    out = _run(["benchmarks/bench_actor_throughput.py", "--smoke", "--impls", "packed_torch", "--shapes",
                "35b-a3b,35b-a3b-dense", "--profile", str(tmp_path / "prof"), "--json", str(tmp_path / "a.json")])
    assert "time per token, 35b-a3b:packed_torch / 35b-a3b-dense:packed_torch" in out
    s = json.loads((tmp_path / "a.json").read_text())
    assert set(s["results"]) == {"35b-a3b:packed_torch", "35b-a3b-dense:packed_torch"}
    moe, dense = s["shapes"]["35b-a3b"], s["shapes"]["35b-a3b-dense"]
    assert moe["params"] > dense["params"]  # 8 experts against one MLP of the same active width
    # the dense twin does the same work per token as the MoE's active experts (routers aside)
    assert dense["train_flops_useful"] == pytest.approx(moe["train_flops_useful"], rel=0.05)
    assert set(s["profiles"]) == set(s["results"])
    assert len(list((tmp_path / "prof").glob("*.json.gz"))) == 2


def test_rollout_bench_profiles_the_decode_steps(tmp_path):
    out = _run(["benchmarks/bench_rollout.py", "--smoke", "--cases", "fixed", "--vllm", "off", "--profile",
                str(tmp_path), "--profile-tokens", "6"])
    assert "hf_engine::decode ranges" in out and "hf_engine::prefill ranges" in out


def test_rollout_bench_times_one_decode_step():
    out = _run(["benchmarks/bench_rollout.py", "--smoke", "--cases", "step", "--vllm", "off"])
    assert "one decode step, 12 tokens per slot in 40-token allocations" in out and "| 4 | engine |" in out


def test_weight_handoff_bench_runs():
    out = _run(["benchmarks/bench_weight_handoff.py", "--smoke", "--repeat", "1"])
    assert "| list |" in out and "| package |" in out


def test_9b_shapes_are_qwen3_5_9b():
    """Both benchmarks' 9B shape is Qwen3_5TextConfig's defaults (the real 9B), apart from the tokenizer ids."""
    import transformers as tf

    import bench_actor_throughput as actor
    import bench_rollout as rollout
    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    real = tf.Qwen3_5TextConfig().to_dict()
    skip = {"pad_token_id", "eos_token_id", "bos_token_id", "architectures"}
    for cfg in (actor.shape_config("9b", False, None), tf.Qwen3_5TextConfig(**tiny_text_config_kwargs(
            **rollout.SHAPE_9B))):
        got = cfg.to_dict()
        assert {k: (v, got[k]) for k, v in real.items() if k not in skip and got.get(k) != v} == {}


@pytest.mark.parametrize("tied", [True, False])
def test_decode_bytes_counts_weights_state_and_kv(tied):
    """Every weight once (an untied input embedding only for the batch's rows; a tied one is the LM head, read
    whole), the recurrent state read and written, the keys and values over the context read."""
    import transformers as tf

    import bench_rollout as rollout
    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    cfg = tf.Qwen3_5TextConfig(**tiny_text_config_kwargs(**dict(rollout.SHAPE_SMOKE, tie_word_embeddings=tied)))
    model = tf.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    emb = model.get_input_embeddings().weight
    b, ctx = 3, 10
    params = sum(p.numel() for p in model.parameters())  # bf16: 2 bytes each
    n_lin, n_full = cfg.layer_types.count("linear_attention"), cfg.layer_types.count("full_attention")
    assert n_lin and n_full
    want = 2 * (params if tied else params - emb.numel() + b * emb.shape[1])
    want += n_lin * b * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4 * 2
    want += n_full * b * ctx * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    assert rollout.decode_bytes(model, b, ctx, 4) == want


def test_decode_bytes_reads_only_the_experts_a_batch_picks(monkeypatch):
    """A MoE shape: the routed experts count at the expected share a batch's tokens pick (top-k of E each,
    uniform), everything else as for a dense model; the 35b-a3b rollout shape is the scale script's."""
    import bench_rollout as rollout

    model = rollout.build_model("tiny_moe", "cpu", torch.bfloat16)
    cfg = model.config
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM" and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n) * 2  # bf16
    assert routed
    for b in (1, 3, 64):
        moe = rollout.decode_bytes(model, b, 10, 4)
        with monkeypatch.context() as m:
            m.setattr(cfg, "num_experts", 0)  # as if every expert were read
            every = rollout.decode_bytes(model, b, 10, 4)
        assert moe == pytest.approx(every - routed * (1 - 2 / 8) ** b)
    assert rollout.SHAPES["35b-a3b"] == "35b_a3b"
