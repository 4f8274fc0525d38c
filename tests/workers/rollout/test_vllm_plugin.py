"""The project's vLLM plugin: declared as a vLLM entry point, and it registers what vLLM lacks (CPU)."""

from verl.models.qwen3_5.vllm_arch import TEXT_ARCHITECTURES, register_text_architectures


class _Registry:
    """STAND-IN for vllm.ModelRegistry: the two calls the registration makes, recorded."""

    def __init__(self, known):
        self.known = list(known)
        self.registered = {}

    def get_supported_archs(self):
        return self.known + list(self.registered)

    def register_model(self, arch, cls):
        self.registered[arch] = cls


def test_missing_text_architectures_are_registered_lazily_with_the_multimodal_config_rules():
    reg = _Registry(["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"])
    rules = object()
    config_map = {"Qwen3_5ForConditionalGeneration": rules, "Qwen3_5MoeForConditionalGeneration": rules}
    added = register_text_architectures(reg, config_map)
    assert added == list(TEXT_ARCHITECTURES)
    # "module:Class" strings: vLLM imports the classes only when a checkpoint names them (no CUDA at plugin load)
    assert reg.registered == {"Qwen3_5ForCausalLM": "verl.models.qwen3_5.vllm_text_models:Qwen3_5TextForCausalLM",
                              "Qwen3_5MoeForCausalLM":
                                  "verl.models.qwen3_5.vllm_text_models:Qwen3_5MoeTextForCausalLM"}
    assert config_map["Qwen3_5ForCausalLM"] is rules and config_map["Qwen3_5MoeForCausalLM"] is rules
    assert register_text_architectures(reg, config_map) == []  # idempotent: vLLM loads plugins in every process


def test_a_vllm_that_knows_the_architecture_keeps_its_own_class():
    reg = _Registry(["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
    assert register_text_architectures(reg, {}) == [] and reg.registered == {}


def test_plugin_collects_the_registrations_the_model_specs_name():
    from verl.workers.rollout.vllm_rollout.plugin import registration_functions

    assert register_text_architectures in registration_functions()


def test_setup_declares_the_entry_point_vllm_loads():
    import ast
    from pathlib import Path

    from verl.workers.rollout.vllm_rollout import plugin

    setup = Path(__file__).resolve().parents[3] / "setup.py"
    text = setup.read_text()
    ast.parse(text)
    assert f'"{plugin.ENTRY_POINT_GROUP}": ["{plugin.ENTRY_POINT_NAME} = {plugin.__name__}:register"]' in text


def test_the_installed_distribution_declares_the_plugin():
    """``scripts/setup.sh`` installs the project with pip, so vLLM's processes find the plugin by entry point."""
    from verl.workers.rollout.vllm_rollout.plugin import entry_point_installed

    assert entry_point_installed()
