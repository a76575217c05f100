"""Incremental detokenization: incomplete UTF-8 held back, stop strings matched across tokens and
kept out of the text, text that could start a stop string held until it cannot."""

import random
import time

from services.worker.engine.detokenizer import IncrementalDetokenizer


class ByteDecoder:
    """Token i is PIECES[i] (bytes); decoding joins them, broken UTF-8 as U+FFFD (like byte-level BPE)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def _feed(pieces: list[bytes], stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(ByteDecoder(pieces), stop)
    deltas = []
    for i in range(len(pieces)):
        deltas.append(detok.add([i]))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return deltas, detok


def test_deltas_concatenate_to_the_text_and_never_split_a_character():
    text = "héllo wörld ✓ 日本"
    raw = text.encode()
    pieces = [raw[i : i + 2] for i in range(0, len(raw), 2)]  # cuts through multi-byte characters
    deltas, _ = _feed(pieces)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_across_token_boundaries_is_not_in_the_text():
    pieces = [b"def f", b"(x):\n  re", b"tu", b"rn x\n", b"def g"]
    deltas, detok = _feed(pieces, stop=("return",))
    assert detok.stopped
    assert "".join(deltas) == "def f(x):\n  "
    assert "re" not in "".join(deltas[:2])  # the possible start of "return" was held back


def test_held_back_text_is_released_when_it_is_not_a_stop_string():
    pieces = [b"ab", b"c", b"d", b"e"]
    deltas, detok = _feed(pieces, stop=("cx", "bcq"))
    assert deltas[0] == "a"  # "b" could start "bcq"
    assert deltas[1] == ""  # "bc" could still become "bcq"
    assert deltas[2] == "bcd"
    assert "".join(deltas) == "abcde" and not detok.stopped


def test_earliest_of_several_stop_strings_wins_and_text_after_it_is_dropped():
    pieces = [b"one two three"]
    deltas, _ = _feed(pieces, stop=("three", "two"))
    assert "".join(deltas) == "one "


def test_an_incomplete_character_at_the_end_is_flushed():
    pieces = ["é".encode()[:1]]
    deltas, _ = _feed(pieces)
    assert deltas[0] == "" and deltas[-1] == "\ufffd"


def test_a_long_generation_decodes_about_once_per_token_and_matches_the_full_text():
    """The decode window slides every few tokens; each token otherwise costs one decode call."""
    text = "def main():\n    print('héllo, wörld ✓')  # 日本語のコメント\n    return 0\n" * 8
    raw = text.encode()
    pieces = [raw[i : i + 3] for i in range(0, len(raw), 3)]  # cuts through multi-byte characters

    class Counting(ByteDecoder):
        calls = 0

        def decode(self, ids):
            Counting.calls += 1
            return super().decode(ids)

    detok = IncrementalDetokenizer(Counting(pieces))
    deltas = [detok.add([i]) for i in range(len(pieces))] + [detok.flush()]
    assert "".join(deltas) == text
    assert Counting.calls <= 1.25 * len(pieces) + 1, (Counting.calls, len(pieces))


def _sentencepiece_style():
    """A tiny Llama-2-style tokenizer: Metaspace pieces ("▁word"), byte fallback, and a decoder that strips
    the leading space of whatever it decodes first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(["def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"] * 20,
                            trainer)
    return tok


class _Decode:
    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


def test_the_first_word_keeps_its_space_after_the_prompt_with_a_sentencepiece_decoder():
    """Decoded alone, "▁return" is "return": the stream must read " return n ...", what decoding prompt and
    output together gives past the prompt's text (as transformers' decode of the whole sequence)."""
    tok = _sentencepiece_style()
    decoder = _Decode(tok)
    for prompt_text, full_text in [("def fibonacci(n):", "def fibonacci(n): return n if n < 2 else fibonacci(n - 1)"),
                                   ("def", "def fibonacci(n): é ✓")]:  # é ✓: byte-fallback pieces
        prompt = tok.encode(prompt_text).ids
        output = tok.encode(full_text).ids[len(prompt):]
        expected = decoder.decode(prompt + output)[len(decoder.decode(prompt)):]
        assert expected.startswith(" ")
        detok = IncrementalDetokenizer(decoder, (), prompt)
        deltas = [detok.add([t]) for t in output] + [detok.flush()]
        assert "".join(deltas) == expected
        assert all("\ufffd" not in d for d in deltas)


def test_a_prompt_ending_inside_a_character_does_not_garble_the_output():
    """The prompt's tail decodes to an incomplete character: the output is decoded on its own instead."""
    text = "日本語"
    raw = text.encode()
    pieces = [raw[:1], raw[1:4], raw[4:]]  # token 0 ends inside 日
    detok = IncrementalDetokenizer(ByteDecoder(pieces), (), [0])
    assert detok.add([1]) + detok.add([2]) + detok.flush() == raw[1:].decode("utf-8", errors="replace")


class _Chars:
    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def test_stop_strings_release_what_a_brute_force_reading_does():
    """The held-back tail is tracked a character at a time; the text released and where it stops are those of
    the whole text read at once: up to the earliest stop string, all of it when none matches."""
    rng = random.Random(7)
    for trial in range(2000):
        alphabet = "ab" if trial % 2 else "abc "
        stop = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 4)))
        detok, released = IncrementalDetokenizer(_Chars(), stop), ""
        for _ in range(30):
            released += detok.add([ord(rng.choice(alphabet)) for _ in range(rng.randint(1, 3))])
            if detok.stopped:
                break
        starts = [i for i in (detok.text.find(s) for s in stop) if i >= 0]
        if detok.stopped:
            assert released == detok.text[: min(starts)], (stop, detok.text)
        else:
            assert not starts and released + detok.flush() == detok.text, (stop, detok.text)


def test_long_stop_strings_the_output_nearly_matches_cost_little_per_token():
    """Every prefix length of every stop string was tried on each token: 16 stop strings of 255 characters that
    the output keeps nearly matching cost ~1 ms a sequence a token on the engine's thread, every request of the
    batch waiting on it. A bound 20 times above what it costs now."""
    stop = tuple("x" * 254 + str(i) for i in range(15)) + (("\n    foo()" * 26)[:255] + "Q",)
    detok, text = IncrementalDetokenizer(_Chars(), stop), "\n    foo()" * 200
    started = time.perf_counter()
    for i in range(0, len(text), 3):
        detok.add([ord(c) for c in text[i : i + 3]])
    assert time.perf_counter() - started < 0.3
    assert len(text) - detok.sent == 250  # held back: the output still matches the last stop string's start
