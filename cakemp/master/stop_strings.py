"""OpenAI's `stop` sequences over streamed text: what may be shown now, and whether one was reached.

Text arrives in pieces (one token's worth each). A stop sequence can span pieces, so the tail of
the text that could still begin one is held back until the next piece decides it; when one
appears (the first to end, where several do), the text before it is the last shown and the
generation should end. The sequence
itself is never shown, as OpenAI's API leaves it out.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Feeds on a generation's text pieces; hands back the text that is safe to show."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.reached = False
        self._held = ""  # text received and not yet shown: it may begin a stop sequence

    def feed(self, piece: str) -> str:
        """The text that can be shown now that `piece` came; "" once a stop sequence was reached."""
        if self.reached:
            return ""
        text = self._held + piece
        # The sequence that ends first is the one the generation reached (it halts there, so a longer
        # one that began earlier never completes); it is cut where it begins, however the text was pieced.
        found = [(at + len(s), at) for s in self.stops if (at := text.find(s)) >= 0]
        if found:
            self.reached, self._held = True, ""
            return text[:min(found)[1]]
        keep = max((_overlap(text, s) for s in self.stops), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What was held back, once the generation ended without reaching a stop sequence."""
        held, self._held = self._held, ""
        return "" if self.reached else held


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that is a beginning of `stop` (shorter than `stop`)."""
    for length in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-length:]):
            return length
    return 0
