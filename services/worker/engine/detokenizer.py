"""Incremental detokenization of one sequence's output, with stop strings.

Text is of the output token ids only, decoded after the prompt's last few tokens: a SentencePiece
decoder (Llama-2, Mistral) drops the leading space of the first token it decodes, so the first word
of a generation decoded alone loses its space ("def f():" + "return"). A token can end inside a
multi-byte character (the decoder then yields U+FFFD): that text is held back until the character
completes. Text that could be the start of a stop string is held back until it is known not to
be; when a stop string matches, the text up to it is released and the rest is dropped.
"""

from __future__ import annotations

from typing import Protocol

# Tokens decoded together with the newest ones so that decoders that look at neighbours
# (byte-level merges, leading-space rules) give the same text as decoding everything at once.
_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, stop: tuple[str, ...] = (), prompt_ids: list[int] | tuple[int, ...] = ()):
        self.decoder = decoder
        self.stop = tuple(stop)
        self.text = ""  # all text decoded so far (complete characters only)
        self.sent = 0  # characters of self.text already released
        self.stopped = False  # a stop string matched; nothing more is released
        # Per stop string: its failure function, and the longest prefix of it the text ends with (_held_back).
        self._borders = [_failure_function(s) for s in self.stop]
        self._ends_with = [0] * len(self.stop)
        self._scanned = 0  # characters of self.text fed to _ends_with
        # The prompt's tail opens the first window: its text is the window's, never self.text.
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        window = decoder.decode(context) if context else ""
        if window.endswith(_INCOMPLETE):  # the prompt ends inside a character: no clean place to start after
            context, window = [], ""
        self.ids: list[int] = context  # the prompt's tail, then every output token
        self._prefix = 0  # ids[_prefix:_read] decode to _window, whose text past the prompt's ends self.text
        self._read = len(context)
        self._window = window  # decoder.decode(ids[_prefix:_read]), kept so each token costs one decode

    def add(self, token_ids: list[int]) -> str:
        """Feeds new tokens; returns the text that may be released now."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        after = self.decoder.decode(self.ids[self._prefix :])
        if len(after) > len(self._window) and not after.endswith(_INCOMPLETE):
            self.text += after[len(self._window) :]
            self._read = len(self.ids)
            # The window grows to twice the context before it slides: most tokens then take one
            # decode call (the last one's text is the next window's), not two (~0.4 ms a step at
            # batch 256 with a fast tokenizer on one CPU core).
            if self._read - self._prefix > 2 * _CONTEXT_TOKENS:
                self._prefix = self._read - _CONTEXT_TOKENS
                self._window = self.decoder.decode(self.ids[self._prefix : self._read])
            else:
                self._window = after
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the generation: whatever is left (an incomplete character included)."""
        if self.stopped:
            return ""
        tail = self.decoder.decode(self.ids[self._prefix :])
        head = self._window
        if len(tail) > len(head):
            self.text += tail[len(head) :]
            self._read = len(self.ids)
            self._window = tail
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            # Text that could start a match is never released (see _held_back), so a match
            # always starts at or after `sent`.
            matches = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
            if matches:
                end = min(matches)
                out = self.text[self.sent : end]
                self.sent = end
                self.stopped = True
                return out
        end = len(self.text) if final else len(self.text) - self._held_back()
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest unreleased tail of the text that is a proper prefix of a stop string.

        Kept up to date a character at a time (Knuth-Morris-Pratt): trying every prefix length of every stop
        string on each token cost ~1 ms a sequence a token on the engine's thread, for any client sending 16
        long stop strings its output nearly matches (every request of the batch waits on that thread)."""
        text = self.text
        for i in range(self._scanned, len(text)):
            char = text[i]
            for j, (stop, border) in enumerate(zip(self.stop, self._borders)):
                state = self._ends_with[j]
                while state and (state == len(stop) or stop[state] != char):
                    state = border[state - 1]
                self._ends_with[j] = state + 1 if stop[state] == char else state
        self._scanned = len(text)
        pending = len(text) - self.sent
        longest = 0
        for stop, border, state in zip(self.stop, self._borders, self._ends_with):
            while state > min(len(stop) - 1, pending):  # the longest shorter prefix the text ends with
                state = border[state - 1]
            longest = max(longest, state)
        return longest


def _failure_function(pattern: str) -> list[int]:
    """border[k]: the length of the longest proper prefix of pattern[:k + 1] that is also its suffix."""
    border = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = border[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        border[i] = k
    return border
