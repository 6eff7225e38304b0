"""Token data from disk: pre-tokenized memory-mapped files and raw text.

Pre-tokenized files are the scalable path (nothing is read until a batch
needs it). Text files are tokenized fully in memory, which suits corpora up
to a few hundred MB; convert larger ones to ``.npy`` once with
``write_token_file``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshfit.data.errors import DataError
from meshfit.data.shards import METADATA, PreparedTokens, is_prepared
from meshfit.data.tokenizer import load_tokenizer

TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
TOKENIZERS = ("byte", "bpe")
_DTYPE_HELP = "token files must hold integers (uint16, uint32, int32 or int64)"
_SCAN_CHUNK = 1 << 24  # elements per range-check chunk: bounded memory on huge files


# ---------------------------------------------------------------- token files


def load_token_file(path: str | os.PathLike, vocab_size: int, dtype: str | None = None) -> np.ndarray:
    """Memory-map a 1-D token file and check every id is in ``[0, vocab_size)``.

    ``.npy`` files carry their own dtype. Raw ``.bin`` files take it from
    ``dtype``, else from a ``<name>.bin.json`` sidecar ``{"dtype": ...}`` (as
    written by ``write_token_file``), else ``uint16``. The returned
    ``np.memmap`` keeps the file name in ``.filename``.
    """
    path = Path(path)
    if is_prepared(path):  # a `meshfit prepare` folder: its metadata holds the largest id, nothing is scanned
        tokens = PreparedTokens(path)
        if tokens.max_id >= vocab_size:
            raise DataError(f"{path}: holds token id {tokens.max_id} ({METADATA}); ids must be < vocab_size="
                            f"{vocab_size} (prepare it with the model's tokenizer)")
        return tokens
    tokens = _open_token_file(path, dtype)
    _check_range(path, tokens, vocab_size)
    return tokens


def check_files(source: str, path: str | os.PathLike, seq_len: int, tokenizer: str = "byte",
                token_dtype: str | None = None, vocab_size: int | None = None, own_bpe: bool = True) -> None:
    """What can be known of data files before training: they exist and have the right form, and hold at
    least one sequence (``seq_len + 1`` tokens). DataError naming the file otherwise. Token ids are
    range-checked when the ranks load the file. ``own_bpe``: BPE text is tokenized by a tokenizer trained
    on itself (training data), so its token count can be found here; held-out text is tokenized by the
    training data's tokenizer, so only the byte count bounds it before the ranks start."""
    path = Path(path)
    need = f"one sequence needs train.seq_len + 1 = {seq_len + 1}"
    if source == "tokens":
        count = len(PreparedTokens(path)) if is_prepared(path) else len(_open_token_file(path, token_dtype))
        if count < seq_len + 1:
            raise DataError(f"{path}: has {count} tokens; {need} (use more data or a shorter train.seq_len)")
        return
    files = _text_files(path)
    for file in files:
        if file.stat().st_size == 0:
            raise DataError(f"{file}: text file is empty; it needs at least one character")
    count = sum(file.stat().st_size for file in files)  # byte tokenizer: one token per byte
    if count < seq_len + 1:  # BPE: at most one token per byte too
        held = f"its .txt files hold {count} bytes" if path.is_dir() else f"has {count} bytes"
        most = "" if tokenizer == "byte" else "at most "
        raise DataError(f"{path}: {held}, i.e. {most}{count} tokens with data.tokenizer={tokenizer}; {need} "
                        "(use more text or a shorter train.seq_len)")
    if tokenizer == "bpe" and own_bpe and not _words_at_least(files, seq_len + 1):
        # Few words: the BPE token count decides; train the tokenizer here (in memory, as each rank would).
        count = len(tokenize_text(path, "bpe", vocab_size or 0))
        if count < seq_len + 1:
            raise DataError(f"{path}: gives {count} tokens with data.tokenizer=bpe (vocab_size {vocab_size}); "
                            f"{need} (use more text or a shorter train.seq_len)")


def _words_at_least(files: list[Path], need: int) -> bool:
    """The files hold at least `need` whitespace-separated words. BPE never merges across whitespace
    between words (its pre-tokenizer splits there), so it gives at least one token per word: enough words
    settle the length without training the tokenizer. Reads only until `need` words are found."""
    count = 0
    for file in files:
        with open(file, "rb") as handle:
            for line in handle:
                count += len(line.split())
                if count >= need:
                    return True
    return False


def token_count(source: str, path: str | os.PathLike, tokenizer: str = "byte",
                token_dtype: str | None = None) -> int | None:
    """How many tokens a data file holds, known before training: None for BPE text (not yet trained)."""
    path = Path(path)
    if source == "tokens":
        return len(PreparedTokens(path)) if is_prepared(path) else len(_open_token_file(path, token_dtype))
    if tokenizer != "byte":
        return None
    return sum(file.stat().st_size for file in _text_files(path))  # one token per byte


