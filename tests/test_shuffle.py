"""data.shuffle: a seeded permutation of a token array's windows per epoch (data/permutation.py,
data/windows.py), computed index by index: every window once per epoch, the same order under any
data-parallel size, exact mid-epoch resume from the one-integer position, nothing O(windows) in memory."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
import torch

from meshfit.config import ConfigError, load_config
from meshfit.data import TokenBatches
from meshfit.data.permutation import MAX_SIZE, IndexPermutation
from meshfit.data.shards import METADATA as PREPARED_MARKER
from meshfit.data.windows import resolve_shuffle
from meshfit.train.shape import resolve_run

SIZES = [*range(1, 130), 211, 256, 257, 997, 1024, 4093, 4096, 7919, 65521, 65536, 65537, 100_003]


@pytest.mark.parametrize("size", SIZES)
def test_the_permutation_is_a_bijection_and_inverse_undoes_it(size):
    perm = IndexPermutation(size, (7, 1, size))
    image = perm[np.arange(size)]
    assert image.dtype == np.int64 and np.array_equal(np.sort(image), np.arange(size))
    assert np.array_equal(perm.inverse(image), np.arange(size))


@pytest.mark.parametrize("size", [10**12, 3 * 10**12 + 7, MAX_SIZE])
def test_the_permutation_of_a_huge_range_is_computed_index_by_index(size):
    indices = np.random.default_rng(0).integers(0, size, 100_000)
    perm = IndexPermutation(size, (0, 5))
    image = perm[indices]
    assert image.min() >= 0 and image.max() < size
    assert len(np.unique(image)) == len(np.unique(indices))  # no two indices share an image
    assert np.array_equal(perm.inverse(image), indices)
    assert perm[int(indices[3])] == image[3]  # one index at a time, as a 0-d array
    with pytest.raises(IndexError):
        perm[np.array([size])]


def test_the_order_depends_on_the_key_and_looks_random():
    size = 10_000
    first, other = (IndexPermutation(size, key)[np.arange(size)] for key in [(0, 0), (0, 1)])
    assert abs(np.corrcoef(np.arange(size), first)[0, 1]) < 0.05  # not close to file order
    assert np.sum(first == np.arange(size)) < 10  # ~1 fixed point expected
    assert np.mean(first != other) > 0.99
    # Where element 0 goes, over many keys, for a size that needs cycle walking: uniform (χ², 9 degrees of
    # freedom; 27.9 is its 0.1% tail).
    landing = [int(IndexPermutation(10, (k,))[0]) for k in range(2000)]
    counts = np.bincount(landing, minlength=10)
    assert ((counts - 200) ** 2 / 200).sum() < 27.9


def _loader(tokens, dp_rank=0, dp_size=1, global_batch=9, seq_len=10, shuffle=True, seed=3):
    return TokenBatches(tokens, seq_len=seq_len, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size,
                        shuffle=shuffle, seed=seed)


def _windows(inputs: torch.Tensor, seq_len: int = 10) -> list[int]:
    return (inputs[:, 0] // seq_len).tolist()  # tokens = arange: a window's first token names it


def test_every_window_once_per_epoch_each_epoch_in_its_own_order():
    tokens = np.arange(991, dtype=np.int64)  # 99 windows of 11 tokens, 10 apart
    loader = _loader(tokens)
    assert loader.windows_per_epoch == 99
    seen = []
    for _ in range(3 * 11):  # 3 epochs of 11 batches of 9
        x, y = loader.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[:, 0] % 10, torch.zeros(9, dtype=torch.long))
        seen += _windows(x)
    epochs = [seen[e * 99:(e + 1) * 99] for e in range(3)]
    assert all(sorted(epoch) == list(range(99)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2] != list(range(99))
    assert loader.epoch == 3
    assert _windows(_loader(tokens, seed=4).next_batch()[0]) != epochs[0][:9]  # the seed chooses the order
    file_order = _loader(tokens, shuffle=False)
    assert [w for _ in range(11) for w in _windows(file_order.next_batch()[0])] == list(range(99))


def test_the_shuffled_order_is_the_same_under_any_dp_size_and_resumes_mid_epoch():
    tokens = np.arange(991, dtype=np.int64)
    whole = _loader(tokens)
    reference = [whole.next_batch()[0] for _ in range(8)]  # crosses into the second epoch at sequence 99
    for dp in (3, 9):
        ranks = [_loader(tokens, dp_rank=r, dp_size=dp) for r in range(dp)]
        for step in range(8):
            assert torch.equal(torch.cat([r.next_batch()[0] for r in ranks]), reference[step])
    one = _loader(tokens)
    for _ in range(5):  # stop mid-epoch, at sequence 45
        one.next_batch()
    state = one.state_dict()
    resumed = [_loader(tokens, dp_rank=r, dp_size=3) for r in range(3)]
    for r in resumed:
        r.load_state_dict(state)
    for step in range(5, 8):
        assert torch.equal(torch.cat([r.next_batch()[0] for r in resumed]), reference[step])


class Corpus:
    """A token array of 10^13 tokens that exists nowhere: token i is i mod 50 000. Only len() and fancy
    indexing, as a reader of a folder of shards offers."""

    def __len__(self) -> int:
        return 10**13

    def __getitem__(self, index: np.ndarray) -> np.ndarray:
        return np.asarray(index) % 50_000


def test_a_corpus_of_billions_of_windows_shuffles_without_an_array_of_them():
    loader = TokenBatches(Corpus(), seq_len=4096, global_batch=64, dp_rank=1, dp_size=2, shuffle=True, seed=1)
    assert loader.windows_per_epoch == (10**13 - 1) // 4096  # 2.4e9 windows
    loader.load_state_dict({**loader.state_dict(), "sequences_consumed": 5 * loader.windows_per_epoch - 64})
    tracemalloc.start()
    start = time.perf_counter()
    x, y = loader.next_batch()  # the end of epoch 4
    x2, _ = loader.next_batch()  # the start of epoch 5
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 2 and peak < 8 * 2**20  # the rows themselves are 32 × 4097 × 8 B ≈ 1 MiB
    assert x.shape == (32, 4096) and torch.equal(x[:, 1:], y[:, :-1])
    starts = x[:, 0].numpy()
    assert np.array_equal(x.numpy(), (starts[:, None] + np.arange(4096)) % 50_000)  # whole windows
    assert loader.epoch == 5 and not torch.equal(x, x2)


def test_shuffle_is_on_by_default_only_for_prepared_data_folders(tmp_path):
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / PREPARED_MARKER).write_text("{}")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("abc")
    (tmp_path / "t.npy").write_bytes(b"")
    assert resolve_shuffle(None, prepared) is True
    assert [resolve_shuffle(None, p) for p in (tmp_path / "text", tmp_path / "t.npy", None)] == [False] * 3
    assert resolve_shuffle(False, prepared) is False and resolve_shuffle(True, tmp_path / "t.npy") is True


def test_shuffle_is_refused_for_synthetic_data():
    with pytest.raises(ConfigError, match="data.shuffle does not apply to data.source=synthetic"):
        resolve_run(load_config(None, ["data.shuffle=true"]), 1)
    resolve_run(load_config(None, ["data.shuffle=false"]), 1)
