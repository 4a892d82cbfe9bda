"""Streaming detokenization: token ids in, text pieces out, one `push` per token, never half a character."""

from __future__ import annotations

import codecs

from dynserve.errors import TokenizerError

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, one `push` per token.

    Works on bytes: each token's bytes go through an incremental UTF-8 decoder that holds back an
    incomplete trailing character until its remaining bytes arrive, so no piece ever ends in half a
    character and the cost per token is the size of that token. The concatenation of all pieces plus
    `flush()` equals `Tokenizer.decode` of the same ids.
    """

    def __init__(self, token_bytes: tuple[bytes, ...], skipped_ids: frozenset[int],
                 token_texts: tuple[str | None, ...]) -> None:
        """`token_texts`: each token's text where its bytes are whole characters, else None; such a token,
        pushed while no partial character is held, skips the incremental decoder."""
        self._token_bytes = token_bytes
        self._token_texts = token_texts
        self._skipped_ids = skipped_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._unjoined_pieces: list[str] = []
        self._joined = ""

    def push(self, token_id: int) -> str:
        """The text newly completed by `token_id` (often "", e.g. for the first bytes of an emoji)."""
        if not 0 <= token_id < len(self._token_bytes):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary of {len(self._token_bytes)}")
        if token_id in self._skipped_ids:
            return ""
        piece = self._token_texts[token_id]
        if piece is None or self._utf8.buffer:  # part of a character, or one is held: the decoder joins them
            piece = self._utf8.decode(self._token_bytes[token_id])
        return self._emit(piece)

    def flush(self) -> str:
        """Whatever is still held at the end of the stream; incomplete bytes become U+FFFD."""
        return self._emit(self._utf8.decode(b"", final=True))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._unjoined_pieces:
            self._joined += "".join(self._unjoined_pieces)
            self._unjoined_pieces.clear()
        return self._joined

    def _emit(self, piece: str) -> str:
        if piece:
            self._unjoined_pieces.append(piece)
        return piece
