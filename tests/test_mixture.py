"""data.sources: a weighted mixture of token sources whose blend is computed from the sequence number
(data/blend.py), so the position stays one integer; its held-out data; bad input refused before any rank
starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshfit.data import DataError, Mixture, Part, TokenBatches
from meshfit.data.blend import Blend, block_counts, sufficient_block
from meshfit.data.heldout import eval_mixture, held_out_batches

RANGE = 1000  # source s holds token ids [s·RANGE, (s+1)·RANGE): an id names its source


def _tokens(s: int, n: int) -> np.ndarray:
    return (s * RANGE + np.arange(n) % RANGE).astype(np.int64)


def _mixture(weights=(1, 2, 4), sizes=(3001, 4001, 801), block=1000, shuffle=True) -> Mixture:
    return Mixture(tuple(Part(_tokens(s, n), w, f"s{s}.npy", shuffle) for s, (w, n) in enumerate(zip(weights, sizes))),
                   block)


def _loader(mixture, dp_rank=0, dp_size=1, global_batch=8, seq_len=16, seed=5):
    return TokenBatches(mixture, seq_len=seq_len, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size,
                        seed=seed)


def test_block_counts_are_the_largest_remainder_rounding():
    assert block_counts([1, 2, 4], 1000).tolist() == [143, 286, 571]  # quotas 142.86, 285.71, 571.43
    assert block_counts([0.5, 0.3, 0.2], 1000).tolist() == [500, 300, 200]
    assert block_counts([1, 1, 1], 1000).tolist() == [334, 333, 333]  # a tie goes to the earlier source
    assert block_counts([1, 1, 1], 7).tolist() == [3, 2, 2]
    rng = np.random.default_rng(0)
    for _ in range(200):
        weights, block = rng.exponential(size=rng.integers(1, 9)), int(rng.integers(1, 5000))
        counts = block_counts(weights, block)
        assert counts.sum() == block and np.all(np.abs(counts - block * weights / weights.sum()) < 1)
    assert sufficient_block([1, 2, 1000]) == 1003 and block_counts([1, 2, 1000], 1003).min() == 1
    assert block_counts([1, 1000], 500).tolist() == [0, 500]  # quotas 0.4995, 499.5


def test_each_source_is_read_in_order_without_gaps_exactly_its_count_per_block():
    blend = Blend([1, 2, 4], block=100, seed=3)
    source, index = blend.locate(np.arange(1000))
    counts = [14, 29, 57]
    assert blend.counts.tolist() == counts
    for s, n in enumerate(counts):
        assert np.array_equal(index[source == s], np.arange(10 * n))  # the k-th of source s, in order
        assert all(np.sum(source[b * 100:(b + 1) * 100] == s) == n for b in range(10))
    assert not np.array_equal(source[:100], source[100:200])  # each block has its own seeded order
    assert not np.array_equal(source[:100], Blend([1, 2, 4], 100, seed=4).locate(np.arange(100))[0])
    for stop in (0, 57, 100, 731, 1000):
        assert blend.consumed(stop).tolist() == np.bincount(source[:stop], minlength=3).tolist()
    again, index_again = Blend([1, 2, 4], 100, seed=3).locate(np.array([731, 5, 999]))  # any order, no state
    assert again.tolist() == source[[731, 5, 999]].tolist() and index_again.tolist() == index[[731, 5, 999]].tolist()


def test_realized_shares_match_the_weights():
    """3 sources with disjoint ids, 400 steps of 8 sequences: the share of each source's ids is within
    the binomial bound (3σ) of its weight, and exactly n_s per whole block of 1000."""
    loader = _loader(_mixture())
    ids = torch.cat([loader.next_batch()[1].reshape(-1) for _ in range(400)])
    counts = torch.bincount(ids // RANGE, minlength=3).numpy()
    sequences = 400 * 8
    shares, weights = counts / counts.sum(), np.array([1, 2, 4]) / 7
    bound = 3 * np.sqrt(weights * (1 - weights) / sequences)
    assert np.all(np.abs(shares - weights) < bound), (shares, weights, bound)
    whole = _loader(_mixture())
    first = torch.cat([whole.next_batch()[1][:, 0] for _ in range(375)])  # 3000 sequences = 3 blocks
    assert torch.bincount(first // RANGE, minlength=3).tolist() == [3 * 143, 3 * 286, 3 * 571]


def test_each_source_is_its_own_window_stream_with_its_own_epochs():
    """Source 2 (801 tokens, 50 windows of 16 + 1) wraps many times; each of its epochs reads every window
    once, in its own order; the others stay in their first epoch."""
    loader = _loader(_mixture())
    starts = []
    for _ in range(100):
        x, _ = loader.next_batch()
        mine = x[x[:, 0] // RANGE == 2]
        assert torch.equal(mine, mine[:, :1] + torch.arange(16))  # whole windows
        starts += ((mine[:, 0] - 2 * RANGE) // 16).tolist()
    epochs = [starts[e * 50:(e + 1) * 50] for e in range(len(starts) // 50)]
    assert len(epochs) >= 8 and all(sorted(e) == list(range(50)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != list(range(50))
    state = loader.state_dict()
    assert state["source_epochs"] == [0, 0, len(starts) // 50] and state["epoch"] == len(starts) // 50
    plain = _loader(_mixture(shuffle=False))
    firsts = [int(s) for _ in range(20) for s in plain.next_batch()[0][:, 0] if s // RANGE == 2]
    assert firsts == [2 * RANGE + 16 * (k % 50) for k in range(len(firsts))]  # shuffle=False: file order


def test_the_stream_is_the_same_under_any_dp_size_and_resumes_from_the_position():
    mixture = _mixture()
    whole = _loader(mixture)
    reference = [whole.next_batch() for _ in range(6)]
    two = [_loader(mixture, dp_rank=r, dp_size=2) for r in range(2)]
    for step in range(3):
        assert torch.equal(torch.cat([r.next_batch()[0] for r in two]), reference[step][0])
    state = two[1].state_dict()  # saved at step 3 under dp 2, resumed under dp 4
    assert state["sequences_consumed"] == 24
    four = [_loader(mixture, dp_rank=r, dp_size=4) for r in range(4)]
    for r in four:
        r.load_state_dict(state)
    for step in range(3, 6):
        got = [r.next_batch() for r in four]
        assert torch.equal(torch.cat([g[0] for g in got]), reference[step][0])
        assert torch.equal(torch.cat([g[1] for g in got]), reference[step][1])


@pytest.mark.parametrize("weight", [0, -1, float("inf"), float("nan")])
def test_a_bad_weight_names_its_source(weight):
    with pytest.raises(DataError, match=f"s1.npy: weight {weight!r} is not valid; a weight is a finite number > 0"):
        _mixture(weights=(1, weight, 1))


def test_a_weight_without_a_share_of_the_block_and_no_sources_are_refused():
    with pytest.raises(DataError, match="s0.npy: its weight 1 gives it 0 of every 100 sequences; a block of ≥ 1001"):
        _mixture(weights=(1, 500, 500), block=100)
    with pytest.raises(DataError, match="a mixture needs at least one source"):
        Mixture(())


def test_a_held_out_mixture_is_one_block_of_the_evaluated_sequences():
    """N = 4 batches × 8 = 32 held-out sequences: source s gives exactly its rounded share of them, the
    same ones at every evaluation and under any dp size."""
    parts = [Part(_tokens(s, n), w, f"held{s}") for s, (w, n) in enumerate(zip((1, 2, 4), (200, 300, 400)))]
    held = eval_mixture(parts, global_batch=8, batches=4, seq_len=16)
    assert held.block == 32 and block_counts(held.weights, 32).tolist() == [5, 9, 18]
    reader = held_out_batches(held, seq_len=16, global_batch=8, dp_rank=0, dp_size=1, batches=4, name="held")
    passes = [torch.cat([y for _, y in reader]) for _ in range(2)]
    assert torch.equal(passes[0], passes[1])
    assert torch.bincount(passes[0][:, 0] // RANGE).tolist() == [5, 9, 18]
    halves = [held_out_batches(held, seq_len=16, global_batch=8, dp_rank=r, dp_size=2, batches=4, name="held")
              for r in range(2)]
    split = [list(h) for h in halves]
    assert torch.equal(torch.cat([torch.cat([a[1], b[1]]) for a, b in zip(*split)]), passes[0])
    with pytest.raises(DataError, match=r"held0: holds 50 tokens, i.e. 3 sequences .* an evaluation reads 5"):
        eval_mixture([Part(_tokens(0, 50), 1, "held0"), *parts[1:]], global_batch=8, batches=4, seq_len=16)
    with pytest.raises(DataError, match="held0: its weight 1 gives it 0 of the train.eval_batches × "
                                        "train.global_batch = 1 × 8 = 8 held-out sequences"):
        eval_mixture([Part(_tokens(0, 200), 1, "held0"), Part(_tokens(1, 200), 100, "held1")], 8, 1, 16)
