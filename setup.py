"""Installs the `verl` package (a clean-room, verl-compatible RL post-training framework for Qwen3.5).

torch is deliberately absent from install_requires: on a CPU machine pip would otherwise pull the CUDA
build with several GB of CUDA libraries. Install torch first (the README's commands do).
"""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent


def _reqs(name):
    lines = (here / name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith(("#", "-"))]


extras = {
    "test": _reqs("requirements-test.txt"),
    # Gated DeltaNet kernels for GPU. Never install on a CPU box together with triton: transformers would
    # then select fla's Triton kernels and every CPU forward fails.
    "gpu": ["flash-linear-attention>=0.5.2", "fla-core>=0.5.2"],
    "vllm": ["vllm>=0.18.0,<=0.33.0"],
    "sglang": ["sglang[srt]>=0.5.8"],
    "mcore": ["megatron-core>=0.18"],
    "tensorboard": ["tensorboard"],
    "wandb": ["wandb"],
}

setup(
    name="verl",
    version=(here / "verl" / "version" / "version").read_text().strip(),
    description="verl-compatible RL post-training (GRPO/PPO, SFT) with first-class Qwen3.5 support",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["verl", "verl.*"]),
    package_data={"verl": ["version/version", "trainer/config/*.yaml", "trainer/config/*.txt", "trainer/config/**/*.yaml",
                           "trainer/demo/*.json", "trainer/demo/*.jinja", "utils/chat_templates/*.jinja"]},
    include_package_data=True,
    install_requires=_reqs("requirements.txt"),
    extras_require=extras,
    # vLLM loads this in each of its processes: the architectures vLLM must be told about (text-only Qwen3.5).
    entry_points={"vllm.general_plugins": ["verl_models = verl.workers.rollout.vllm_rollout.plugin:register"]},
)
