"""``vocab_parallel_log_probs`` (the Megatron actor's log-prob / entropy head) against a plain fp64 reference.

* one rank (a stand-in group of size 1): values and gradients for fp32 and bf16 logits, leading dims [B, S],
  labels at the vocabulary's edges, with and without entropy, and the sub-chunk loop shrunk so that several
  sub-chunks and a ragged tail run;
* memory: what the autograd Function saves for backward, and how many fp32 vocabulary-wide buffers are alive at
  once (autograd through plain ops saved fp32 copies and held four such tensors at once);
* two gloo ranks, each holding half the vocabulary: values, the concatenated logits gradients, and
  ``hidden_to_log_probs`` (checkpointed chunks, megatron's default tensor group) with hidden / weight gradients.

Runs on a CPU where megatron-core imports.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import weakref

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the mcore extra)")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import verl.models.qwen3_5.mcore.forward as fwd  # noqa: E402

B, S, V = 3, 7, 40


class _OneRank:
    """The two methods the function asks of a process group, for a group of one rank."""

    def size(self):
        return 1

    def rank(self):
        return 0


def _inputs(dtype, seed=0, b=B, s=S, v=V):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, s, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, 0], labels[0, 1], labels[-1, -1] = 0, v - 1, v - 1  # the shard's edges
    grad_lp = torch.randn(b, s, generator=g)
    grad_ent = torch.randn(b, s, generator=g)
    return logits, labels, grad_lp, grad_ent


def _reference(logits, labels, grad_lp, grad_ent, calculate_entropy):
    """fp64 log_softmax gather and -(softmax * log_softmax).sum, differentiated by autograd."""
    x = logits.detach().double().requires_grad_(True)
    log_sm = torch.log_softmax(x, -1)
    lp = log_sm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(log_sm.exp() * log_sm).sum(-1)
    loss = (lp * grad_lp.double()).sum()
    if calculate_entropy:
        loss = loss + (ent * grad_ent.double()).sum()
    loss.backward()
    return lp.detach(), ent.detach(), x.grad


def _run(logits, labels, grad_lp, grad_ent, calculate_entropy, group=None):
    x = logits.clone().requires_grad_(True)
    lp, ent = fwd.vocab_parallel_log_probs(x, labels, _OneRank() if group is None else group,
                                           calculate_entropy=calculate_entropy)
    loss = (lp * grad_lp).sum()
    if calculate_entropy:
        loss = loss + (ent * grad_ent).sum()
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), x.grad


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@pytest.mark.parametrize("calculate_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sub_rows", [None, 4])  # None: the module's own sub-chunk (one for these sizes)
def test_one_rank_matches_fp64_reference(monkeypatch, dtype, calculate_entropy, sub_rows):
    if sub_rows is not None:
        monkeypatch.setattr(fwd, "SUB_CHUNK_ELEMENTS", sub_rows * V)  # 21 rows: five sub-chunks of 4, tail of 1
    logits, labels, grad_lp, grad_ent = _inputs(dtype)
    before = logits.clone()
    lp, ent, grad = _run(logits, labels, grad_lp, grad_ent, calculate_entropy)
    # the reference starts from the same (possibly bf16-rounded) logits: only the arithmetic differs
    ref_lp, ref_ent, ref_grad = _reference(logits, labels, grad_lp, grad_ent, calculate_entropy)
    assert lp.shape == (B, S) and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=1e-5)
    if calculate_entropy:
        assert ent.shape == (B, S) and ent.dtype == torch.float32
        torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)
    else:
        assert ent is None
    assert grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(grad.double(), ref_grad, **TOL[dtype])
    assert torch.equal(logits, before)  # the fp32 path works on copies, never in the caller's tensor


def test_one_output_unused(monkeypatch):
    """Only the entropy (or only the log-prob) reaches the loss: the other upstream gradient is None."""
    monkeypatch.setattr(fwd, "SUB_CHUNK_ELEMENTS", 5 * V)
    logits, labels, grad_lp, grad_ent = _inputs(torch.float32, seed=1)
    zero = torch.zeros_like(grad_lp)
    for use_lp, use_ent in ((False, True), (True, False)):
        x = logits.clone().requires_grad_(True)
        lp, ent = fwd.vocab_parallel_log_probs(x, labels, _OneRank(), calculate_entropy=True)
        ((lp * grad_lp).sum() if use_lp else (ent * grad_ent).sum()).backward()
        _, _, ref = _reference(logits, labels, grad_lp if use_lp else zero, grad_ent if use_ent else zero, True)
        torch.testing.assert_close(x.grad.double(), ref, atol=2e-5, rtol=1e-5)


def test_values_match_without_autograd():
    logits, labels, _, _ = _inputs(torch.bfloat16, seed=2)
    with torch.no_grad():
        lp, ent = fwd.vocab_parallel_log_probs(logits, labels, _OneRank(), calculate_entropy=True)
    ref_lp, ref_ent, _ = _reference(logits, labels, torch.zeros(B, S), torch.zeros(B, S), True)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------ memory
def test_saves_only_the_input_logits_vocabulary_wide():
    """What autograd keeps between forward and backward: the bf16 logits as given, labels, and per-token fp32
    scalars. The plain-ops version saved fp32 [tokens x V] tensors (exp, shifted) here."""
    logits, labels, _, _ = _inputs(torch.bfloat16, seed=3)
    x = logits.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = fwd.vocab_parallel_log_probs(x, labels, _OneRank(), calculate_entropy=True)
    wide = [t for t in saved if t.numel() >= V]
    assert len(wide) == 1 and wide[0].dtype == torch.bfloat16 and wide[0].data_ptr() == x.data_ptr(), \
        [(tuple(t.shape), t.dtype) for t in wide]
    others = [t for t in saved if t is not wide[0]]
    assert all(t.numel() <= B * S for t in others), [(tuple(t.shape), t.dtype) for t in others]
    (lp.sum() + ent.sum()).backward()  # the saved set is enough for the backward


class _Fp32WideTracker(TorchDispatchMode):
    """Watches every op's fp32 outputs whose last dim is the vocabulary: the largest one, and the most distinct
    storages alive at once (views keep their storage alive, so every output is tracked by a weak reference)."""

    def __init__(self, v):
        super().__init__()
        self.v, self.refs, self.max_numel, self.max_live = v, [], 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 1 and t.shape[-1] == self.v:
                self.max_numel = max(self.max_numel, t.numel())
                self.refs.append(weakref.ref(t))
        live = {r().untyped_storage().data_ptr() for r in self.refs if r() is not None}
        self.max_live = max(self.max_live, len(live))
        return out


@pytest.mark.parametrize("calculate_entropy", [False, True])
def test_at_most_two_fp32_sub_chunk_buffers(monkeypatch, calculate_entropy):
    sub = 4
    monkeypatch.setattr(fwd, "SUB_CHUNK_ELEMENTS", sub * V)
    logits, labels, grad_lp, grad_ent = _inputs(torch.bfloat16, seed=4)
    x = logits.clone().requires_grad_(True)
    tracker = _Fp32WideTracker(V)
    with tracker:
        lp, ent = fwd.vocab_parallel_log_probs(x, labels, _OneRank(), calculate_entropy=calculate_entropy)
        loss = (lp * grad_lp).sum() + ((ent * grad_ent).sum() if calculate_entropy else 0)
        loss.backward()
    assert tracker.refs, "the tracker saw no fp32 vocabulary-wide tensor: it is not watching the ops"
    assert tracker.max_numel <= sub * V, f"an fp32 tensor of {tracker.max_numel // V} rows (sub-chunk: {sub})"
    assert tracker.max_live <= (2 if calculate_entropy else 1), tracker.max_live
    assert x.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------- two ranks
TP, LOCAL_V, H = 2, 24, 8


def _head_inputs():
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(S, B, H, generator=g, dtype=torch.float64)  # [S, B, H], as megatron's layout
    weight = torch.randn(TP * LOCAL_V, H, generator=g, dtype=torch.float64)
    return hidden, weight


class _Head(torch.nn.Module):
    """The parts of the mcore GPT model that ``hidden_to_log_probs`` reads."""

    def __init__(self, weight_shard):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(sequence_parallel=False)
        self.output_layer = torch.nn.Module()
        self.output_layer.weight = torch.nn.Parameter(weight_shard)

    def output_weight(self):
        return None


def _tp_checks(rank, group):
    from megatron.core import parallel_state

    fwd.SUB_CHUNK_ELEMENTS = 3 * LOCAL_V  # several sub-chunks per rank
    own = slice(rank * LOCAL_V, (rank + 1) * LOCAL_V)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, labels, grad_lp, grad_ent = _inputs(dtype, seed=5, v=TP * LOCAL_V)
        labels[1, 0], labels[1, 1] = LOCAL_V - 1, LOCAL_V  # either side of the shard boundary
        for ent in (False, True):
            # an explicit sub-group, and megatron's default tensor group
            for name, grp in (("group", group), ("default", None)):
                x = logits[..., own].clone().requires_grad_(True)
                lp, e = fwd.vocab_parallel_log_probs(x, labels, grp, calculate_entropy=ent)
                ((lp * grad_lp).sum() + ((e * grad_ent).sum() if ent else 0)).backward()
                out[(str(dtype), ent, name)] = (lp.detach(), None if e is None else e.detach(), x.grad)

    # the LM head under checkpointed chunks of 3 tokens; the hidden's gradient is summed over the tensor ranks
    # by megatron's copy-to-tensor-parallel-region backward
    hidden, weight = _head_inputs()
    g = torch.Generator().manual_seed(12)
    labels = torch.randint(0, TP * LOCAL_V, (B, S), generator=g)
    labels[0, 0], labels[0, 1], labels[1, 0] = LOCAL_V - 1, LOCAL_V, TP * LOCAL_V - 1
    grad_lp, grad_ent = torch.randn(B, S, generator=g), torch.randn(B, S, generator=g)
    head = _Head(weight[own].float().clone())
    h = hidden.float().clone().requires_grad_(True)
    with torch.enable_grad():
        lp, e = fwd.hidden_to_log_probs(head, h, labels, temperature=0.7, calculate_entropy=True, chunk_size=3)
    assert parallel_state.get_tensor_model_parallel_world_size() == TP
    ((lp * grad_lp).sum() + (e * grad_ent).sum()).backward()
    out["head"] = (lp.detach(), e.detach(), h.grad, head.output_layer.weight.grad)
    return out


def _tp_worker(rank, init_file, result_dir):
    import torch.distributed as dist

    from tests.engine_utils import rank_report

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP,
                            timeout=datetime.timedelta(seconds=120))
    with rank_report(result_dir, rank):
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
        group = dist.new_group(list(range(TP)))
        torch.save(_tp_checks(rank, group), os.path.join(result_dir, f"out{rank}.pt"))
        parallel_state.destroy_model_parallel()


def test_two_ranks_match_the_full_vocabulary_reference():
    from tests.engine_utils import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_tp_worker, TP, tmp)
        outs = [torch.load(os.path.join(tmp, f"out{r}.pt")) for r in range(TP)]

    for dtype in (torch.float32, torch.bfloat16):
        logits, labels, grad_lp, grad_ent = _inputs(dtype, seed=5, v=TP * LOCAL_V)
        labels[1, 0], labels[1, 1] = LOCAL_V - 1, LOCAL_V
        for ent in (False, True):
            ref_lp, ref_ent, ref_grad = _reference(logits, labels, grad_lp, grad_ent, ent)
            for name in ("group", "default"):
                key = (str(dtype), ent, name)
                for rank in range(TP):  # every rank holds the whole result
                    lp, e, _ = outs[rank][key]
                    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=1e-5, msg=str(key))
                    if ent:
                        torch.testing.assert_close(e.double(), ref_ent, atol=2e-5, rtol=1e-5, msg=str(key))
                    else:
                        assert e is None
                grad = torch.cat([outs[r][key][2] for r in range(TP)], -1)
                assert grad.dtype == dtype
                torch.testing.assert_close(grad.double(), ref_grad, **TOL[dtype], msg=str(key))

    # the head: log-probs of (hidden @ W.T) / T, and gradients wrt hidden and each rank's rows of W
    hidden, weight = _head_inputs()
    g = torch.Generator().manual_seed(12)
    labels = torch.randint(0, TP * LOCAL_V, (B, S), generator=g)
    labels[0, 0], labels[0, 1], labels[1, 0] = LOCAL_V - 1, LOCAL_V, TP * LOCAL_V - 1
    grad_lp, grad_ent = torch.randn(B, S, generator=g), torch.randn(B, S, generator=g)
    h = hidden.float().double().requires_grad_(True)
    w = weight.float().double().requires_grad_(True)
    log_sm = torch.log_softmax((h @ w.T) / 0.7, -1).transpose(0, 1)  # [B, S, V]
    ref_lp = log_sm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_sm.exp() * log_sm).sum(-1)
    ((ref_lp * grad_lp.double()).sum() + (ref_ent * grad_ent.double()).sum()).backward()
    for rank in range(TP):
        lp, e, h_grad, _ = outs[rank]["head"]
        assert lp.shape == (B, S) and e.shape == (B, S)
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(e.double(), ref_ent.detach(), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(h_grad.double(), h.grad, atol=1e-4, rtol=1e-4)
    w_grad = torch.cat([outs[r]["head"][3] for r in range(TP)], 0)
    torch.testing.assert_close(w_grad.double(), w.grad, atol=1e-4, rtol=1e-4)
