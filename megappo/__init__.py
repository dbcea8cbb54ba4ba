"""megappo: PPO for language models on Megatron-Core (see README.md and DESIGN in docs)."""

__version__ = "0.1.0"
