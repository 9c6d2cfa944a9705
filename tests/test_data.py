"""Tests for `colossal_lab.training.data`: the standard-library corpus, tokenizer, caches, batches.

Small on purpose (40 files, a 600-token vocabulary): the whole file runs in seconds on
two CPU cores. The full build is timed by hand, not here.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections import Counter

import numpy as np
import pytest
import torch

from colossal_lab.training import data

MAX_FILES = 40
VOCAB = 600


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache folder holding the tokenizer and both token streams of the small corpus."""
    cache_dir = tmp_path_factory.mktemp("cache")
    for split in data.SPLITS:
        data.load_tokens(split, VOCAB, MAX_FILES, cache_dir)
    return cache_dir


def _cache_files(cache_dir):
    return sorted(p for p in cache_dir.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- files


def test_corpus_files_sorted_and_deterministic():
    files = data.corpus_files()
    rels = [p.relative_to(data.stdlib_root()).as_posix() for p in files]
    assert rels == sorted(rels)
    assert len(files) > 500
    assert files == data.corpus_files()
    assert all(p.suffix == ".py" and p.is_file() for p in files)
    assert not any(
        part in ("site-packages", "dist-packages") or part.startswith("config-3")
        for p in files
        for part in p.parts
    )
    assert not any(p.name.startswith("_sysconfigdata") for p in files)


@pytest.mark.parametrize("max_files", [2, 3, 17, MAX_FILES])
def test_corpus_files_subset(max_files):
    subset = data.corpus_files(max_files)
    assert len(subset) == max_files
    assert subset == data.corpus_files(max_files)
    assert set(subset) <= set(data.corpus_files())


def test_max_files_beyond_corpus_is_the_whole_corpus():
    everything = data.corpus_files()
    assert data.corpus_files(len(everything) + 10) == everything


@pytest.mark.parametrize("max_files", [0, 1])
def test_max_files_too_small(max_files):
    with pytest.raises(ValueError, match="max_files >= 2"):
        data.corpus_files(max_files)


@pytest.mark.parametrize("max_files", [2, 3, MAX_FILES, None])
def test_split_disjoint_and_non_empty(max_files):
    files = data.corpus_files(max_files)
    train = {p for p in files if data.split_of(p) == "train"}
    val = {p for p in files if data.split_of(p) == "val"}
    assert train and val
    assert not train & val
    assert train | val == set(files)


def test_split_is_a_function_of_the_relative_path():
    everything = data.corpus_files()
    for p in everything[:50]:
        rel = p.relative_to(data.stdlib_root())
        assert data.split_of(p) == data.split_of(rel) == data.split_of(rel.as_posix())
    # A file keeps its split whatever max_files: val never leaks into a subset's train.
    full_val = {p for p in everything if data.split_of(p) == "val"}
    small_val = {p for p in data.corpus_files(MAX_FILES) if data.split_of(p) == "val"}
    assert small_val <= full_val
    assert 0.02 < len(full_val) / len(everything) < 0.10


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(cache):
    tokenizer = data.train_tokenizer(VOCAB, MAX_FILES, cache)
    snippet = inspect.getsource(textwrap.dedent)
    for text in (snippet, "π ≈ 3.14159  # naïve café 😀\r\n\tx = '\\x00'", ""):
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode(snippet).ids) < len(snippet.encode())  # merges happened


def test_tokenizer_special_token(cache):
    tokenizer = data.train_tokenizer(VOCAB, MAX_FILES, cache)
    assert tokenizer.token_to_id(data.EOS_TOKEN) == data.EOS_ID
    assert tokenizer.get_vocab_size() == VOCAB


