import math

import pytest
import torch

from verl.utils import torch_functional as tf


def test_logprobs_match_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64) * 5
    labels = torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    out = tf.logprobs_from_logits(logits, labels)
    assert out.shape == (2, 5) and out.dtype == torch.float64
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(tf.logprobs_from_logits_naive(logits, labels), expected)


def test_logprobs_chunked_path_stable_and_differentiable(monkeypatch):
    # force several row blocks and use huge logits that overflow a naive exp()
    monkeypatch.setattr(tf, "_LOGPROB_CHUNK_ELEMENTS", 8)
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0], [5.0, 3.0, 1.0]], requires_grad=True)
    labels = torch.tensor([0, 1, 2])
    out = tf.logprobs_from_logits(logits, labels)
    lse3 = math.log(math.exp(5) + math.exp(3) + math.exp(1))
    torch.testing.assert_close(out.detach(), torch.tensor([0.0, -math.log(3.0), 1.0 - lse3]))
    out.sum().backward()
    # d/dz log softmax(z)_y = onehot(y) - softmax(z)
    expected_grad = torch.nn.functional.one_hot(labels, 3).float() - torch.softmax(logits.detach(), dim=-1)
    torch.testing.assert_close(logits.grad, expected_grad)


def test_logprobs_bf16_returns_fp32_and_shape_error():
    logits = torch.randn(3, 7).to(torch.bfloat16)
    labels = torch.tensor([1, 2, 3])
    out = tf.logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="labels must have the shape"):
        tf.logprobs_from_logits(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_uniform_and_chunked():
    logits = torch.zeros(3, 4)
    torch.testing.assert_close(tf.entropy_from_logits(logits), torch.full((3,), math.log(4)))
    # one-hot-ish distribution has ~0 entropy
    assert tf.entropy_from_logits(torch.tensor([[100.0, 0.0]])).item() < 1e-6
    x = torch.randn(5, 9)
    torch.testing.assert_close(tf.entropy_from_logits_with_chunking(x, chunk_size=2), tf.entropy_from_logits(x))


def test_masked_stats_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert tf.masked_sum(values, mask).item() == 10.0  # NaN outside the mask is ignored
    assert tf.masked_mean(values, mask).item() == pytest.approx(2.5)
    torch.testing.assert_close(tf.masked_mean(values, mask, axis=1), torch.tensor([2.0, 4.0]))
    # unbiased var of {1,2,3,4}: mean 2.5, squared deviations 2.25+0.25+0.25+2.25=5 -> 5/3
    assert tf.masked_var(values, mask).item() == pytest.approx(5 / 3, rel=1e-5)
    assert tf.masked_var(values, mask, unbiased=False).item() == pytest.approx(5 / 4, rel=1e-5)
    with pytest.raises(ValueError, match="mask is one"):
        tf.masked_var(values, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="At least one"):
        tf.masked_var(values, torch.zeros(2, 3))


def test_masked_whiten_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 50.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    std = math.sqrt(5 / 3)
    expected = (values - 2.5) / std
    out = tf.masked_whiten(values, mask)
    torch.testing.assert_close(out[:4], expected[:4], rtol=1e-5, atol=1e-5)
    out_keep_mean = tf.masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(out_keep_mean[:4], expected[:4] + 2.5, rtol=1e-5, atol=1e-5)


def test_get_response_mask_single_and_multi_eos():
    ids = torch.tensor([[20, 10, 34, 1, 0, 0], [78, 0, 76, 2, 1, 0], [23, 98, 45, 9, 8, 7]])
    assert tf.get_response_mask(ids, eos_token=1).tolist() == [
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]
    multi = tf.get_response_mask(ids, eos_token=[1, 2], dtype=torch.bool)
    assert multi.dtype == torch.bool
    assert multi.int().tolist()[1] == [1, 1, 1, 1, 0, 0]


def test_padding_helpers():
    out = tf.pad_2d_list_to_length([[1, 2], [3]], pad_token_id=0, max_length=4)
    assert out.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0]]
    assert tf.pad_2d_list_to_length([[1, 2, 3]], pad_token_id=9, max_length=2).tolist() == [[1, 2, 3]]
    t = torch.tensor([[5, 6]])
    assert tf.pad_sequence_to_length(t, 4, 0).tolist() == [[5, 6, 0, 0]]
    assert tf.pad_sequence_to_length(t, 4, 0, left_pad=True).tolist() == [[0, 0, 5, 6]]
    assert tf.pad_sequence_to_length(t, 1, 0) is t


