"""The built-in tokenizer's special tokens and the default continuation suffix: what
the light core (``kvhandoff.model.ModelTokens``) and the generator share."""

from __future__ import annotations

BUILTIN_MODEL_NAME = "kvhandoff-tiny-reco-v2"
THINK_START = "<think>"
THINK_END = "</think>"
SID_BEGIN = "<|sid_begin|>"
SID_END = "<|sid_end|>"
BOS = "<s>"
EOS = "</s>"
SPECIAL_TOKENS = [BOS, EOS, THINK_START, THINK_END, SID_BEGIN, SID_END]

#: The continuation that turns a stage-1 parent into the stage-2 prompt.
DEFAULT_SUFFIX_TEXT = f"{THINK_END}\n{SID_BEGIN}"
