"""A real text corpus on every machine, with no download: the Python standard library.

Throughput runs need no real data (`random_batches`), but a loss curve does: to show that
a switch leaves learning unchanged we need text with structure, identical on a laptop, a
CI runner and an offline GPU node. The standard library's source is installed wherever
Python is: tens of megabytes of code, docstrings and comments by hundreds of authors,
`corpus_stats` says how much on this machine.

**Which files.** Every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, test suites
included (ordinary idiomatic Python, more than half of the text), but not
``site-packages`` / ``dist-packages`` (third-party, differs per environment) nor
``_sysconfigdata_*.py`` and ``config-3.*/`` (the build machine's paths and flags). Files
are sorted by relative POSIX path and read as UTF-8 with ``errors="replace"``. The
standard library differs between Python versions, so every cache key carries the Python
version and a fingerprint of the file list.

**Pipeline**::

    corpus_files  ─split_of─────────▶  train files, val files  crc32(path) % 20 == 0: val
    train files   ─train_tokenizer──▶  byte-level BPE          cached .json
    split's files ─load_tokens──────▶  file <eos> file <eos>…  1-D, cached .npy
    stream        ─packed_sequences─▶  (n_seq, T + 1) rows     non-overlapping chunks
    rows          ─batches──────────▶  rows[:, :-1], rows[:, 1:]  (B, T) inputs, labels

The split hashes the path, not the contents, so a file keeps its split whatever
``max_files`` is: a validation file never leaks into a tokenizer or a model trained on a
subset. The tokenizer is GPT-2's recipe (byte-level BPE: 256 byte tokens, so every string
round-trips) trained with Hugging Face ``tokenizers`` on the train split only. Caches
are written to a temporary file and renamed into place, so an interrupted run never
leaves a half-written cache; processes that start at once (``torchrun`` ranks) build
identical caches and the last rename wins.

References: Radford et al. 2019 (GPT-2, byte-level BPE); Sennrich et al. 2016 (BPE);
https://huggingface.co/docs/tokenizers.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["EOS_ID", "EOS_TOKEN", "SPLITS", "CorpusStats", "batches", "corpus_files",
           "corpus_stats", "load_tokens", "packed_sequences", "random_batches", "split_of",
           "stdlib_root", "train_tokenizer"]

Split = Literal["train", "val"]
SPLITS: tuple[Split, ...] = ("train", "val")

EOS_TOKEN = "<|endoftext|>"
"""Ends every file in the token stream (GPT-2's name for it)."""
EOS_ID = 0
"""Id of `EOS_TOKEN`: the trainer numbers special tokens first."""
SPECIAL_TOKENS = (EOS_TOKEN,)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1
"""256 byte tokens, the special tokens, and room for at least one merge."""
VAL_MODULUS = 20
"""A file is in the val split when crc32(relative path) % VAL_MODULUS == 0 (about 5%)."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_ENCODE_CHUNK_FILES = 64  # files per encode_batch call: bounds memory, keeps cores busy


# --------------------------------------------------------------------------- files


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library, where the corpus lives."""
    return Path(sysconfig.get_paths()["stdlib"])


def _skip_dir(name: str) -> bool:
    return name in _SKIP_DIRS or name.startswith("config-3")


@cache
def _all_relpaths(root: str) -> tuple[str, ...]:
    """Sorted relative POSIX paths of every corpus file under ``root``."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _skip_dir(d)]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                rels.append(Path(dirpath, name).relative_to(root).as_posix())
    if not rels:
        raise FileNotFoundError(f"no *.py files under the standard library at {root}")
    return tuple(sorted(rels))


def _relpath(path: str | Path) -> str:
    """``path`` relative to the stdlib root, as a POSIX string (relative paths pass)."""
    p = Path(path)
    if p.is_absolute():
        p = p.relative_to(stdlib_root())
    return p.as_posix()


def split_of(path: str | Path) -> Split:
    """Which split a corpus file belongs to: ``"val"`` for about 1 file in 20.

    Args:
        path: a file from `corpus_files`, or its path relative to `stdlib_root`.

    The decision is ``zlib.crc32(relative path) % 20 == 0``: stable across processes and
    machines (unlike ``hash``, which is salted per process) and independent of
    ``max_files``, so a file never changes split when the corpus is subsampled.
    """
    rel = _relpath(path)
    return "val" if zlib.crc32(rel.encode("utf-8")) % VAL_MODULUS == 0 else "train"


def _evenly_spaced(items: Sequence[str], k: int) -> list[str]:
    """``k`` items spread evenly over ``items`` (the midpoints of k equal strata)."""
    n = len(items)
    return [items[(2 * i + 1) * n // (2 * k)] for i in range(k)]


def _normalize_max_files(max_files: int | None) -> int | None:
    """Validate ``max_files``; None when it selects the whole corpus (one cache key)."""
    if max_files is None:
        return None
    n = len(_all_relpaths(str(stdlib_root())))
    if max_files < 2:
        raise ValueError(
            f"max_files={max_files} leaves no room for both a train and a val file; "
            f"use max_files >= 2, or None for all {n} files"
        )
    return None if max_files >= n else int(max_files)


def _selected_relpaths(max_files: int | None) -> tuple[str, ...]:
    rels = _all_relpaths(str(stdlib_root()))
    by_split = {s: [r for r in rels if split_of(r) == s] for s in SPLITS}
    if not by_split["val"] or not by_split["train"]:
        raise RuntimeError(f"the stdlib at {stdlib_root()} gives an empty split")
    max_files = _normalize_max_files(max_files)
    if max_files is None:
        return rels
    # Subsample each split on its own so that even max_files=2 has a val file.
    n_val = len(by_split["val"])
    k_val = min(n_val, max(1, round(max_files * n_val / len(rels))))
    chosen = _evenly_spaced(by_split["train"], max_files - k_val)
    chosen += _evenly_spaced(by_split["val"], k_val)
    return tuple(sorted(chosen))


def corpus_files(max_files: int | None = None) -> list[Path]:
    """The corpus: absolute paths of the standard library's ``*.py`` files, sorted.

    Args:
        max_files: None for every file; else an evenly spaced, deterministic subset of
            this many files (at least 2), drawn from each split separately so that both
            splits are non-empty. For fast CPU tests.
    """
    root = stdlib_root()
    return [root / rel for rel in _selected_relpaths(max_files)]


def _split_files(split: Split, max_files: int | None) -> list[Path]:
    return [p for p in corpus_files(max_files) if split_of(p) == split]


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; use one of {SPLITS}")


# --------------------------------------------------------------------------- cache


def _default_cache_dir() -> Path:
    env = os.environ.get("COLOSSAL_LAB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "colossal_lab"


@cache
def _fingerprint(root: str) -> str:
    """Short hash of every corpus file's relative path and size under ``root``."""
    h = hashlib.sha256()
    for rel in _all_relpaths(root):
        h.update(f"{rel}\t{Path(root, rel).stat().st_size}\n".encode())
    return h.hexdigest()[:10]


def _cache_root(cache_dir: str | Path | None) -> Path:
    """Cache folder of this stdlib: ``<cache_dir>/stdlib-py3.11-<fingerprint>``."""
    base = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return base / f"stdlib-py{py}-{_fingerprint(str(stdlib_root()))}"


def _files_tag(max_files: int | None) -> str:
    return "all" if max_files is None else f"f{max_files}"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` and rename tmp onto ``path``: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------- tokenizer


def _check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: the 256 byte "
            f"tokens and {len(SPECIAL_TOKENS)} special token(s) {SPECIAL_TOKENS} take "
            f"{MIN_VOCAB_SIZE - 1} ids; use vocab_size >= {MIN_VOCAB_SIZE} "
            f"(the default is 32000, LLaMA's)"
        )


def _train_bpe(
    texts: Iterable[str], vocab_size: int, length: int | None = None
) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE on ``texts`` (no caching)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),  # numbered first: EOS_ID == 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, always
        show_progress=sys.stderr.isatty(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_ID:
        raise RuntimeError(f"{EOS_TOKEN} got id {tokenizer.token_to_id(EOS_TOKEN)}")
    return tokenizer


def _tokenizer_path(
    vocab_size: int, max_files: int | None, cache_dir: str | Path | None
) -> tuple[Path, int | None]:
    """Check the arguments; return the tokenizer's cache path and normalized max_files."""
    _check_vocab_size(vocab_size)
    max_files = _normalize_max_files(max_files)
    name = f"tokenizer-v{vocab_size}-{_files_tag(max_files)}.json"
    return _cache_root(cache_dir) / name, max_files


def train_tokenizer(
    vocab_size: int = 32000,
    max_files: int | None = None,
    cache_dir: str | Path | None = None,
) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the train split, cached as JSON.

    Args:
        vocab_size: tokens in the vocabulary, special token included (at least 258).
            A tiny corpus may run out of pairs to merge and stop short of it; every id is
            still below ``vocab_size``.
        max_files: train on the train split of ``corpus_files(max_files)``.
        cache_dir: cache folder; default ``$COLOSSAL_LAB_CACHE`` or
            ``~/.cache/colossal_lab``. The file is keyed by Python version, a fingerprint
            of the corpus, ``vocab_size`` and ``max_files``.

    ``EOS_TOKEN`` has id ``EOS_ID`` (0). Training is deterministic: the same corpus and
    arguments give the same merges (checked across processes); later calls load the
    cached file.
    """
    path, max_files = _tokenizer_path(vocab_size, max_files, cache_dir)
    try:
        if path.exists():
            return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises bare Exceptions
        warnings.warn(f"tokenizer cache {path} damaged ({e}): retrained", stacklevel=2)
    files = _split_files("train", max_files)
    tokenizer = _train_bpe((_read_text(p) for p in files), vocab_size, length=len(files))
    _atomic_write(path, lambda tmp: tokenizer.save(str(tmp)))
    return tokenizer


# --------------------------------------------------------------------------- tokens


def _encode_files(tokenizer: Tokenizer, files: Sequence[Path]) -> np.ndarray:
    """Token ids of ``files``, each followed by ``EOS_ID``, as one 1-D array."""
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.int32
    # Encode a literal "<|endoftext|>" inside a file as text: only we place EOS tokens.
    tokenizer.encode_special_tokens = True
    eos = np.array([EOS_ID], dtype=dtype)
    pieces = []
    for start in range(0, len(files), _ENCODE_CHUNK_FILES):
        texts = [_read_text(p) for p in files[start : start + _ENCODE_CHUNK_FILES]]
        # encode_batch_fast: parallel over files, skips offsets we do not need
        for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False):
            pieces += [np.asarray(encoding.ids, dtype=dtype), eos]
    return np.concatenate(pieces)


def _save_npy(array: np.ndarray) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array)

    return write


def load_tokens(
    split: Split,
    vocab_size: int = 32000,
    max_files: int | None = None,
    cache_dir: str | Path | None = None,
) -> torch.Tensor:
    """The token stream of one split: every file in order, each followed by EOS.

    Args:
        split: ``"train"`` or ``"val"``.
        vocab_size, max_files, cache_dir: as in `train_tokenizer` (trained if needed).

    Returns:
        A 1-D int32 tensor (int32 halves the memory of int64; `batches` widens each
        batch). Cached as ``.npy`` (uint16 on disk while the vocabulary fits), keyed also
        by a hash of the tokenizer file, so a retrained tokenizer never meets stale ids.
    """
    _check_split(split)
    tokenizer = train_tokenizer(vocab_size, max_files, cache_dir)
    tok_path, max_files = _tokenizer_path(vocab_size, max_files, cache_dir)
    tok_hash = hashlib.sha256(tok_path.read_bytes()).hexdigest()[:10]
    path = tok_path.with_name(
        f"tokens-{split}-v{vocab_size}-{_files_tag(max_files)}-{tok_hash}.npy"
    )
    try:
        array = np.load(path) if path.exists() else None
    except (OSError, ValueError, EOFError) as e:  # a damaged cache: encoded again
        warnings.warn(f"token cache {path} damaged ({e}): encoded again", stacklevel=2)
        array = None
    if array is None:
        array = _encode_files(tokenizer, _split_files(split, max_files))
        _atomic_write(path, _save_npy(array))
    return torch.from_numpy(array.astype(np.int32))


def packed_sequences(
    split: Split,
    seq_len: int,
    vocab_size: int = 32000,
    max_files: int | None = None,
    cache_dir: str | Path | None = None,
) -> torch.Tensor:
    """The token stream cut into non-overlapping rows of ``seq_len + 1`` tokens.

    Args:
        split: ``"train"`` or ``"val"``.
        seq_len: tokens the model sees per row (T).
        vocab_size, max_files, cache_dir: as in `train_tokenizer`.

    Returns:
        An int32 tensor of shape ``(n_seq, seq_len + 1)``, ``n_seq = n_tokens //
        (seq_len + 1)``; row ``i`` is ``stream[i * (T + 1) : (i + 1) * (T + 1)]`` and the
        tail that fills no row is dropped. Inputs are ``rows[:, :-1]``, labels
        ``rows[:, 1:]``. Rows cross file boundaries; the EOS token marks them, as in
        GPT-2 and LLaMA pre-training.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}; use seq_len >= 1")
    stream = load_tokens(split, vocab_size, max_files, cache_dir)
    n_seq = stream.numel() // (seq_len + 1)
    if n_seq == 0:
        raise ValueError(
            f"the {split} split has {stream.numel()} tokens (max_files={max_files}), "
            f"fewer than seq_len + 1 = {seq_len + 1}; use seq_len <= "
            f"{stream.numel() - 1} or more files (a larger max_files, or None for all)"
        )
    return stream[: n_seq * (seq_len + 1)].view(n_seq, seq_len + 1)  # (n_seq, T + 1)


# --------------------------------------------------------------------------- batches


def _split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T + 1) rows → (input_ids, labels), each a contiguous (B, T) LongTensor."""
    rows = rows.long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def batches(
    data: torch.Tensor,
    batch_size: int,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
    loop: bool = True,
    start: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled ``(input_ids, labels)`` batches from `packed_sequences` rows.

    Args:
        data: ``(n_seq, T + 1)`` integer rows.
        batch_size: rows per batch (B); the last incomplete batch of an epoch is dropped
            so every batch has the same shape (no recompiles under ``torch.compile``).
        seed: the order of rows in every epoch follows from it; each epoch has a new one.
        device: where the batches go (default: ``data.device``). From CPU to CUDA the
            rows are gathered into pinned memory and copied with ``non_blocking=True``,
            so the copy overlaps the previous step's GPU work.
        loop: True: epochs forever; False: stop after one epoch.
        start: skip the first `start` batches of this sequence without gathering
            them (a resumed run continues where it stopped, batch for batch).

    Yields:
        ``(input_ids, labels)``, LongTensors of shape ``(B, T)`` with
        ``labels[:, t] == input_ids[:, t + 1]`` within the row.
    """
    if data.dim() != 2 or data.size(1) < 2:
        raise ValueError(
            f"data has shape {tuple(data.shape)}; expected (n_seq, seq_len + 1) rows "
            f"from packed_sequences"
        )
    if not 1 <= batch_size <= data.size(0):
        raise ValueError(
            f"batch_size={batch_size} but data has {data.size(0)} rows; use a batch_size "
            f"between 1 and {data.size(0)}, a shorter seq_len or more files"
        )
    if start < 0:
        raise ValueError(f"start={start} must be >= 0")
    target = torch.device(device) if device is not None else data.device
    pin = target.type == "cuda" and data.device.type == "cpu"
    return _batches(data, batch_size, seed, target, pin, loop, start)


def _batches(
    data: torch.Tensor,
    batch_size: int,
    seed: int,
    device: torch.device,
    pin: bool,
    loop: bool,
    skip: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    n_seq = data.size(0)
    per_epoch = n_seq // batch_size
    while True:
        order = torch.randperm(n_seq, generator=generator).to(data.device)
        if skip >= per_epoch:  # a whole skipped epoch: only its permutation was drawn
            skip -= per_epoch
            if not loop:
                return
            continue
        for start in range(skip * batch_size, n_seq - batch_size + 1, batch_size):
            rows = data[order[start : start + batch_size]]  # (B, T + 1), still int32
            if pin:
                rows = rows.pin_memory()
            # Copy the narrow dtype, widen on the device: half the bytes over PCIe.
            yield _split_rows(rows.to(device, non_blocking=True))
        skip = 0
        if not loop:
            return


def random_batches(
    vocab_size: int,
    batch_size: int,
    seq_len: int,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
    start: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of uniformly random tokens, for throughput runs.

    Args:
        vocab_size: tokens are drawn from ``[0, vocab_size)``.
        batch_size, seq_len: each batch is ``(batch_size, seq_len)``.
        seed: seeds a generator on ``device``; same seed and device, same batches.
        device: where the tokens are drawn (default CPU); on a GPU no host work or copy
            competes with the step being timed.
        start: skip the first `start` batches (drawn and dropped: the same sequence).

    Yields:
        ``(input_ids, labels)`` LongTensors of shape ``(B, T)``, labels shifted by one
        as in `batches`, so the loss computation is the same as with real text.
    """
    if vocab_size < 1 or batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"vocab_size={vocab_size}, batch_size={batch_size}, seq_len={seq_len}; "
            f"all must be >= 1"
        )
    target = torch.device(device) if device is not None else torch.device("cpu")
    generator = torch.Generator(device=target).manual_seed(seed)

    def endless() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(start):
            torch.randint(vocab_size, (batch_size, seq_len + 1), generator=generator,
                          device=target)
        while True:
            rows = torch.randint(  # (B, T + 1)
                vocab_size, (batch_size, seq_len + 1), generator=generator, device=target
            )
            yield _split_rows(rows)

    return endless()


# --------------------------------------------------------------------------- stats


@dataclass(frozen=True)
class CorpusStats:
    """Size of the corpus on this machine, per split, as the book prints it."""

    python: str
    """Python version whose standard library this is, e.g. ``"3.11.7"``."""
    root: str
    """Where the standard library lives."""
    vocab_size: int
    """Tokens in the trained tokenizer (at most the requested size)."""
    train_files: int
    """Files in the train split."""
    val_files: int
    """Files in the val split."""
    train_bytes: int
    """UTF-8 bytes of the train text as the tokenizer sees it (after decoding)."""
    val_bytes: int
    """UTF-8 bytes of the val text."""
    train_tokens: int
    """Tokens in the train stream, one EOS per file included."""
    val_tokens: int
    """Tokens in the val stream, one EOS per file included."""

    def files(self, split: Split) -> int:
        """Files in ``split``."""
        return getattr(self, f"{split}_files")

    def bytes(self, split: Split) -> int:
        """UTF-8 bytes in ``split``."""
        return getattr(self, f"{split}_bytes")

    def tokens(self, split: Split) -> int:
        """Tokens in ``split``."""
        return getattr(self, f"{split}_tokens")

    def bytes_per_token(self, split: Split | None = None) -> float:
        """Compression of the tokenizer: bytes per token in ``split`` (None: both)."""
        splits = SPLITS if split is None else (split,)
        return sum(self.bytes(s) for s in splits) / sum(self.tokens(s) for s in splits)

    def __str__(self) -> str:
        lines = [
            f"Python {self.python} standard library, "
            f"byte-level BPE with {self.vocab_size:,} tokens",
            f"{'split':<6}{'files':>8}{'MB':>9}{'tokens':>13}{'bytes/token':>13}",
        ]
        for name, splits in (("train", ("train",)), ("val", ("val",)), ("total", SPLITS)):
            files = sum(self.files(s) for s in splits)
            nbytes = sum(self.bytes(s) for s in splits)
            tokens = sum(self.tokens(s) for s in splits)
            lines.append(
                f"{name:<6}{files:>8,}{nbytes / 1e6:>9.2f}{tokens:>13,}"
                f"{nbytes / tokens:>13.2f}"
            )
        return "\n".join(lines)


def corpus_stats(
    vocab_size: int = 32000,
    max_files: int | None = None,
    cache_dir: str | Path | None = None,
) -> CorpusStats:
    """Files, bytes and tokens per split (builds the tokenizer and streams if needed)."""
    counts: dict[str, int] = {}
    for split in SPLITS:
        files = _split_files(split, max_files)
        counts[f"{split}_files"] = len(files)
        counts[f"{split}_bytes"] = sum(len(_read_text(p).encode("utf-8")) for p in files)
        stream = load_tokens(split, vocab_size, max_files, cache_dir)
        counts[f"{split}_tokens"] = stream.numel()
    return CorpusStats(
        python=".".join(map(str, sys.version_info[:3])),
        root=str(stdlib_root()),
        vocab_size=train_tokenizer(vocab_size, max_files, cache_dir).get_vocab_size(),
        **counts,
    )