def test_postprocess_data_pad_and_truncate():
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    mask = torch.ones_like(ids)
    padded, pmask = tf.postprocess_data(ids, mask, 7, pad_token_id=0, left_pad=True)
    assert padded.tolist() == [[0, 0, 1, 2, 3, 4, 5]] and pmask.tolist() == [[0, 0, 1, 1, 1, 1, 1]]
    assert tf.postprocess_data(ids, mask, 3, 0, truncation="left")[0].tolist() == [[3, 4, 5]]
    assert tf.postprocess_data(ids, mask, 3, 0, truncation="right")[0].tolist() == [[1, 2, 3]]
    assert tf.postprocess_data(ids, mask, 3, 0, truncation="middle")[0].tolist() == [[1, 4, 5]]
    with pytest.raises(NotImplementedError, match="max_length=3"):
        tf.postprocess_data(ids, mask, 3, 0, truncation="error")
    with pytest.raises(ValueError, match="truncation"):
        tf.postprocess_data(ids, mask, 3, 0, truncation="bogus")


def test_tokenize_and_postprocess_with_fake_tokenizer():
    class Tok:
        def __call__(self, text, return_tensors, add_special_tokens):
            assert add_special_tokens is False
            ids = torch.tensor([[ord(c) for c in text]])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    ids, mask = tf.tokenize_and_postprocess_data("ab", Tok(), max_length=4, pad_token_id=0)
    assert ids.tolist() == [[0, 0, 97, 98]] and mask.tolist() == [[0, 0, 1, 1]]


def test_position_ids_clip_and_unpad():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert tf.compute_position_id_with_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]
    x = torch.tensor([-5.0, 0.5, 9.0])
    assert tf.clip_by_value(x, torch.tensor(0.0), torch.tensor([1.0, 1.0, 2.0])).tolist() == [0.0, 0.5, 2.0]
    indices, cu, longest = tf.get_unpad_data(mask)
    assert indices.tolist() == [2, 3, 4, 5, 6, 7] and cu.tolist() == [0, 3, 6] and longest == 3
    assert tf.remove_pad_token(torch.tensor([[0, 0, 7, 8]]), torch.tensor([[0, 0, 1, 1]])) == [[7, 8]]


def test_response_logprobs_and_expand_nested():
    torch.manual_seed(1)
    ids = torch.randint(0, 6, (2, 5))
    logits = torch.randn(2, 5, 6)
    out = tf.log_probs_from_logits_response(ids, logits, response_length=2)
    ref = torch.log_softmax(logits[:, 2:4], -1).gather(-1, ids[:, 3:, None]).squeeze(-1)
    torch.testing.assert_close(out, ref)
    nt = torch.nested.as_nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    expanded = tf.expand_as_nested(torch.tensor([7.0, 9.0]), nt)
    assert [t.tolist() for t in expanded.unbind()] == [[7.0, 7.0], [9.0, 9.0, 9.0]]


def _lrs(scheduler, steps):
    values = []
    for _ in range(steps):
        values.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return values


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def test_cosine_schedule_values():
    lrs = _lrs(tf.get_cosine_schedule_with_warmup(_opt(), num_warmup_steps=2, num_training_steps=6), 7)
    # warmup 0, 0.5; then 0.5*(1+cos(pi*p)) with p = (s-2)/4
    expected = [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * (s - 2) / 4)) for s in range(2, 7)]
    assert lrs == pytest.approx(expected)
    floor = _lrs(tf.get_cosine_schedule_with_warmup(_opt(), 0, 4, min_lr_ratio=0.1), 5)
    assert floor[0] == pytest.approx(1.0) and floor[-1] == pytest.approx(0.1)
    assert floor[2] == pytest.approx(0.1 + 0.9 * 0.5)
    start = _lrs(tf.get_cosine_schedule_with_warmup(_opt(), 4, 8, init_lr_ratio=0.2), 2)
    assert start == pytest.approx([0.2, 0.4])
    with pytest.raises(ValueError, match="min_lr_ratio"):
        tf.get_cosine_schedule_with_warmup(_opt(), 1, 2, min_lr_ratio=2.0)


def test_constant_and_wsd_schedules():
    assert _lrs(tf.get_constant_schedule_with_warmup(_opt(), 4), 6) == pytest.approx([0, 0.25, 0.5, 0.75, 1, 1])
    wsd = _lrs(tf.get_wsd_schedule_with_warmup(_opt(), 2, 12, min_lr_ratio=0.0, stable_ratio=0.5), 13)
    assert wsd[:2] == pytest.approx([0.0, 0.5])
    assert wsd[2:7] == pytest.approx([1.0] * 5)
    assert wsd[7] == pytest.approx(1.0) and wsd[12] == pytest.approx(0.0)