def _open_token_file(path: Path, dtype: str | None) -> np.ndarray:
    """The memory-mapped tokens of a file whose form is right (not yet range-checked)."""
    if not path.is_file():
        what = f"is a directory without {METADATA}" if path.is_dir() else "does not exist"
        raise DataError(f"{path}: {what}; expected a token file (.npy, or raw .bin) or a folder `meshfit prepare` "
                        "wrote")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: file is empty; a token file needs at least one token")
    if path.suffix == ".npy":
        return _map_npy(path)
    if path.suffix == ".bin":
        return _map_bin(path, dtype)
    raise DataError(f"{path}: unsupported token file extension {path.suffix!r}; valid: .npy, .bin")


def write_token_file(path: str | os.PathLike, tokens: object, dtype: str | None = None) -> Path:
    """Write 1-D integer tokens to ``.npy``, or raw ``.bin`` plus a dtype sidecar.

    Without ``dtype`` the smallest of uint16, uint32, int32, int64 that holds
    every id is used.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{path}: got {arr.ndim}-D {arr.dtype} tokens; {_DTYPE_HELP} in a 1-D array")
    if arr.size == 0:
        raise DataError(f"{path}: refusing to write an empty token file; pass at least one token")
    lo, hi = int(arr.min()), int(arr.max())
    fits = [d for d in TOKEN_DTYPES if np.iinfo(d).min <= lo and hi <= np.iinfo(d).max]
    dtype = dtype or fits[0]
    if dtype not in fits:
        raise DataError(f"{path}: ids span [{lo}, {hi}], which {dtype!r} cannot hold; valid here: {', '.join(fits)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        np.save(path, arr.astype(dtype))
    elif path.suffix == ".bin":
        arr.astype(dtype).tofile(path)
        _sidecar(path).write_text(json.dumps({"dtype": dtype}))
    else:
        raise DataError(f"{path}: unsupported token file extension {path.suffix!r}; valid: .npy, .bin")
    return path


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _map_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"{path}: not a readable .npy array ({exc}); {_DTYPE_HELP}") from exc
    if not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{path}: has dtype {tokens.dtype}; {_DTYPE_HELP}")
    if tokens.ndim != 1:
        raise DataError(f"{path}: has shape {tokens.shape}; token files must be 1-D (one long token stream)")
    if tokens.size == 0:
        raise DataError(f"{path}: holds 0 tokens; a token file needs at least one token")
    return tokens


def _map_bin(path: Path, dtype: str | None) -> np.ndarray:
    dtype = _bin_dtype(path, dtype)
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(
            f"{path}: has {size} bytes, not a multiple of {itemsize} (the size of {dtype}); "
            "the file is truncated or its dtype is wrong (set data.token_dtype)"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _bin_dtype(path: Path, requested: str | None) -> str:
    """Resolve a raw file's dtype; an argument that contradicts the sidecar is an error."""
    valid = ", ".join(TOKEN_DTYPES)
    if requested is not None and requested not in TOKEN_DTYPES:
        raise DataError(f"{path}: token dtype {requested!r} is not supported; valid: {valid}")
    sidecar = _sidecar(path)
    if not sidecar.is_file():
        return requested or "uint16"
    try:
        recorded = json.loads(sidecar.read_text())["dtype"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{sidecar}: expected JSON like {{\"dtype\": \"uint16\"}} ({exc})") from exc
    if recorded not in TOKEN_DTYPES:
        raise DataError(f"{sidecar}: dtype {recorded!r} is not supported; valid: {valid}")
    if requested is not None and requested != recorded:
        raise DataError(f"{path}: dtype {requested!r} was requested but {sidecar.name} says {recorded!r}")
    return recorded


def _check_range(path: Path, tokens: np.ndarray, vocab_size: int) -> None:
    if vocab_size < 1:
        raise DataError(f"{path}: vocab_size must be >= 1 (got {vocab_size})")
    signed = np.issubdtype(tokens.dtype, np.signedinteger)
    for start in range(0, tokens.size, _SCAN_CHUNK):
        chunk = tokens[start : start + _SCAN_CHUNK]
        if signed and chunk.min() < 0:
            pos = start + int(np.argmax(chunk < 0))
            raise DataError(f"{path}: negative token id {int(tokens[pos])} at position {pos}; ids must be >= 0")
        if chunk.max() >= vocab_size:
            pos = start + int(np.argmax(chunk >= vocab_size))
            raise DataError(
                f"{path}: token id {int(tokens[pos])} at position {pos} is out of range; "
                f"ids must be < vocab_size={vocab_size} (raise model.vocab_size or re-tokenize)"
            )


# ----------------------------------------------------------------------- text


def tokenize_text(
    path: str | os.PathLike, tokenizer: str, vocab_size: int, cache_dir: str | os.PathLike | None = None,
    trained_on: str | os.PathLike | None = None,
) -> np.ndarray:
    """Tokenize a UTF-8 text file, or every ``*.txt`` in a directory (sorted by name).

    ``"byte"``: each UTF-8 byte is a token (ids 0..255; needs vocab_size >= 256).
    ``"bpe"``: a byte-level BPE with exactly ``vocab_size`` tokens, *trained on
    this same text*. It is saved as ``<cache_dir>/bpe-<vocab>-<text hash>/tokenizer.json``
    and reused whenever the text and vocab_size match, so ids stay identical
    across runs; without ``cache_dir`` it is retrained each call (deterministic,
    just slower). Files are tokenized separately and concatenated in order.
    ``trained_on``: encode with the BPE of that text instead (held-out text must get the ids of the text
    the model trains on).
    """
    path = Path(path)
    if tokenizer not in TOKENIZERS:  # a Hugging Face tokenizer folder: each file is one document
        pretrained = load_tokenizer(tokenizer)
        texts = [_decode(file, file.read_bytes()) for file in _text_files(path)]
        return np.concatenate(pretrained.encode(texts))
    if vocab_size < 256:
        raise DataError(f"{path}: {tokenizer!r} tokenization needs vocab_size >= 256 (got {vocab_size})")
    raw = {file: file.read_bytes() for file in _text_files(path)}
    texts = [_decode(file, data) for file, data in raw.items()]
    if tokenizer == "byte":
        return np.concatenate([np.frombuffer(data, dtype=np.uint8) for data in raw.values()])
    basis, basis_raw = path, raw
    if trained_on is not None:
        basis = Path(trained_on)
        basis_raw = {file: file.read_bytes() for file in _text_files(basis)}
    basis_texts = texts if trained_on is None else [_decode(file, data) for file, data in basis_raw.items()]
    tok = _bpe_tokenizer(basis, basis_texts, vocab_size, _bpe_cache_file(cache_dir, basis_raw.values(), vocab_size))
    dtype = np.min_scalar_type(vocab_size - 1)
    return np.concatenate([np.asarray(enc.ids, dtype=dtype) for enc in tok.encode_batch(texts)])


def tokenizer_note(tokenizer: str, vocab_size: int) -> str | None:
    """A `note:` line when the settings make the BPE tokenizer learn nothing: its 256 byte symbols come
    first, so a vocabulary of 256 leaves no room for a merge and it tokenizes byte by byte."""
    if tokenizer == "bpe" and vocab_size == 256:
        return ("note: data.tokenizer=bpe with model.vocab_size=256 learns no merges (the 256 byte symbols fill "
                "the vocabulary), so every byte is one token, as with data.tokenizer=byte; raise "
                "model.vocab_size for merges")
    return None


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: does not exist; expected a UTF-8 text file or a directory of .txt files")
    files = sorted(p for p in path.glob("*.txt") if p.is_file())
    if not files:
        raise DataError(f"{path}: directory has no .txt files; put UTF-8 text in *.txt files there")
    return files


def _decode(file: Path, data: bytes) -> str:
    if not data:
        raise DataError(f"{file}: text file is empty; it needs at least one character")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{file}: invalid UTF-8 at byte offset {exc.start} ({exc.reason}); text files must be UTF-8"
        ) from exc


def _bpe_cache_file(cache_dir: str | os.PathLike | None, contents: object, vocab_size: int) -> Path | None:
    """Cache location keyed by vocab size and text content, so changing either retrains."""
    if cache_dir is None:
        return None
    digest = hashlib.sha256()
    for data in contents:
        digest.update(len(data).to_bytes(8, "little"))  # length prefix: file boundaries count
        digest.update(data)
    return Path(cache_dir) / f"bpe-{vocab_size}-{digest.hexdigest()[:16]}" / "tokenizer.json"


def _bpe_tokenizer(path: Path, texts: list[str], vocab_size: int, cache_file: Path | None) -> Tokenizer:
    if cache_file is not None and cache_file.is_file():
        try:
            return Tokenizer.from_file(str(cache_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"{cache_file}: cached tokenizer is unreadable ({exc}); delete it to retrain") from exc
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        # All 256 byte symbols up front: any later text stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise DataError(
            f"{path}: BPE training on this text found only {tok.get_vocab_size()} tokens, "
            f"short of vocab_size={vocab_size}; use vocab_size <= {tok.get_vocab_size()} or more text"
        )
    if cache_file is not None:
        _atomic_save(tok, cache_file)
    return tok


def _atomic_save(tok: Tokenizer, cache_file: Path) -> None:
    # Several ranks may train the same tokenizer at once; rename makes the
    # last writer win with a complete file instead of interleaved bytes.
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_file.parent, suffix=".tmp")
    os.close(fd)
    tok.save(tmp)
    os.replace(tmp, cache_file)
