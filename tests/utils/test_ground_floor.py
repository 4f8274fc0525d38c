"""verl.utils is the ground floor: no module in it imports the packages that stand on it (models, workers, the
protocol, the single controller, trainers). Model knowledge reaches utils only through
verl.utils.model_specs, which verl.models fills on import."""

import ast
import pathlib

import verl

_UPPER = ("verl.models", "verl.workers", "verl.protocol", "verl.protocol_future", "verl.single_controller",
          "verl.trainer", "verl.experimental")


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_utils_imports_nothing_above_it():
    root = pathlib.Path(verl.__file__).parent / "utils"
    upward = sorted(f"{p.relative_to(root.parent)} -> {m}" for p in root.rglob("*.py") for m in _imports(p)
                    if m == "verl" or m.startswith(_UPPER))
    assert upward == []


def test_flops_formula_reaches_utils_through_the_spec_hook(monkeypatch):
    from transformers import Qwen3Config

    import verl.models  # noqa: F401  (hands the spec table to verl.utils.model_specs)
    from verl.utils import flops_counter, model_specs

    cfg = Qwen3Config(vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, architectures=["Qwen3ForCausalLM"])
    assert flops_counter.forward_flops(cfg, [5, 3]) == flops_counter.dense_decoder_forward_flops(cfg, [5, 3]) > 0
    monkeypatch.setattr(model_specs, "_lookup", None)  # no model package imported: no formula, not a guess
    assert flops_counter.forward_flops(cfg, [5, 3]) == 0.0
