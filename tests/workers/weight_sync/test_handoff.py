"""The trainer -> rollout-pool weight hand-over (verl.workers.weight_sync.handoff): exact round trip for every
dtype and shape a model holds, copies (never aliases of the sender's tensors or of the store's read-only pages),
and, inside Ray, bytes that travel through the object store while the controller only forwards a small handle."""

from __future__ import annotations

import pickle

import pytest
import torch

from verl.workers.weight_sync.handoff import WeightPackage, pack, unpack


def _weights():
    g = torch.Generator().manual_seed(0)
    return [
        ("bf16", torch.randn(5, 7, generator=g).to(torch.bfloat16)),
        ("fp32", torch.randn(3, generator=g)),
        ("fp16_scalar", torch.tensor(1.5, dtype=torch.float16)),
        ("empty", torch.zeros(0, 4)),
        ("int64_strided", torch.arange(12).view(3, 4).t()),  # not contiguous
        ("bool", torch.tensor([True, False, True])),
    ]


def test_round_trip_is_exact_and_copies():
    weights = _weights()
    package = pack(weights, use_object_store=False)
    assert isinstance(package, WeightPackage) and len(package) == len(weights)
    assert package.nbytes == sum(t.numel() * t.element_size() for _, t in weights)
    weights[0][1].add_(1)  # the sender moves on (next step's update): the package keeps what was packed
    received = list(unpack(package))
    for (name, sent), (got_name, got) in zip(_weights(), received):
        assert got_name == name and got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent), name
    received[1][1].add_(1)  # writable, and a copy of the package's bytes
    assert torch.equal(list(unpack(package))[1][1], _weights()[1][1])


def test_unpack_is_lazy_and_a_plain_list_passes_through():
    plain = _weights()
    assert list(unpack(plain)) == plain
    package = pack(_weights(), use_object_store=False)
    it = unpack(package)
    name, first = next(it)  # one tensor at a time: the receiver never holds a second full copy
    assert name == "bf16" and first.dtype == torch.bfloat16


def test_through_ray_the_controller_forwards_a_small_handle():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote
        class Sender:
            def send(self):
                return pack([("w", torch.arange(1 << 20, dtype=torch.float32))])  # 4 MiB

        @ray.remote
        class Receiver:
            def take(self, package):
                ((name, t),) = list(unpack(package))
                t.add_(1)  # a store page would be read-only: this must be a copy
                return name, float(t.sum())

        sender = Sender.remote()  # the object's owner: it lives as long as the trainer's worker does
        package = ray.get(sender.send.remote())
        assert not isinstance(package.arrays, list)  # a reference into the object store
        assert len(pickle.dumps(package)) < 16_384  # what the controller handles: no tensor bytes
        n = 1 << 20
        assert ray.get(Receiver.remote().take.remote(package)) == ("w", float(n * (n - 1) / 2 + n))
    finally:
        ray.shutdown()
