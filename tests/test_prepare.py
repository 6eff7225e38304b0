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


def _prepare(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, list[str]]:
    code = main(["prepare", *argv])
    return code, capsys.readouterr().err.strip().splitlines()


def test_every_bad_input_is_one_error_line_and_leaves_nothing(tmp_path: Path, tokenizer: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = _jsonl(tmp_path / "good.jsonl", DOCS[:3])
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    (tmp_path / "other.jsonl").write_text('{"text": "a"}\n{"body": "b", "id": 2}\n')
    (tmp_path / "empty.jsonl").write_text('{"text": "a"}\n{"text": "   "}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    (tmp_path / "notok").mkdir()
    cases = [
        ([str(good), str(tmp_path / "broken.jsonl")], tokenizer, "broken.jsonl, line 2: not JSON"),
        ([str(tmp_path / "other.jsonl")], tokenizer, "other.jsonl, line 2: no field 'text' (found: body, id)"),
        ([str(tmp_path / "empty.jsonl")], tokenizer, "empty.jsonl, line 2: empty document"),
        ([str(tmp_path / "latin1.txt")], tokenizer, "latin1.txt: not UTF-8 text (byte 3"),
        ([str(tmp_path / "nocol.parquet")], tokenizer, "nocol.parquet: no column 'text' (columns: body)"),
        ([str(good)], tmp_path / "notok", "the folder has no tokenizer.json"),
        ([str(tmp_path / "missing.jsonl")], tokenizer, "missing.jsonl: no such file or folder"),
    ]
    for inputs, tok, needle in cases:
        code, err = _prepare(capsys, *inputs, "--tokenizer", str(tok), "--out", str(tmp_path / "out"))
        assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (needle, err)
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.prepare-*")), needle
    code, _ = _prepare(capsys, str(tmp_path / "empty.jsonl"), "--tokenizer", str(tokenizer), "--out",
                       str(tmp_path / "out"), "--skip-empty")
    assert code == 0 and read_metadata(tmp_path / "out")["skipped_empty_documents"] == 1
    code, err = _prepare(capsys, str(good), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"))
    assert code == 2 and "already exists and is not empty" in err[0] and read_metadata(tmp_path / "out")["documents"] == 1
    assert _prepare(capsys, str(good), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"),
                    "--overwrite")[0] == 0 and read_metadata(tmp_path / "out")["documents"] == 3


def _train_refusal(capsys: pytest.CaptureFixture, tmp_path: Path, *sets: str) -> str:
    argv = ["train", "--run-dir", str(tmp_path / "run")]
    for item in ["model.preset=tiny", "model.vocab_size=512", "train.seq_len=16", *sets]:
        argv += ["--set", item]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert not (tmp_path / "run").exists()
    return err[0]


def test_training_refuses_shards_cut_short_another_tokenizer_and_a_larger_vocabulary(
        tmp_path: Path, tokenizer: Path, capsys: pytest.CaptureFixture) -> None:
    good = _jsonl(tmp_path / "good.jsonl", DOCS)
    assert main(["prepare", str(good), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "prep")]) == 0
    shards = [f"data.source=tokens", f"data.path={tmp_path / 'prep'}"]
    other = make_tokenizer(tmp_path / "other", vocab=290)
    assert "is not the tokenizer data.path=" in _train_refusal(capsys, tmp_path, *shards, f"data.tokenizer={other}")
    small = ["model.vocab_size=256", f"data.tokenizer={tokenizer}"]
    assert "has 300 tokens, more than the model's vocabulary of 256" in _train_refusal(capsys, tmp_path, *shards, *small)
    tokens = tmp_path / "prep" / "shard-00000.tokens"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    assert "shard-00000.tokens holds" in _train_refusal(capsys, tmp_path, *shards)


def test_training_on_shards_equals_training_on_the_same_tokens_in_one_file(tmp_path: Path, tokenizer: Path) -> None:
    from meshfit.config import load_config
    from meshfit.train.launch import launch

    good = _jsonl(tmp_path / "good.jsonl", DOCS * 4)
    assert main(["prepare", str(good), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "prep"),
                 "--shard-tokens", "500"]) == 0
    np.save(tmp_path / "same.npy", np.concatenate(load_tokenizer(tokenizer).encode(DOCS * 4)))
    base = ["model.preset=tiny", "model.vocab_size=512", "train.seq_len=32", "train.global_batch=4", "train.steps=3",
            "data.source=tokens", "checkpoint.at_end=false", "data.shuffle=true"]  # prepared data shuffles by default
    losses = {}
    for name, path in (("shards", tmp_path / "prep"), ("file", tmp_path / "same.npy")):
        outcome = launch(load_config(None, [*base, f"data.path={path}"]), tmp_path / name)
        assert outcome.ok, outcome.message
        losses[name] = outcome.result["losses"]
    assert losses["shards"] == losses["file"]


def test_prompt_response_pairs_count_only_the_response_as_targets(tmp_path: Path, tokenizer: Path) -> None:
    import torch

    from meshfit.data.boundaries import IGNORE
    from meshfit.data.loader import TokenBatches

    pairs = [(f"question {i}: the quick fox?", f"answer {i}: " + "héllo wörld " * (1 + i % 3)) for i in range(40)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"q": p, "a": r}) + "\n" for p, r in pairs))
    assert main(["prepare", str(path), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "sft"),
                 "--prompt-field", "q", "--response-field", "a", "--shard-tokens", "200"]) == 0
    tok = load_tokenizer(tokenizer)
    encoded = tok.encode_pairs(pairs)
    ids = np.concatenate([i for i, _ in encoded]).astype(np.int64)
    counted = np.concatenate([c for _, c in encoded]).astype(bool)
    for (i, c), (prompt, response) in zip(encoded, pairs, strict=True):
        # The prompt as a document's start (BOS), then the response's own tokens, then EOS; only those count.
        head = tok.encode([prompt])[0][:-1].tolist()
        assert i.tolist()[:len(head)] == head and not c[:len(head)].any() and c[len(head):].all()
        assert i[-1] == tok.eos_id
    batches = TokenBatches(PreparedTokens(tmp_path / "sft"), seq_len=32, global_batch=4, dp_rank=0, dp_size=1)
    inputs, targets = batches.next_batch()
    starts = np.arange(4)[:, None] * 32 + np.arange(33)  # file order: windows 0..3
    assert torch.equal(inputs, torch.from_numpy(ids[starts[:, :-1]].astype(np.int64)))
    expected = np.where(counted[starts[:, 1:]], ids[starts[:, 1:]], IGNORE)
    assert torch.equal(targets, torch.from_numpy(expected.astype(np.int64)))
    assert (targets == IGNORE).any() and (targets != IGNORE).any()
    code = main(["prepare", str(path), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "x"),
                 "--prompt-field", "q"])
    assert code == 2


def test_a_run_on_prompt_response_data_trains_on_the_responses(tmp_path: Path, tokenizer: Path) -> None:
    from meshfit.config import load_config
    from meshfit.train.launch import launch

    pairs = [(f"q{i}: the quick fox?", "a: héllo wörld " * (1 + i % 3)) for i in range(60)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"q": p, "a": r}) + "\n" for p, r in pairs))
    assert main(["prepare", str(path), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "sft"),
                 "--prompt-field", "q", "--response-field", "a"]) == 0
    base = ["model.preset=tiny", "model.vocab_size=512", "train.seq_len=32", "train.global_batch=4", "train.steps=4",
            "data.source=tokens", f"data.path={tmp_path / 'sft'}", "checkpoint.at_end=false", "train.lr=1e-2"]
    outcome = launch(load_config(None, base), tmp_path / "run")
    assert outcome.ok, outcome.message
    losses = outcome.result["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
