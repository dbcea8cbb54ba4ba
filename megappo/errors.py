"""The errors megappo raises for input it cannot run: `ConfigError` (a recipe or an override)
and `ModelConfigError` (an HF config megappo cannot build, or a layout it cannot be split into),
`CheckpointError` (a checkpoint that cannot be read or written: damaged files, a full disk), and
`InfrastructureError` (something the run needs cannot work: a sandbox, a service).

Their messages name the setting and the fix. They live apart so that any layer can raise them
without importing the config schema or the model code (`megappo.config.ConfigError` and
`megappo.models.hf_config.ModelConfigError` are the same classes, re-exported there).

This module imports nothing from megappo and knows nothing about what raises the errors.
"""

from __future__ import annotations

P = "{p}"  # placeholder for a section's dotted prefix in error templates, filled in as errors propagate


class ConfigError(ValueError):
    """A recipe or override megappo cannot run; the message names the dotted key and the fix."""

    def __init__(self, template: str):
        self.template = template  # keys written as '{p}key', relative to the section that raised
        super().__init__(template.replace(P, ""))

    def at(self, prefix: str) -> ConfigError:
        return ConfigError(self.template.replace(P, prefix))

    def under(self, name: str) -> ConfigError:
        """The same error seen from the enclosing section, where this one is field `name`."""
        return self.at(f"{P}{name}.")


class ModelConfigError(ValueError):
    """An HF config megappo cannot build, or a layout it cannot be split into."""


class CheckpointError(ConfigError):
    """A trainer checkpoint that failed its digest check or cannot be read, or a save that ran out of
    space; the message names the file (or directory) and the fix. Exits 2 like bad input.

    `every_rank`: every rank raises the same error (a decision they took together), so only rank 0
    reports it."""

    def __init__(self, message: str, *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class InfrastructureError(RuntimeError):
    """Something a run needs cannot work (the code executor's sandbox is missing, its service is down): the run
    stops with it. Never a score, and never an environment's observation (a tool that raises it is not
    answered with it: megappo.envs.tools.run_call lets it through)."""


class CheckpointWarning(UserWarning):
    """A checkpoint that was skipped (damaged, unfinished), fallen back to, or read unverified;
    the CLI shows it as one `megappo: warning: ...` line."""
