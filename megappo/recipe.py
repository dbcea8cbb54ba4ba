"""Deprecated: `megappo.recipe` moved to `megappo.config` (load_config, config_from_dict, dump_config,
apply_override, read_config; the rest of the reading is megappo.config.loading). Importing this
module warns once and re-exports those names; it goes away in a later release.

Owns nothing; knows only where the names went.
"""

import warnings

from megappo.config import apply_override, config_from_dict, dump_config, load_config, read_config

__all__ = ["apply_override", "config_from_dict", "dump_config", "load_config", "read_config"]

warnings.warn("megappo.recipe is deprecated: import load_config, config_from_dict, dump_config, apply_override and "
              "read_config from megappo.config", DeprecationWarning, stacklevel=2)
