import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from meshfit.data import (
    DataError,
    MarkovSource,
    TokenBatches,
    check_files,
    load_token_file,
    make_source,
    tokenize_text,
    write_token_file,
)

# ------------------------------------------------------------------ synthetic


def test_markov_sequence_depends_only_on_seed_and_index():
    fresh = MarkovSource(64, seed=3).sequence(5, 100)
    warmed = MarkovSource(64, seed=3)
    for i in range(5):
        warmed.sequence(i, 100)
    assert torch.equal(fresh, warmed.sequence(5, 100))
    assert torch.equal(fresh, warmed.sequences(range(8), 100)[5])
    assert fresh.dtype == torch.long and fresh.shape == (100,)
    assert not torch.equal(fresh, warmed.sequence(6, 100))
    assert not torch.equal(fresh, MarkovSource(64, seed=4).sequence(5, 100))


def test_entropy_floor_matches_empirical_cross_entropy():
    src = MarkovSource(256, seed=0)
    floor = src.entropy_floor()
    assert 0 < floor < math.log(256) - 0.5
    seqs = src.sequences(range(200), 1000)
    empirical = -torch.log(src.transition_probs(seqs[:, :-1], seqs[:, 1:])).mean().item()
    assert empirical == pytest.approx(floor, rel=0.02)


@pytest.mark.parametrize("vocab_size,k", [(16, 16), (50, 32), (300, 32)])
def test_sparse_chain_is_a_proper_chain_with_exact_stationary_distribution(vocab_size, k):
    src = MarkovSource(vocab_size, seed=2)
    assert src.successors == k and src.successor_ids.shape == src.successor_probs.shape == (vocab_size, k)
    assert all(len(set(row.tolist())) == k for row in src.successor_ids)  # distinct successors
    prev = torch.arange(vocab_size).repeat_interleave(vocab_size)
    dense = src.transition_probs(prev, torch.arange(vocab_size).repeat(vocab_size)).view(vocab_size, vocab_size)
    assert torch.allclose(dense.sum(dim=1), torch.ones(vocab_size, dtype=torch.float64), atol=1e-12)
    assert dense.min() > 0  # the uniform restart reaches every token
    assert torch.allclose(src.stationary @ dense, src.stationary, atol=1e-13)
    assert src.stationary.sum().item() == pytest.approx(1.0, abs=1e-12)
    dense_floor = -(src.stationary @ torch.special.xlogy(dense, dense).sum(dim=1)).item()
    assert src.entropy_floor() == pytest.approx(dense_floor, rel=1e-12)


def test_llama3_sized_vocab_stores_only_sparse_rows():
    vocab_size, k = 128_256, 32
    src = MarkovSource(vocab_size, seed=0)
    assert src.successor_ids.shape == src.successor_probs.shape == (vocab_size, k)
    assert src.stationary.shape == (vocab_size,) and src.stationary.dtype == torch.float64
    tensors = [v for v in vars(src).values() if isinstance(v, (torch.Tensor, np.ndarray))]
    stored = sum(t.nbytes for t in tensors)
    assert stored <= 3 * vocab_size * k * 8 + 2 * vocab_size * 8  # ids, probs, CDF, pi, start CDF
    assert stored < 2**30 / 8  # a dense float64 matrix would be 131 GB
    assert 0 < src.entropy_floor() < math.log(vocab_size) - 2
    seqs = src.sequences(range(4), 64)
    assert seqs.shape == (4, 64) and 0 <= seqs.min() and seqs.max() < vocab_size


def test_markov_batch_generation_is_fast():
    src = MarkovSource(256, seed=1)
    src.sequences(range(64), 256)  # warm-up
    start = time.perf_counter()
    src.sequences(range(64, 128), 256)
    assert time.perf_counter() - start < 0.5  # ~10 ms typical; loose for busy CI


# --------------------------------------------------------------------- loader


def _sources():
    return [MarkovSource(50, seed=7), np.arange(10_000, dtype=np.uint16) % 50]


def _loader(source, dp_rank=0, dp_size=1, global_batch=8, seq_len=16):
    return TokenBatches(source, seq_len=seq_len, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size)


