"""Incremental detokenization with stop-string detection, one per output sample.

Every step the engine hands each running sample its new token ids and streams
back whatever text became safe to show. Two things make text unsafe to show yet:

1. An incomplete character. Byte-level BPE splits one multi-byte UTF-8
   character over several tokens; until the last one arrives, the decoded text
   ends with U+FFFD. We emit nothing for such a token and re-decode it together
   with the next one.
2. A possible stop string. If the text ends with "</an" and "</answer>" is a
   stop string, showing "</an" now could leak part of the stop string. We hold
   back the longest tail that is a proper prefix of some stop string.

Decoding uses two offsets into `ids` (prompt context + outputs), so each step
decodes only a short window instead of the whole output:

    ids:  [ ..context.. | out0 out1 out2 | out3 out4 ]
                        ^                ^          ^
                  prefix_offset     read_offset   len(ids)
          prefix_text = decode(ids[prefix_offset:read_offset])  (already emitted)
          full_text   = decode(ids[prefix_offset:])
          new text    = full_text[len(prefix_text):]

The tokens in [prefix_offset, read_offset) are decoded again only as context:
tokenizers whose decoders strip or add a leading space on the first token of a
decode (SentencePiece '▁') then still produce the right space. The prompt's last
few tokens seed the window so the first output token gets that context too.
When the new text is usable, prefix_offset moves to read_offset and read_offset
to the end; otherwise both stay and the window grows by the held token(s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as decoding context, and the most we widen it to find a
# context that decodes cleanly (one that does not start mid-character).
_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 16


@dataclass(frozen=True, slots=True)
class DetokenizerDelta:
    text: str  # new text safe to emit now ("" when everything is held back)
    matched_stop: str | None = None  # the stop string that ended the sample
    # True when a stop matched and decoded text was discarded: the stop string
    # itself (unless include_stop_str_in_output) and/or text after it.
    stop_truncated: bool = False


class IncrementalDetokenizer:
    """Turns one sample's output token ids into streamed text deltas.

    Invariants (for output that decodes to valid UTF-8):
    - with no stop match, "".join(deltas) + flush() == tokenizer.decode(outputs);
    - no delta ends mid-character;
    - with a stop match, the joined deltas end right before the earliest-ending
      stop occurrence (right after it with include_stop_str_in_output), and no
      text of the stop (or after it) was ever emitted before that; occurrences
      in text released while stops were unarmed (min_tokens) do not count.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = tuple(stop)
        self._include_stop = include_stop_str_in_output
        # Every proper, non-empty prefix of every stop string: the tails that
        # must be held back. _stop_chars lets the common case (the text's last
        # character occurs in no stop string) skip the suffix scan entirely.
        self._stop_prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._max_held = max((len(s) for s in self._stops), default=1) - 1
        self._stop_chars = frozenset("".join(self._stops))

        self._ids: list[int] = self._pick_context(list(prompt_token_ids))
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._held = ""  # decoded, not emitted: could start a stop string
        self._finished = False
        self.matched_stop: str | None = None

    @property
    def finished(self) -> bool:
        """True after a stop string matched or flush() was called."""
        return self._finished

    def add_tokens(self, new_token_ids: list[int], stops_armed: bool = True) -> DetokenizerDelta:
        """The text `new_token_ids` make safe to show. While `stops_armed` is
        False (the sample has fewer than min_tokens outputs) stop strings
        neither match nor hold text back: text released then is never searched,
        so a stop string that starts before arming cannot match. (Tokens still
        undecoded when arming comes, e.g. half a character, are searched.)"""
        if self._finished:
            raise RuntimeError("add_tokens after the sample finished (stop matched or flushed)")
        if not new_token_ids:
            return DetokenizerDelta("")
        self._ids.extend(new_token_ids)
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(self._prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token) or an incomplete
            # character: keep the offsets, decode these tokens again next step.
            return DetokenizerDelta("")
        new_text = full_text[len(self._prefix_text) :]
        self._advance()
        if not stops_armed:
            text, self._held = self._held + new_text, ""
            return DetokenizerDelta(text)
        return self._release(new_text, final=False)

    def flush(self) -> str:
        """The request ended without a stop (EOS, length, abort): release all
        held text, including an incomplete trailing character as U+FFFD."""
        if self._finished:
            return ""
        full_text = self._decode(self._ids[self._prefix_offset :])
        new_text = full_text[len(self._prefix_text) :]
        self._advance()
        text = self._release(new_text, final=True).text
        self._finished = True
        return text

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])

    def _release(self, new_text: str, final: bool) -> DetokenizerDelta:
        """Emit `new_text` after any held tail, minus what must stay held."""
        if not self._stops:
            return DetokenizerDelta(new_text)
        # Any stop occurrence not yet seen starts inside `buf`: everything
        # emitted earlier was, when emitted, no prefix of any stop string.
        buf = self._held + new_text
        match = self._find_stop(buf)
        if match is not None:
            start, end, stop = match
            cut = end if self._include_stop else start
            self._held = ""
            self._finished = True
            self.matched_stop = stop
            return DetokenizerDelta(buf[:cut], stop, stop_truncated=cut < len(buf))
        keep = 0 if final else self._held_tail_len(buf)
        self._held = buf[len(buf) - keep :]
        return DetokenizerDelta(buf[: len(buf) - keep])

    def _find_stop(self, buf: str) -> tuple[int, int, str] | None:
        # The occurrence that ends first is the one a character-by-character
        # stream would have hit first, so the result does not depend on how
        # tokens were chunked into steps. Ties go to the earlier start.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        return start, end, stop

    def _held_tail_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that a stop string starts with."""
        if not buf or buf[-1] not in self._stop_chars:
            return 0
        for k in range(min(self._max_held, len(buf)), 0, -1):
            if buf[-k:] in self._stop_prefixes:
                return k
        return 0

    def _pick_context(self, prompt: list[int]) -> list[int]:
        # The context must decode without U+FFFD: a window that starts or ends
        # mid-character would shift the character alignment of the output.
        n = len(prompt)
        for k in range(min(_CONTEXT_TOKENS, n), min(_MAX_CONTEXT_TOKENS, n) + 1):
            context = prompt[n - k :]
            if REPLACEMENT_CHAR not in self._decode(context):
                return context
        return []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
