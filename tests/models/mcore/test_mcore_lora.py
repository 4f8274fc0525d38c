"""LoRA on megatron-core's tensor-parallel linears (verl/models/mcore/lora.py).

* Two adapted linears (column then row) at TP=1 and TP=2 (gloo, 2 processes) equal a plain torch reference of
  ``x W^T + (alpha/r) x A^T B^T`` per layer, outputs and the adapters' gradients (gathered to full matrices); the
  adapter starts the same at both TP sizes; the base weights are frozen; ``lora_disabled`` gives the base output;
  ``export_data`` is this rank's shard of the merged weight.
* The Qwen3.5 megatron-core model with adapters on every linear (random B) gives the log-probs of the Hugging Face
  model loaded with the exported (merged) weights.

Needs megatron-core (skipped where it does not import: the CPU CI); runs on a CPU with megatron-core's source on
PYTHONPATH (``PYTHONPATH=$PWD:<mcore>:<triton> pytest tests/models/mcore/test_mcore_lora.py``) and on the GPU
machine. Sequence parallelism (reduce-scatter / all-gather of the r-wide activations) needs NCCL: it runs in the
GPU engine test, not here.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the mcore extra)")

IN, MID, R, ALPHA = 16, 24, 4, 8.0


def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


def _reference(x):
    """Plain torch: the two layers' full weights and adapters (A as the adapter draws it, B as the test sets it)."""
    from verl.models.mcore.lora import LoRASettings, _fresh_a

    s = LoRASettings(rank=R, alpha=ALPHA)
    w1, w2 = _full(1, MID, IN), _full(2, IN, MID)
    a1, a2 = _fresh_a("fc1", (R, IN), s), _fresh_a("fc2", (R, MID), s)
    b1, b2 = _full(3, MID, R), _full(4, IN, R)
    params = [p.requires_grad_(True) for p in (a1, b1, a2, b2)]
    h = x @ w1.t() + s.scaling * (x @ a1.t()) @ b1.t()
    y = h @ w2.t() + s.scaling * (h @ a2.t()) @ b2.t()
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return y.detach(), {n: p.grad for n, p in zip(("fc1.lora_A", "fc1.lora_B", "fc2.lora_A", "fc2.lora_B"), params)}


def _worker(rank, tp, out_file, port):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from verl.models.mcore.lora import LoRASettings, apply_lora, export_data, lora_disabled

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=4, params_dtype=torch.float32,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp)
    init = torch.nn.init.zeros_
    model = torch.nn.Module()
    model.fc1 = ColumnParallelLinear(IN, MID, config=cfg, init_method=init, bias=False, gather_output=False)
    model.fc2 = RowParallelLinear(MID, IN, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                                  skip_bias_add=True)
    rows, cols = slice(rank * MID // tp, (rank + 1) * MID // tp), slice(rank * MID // tp, (rank + 1) * MID // tp)
    with torch.no_grad():
        model.fc1.weight.copy_(_full(1, MID, IN)[rows])
        model.fc2.weight.copy_(_full(2, IN, MID)[:, cols])
    adapted = apply_lora([model], LoRASettings(rank=R, alpha=ALPHA), global_name=lambda vp, name: name)
    assert sorted(adapted) == ["fc1", "fc2"]
    assert not model.fc1.weight.requires_grad and model.fc1.lora_A.requires_grad
    with torch.no_grad():
        assert model.fc1.lora_B.abs().sum() == 0  # a fresh adapter leaves the model as it was
        model.fc1.lora_B.copy_(_full(3, MID, R)[rows])
        model.fc2.lora_B.copy_(_full(4, IN, R))
    x = _full(5, 6, 1, IN)  # [S, B, H]

    def run():
        h, _ = model.fc1(x)
        y, _ = model.fc2(h)
        return y

    y = run()
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    with lora_disabled([model]):
        base = run().detach()

    def gather(t, dim):
        if tp == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim)

    result = {
        "y": y.detach(), "base": base,
        "fc1.lora_A": model.fc1.lora_A.grad, "fc1.lora_B": gather(model.fc1.lora_B.grad, 0),
        "fc2.lora_A": gather(model.fc2.lora_A.grad, 1), "fc2.lora_B": model.fc2.lora_B.grad,
        "merged1": gather(export_data(model.fc1.weight), 0), "merged2": gather(export_data(model.fc2.weight), 1),
        "a1": model.fc1.lora_A.detach(), "a2": gather(model.fc2.lora_A.detach(), 1),
    }
    if rank == 0:
        torch.save(result, out_file)
    dist.barrier()
    dist.destroy_process_group()