@pytest.mark.parametrize("source", _sources(), ids=["markov", "tokens"])
def test_dp_rank_slices_partition_the_global_batch_in_order(source):
    whole = _loader(source)
    halves = [_loader(source, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        x, y = whole.next_batch()
        parts = [h.next_batch() for h in halves]
        assert parts[0][0].shape == (4, 16)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert x.dtype == y.dtype == torch.long and y.is_contiguous()


def test_token_windows_are_contiguous_and_wrap_by_epoch():
    tokens = np.arange(1000, dtype=np.int64)
    loader = _loader(tokens, global_batch=4, seq_len=10)
    assert loader.windows_per_epoch == 99
    x, y = loader.next_batch()
    assert torch.equal(x[1], torch.arange(10, 20)) and torch.equal(y[1], torch.arange(11, 21))
    loader.load_state_dict({**loader.state_dict(), "sequences_consumed": 99})
    assert loader.epoch == 1
    assert torch.equal(loader.next_batch()[0][0], torch.arange(10))


@pytest.mark.parametrize("source", _sources(), ids=["markov", "tokens"])
def test_resume_continues_exactly_even_with_another_dp_size(source):
    reference = _loader(source)
    for _ in range(3):
        reference.next_batch()
    expected = reference.next_batch()

    interrupted = _loader(source)
    for _ in range(3):
        interrupted.next_batch()
    state = interrupted.state_dict()
    assert state["sequences_consumed"] == 24 and state["global_batch"] == 8 and state["seq_len"] == 16

    same = _loader(source)
    same.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(same.next_batch(), expected))

    ranks = [_loader(source, dp_rank=r, dp_size=4) for r in range(4)]
    for r in ranks:
        r.load_state_dict(state)
    got = [r.next_batch() for r in ranks]
    assert torch.equal(torch.cat([g[0] for g in got]), expected[0])
    assert torch.equal(torch.cat([g[1] for g in got]), expected[1])


def test_resume_with_other_batch_shape_is_refused():
    state = _loader(_sources()[0]).state_dict()
    with pytest.raises(ValueError, match="saved with global_batch=8, now 16"):
        _loader(_sources()[0], global_batch=16).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len=16, now 32"):
        _loader(_sources()[0], seq_len=32).load_state_dict(state)


def test_indivisible_global_batch_lists_valid_dp_sizes():
    with pytest.raises(ValueError, match="valid dp sizes: 1, 2, 3, 4, 6, 12"):
        _loader(_sources()[0], global_batch=12, dp_size=5)


# ---------------------------------------------------------------- token files


@pytest.mark.parametrize("name,dtype", [("t.npy", None), ("t.npy", "int32"), ("t.bin", None), ("t.bin", "uint32")])
def test_token_file_roundtrip(tmp_path, name, dtype):
    tokens = np.random.default_rng(0).integers(0, 70_000 if dtype == "uint32" else 1000, size=5000)
    path = write_token_file(tmp_path / name, tokens, dtype=dtype)
    loaded = load_token_file(path, vocab_size=70_000)
    assert isinstance(loaded, np.memmap) and Path(loaded.filename) == path.resolve()
    np.testing.assert_array_equal(loaded, tokens)
    if dtype:
        assert loaded.dtype == np.dtype(dtype)


def test_bin_dtype_argument_and_sidecar(tmp_path):
    raw = tmp_path / "raw.bin"
    np.arange(100, dtype=np.uint32).tofile(raw)  # no sidecar: caller names the dtype
    np.testing.assert_array_equal(load_token_file(raw, 100, dtype="uint32"), np.arange(100))
    path = write_token_file(tmp_path / "t.bin", np.arange(100), dtype="int32")
    assert json.loads((tmp_path / "t.bin.json").read_text()) == {"dtype": "int32"}
    with pytest.raises(DataError, match="t.bin.json says 'int32'"):
        load_token_file(path, 100, dtype="uint16")


def _bad_missing(d):
    return d / "missing.npy"


def _bad_empty(d):
    (d / "empty.bin").write_bytes(b"")
    return d / "empty.bin"


def _bad_float(d):
    np.save(d / "tokens.npy", np.zeros(10, dtype=np.float32))
    return d / "tokens.npy"


def _bad_too_large(d):
    return write_token_file(d / "big.npy", [1, 2, 100, 3])


def _bad_negative(d):
    return write_token_file(d / "neg.npy", [1, -4, 2])


def _bad_odd_size(d):
    (d / "odd.bin").write_bytes(b"\x01\x00\x02")
    return d / "odd.bin"


@pytest.mark.parametrize(
    "make,needle",
    [
        (_bad_missing, "does not exist"),
        (_bad_empty, "empty"),
        (_bad_float, "has dtype float32; token files must hold integers (uint16, uint32, int32 or int64)"),
        (_bad_too_large, "token id 100 at position 2 is out of range; ids must be < vocab_size=50"),
        (_bad_negative, "negative token id -4 at position 1"),
        (_bad_odd_size, "has 3 bytes, not a multiple of 2"),
    ],
)
def test_bad_token_files_name_the_file(tmp_path, make, needle):
    path = make(tmp_path)
    with pytest.raises(DataError) as err:
        load_token_file(path, vocab_size=50)
    assert path.name in str(err.value) and needle in str(err.value)


def test_too_short_token_file_names_the_file(tmp_path):
    tokens = load_token_file(write_token_file(tmp_path / "short.npy", np.arange(100)), vocab_size=100)
    with pytest.raises(DataError, match=r"short\.npy: has 100 tokens; one sequence needs seq_len\+1 = 257"):
        TokenBatches(tokens, seq_len=256, global_batch=2, dp_rank=0, dp_size=1)


# ----------------------------------------------------------------------- text


def test_byte_tokenization_of_file_and_sorted_directory(tmp_path):
    (tmp_path / "b.txt").write_text("wörld", encoding="utf-8")
    (tmp_path / "a.txt").write_text("hi ", encoding="utf-8")
    ids = tokenize_text(tmp_path, "byte", vocab_size=256)
    assert bytes(ids.astype(np.uint8)) == "hi wörld".encode()
    with pytest.raises(DataError, match="a.txt.*vocab_size >= 256"):
        tokenize_text(tmp_path / "a.txt", "byte", vocab_size=100)


def test_bad_text_files_name_the_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty.txt: text file is empty"):
        tokenize_text(tmp_path / "empty.txt", "byte", 256)
    (tmp_path / "latin1.txt").write_bytes(b"abc\xe9def")
    with pytest.raises(DataError, match="latin1.txt: invalid UTF-8 at byte offset 3"):
        tokenize_text(tmp_path / "latin1.txt", "byte", 256)


def _generated_text(n_words=4000):
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = ["".join(rng.choice(letters, size=rng.integers(3, 9))) for _ in range(40)]
    words = rng.choice(lexicon, size=n_words)
    return "\n".join(" ".join(words[i : i + 12]) for i in range(0, n_words, 12))


def test_bpe_trained_on_text_honours_vocab_and_reuses_cache(tmp_path):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text(_generated_text(), encoding="utf-8")
    cache = tmp_path / "cache"
    ids = tokenize_text(text_file, "bpe", vocab_size=400, cache_dir=cache)
    (saved,) = cache.glob("*/tokenizer.json")
    tok = Tokenizer.from_file(str(saved))
    assert tok.get_vocab_size() == 400 and ids.max() < 400
    assert len(ids) < len(text_file.read_bytes()) / 2  # merges were learned
    assert tok.decode(ids.tolist()) == text_file.read_text(encoding="utf-8")

    mtime = saved.stat().st_mtime_ns
    again = tokenize_text(text_file, "bpe", vocab_size=400, cache_dir=cache)
    np.testing.assert_array_equal(again, ids)
    assert saved.stat().st_mtime_ns == mtime and len(list(cache.glob("*/tokenizer.json"))) == 1


def test_bpe_needs_enough_text_for_the_vocab(tmp_path):
    (tmp_path / "tiny.txt").write_text("ab ab ab")
    with pytest.raises(DataError, match="tiny.txt: BPE training .* vocab_size=1000"):
        tokenize_text(tmp_path / "tiny.txt", "bpe", vocab_size=1000)


def test_bpe_text_length_is_checked_before_training_without_writing_anything(tmp_path, monkeypatch):
    """A text with enough words is accepted without training the tokenizer (BPE gives at least one token
    per word); one with few words is tokenized in memory and its real token count decides."""
    import meshfit.data.files as files

    corpus, long_word, sentence = tmp_path / "corpus.txt", tmp_path / "word.txt", tmp_path / "sentence.txt"
    corpus.write_text(_generated_text())
    long_word.write_text("".join(np.random.default_rng(0).choice(list("abcdefghijklmnopqrstuvwxyz"), 200)))
    sentence.write_text("hello world, this is a short text. ")
    words = len(corpus.read_bytes().split())
    trained = []
    real = files.tokenize_text
    monkeypatch.setattr(files, "tokenize_text", lambda *a, **k: trained.append(a[0]) or real(*a, **k))
    check_files("text", corpus, words - 1, "bpe", vocab_size=400)
    assert trained == []  # settled by its words
    counted = len(real(corpus, "bpe", 400))
    check_files("text", corpus, counted - 1, "bpe", vocab_size=400)  # fewer words than that: trained
    with pytest.raises(DataError, match=f"corpus.txt: gives {counted} tokens with data.tokenizer=bpe"):
        check_files("text", corpus, counted, "bpe", vocab_size=400)
    check_files("text", long_word, 64, "bpe", vocab_size=260)  # one word, yet 191 tokens
    with pytest.raises(DataError, match=r"gives 18 tokens .* train.seq_len \+ 1 = 33"):
        check_files("text", sentence, 32, "bpe", vocab_size=270)
    assert trained == [corpus, corpus, long_word, sentence] and sorted(tmp_path.iterdir()) == sorted(
        [corpus, long_word, sentence])  # nothing written (no tokenizer cache)


# ---------------------------------------------------------------- make_source


def test_make_source_dispatch_and_errors(tmp_path):
    assert isinstance(make_source("synthetic", path=None, vocab_size=32, seed=1), MarkovSource)
    path = write_token_file(tmp_path / "t.npy", np.arange(64))
    np.testing.assert_array_equal(make_source("tokens", path=str(path), vocab_size=64, seed=0), np.arange(64))
    (tmp_path / "x.txt").write_text("hello")
    assert len(make_source("text", path=tmp_path / "x.txt", vocab_size=256, seed=0)) == 5
    with pytest.raises(ValueError, match="data.source='csv' is not valid; choose one of synthetic, text, tokens"):
        make_source("csv", path=None, vocab_size=32, seed=0)
    with pytest.raises(ValueError, match="data.path is required"):
        make_source("tokens", path=None, vocab_size=32, seed=0)
