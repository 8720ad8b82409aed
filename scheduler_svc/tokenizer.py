"""The scheduler's tokenizer: text <-> token ids and chat-template rendering.

The scheduler process must stay free of torch and transformers, so it never
loads a model directory. The executor ships everything needed in the handshake
(`TokenizerInfo`): the Hugging Face `tokenizers` JSON, the Jinja chat template
and the BOS/EOS strings. This module rebuilds a tokenizer from those fields with
the `tokenizers` library and renders chat templates with a sandboxed jinja2
environment configured the way transformers configures it, so prompts tokenize
to exactly the ids the model was trained on.
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
# Above this many characters (or ids) `tokenizers` is called through its batch
# API, which releases the GIL while the Rust side works; below it the plain call
# is cheaper. Either way the result is the same.
GIL_FREE_FROM = 4096
# Marks a control-token string cut out of chat content while the template
# renders; noncharacters plus a per-call nonce, so content cannot forge one.
_HOLE = re.compile("\ufdd0([0-9a-f]{16}):([0-9]+)\ufdd1")


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot render
    # (e.g. "roles must alternate"); surfaces as ValueError to the caller.
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's built-in tojson HTML-escapes '<', '>' and '&'; chat templates
    # expect plain JSON (this is what transformers installs too).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token and chat-template facts
    the executor reported. Plain Python types in and out."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        chat_template: str,
        bos_token: str,
        eos_token: str,
        add_bos_token: bool,
    ) -> None:
        self._backend = backend
        self._chat_template_source = chat_template
        self._compiled_template: jinja2.Template | None = None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id: int | None = backend.token_to_id(eos_token) if eos_token else None
        if bos_token and self.bos_token_id is None:
            raise ValueError(f"bos_token {bos_token!r} is not in the tokenizer vocabulary")
        if eos_token and self.eos_token_id is None:
            raise ValueError(f"eos_token {eos_token!r} is not in the tokenizer vocabulary")
        # transformers folds add_bos_token into the JSON's post-processor, so
        # a JSON exported from it may already prepend BOS. Prepend it ourselves
        # only when the post-processor does not, so BOS is never doubled.
        post_adds_bos = backend.encode("", add_special_tokens=True).ids[:1] == [self.bos_token_id]
        self._prepend_bos = add_bos_token and self.bos_token_id is not None and not post_adds_bos
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special.update(i for i in (self.bos_token_id, self.eos_token_id) if i is not None)
        # Every id `decode(..., skip_special_tokens=True)` drops, plus BOS/EOS.
        # A superset of transformers' all_special_ids, which only lists the
        # named special tokens (bos/eos/unk/pad/additional).
        self.all_special_ids: list[int] = sorted(special)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        vocab = backend.get_vocab(with_added_tokens=True)
        # No token covers more characters than its vocabulary entry has (byte-level
        # BPE: one entry char per input byte), so a text of more than
        # n * max_token_chars characters has more than n tokens: a bound checked
        # before tokenizing anything.
        self.max_token_chars: int = max((len(t) for t in vocab), default=1)
        self._special_ids = frozenset(special)
        strings = sorted({backend.id_to_token(i) for i in special} - {None, ""}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, strings))) if strings else None
        self._text_backend: _BackendTokenizer | None = None  # built on first use: tokenizes control tokens as text

    @classmethod
    def from_info(
        cls,
        tokenizer_json: str,
        chat_template: str,
        bos_token: str,
        eos_token: str,
        add_bos_token: bool,
    ) -> Tokenizer:
        """Build from the handshake's TokenizerInfo fields."""
        try:
            backend = _BackendTokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the Rust side raises plain Exception
            raise ValueError(f"tokenizer_json is not a valid tokenizers JSON: {exc}") from exc
        return cls(backend, chat_template, bos_token, eos_token, add_bos_token)

    # --- ids <-> text ---

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        if len(text) < GIL_FREE_FROM:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            # The fast variant keeps no offsets: freeing a million-token Encoding with
            # them held the GIL for ~0.25 s.
            ids = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    @staticmethod
    def _encoding(backend: _BackendTokenizer, text: str, add_special_tokens: bool):
        """The Encoding, offsets included."""
        if len(text) < GIL_FREE_FROM:
            return backend.encode(text, add_special_tokens=add_special_tokens)
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) < GIL_FREE_FROM:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, ids: list[int]) -> list[str]:
        """Raw vocabulary strings (e.g. 'Ġworld' for byte-level BPE)."""
        tokens = [self._backend.id_to_token(i) for i in ids]
        if None in tokens:
            bad = [i for i, t in zip(ids, tokens) if t is None]
            raise ValueError(f"token ids out of vocabulary (size {self.vocab_size}): {bad[:8]}")
        return tokens

    # --- chat ---

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template_source)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` to the prompt string, as transformers'
        apply_chat_template(tokenize=False) does. Encode the result with
        `add_special_tokens=False` (or call `encode_chat`): the template
        already wrote every special token it wants."""
        template = self._template()
        _validate_messages(messages)
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed to render: {exc}") from exc

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, special_tokens_in_content: bool = False
    ) -> list[int]:
        """Prompt ids for a chat, equal to transformers'
        apply_chat_template(tokenize=True) when no message content contains
        a control-token string.

        Control tokens (`<|im_start|>`, EOS, ...) written inside message content
        are tokenized as the text they spell, never as the control token: a user
        cannot close their turn and forge a system one. Only the template writes
        control tokens, unless `special_tokens_in_content` (trusted clients).
        """
        if special_tokens_in_content or self._special_re is None:
            prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            return self.encode(prompt, add_special_tokens=False)
        _validate_messages(messages)
        nonce, cut = secrets.token_hex(8), []

        def hole(match: re.Match) -> str:
            cut.append(match.group(0))
            return f"\ufdd0{nonce}:{len(cut) - 1}\ufdd1"

        safe = [{**m, "content": self._special_re.sub(hole, m["content"])} for m in messages]
        prompt = self.apply_chat_template(safe if cut else messages, add_generation_prompt=add_generation_prompt)
        if not cut:
            return self.encode(prompt, add_special_tokens=False)
        return self._encode_with_text_holes(prompt, nonce, cut)

    def _encode_with_text_holes(self, prompt: str, nonce: str, cut: list[str]) -> list[int]:
        """Encodes `prompt` with its holes filled back in, the filled spans as text.

        The whole prompt is encoded once, so every token outside the holes is
        what a plain encode gives; each control token covering a hole is then
        replaced by the ids of the text it spans.
        """
        text, starts, ends, pos, length = [], [], [], 0, 0
        for match in _HOLE.finditer(prompt):
            text.append(prompt[pos : match.start()])
            length += match.start() - pos
            pos = match.end()
            if match.group(1) != nonce:  # content imitating a hole (it cannot know the nonce): its own text
                text.append(match.group(0))
                length += len(match.group(0))
                continue
            filling = cut[int(match.group(2))]
            text.append(filling)
            starts.append(length)
            length += len(filling)
            ends.append(length)
        text.append(prompt[pos:])
        full = "".join(text)
        encoding = self._encoding(self._backend, full, add_special_tokens=False)
        if self._text_backend is None:
            self._text_backend = _BackendTokenizer.from_str(self._backend.to_str())
            self._text_backend.encode_special_tokens = True
        ids = []
        for token, (start, end) in zip(encoding.ids, encoding.offsets):
            k = bisect.bisect_left(starts, start)
            if token in self._special_ids and k < len(starts) and ends[k] <= end:
                ids += self._text_backend.encode(full[start:end], add_special_tokens=False).ids
            else:
                ids.append(token)
        return ids

    def _template(self) -> jinja2.Template:
        # Compiled lazily: a model whose template is missing or broken can
        # still serve plain-text completions; only chat requests fail.
        if not self._chat_template_source:
            raise ValueError("this model has no chat template; send a plain-text prompt instead")
        if self._compiled_template is None:
            try:
                self._compiled_template = _compile_chat_template(self._chat_template_source)
            except jinja2.TemplateError as exc:
                raise ValueError(f"the model's chat template does not compile: {exc}") from exc
        return self._compiled_template


def _validate_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}] has unknown role {role!r}; allowed: {sorted(CHAT_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
