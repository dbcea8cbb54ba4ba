"""megappo: PPO for language models on Megatron-Core (see README.md and DESIGN in docs)."""

from megappo import megatron_import

__version__ = "0.1.0"

megatron_import.install()  # Megatron-Core's import-time torch.compile decorations compile at first call
