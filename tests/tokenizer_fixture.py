"""A small Hugging Face tokenizer folder made locally with `tokenizers` (no download)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEXTS = ["the quick brown fox jumps over the lazy dog", "héllo wörld, ünïcode text 123",
         "pack my box with five dozen liquor jugs"]


def make_tokenizer(folder: Path, vocab: int = 300, bos_in_template: bool = True, **config: object) -> Path:
    """A byte-level BPE with <s> (BOS) and </s> (EOS); the post-processor adds BOS when `bos_in_template`.
    `config` goes to tokenizer_config.json (default: bos_token <s>, eos_token </s>)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    if bos_in_template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", **config}))
    return folder