def _run(tp):
    import torch.multiprocessing as mp

    out = os.path.join(tempfile.mkdtemp(), "out.pt")
    port = 29600 + (os.getpid() + tp) % 300
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, tp, out, port)) for r in range(tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return torch.load(out)


@pytest.mark.parametrize("tp", [1, 2])
def test_adapted_linears_equal_the_dense_reference(tp):
    from verl.models.mcore.lora import LoRASettings, _fresh_a

    got = _run(tp)
    x = _full(5, 6, 1, IN)
    want_y, want_grads = _reference(x)
    torch.testing.assert_close(got["y"], want_y, atol=1e-5, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(got[name], g, atol=1e-5, rtol=1e-5, msg=name)
    s = LoRASettings(rank=R, alpha=ALPHA)
    a1, a2 = _fresh_a("fc1", (R, IN), s), _fresh_a("fc2", (R, MID), s)
    torch.testing.assert_close(got["a1"], a1)  # the same adapter at every TP size
    torch.testing.assert_close(got["a2"], a2)
    w1, w2 = _full(1, MID, IN), _full(2, IN, MID)
    base = (x @ w1.t()) @ w2.t()
    torch.testing.assert_close(got["base"], base, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["merged1"], w1 + s.scaling * _full(3, MID, R) @ a1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got["merged2"], w2 + s.scaling * _full(4, IN, R) @ a2, atol=1e-6, rtol=1e-6)


def test_unknown_target_and_empty_selection_are_refused():
    import mcore_parity as mp
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from verl.models.mcore.lora import LoRASettings, apply_lora

    mp.init_single_process("cpu")
    cfg = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=4, params_dtype=torch.float32,
                            use_cpu_initialization=True)
    model = torch.nn.Module()
    model.linear_qkv = ColumnParallelLinear(IN, MID, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                                            gather_output=False)
    with pytest.raises(ValueError, match=r"names \['q_proj'\].*linear_qkv"):
        apply_lora([model], LoRASettings(rank=R, alpha=ALPHA, targets=("q_proj",)))
    with pytest.raises(ValueError, match="selects no linear"):
        apply_lora([model], LoRASettings(rank=R, alpha=ALPHA, excludes=("linear_qkv",)))


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="megatron-core's MoE router needs CUDA"))])
def test_qwen3_5_with_adapters_equals_hf_with_the_merged_weights(tmp_path, kind):
    import transformers as tf

    import mcore_parity as mp
    from verl.models.mcore.lora import LoRASettings, apply_lora, export_data, is_lora_param
    from verl.models.qwen3_5.mcore.weight_converter import to_hf_stream
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mp.init_single_process(device)
    path = str(tmp_path / kind)
    build_tiny_qwen3_5(None, kind=kind, seed=3, with_tokenizer=False).save_pretrained(path)
    extra = {} if kind == "dense" else dict(moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
    model, hf_config = mp.build_mcore_from_hf(path, torch.float32, device, **extra)
    adapted = apply_lora([model], LoRASettings(rank=R, alpha=ALPHA), global_name=lambda vp, name: name)
    leaves = {n.rsplit(".", 1)[-1] for n in adapted}
    assert {"linear_qkv", "linear_proj", "in_proj", "out_proj", "linear_fc1", "linear_fc2"} <= leaves, leaves
    assert not any("router" in n or "output_layer" in n for n in adapted)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    seqs, ids, pos, cu, params = mp.packed_batch([11, 5, 17], 30, 120, device)
    lp, _, _ = mp.mcore_packed_log_probs(model, hf_config, ids, pos, cu, params)
    from verl.models.mcore.lora import lora_disabled

    with lora_disabled([model]):
        lp_base, _, _ = mp.mcore_packed_log_probs(model, hf_config, ids, pos, cu, params)
    moved = max((a - b).abs().max().item() for a, b in zip(lp, lp_base))
    assert moved > 1e-3, f"the adapters move the log-probs by only {moved:.2e}"
    merged = ((n, export_data(p)) for n, p in model.named_parameters() if not is_lora_param(n))
    hf_state = dict(to_hf_stream(merged, hf_config, tp_size=1, etp_size=1, expert_format="fused"))
    hf = getattr(tf, hf_config.architectures[0]).from_pretrained(path, dtype=torch.float32).to(device).eval()
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    assert not unexpected and not [m for m in missing if "lm_head" not in m], (missing, unexpected)
    with torch.no_grad():
        for s, want in zip(seqs, lp):
            s = s.to(device)
            logits = hf(input_ids=s[None]).logits.float()
            got = torch.log_softmax(logits[0, :-1], -1).gather(-1, s[1:, None])[:, 0]
            torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=0)
