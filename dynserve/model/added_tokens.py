"""Splitting text at a tokenizer's added tokens (special ones such as `<|im_start|>`, user-defined ones), so that
`Tokenizer.encode` encodes, and caches, the text between them piece by piece.

Invariant: the split finds, scanning from the left, the longest added token at each position, as `tokenizers`
matches them; `added_token_splitter` declines (None) for tokenizers whose added tokens would make encoding the
pieces apart differ from encoding the whole text.
"""

from __future__ import annotations

import re
from typing import Any

import tokenizers

__all__ = ["added_token_splitter", "longest_match_pattern"]


def added_token_splitter(raw: tokenizers.Tokenizer) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A pattern splitting text at the tokenizer's added tokens (longest first, kept as pieces), and their
    ids; None when an added token strips whitespace around it or matches only single words, where
    encoding the pieces apart could differ from encoding the whole."""
    added = {token.content: token_id for token_id, token in raw.get_added_tokens_decoder().items()}
    tokens = raw.get_added_tokens_decoder().values()
    normalizes = raw.normalizer is not None
    if not added or any(t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizes) for t in tokens):
        return None, added
    return re.compile(f"({longest_match_pattern(list(added))})"), added


def longest_match_pattern(words: list[str]) -> str:
    """A regex matching, at a position, the longest of `words` found there (as the alternation of the words,
    longest first, would), written as a trie: with Gemma's 6,414 added tokens a 16k-character text splits in
    0.6 ms instead of the alternation's 130 ms (which tries every word at every position). Children
    differ in their first character, so at most one can go on matching; a word ending at a node
    makes what follows optional, and the greedy `?` tries the longer words first."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here

    def pattern(node: dict[str, Any]) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in node.items() if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{body})?" if "" in node else body

    return pattern(trie)
