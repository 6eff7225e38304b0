"""data.document_mask: which EOS id closes the documents of the run's data, checked before any rank starts.

The id comes from the data itself where it is recorded: a folder `meshfit prepare` wrote (its metadata's
``tokenizer.eos_id``), or text read with a tokenizer folder (its ``tokenizer_config.json``). A raw token
file (.npy, .bin) records none: ``data.eos_id`` names it; so does it for synthetic data, whose documents
then end wherever the chain emits that token (dry runs and tests). Text read with the byte or BPE tokenizer,
which joins files without an EOS, cannot be masked.
"""

from __future__ import annotations

from pathlib import Path

from meshfit.config import Config, ConfigError
from meshfit.data import DataError
from meshfit.data.shards import is_prepared, read_metadata
from meshfit.data.tokenizer import load_tokenizer


def _recorded_eos(cfg: Config, path: str) -> tuple[int | None, str]:
    """(the EOS id the data at `path` records, where it was read); None when it records none."""
    data = cfg.data
    if data.source == "tokens" and is_prepared(path):
        return read_metadata(path)["tokenizer"].get("eos_id"), f"{Path(path) / 'meshfit-data.json'}"
    if data.source == "text" and data.tokenizer not in ("byte", "bpe"):
        return load_tokenizer(data.tokenizer).eos_id, f"data.tokenizer={data.tokenizer}"
    return None, ""


def _paths(cfg: Config) -> list[str]:
    data = cfg.data
    paths = [entry.path for entry in data.sources] if data.sources is not None else [data.path]
    return [p for p in [*paths, data.val_path] if p]


def document_eos(cfg: Config) -> int | None:
    """The EOS id data.document_mask reads boundaries from, or None when the mask is off; ConfigError
    naming the field when the data has no known EOS or its parts disagree."""
    data = cfg.data
    if not data.document_mask:
        if data.eos_id is not None:
            raise ConfigError(f"data.eos_id={data.eos_id} is used only by data.document_mask=true; set that too, or "
                              "leave data.eos_id unset")
        return None
    if data.source == "synthetic":
        if data.eos_id is None:
            raise ConfigError("data.document_mask=true needs documents closed by an EOS token; data.source=synthetic "
                              "has none unless data.eos_id names a token of the chain to close them (or use "
                              "data.source=tokens, or text with a tokenizer folder)")
        return data.eos_id
    if data.eos_id is not None and data.source != "tokens":
        raise ConfigError(f"data.eos_id applies to token files (data.source=tokens) and synthetic data; with "
                          f"data.source={data.source} the EOS id is the tokenizer folder's (data.tokenizer)")
    try:
        found = {path: _recorded_eos(cfg, path) for path in _paths(cfg)}
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    recorded = {path: eos for path, (eos, _) in found.items() if eos is not None}
    if data.eos_id is not None:
        for path, eos in recorded.items():
            if eos != data.eos_id:
                raise ConfigError(f"data.eos_id={data.eos_id}, but {found[path][1]} records EOS id {eos}; leave "
                                  "data.eos_id unset (the recorded id is used) or give the same id")
        return data.eos_id
    unknown = [path for path in found if path not in recorded]
    if unknown:
        if data.source == "text":
            how = (f"data.tokenizer={data.tokenizer} joins documents without an EOS token; use a tokenizer "
                   "folder whose tokenizer_config.json names eos_token")
        else:
            how = ("it is a raw token file, which records no EOS id: give it as data.eos_id, or prepare the data "
                   "with `meshfit prepare`")
        raise ConfigError(f"data.document_mask=true needs the EOS id closing each document of {unknown[0]}: {how}")
    ids = set(recorded.values())
    if len(ids) > 1:
        raise ConfigError(f"data.document_mask=true: the data's parts record different EOS ids ({sorted(ids)}); "
                          "prepare them with one tokenizer")
    return ids.pop()
