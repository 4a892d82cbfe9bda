"""Per-request output text: incremental detokenization and stop strings.

Keeps the invariant that text handed to the client never contains a stop string and never has to be taken
back: the tail that could still grow into a stop string is held until it cannot.
"""

from __future__ import annotations

from dynserve.model.detokenizer import IncrementalDetokenizer

__all__ = ["OutputText"]


class OutputText:
    def __init__(self, detokenizer: IncrementalDetokenizer, stop: tuple[str, ...]) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._text = ""  # everything detokenized so far (cut at a stop string once one is found)
        self._num_emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the text that is now safe to emit. Sets `stopped` on a stop string."""
        piece = self._detokenizer.push(token_id)
        self._text += piece
        if not self._stop:  # nothing is ever held back: the piece is the delta
            self._num_emitted += len(piece)
            return piece
        return self._take(final=False)

    def finish(self) -> str:
        """Everything not yet emitted (the request ended)."""
        if not self.stopped:
            self._text += self._detokenizer.flush()
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        if self._stop and not self.stopped:
            window_start = max(0, self._num_emitted - max(len(s) for s in self._stop))
            hits = [i for s in self._stop if (i := self._text.find(s, window_start)) >= 0]
            if hits:
                self._text = self._text[: min(hits)]
                self.stopped = True
        end = len(self._text)
        if not final and not self.stopped:
            end -= self._held_back()
        delta = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    @property
    def text(self) -> str:
        return self._text
