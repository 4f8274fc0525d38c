"""Custom rollout weight loaders (seed 003, section 2.2), loader-reported coverage, and tied-layer refresh.

The model here is a small torch module whose parameters carry vLLM-style ``weight_loader`` attributes: a
STAND-IN for a vLLM model (the same code runs against vLLM's CPU build in
tests/workers/rollout/test_vllm_custom_loader.py, -m vllm).
"""

import pytest
import torch
from torch import nn

from verl.models.dtensor_weight_loader import WEIGHT_LOADER_REGISTRY, get_weight_loader, register_weight_loader
from verl.utils.vllm.reload import LoadedNames, aliased_layers, refresh_aliased_layers
from verl.workers.weight_sync import WeightCoverageError, check_loader_coverage


class _Engine(nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        for p in self.parameters():
            p.requires_grad_(False)
            p.weight_loader = lambda param, w: param.data.copy_(w)

    def load_weights(self, weights):  # vLLM's contract: returns the names it loaded
        params = dict(self.named_parameters())
        done = set()
        for name, w in weights:
            params[name].weight_loader(params[name], w)
            done.add(name)
        return done


@pytest.fixture
def clean_registry():
    before = dict(WEIGHT_LOADER_REGISTRY)
    yield
    WEIGHT_LOADER_REGISTRY.clear()
    WEIGHT_LOADER_REGISTRY.update(before)


def test_register_and_look_up_by_architecture(clean_registry):
    @register_weight_loader("MyModelForCausalLM")
    def loader(actor_weights, vllm_model):
        return vllm_model

    assert get_weight_loader(["Other", "MyModelForCausalLM"]) is loader
    assert get_weight_loader(["LlamaForCausalLM"]) is None  # vLLM's own loader
    with pytest.raises(ValueError, match="already registered"):
        register_weight_loader("MyModelForCausalLM", lambda w, m: m)
    register_weight_loader("MyModelForCausalLM", lambda w, m: m, override=True)


def test_custom_loader_writes_and_coverage_comes_from_its_calls():
    engine = _Engine()
    weights = {"embed.weight": torch.ones(8, 4), "body.weight": torch.full((4, 4), 2.0)}

    def loader(actor_weights, vllm_model):
        params = dict(vllm_model.named_parameters())
        for name, w in actor_weights.items():
            params[name].weight_loader(params[name], w)
        return vllm_model

    with LoadedNames(engine, loader=loader) as loaded:
        engine.load_weights(iter(weights.items()))
    assert loaded.reported and loaded.names == {"embed.weight", "body.weight"}
    assert torch.equal(engine.head.weight, torch.ones(8, 4))  # tied to embed
    assert "load_weights" not in engine.__dict__  # the class method is back
    with pytest.raises(WeightCoverageError, match=r"never written: body\.bias"):
        check_loader_coverage([n for n, _ in engine.named_parameters()], loaded.names, list(weights))
    check_loader_coverage(["embed.weight", "body.weight"], loaded.names, list(weights))


def test_model_loader_report_and_duplicates():
    engine = _Engine(tie=False)
    sent = [("embed.weight", torch.zeros(8, 4)), ("body.weight", torch.zeros(4, 4)), ("body.bias", torch.zeros(4)),
            ("head.weight", torch.zeros(8, 4))]
    with LoadedNames(engine) as loaded:
        engine.load_weights(iter(sent))
    names = [n for n, _ in engine.named_parameters()]
    check_loader_coverage(names, loaded.names, [n for n, _ in sent])
    with pytest.raises(WeightCoverageError, match=r"more than once: body\.bias"):
        check_loader_coverage(names, loaded.names, [n for n, _ in sent] + ["body.bias"])
    with pytest.raises(WeightCoverageError, match="reported no loaded names"):
        check_loader_coverage(names, None, [])


def test_aliased_layers_are_reprocessed():
    tied, untied = _Engine(tie=True), _Engine(tie=False)
    assert set(aliased_layers(tied)) == {"embed", "head"} and aliased_layers(untied) == {}
    seen = []
    assert sorted(refresh_aliased_layers(tied, process=lambda layer: seen.append(type(layer).__name__))) == [
        "embed", "head"]
    assert sorted(seen) == ["Embedding", "Linear"]
    # Without an explicit process, layers without vLLM's quant_method hook hold nothing to refresh.
    assert refresh_aliased_layers(tied) == []
