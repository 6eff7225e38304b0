"""Pretrained tokenizers and `meshfit prepare`: ids as transformers gives them, shards that depend on the
documents alone (not the input format, not the worker count), and every bad input named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import transformers
from tokenizer_fixture import make_tokenizer

from meshfit.commands.main import main
from meshfit.data.shards import METADATA, PreparedTokens, read_metadata
from meshfit.data.tokenizer import load_tokenizer

DOCS = [f"document {i}: " + " ".join(["the quick brown fox", "héllo wörld", "five dozen jugs"][i % 3]
                                      for _ in range(1 + i % 7)) for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("bos_in_template, config", [(True, {}), (False, {"add_bos_token": True}),
                                                     (False, {"add_bos_token": True, "add_eos_token": True}),
                                                     (False, {"bos_token": None})])
def test_ids_equal_transformers_fast_tokenizer_then_eos(tmp_path: Path, bos_in_template: bool, config: dict) -> None:
    folder = make_tokenizer(tmp_path, bos_in_template=bos_in_template, **config)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **settings)
    ours = load_tokenizer(folder).encode(DOCS[:5])
    for text, ids in zip(DOCS[:5], ours):
        expected = theirs.encode(text)
        assert ids.tolist() == (expected if expected[-1] == 1 else [*expected, 1])  # </s> = 1 closes a document


def _jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != METADATA}


def test_jsonl_and_parquet_give_the_same_shards_and_offsets(tmp_path: Path, tokenizer: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS}), tmp_path / "c.parquet", row_group_size=7)
    out = {}
    for name, args in (("jsonl", [str(_jsonl(tmp_path / "c.jsonl", DOCS))]),
                       ("parquet", [str(tmp_path / "c.parquet"), "--field", "body"])):
        assert main(["prepare", *args, "--tokenizer", str(tokenizer), "--out", str(tmp_path / name),
                     "--shard-tokens", "300"]) == 0
        out[name] = _shard_bytes(tmp_path / name)
    assert out["jsonl"] == out["parquet"] and len(out["jsonl"]) > 4  # several shards
    meta = read_metadata(tmp_path / "jsonl")
    ids = load_tokenizer(tokenizer).encode(DOCS)
    whole = np.concatenate(ids)
    assert (meta["documents"], meta["tokens"], meta["max_id"]) == (len(DOCS), len(whole), int(whole.max()))
    lengths = np.concatenate([np.diff(np.fromfile(tmp_path / "jsonl" / s["offsets"], dtype=np.int64))
                              for s in meta["shards"]])
    assert lengths.tolist() == [len(i) for i in ids]
    tokens = PreparedTokens(tmp_path / "jsonl")
    rows = np.arange(len(whole) - 10)[::37, None] + np.arange(11)  # windows crossing shard boundaries
    assert np.array_equal(tokens[rows], whole[rows]) and len(tokens) == len(whole)
    assert np.array_equal(tokens[5:][rows[:3]], whole[5:][rows[:3]])


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_four_workers_write_the_bytes_one_worker_writes(tmp_path: Path, tokenizer: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import meshfit.data.prepare

    monkeypatch.setattr(meshfit.data.prepare, "BATCH_CHARS", 3000)  # many batches, all workers busy
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(4):  # files in a folder, read in sorted order; one .txt is one document
        _jsonl(corpus / f"part-{k}.jsonl", DOCS[k::4] * 40)
    (corpus / "z.txt").write_text(DOCS[0])
    for workers in ("1", "4"):
        assert main(["prepare", str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / workers),
                     "--workers", workers, "--shard-tokens", "5000"]) == 0
    assert _shard_bytes(tmp_path / "1") == _shard_bytes(tmp_path / "4")
    assert read_metadata(tmp_path / "4")["documents"] == 4 * 15 * 40 + 1