@pytest.mark.parametrize("vocab_size", [0, 256, data.MIN_VOCAB_SIZE - 1])
def test_vocab_too_small(vocab_size, tmp_path):
    with pytest.raises(ValueError, match=f"vocab_size >= {data.MIN_VOCAB_SIZE}"):
        data.train_tokenizer(vocab_size, MAX_FILES, tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        data.load_tokens("train", vocab_size, MAX_FILES, tmp_path)


def test_smallest_vocab_works(tmp_path):
    tokenizer = data.train_tokenizer(data.MIN_VOCAB_SIZE, 4, tmp_path)
    assert tokenizer.get_vocab_size() == data.MIN_VOCAB_SIZE


def test_deterministic_build(cache, tmp_path):
    """A second build from scratch gives the same tokenizer and the same token ids."""
    again = data.train_tokenizer(VOCAB, MAX_FILES, tmp_path)
    assert again.to_str() == data.train_tokenizer(VOCAB, MAX_FILES, cache).to_str()
    for split in data.SPLITS:
        torch.testing.assert_close(
            data.load_tokens(split, VOCAB, MAX_FILES, tmp_path),
            data.load_tokens(split, VOCAB, MAX_FILES, cache),
            rtol=0,
            atol=0,
        )


# --------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("split", data.SPLITS)
def test_token_stream(split, cache):
    stream = data.load_tokens(split, VOCAB, MAX_FILES, cache)
    n_files = sum(data.split_of(p) == split for p in data.corpus_files(MAX_FILES))
    assert stream.dim() == 1 and stream.dtype == torch.int32
    assert 0 <= int(stream.min()) and int(stream.max()) < VOCAB
    assert int((stream == data.EOS_ID).sum()) == n_files  # one EOS after every file
    assert int(stream[-1]) == data.EOS_ID


def test_bad_split(cache):
    with pytest.raises(ValueError, match="split="):
        data.load_tokens("test", VOCAB, MAX_FILES, cache)


def test_cache_reused(cache, monkeypatch):
    """The second call reads the cache: no training, no encoding, no file rewritten."""
    before = {p: p.stat().st_mtime_ns for p in _cache_files(cache)}
    tokenizer = data.train_tokenizer(VOCAB, MAX_FILES, cache)

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt although the cache holds it")

    monkeypatch.setattr(data, "_train_bpe", fail)
    monkeypatch.setattr(data, "_encode_files", fail)
    assert data.train_tokenizer(VOCAB, MAX_FILES, cache).to_str() == tokenizer.to_str()
    for split in data.SPLITS:
        data.load_tokens(split, VOCAB, MAX_FILES, cache)
    assert {p: p.stat().st_mtime_ns for p in _cache_files(cache)} == before


def test_cache_keys(cache):
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    major, minor = sys.version_info[:2]
    assert folder.name.startswith(f"stdlib-py{major}.{minor}-")
    names = sorted(p.name for p in folder.iterdir())
    assert names[0] == f"tokenizer-v{VOCAB}-f{MAX_FILES}.json"
    assert [n.split("-")[1] for n in names[1:]] == ["train", "val"]


def test_default_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_CACHE", str(tmp_path))
    data.train_tokenizer(data.MIN_VOCAB_SIZE, 4)
    assert [p.suffix for p in _cache_files(tmp_path)] == [".json"]


def test_interrupted_write_leaves_no_cache(tmp_path, monkeypatch):
    """A crash while writing the .npy leaves neither a cache file nor a temporary one."""

    def crash(f, array):
        f.write(b"\x93NUMPY half a header")
        raise RuntimeError("disk full")

    with monkeypatch.context() as m:
        m.setattr(np, "save", crash)
        with pytest.raises(RuntimeError, match="disk full"):
            data.load_tokens("val", VOCAB, MAX_FILES, tmp_path)
    assert [p.suffix for p in _cache_files(tmp_path)] == [".json"]  # tokenizer only
    assert data.load_tokens("val", VOCAB, MAX_FILES, tmp_path).numel() > 0


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("seq_len", [1, 7, 64, 333])
@pytest.mark.parametrize("split", data.SPLITS)
def test_packed_sequences(split, seq_len, cache):
    stream = data.load_tokens(split, VOCAB, MAX_FILES, cache)
    rows = data.packed_sequences(split, seq_len, VOCAB, MAX_FILES, cache)
    n_seq = stream.numel() // (seq_len + 1)
    assert rows.shape == (n_seq, seq_len + 1)
    # Non-overlapping consecutive chunks of the stream; only the tail is dropped.
    assert torch.equal(rows.flatten(), stream[: n_seq * (seq_len + 1)])
    inputs, labels = rows[:, :-1], rows[:, 1:]
    assert torch.equal(labels[:, :-1], inputs[:, 1:])


def test_seq_len_too_long(cache):
    n = data.load_tokens("val", VOCAB, MAX_FILES, cache).numel()
    with pytest.raises(ValueError, match=f"use seq_len <= {n - 1}"):
        data.packed_sequences("val", n, VOCAB, MAX_FILES, cache)
    assert data.packed_sequences("val", n - 1, VOCAB, MAX_FILES, cache).shape == (1, n)
    with pytest.raises(ValueError, match="seq_len"):
        data.packed_sequences("val", 0, VOCAB, MAX_FILES, cache)


# --------------------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def rows(cache):
    return data.packed_sequences("train", 31, VOCAB, MAX_FILES, cache)  # odd T


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_batches_shapes_and_shift(rows):
    batch_size = 5
    epoch = list(data.batches(rows, batch_size, loop=False))
    assert len(epoch) == rows.size(0) // batch_size  # last incomplete batch dropped
    seen = []
    for inputs, labels in epoch:
        assert inputs.shape == labels.shape == (batch_size, rows.size(1) - 1)
        assert inputs.dtype == labels.dtype == torch.long
        assert inputs.is_contiguous() and labels.is_contiguous()
        assert torch.equal(labels[:, :-1], inputs[:, 1:])
        seen.append(torch.cat([inputs[:, :1], labels], dim=1))
    # One epoch draws data rows without replacement (code repeats, so count, not set).
    seen = Counter(map(tuple, torch.cat(seen).tolist()))
    assert seen <= Counter(map(tuple, rows.tolist()))
    assert seen.total() == len(epoch) * batch_size


def test_batches_deterministic_by_seed(rows):
    n = 2 * (rows.size(0) // 8)  # two epochs
    a = _take(data.batches(rows, 8, seed=1), n)
    b = _take(data.batches(rows, 8, seed=1), n)
    c = _take(data.batches(rows, 8, seed=2), n)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))


