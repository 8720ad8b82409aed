"""What the torch-free scheduler needs to tokenize for a model: the HF `tokenizers`
JSON and the chat template.

Contract with the scheduler (it loads `tokenizer_json` with the `tokenizers`
library only):
  - Tokenizer.from_str(tokenizer_json).encode(text).ids equals transformers'
    tokenizer(text).input_ids: the JSON's post-processor already adds the BOS
    token when the model wants one. `add_bos_token` reports whether it does,
    so nothing should add BOS again.
  - A chat-rendered prompt spells out its own special tokens; encode it with
    add_special_tokens=False, as transformers' apply_chat_template does.

We build the JSON through transformers rather than copying tokenizer.json,
because transformers rewrites the post-processor from tokenizer_config.json's
add_bos_token/add_eos_token, and a GGUF has no tokenizer.json at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenizerInfo:
    tokenizer_json: str
    chat_template: str  # "" if the model has none
    bos_token: str  # "" if the tokenizer has none (protobuf strings cannot be None)
    eos_token: str  # likewise
    add_bos_token: bool

    @classmethod
    def from_gguf(cls, path: str) -> TokenizerInfo:
        # PreTrainedTokenizerFast builds the same tokenizer as AutoTokenizer from a
        # GGUF, without AutoTokenizer's slow full parse of the file for its config.
        from transformers import PreTrainedTokenizerFast

        folder, name = os.path.split(os.path.abspath(path))
        return cls._from_transformers(PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name))

    @classmethod
    def from_hf_folder(cls, folder: str) -> TokenizerInfo:
        """Reads tokenizer.json + tokenizer_config.json (chat template also from
        chat_template.jinja / chat_template.json, which transformers picks up)."""
        from transformers import AutoTokenizer

        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise ValueError(f"{folder} has no tokenizer.json")
        return cls._from_transformers(AutoTokenizer.from_pretrained(folder))

    @classmethod
    def _from_transformers(cls, tokenizer) -> TokenizerInfo:
        backend = tokenizer.backend_tokenizer
        template = tokenizer.chat_template or ""
        if isinstance(template, dict):  # named templates: the default one serves chat requests
            template = template.get("default", "")
        bos = tokenizer.bos_token or ""
        # Ask the post-processor itself rather than trusting a config flag.
        bos_id = backend.token_to_id(bos) if bos else None
        first = backend.encode("a", add_special_tokens=True).ids[:1]
        return cls(
            tokenizer_json=backend.to_str(),
            chat_template=template,
            bos_token=bos,
            eos_token=tokenizer.eos_token or "",
            add_bos_token=bos_id is not None and first == [bos_id],
        )
