"""Deprecated: `megappo.tokenizer` moved to `megappo.data.tokenizer` (load_tokenizer, char_tokenizer,
chat_template_ids and the rest). Importing this module warns once and re-exports its public names; it
goes away in a later release.

Owns nothing; knows only where the names went.
"""

import warnings

from megappo.data.tokenizer import (  # noqa: F401 - the old module's names
    BUILTIN_ALPHABETS, builtin_tokenizer_files, char_tokenizer, characters_encoded_as, chat_template_ids,
    check_tokenizer_spec, check_vocab, load_tokenizer, special_token_ids, unknown_characters, unknown_token,
)

warnings.warn("megappo.tokenizer is deprecated: import load_tokenizer and the rest from megappo.data.tokenizer",
              DeprecationWarning, stacklevel=2)
