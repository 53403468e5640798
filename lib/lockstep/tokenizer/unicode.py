"""Text that UTF-8 cannot hold, made encodable the way tiktoken treats it for the `bpe` kind, so
that every tokenizer kind encodes it alike."""

from __future__ import annotations


def without_lone_surrogates(text: str) -> str:
    """`text` with each unpaired surrogate replaced by U+FFFD (and surrogate pairs joined), as
    tiktoken encodes such text for `bpe`."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
