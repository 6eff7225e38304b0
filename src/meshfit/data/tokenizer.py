"""Pretrained tokenizers: a Hugging Face tokenizer folder (``tokenizer.json``, and ``tokenizer_config.json``
for the BOS and EOS tokens), as transformers' fast tokenizers read it.

A document's ids are what ``PreTrainedTokenizerFast(...).encode(text)`` gives: the ``tokenizer.json``
pipeline with its post-processor (which adds BOS where the tokenizer does, as Llama 3's does), and BOS in
front when ``tokenizer_config.json`` sets ``add_bos_token`` and the post-processor did not add it. Then the
config's EOS token closes the document (unless it already ends with it): documents joined in one stream
keep their boundaries, as Megatron-LM's ``--append-eod`` does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from meshfit.data.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class Pretrained:
    """A loaded tokenizer folder; ``digest`` identifies it (sha256 of its two files)."""

    folder: Path
    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    digest: str

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to vocab_size - 1, added (special) tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each document's ids, as documented at the top of this module."""
        dtype = np.min_scalar_type(max(self.vocab_size - 1, 255))
        out = []
        for encoding in self.tokenizer.encode_batch(texts):
            ids = encoding.ids
            if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
                ids = [self.bos_id, *ids]
            if self.eos_id is not None and ids[-1:] != [self.eos_id]:
                ids = [*ids, self.eos_id]
            out.append(np.asarray(ids, dtype=dtype))
        return out

    def encode_pairs(self, pairs: list[tuple[str, str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, counted) of each (prompt, response): the prompt encoded as a document's start (BOS as the
        tokenizer adds it), the response after it without special tokens, then EOS; `counted` (uint8) is 1
        on the response and the EOS, the targets a supervised fine-tuning loss counts, 0 on the prompt."""
        dtype = np.min_scalar_type(max(self.vocab_size - 1, 255))
        prompts = self.tokenizer.encode_batch([p for p, _ in pairs])
        responses = self.tokenizer.encode_batch([r for _, r in pairs], add_special_tokens=False)
        out = []
        for prompt, response in zip(prompts, responses, strict=True):
            head = prompt.ids
            if self.add_bos and self.bos_id is not None and head[:1] != [self.bos_id]:
                head = [self.bos_id, *head]
            tail = response.ids + ([] if self.eos_id is None else [self.eos_id])
            counted = np.concatenate([np.zeros(len(head), np.uint8), np.ones(len(tail), np.uint8)])
            out.append((np.asarray(head + tail, dtype=dtype), counted))
        return out

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.folder), "sha256": self.digest, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id}


def is_tokenizer_folder(value: str | Path) -> bool:
    return Path(value).is_dir() and (Path(value) / TOKENIZER_FILE).is_file()


def _token(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # an AddedToken written out: {"content": "</s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a JSON object (the tokenizer's settings)")
    return config


def load_tokenizer(folder: str | Path, field: str = "data.tokenizer") -> Pretrained:
    """The tokenizer in `folder`; DataError naming `field` and the folder when it is not one."""
    folder = Path(folder)
    file = folder / TOKENIZER_FILE
    if not folder.is_dir():
        raise DataError(f"{field}={folder}: no such folder; give a folder holding {TOKENIZER_FILE} (a Hugging Face "
                        "tokenizer, e.g. the model's folder), or byte / bpe")
    if not file.is_file():
        raise DataError(f"{field}={folder}: the folder has no {TOKENIZER_FILE} (a Hugging Face fast tokenizer; "
                        "a SentencePiece tokenizer.model alone is not read)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise DataError(f"{file}: cannot be read as a tokenizer ({str(exc).splitlines()[0]})") from None
    config = _config(folder)
    ids = {}
    for key in ("bos_token", "eos_token"):
        name = _token(config, key)
        ids[key] = None if name is None else tokenizer.token_to_id(name)
        if name is not None and ids[key] is None:
            raise DataError(f"{folder / CONFIG_FILE}: {key} {name!r} is not a token of {file}")
    digest = hashlib.sha256()
    for path in (file, folder / CONFIG_FILE):
        digest.update(path.read_bytes() if path.is_file() else b"")
    return Pretrained(folder=folder, tokenizer=tokenizer, bos_id=ids["bos_token"], eos_id=ids["eos_token"],
                      add_bos=bool(config.get("add_bos_token", False)), digest=digest.hexdigest())


def check_vocabulary(tokenizer: Pretrained, vocab_size: int, field: str = "data.tokenizer") -> None:
    """A tokenizer whose ids reach past the model's vocabulary is refused (a smaller one is fine)."""
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"{field}={tokenizer.folder}: the tokenizer has {tokenizer.vocab_size} tokens, more than the "
                        f"model's vocabulary of {vocab_size} (model.vocab_size); use the model's own tokenizer")
