"""Ulysses SP=2 (two gloo processes) equals SP=1 for log-probs and gradients, text and VL, plain and fused."""

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from qwen35_test_utils import make_image_sample, packed_positions, patched_copy, random_ids
from tests.engine_utils import rank_report, spawn_ranks
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
from verl.utils import ulysses as uly

WORLD = 2


def _next_token_lp(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)


def _text_case(model, sp_on, fused):
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 4, 12]  # 23 tokens: ulysses_pad adds one pad token for SP=2
    ids = torch.cat([random_ids(n, gen) for n in lengths], 1)
    pos = packed_positions(lengths)
    labels = torch.roll(ids, -1, -1)
    sp_size = WORLD if sp_on else 1
    m = patched_copy(model, ulysses_sp_size=sp_size, use_fused_kernels=fused, fused_kernels_backend="torch")
    m.zero_grad()
    if sp_on:
        ids_in, pos_in, pad = uly.ulysses_pad_and_slice_inputs(ids, pos, sp_size=WORLD)
        labels_in, _, _ = uly.ulysses_pad_and_slice_inputs(labels, None, sp_size=WORLD)
    else:
        ids_in, pos_in, pad, labels_in = ids, pos, 0, labels
    if fused:
        # Sliced ids without shift_labels: the model must roll over the whole row, not within its shard.
        out = m(input_ids=ids_in, position_ids=pos_in, attention_mask=None, use_cache=False, temperature=0.9)
        local = out.log_probs
    else:
        logits = m(input_ids=ids_in, position_ids=pos_in, attention_mask=None, use_cache=False).logits
        local = _next_token_lp(logits / 0.9, labels_in)
    lp = uly.gather_outputs_and_unpad(local, gather_dim=-1, unpad_dim=-1, padding_size=pad)
    # The row's last token has no next token; its wrapped label differs once the row is padded. Drop it.
    return lp[..., :-1], m


def _vl_case(model, sp_on):
    gen = torch.Generator().manual_seed(1)
    samples = [make_image_sample(2, (1, 4, 4), 3, gen), make_image_sample(1, (1, 4, 8), 2, gen)]
    ids = torch.cat([s["input_ids"] for s in samples], 1)
    lengths = [s["input_ids"].shape[1] for s in samples]
    pos = torch.cat(
        [
            model.model.get_rope_index(
                input_ids=s["input_ids"], mm_token_type_ids=s["mm_token_type_ids"], image_grid_thw=s["image_grid_thw"]
            )[0]
            for s in samples
        ],
        -1,
    )
    pos = torch.cat([packed_positions(lengths)[None], pos], 0)  # (4, 1, T)
    labels = torch.roll(ids, -1, -1)
    m = patched_copy(model, ulysses_sp_size=WORLD if sp_on else 1)
    m.zero_grad()
    if sp_on:
        # VL: full (padded) ids and positions; the model slices after merging image embeddings.
        ids_in, pos_in, pad = uly.ulysses_pad(ids, pos, sp_size=WORLD)
        labels_in, _, _ = uly.ulysses_pad_and_slice_inputs(labels, None, sp_size=WORLD)
    else:
        ids_in, pos_in, pad, labels_in = ids, pos, 0, labels
    logits = m(
        input_ids=ids_in,
        position_ids=pos_in,
        attention_mask=None,
        use_cache=False,
        pixel_values=torch.cat([s["pixel_values"] for s in samples]),
        image_grid_thw=torch.cat([s["image_grid_thw"] for s in samples]),
    ).logits
    lp = uly.gather_outputs_and_unpad(_next_token_lp(logits, labels_in), gather_dim=-1, unpad_dim=-1, padding_size=pad)
    return lp, m


def _check(run):
    uly.set_ulysses_sequence_parallel_group(None)
    ref_lp, ref_m = run(False)
    (ref_lp * torch.linspace(-1, 1, ref_lp.shape[-1])).sum().backward()
    uly.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    lp, m = run(True)
    torch.testing.assert_close(lp, ref_lp.detach(), atol=1e-5, rtol=0)
    (lp * torch.linspace(-1, 1, lp.shape[-1])).sum().backward()
    for (name, p_ref), (_, p) in zip(ref_m.named_parameters(), m.named_parameters()):
        if p_ref.grad is None:
            continue
        # Data-parallel averaging over the SP ranks, as FSDP does (gather_outputs_and_unpad scales by sp).
        g = p.grad.clone()
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(g, p_ref.grad, atol=1e-5, rtol=1e-4, msg=lambda s: f"{name}: {s}")
    uly.set_ulysses_sequence_parallel_group(None)


def _worker(rank, init_file, result_dir):
    torch.set_num_threads(1)
    # A bounded timeout: a rank whose check raised still meets its peer at the exit barrier, and a peer
    # stuck in a collective the other rank never entered fails in minutes instead of hanging CI.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    with rank_report(result_dir, rank):
        for kind in ("dense", "moe"):
            model = build_tiny_qwen3_5(None, kind=kind, seed=0, with_tokenizer=False)
            _check(lambda sp, m=model: _text_case(m, sp, fused=False))
        _check(lambda sp, m=model: _text_case(m, sp, fused=True))
        vl = build_tiny_qwen3_5(None, kind="vl", seed=0, with_tokenizer=False)
        _check(lambda sp: _vl_case(vl, sp))


def test_ulysses_sp2_matches_sp1():
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_worker, WORLD, tmp)


def test_pad_and_slice_helpers_without_group():
    ids = torch.arange(5)[None]
    pos = torch.arange(5)[None]
    out_ids, out_pos, pad = uly.ulysses_pad_and_slice_inputs(ids, pos, sp_size=1)
    assert pad == 0 and out_ids is ids
    padded_ids, padded_pos, pad = uly.ulysses_pad(ids, pos.expand(3, 1, 5), sp_size=4)
    assert pad == 3 and padded_ids.shape[-1] == 8 and padded_pos[:, 0, 5:].tolist() == [[0, 1, 2]] * 3
    assert uly.get_ulysses_sequence_parallel_world_size() == 1
    with pytest.raises(ValueError):
        uly.validate_ulysses_config(6, 4)