def test_batches_reshuffle_each_epoch(rows):
    per_epoch = rows.size(0) // 8
    stream = data.batches(rows, 8, seed=0)
    first = torch.cat([x for x, _ in _take(stream, per_epoch)])
    second = torch.cat([x for x, _ in _take(stream, per_epoch)])
    assert not torch.equal(first, second)


@pytest.mark.parametrize("batch_size", [0, 10**6])
def test_batches_bad_batch_size(rows, batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        data.batches(rows, batch_size)  # raised at the call, not at the first next()


def test_random_batches():
    a = _take(data.random_batches(97, 3, 13, seed=5), 3)
    b = _take(data.random_batches(97, 3, 13, seed=5), 3)
    c = next(data.random_batches(97, 3, 13, seed=6))
    for (inputs, labels), (inputs_b, labels_b) in zip(a, b):
        assert inputs.shape == labels.shape == (3, 13) and inputs.dtype == torch.long
        assert 0 <= int(inputs.min()) and int(inputs.max()) < 97
        assert torch.equal(labels[:, :-1], inputs[:, 1:])
        assert torch.equal(inputs, inputs_b) and torch.equal(labels, labels_b)
    assert not torch.equal(a[0][0], a[1][0])
    assert not torch.equal(a[0][0], c[0])
    with pytest.raises(ValueError, match="seq_len=0"):
        data.random_batches(97, 3, 0)


# --------------------------------------------------------------------------- stats


def test_corpus_stats(cache):
    stats = data.corpus_stats(VOCAB, MAX_FILES, cache)
    assert stats.train_files + stats.val_files == MAX_FILES
    assert stats.val_files >= 1
    for split in data.SPLITS:
        stream = data.load_tokens(split, VOCAB, MAX_FILES, cache)
        assert stats.tokens(split) == stream.numel()
        assert 1.0 < stats.bytes_per_token(split) < 8.0
    assert stats.vocab_size == VOCAB
    assert stats.python.startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    text = str(stats)
    assert "bytes/token" in text and "total" in text


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batches_on_cuda_match_cpu(rows):
    cpu = _take(data.batches(rows, 4, seed=3), 3)
    gpu = _take(data.batches(rows, 4, seed=3, device="cuda"), 3)
    for (x, y), (xg, yg) in zip(cpu, gpu):
        assert xg.device.type == "cuda" and xg.dtype == torch.long
        assert torch.equal(x, xg.cpu()) and torch.equal(y, yg.cpu())
    inputs, labels = next(data.random_batches(1000, 2, 8, device="cuda"))
    assert inputs.device.type == "cuda" and torch.equal(labels[:, :-1], inputs[:, 1:])


def test_batches_start_skips_exactly():
    """`start=k` yields what the (k+1)-th batch onwards would have been, across epoch
    boundaries, for corpus rows and for random tokens: what an exact resume needs."""
    rows = torch.arange(10 * 5, dtype=torch.int32).reshape(10, 5)
    full = [b for b, _ in zip(data.batches(rows, 3, seed=4), range(9))]
    for k in (0, 1, 3, 4, 7):
        got = [b for b, _ in zip(data.batches(rows, 3, seed=4, start=k), range(9 - k))]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(full[k:], got)), k
    rnd = [b for b, _ in zip(data.random_batches(50, 2, 4, seed=1), range(5))]
    got = next(data.random_batches(50, 2, 4, seed=1, start=3))
    assert torch.equal(got[0], rnd[3][0])
    with pytest.raises(ValueError, match="start"):
        data.batches(rows, 3, start=-1)
