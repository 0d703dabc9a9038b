"""Training data: text files tokenized once into a cached token file (uint16, or uint32 for a
vocabulary past 65536 ids), the train/validation split, and a seeded, restorable sampler of
(B, T) windows."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gptserve.model import get_tokenizer
from gptserve.model.tokenizers import Tokenizer, TokenizerError, load_tokenizer
from gptserve.training.distributed import Dist, on_every_rank, on_rank0
from gptserve.training.errors import TrainError
from tqdm import tqdm

WIDE_SUFFIX = "-u32"  # a token file of uint32 ids ends its name with this
# what identifies a checkpoint's own tokenizer ("hf"): its files, hashed into the cache key
TOKENIZER_KEY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def find_text_files(path: Path) -> list[Path]:
    if not path.exists():
        raise TrainError(f"data path {path} does not exist")
    files = sorted(p for p in path.rglob("*.txt") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise TrainError(f"data folder {path} has no .txt files")
    if all(f.stat().st_size == 0 for f in files):
        raise TrainError(f"data path {path} is empty")
    return files


def tokenize_cached(
    files: list[Path],
    cache_dir: Path,
    tokenizer: str = "gpt2",
    progress: bool = True,
    source: Path | None = None,
) -> Path:
    """Encode files once into a token file: documents separated by the end-of-text token, each
    started by BOS where the tokenizer adds one (Llama); uint16 ids, uint32 past 65536.

    `tokenizer` is "gpt2", or "hf" with `source` the directory of its tokenizer.json. The file
    name carries a hash of the tokenizer (name, and an "hf" one's files) and of each file's path,
    size and mtime, so an unchanged dataset is never encoded twice.
    """
    h = hashlib.sha256(tokenizer.encode())
    tok: Tokenizer | None = None
    wide = False
    if tokenizer != "gpt2":  # GPT-2's 50257 ids fit uint16 and it loads only when needed
        for name in TOKENIZER_KEY_FILES:
            path = (source or Path()) / name
            h.update(path.read_bytes() if path.is_file() else b"\0")
        if source is not None and source.is_file():  # a GGUF file, whose metadata holds it
            st = source.stat()
            h.update(f"{source.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        tok = _load(tokenizer, source)
        wide = tok.vocab_size > 2**16
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    suffix = WIDE_SUFFIX if wide else ""
    target = cache_dir / f"tokens-{tokenizer}-{h.hexdigest()[:16]}{suffix}.bin"
    if target.is_file():
        return target
    tok = tok or _load(tokenizer, source)
    dtype = token_dtype(target)
    if tok.vocab_size > np.iinfo(dtype).max + 1:
        raise TrainError(
            f"tokenizer {tokenizer} has {tok.vocab_size} tokens; {dtype} cannot hold them"
        )
    starts = [tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    total = sum(f.stat().st_size for f in files)
    try:
        with (
            open(tmp, "wb") as out,
            tqdm(
                total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress
            ) as bar,
        ):
            for i, f in enumerate(files):
                between = [tok.eot_token] if i > 0 else []
                out.write(np.array(between + starts, dtype=dtype).tobytes())
                for texts in _text_chunks(f):
                    ids = tok.encode_batch(texts)  # tiktoken encodes a batch on several threads
                    out.write(np.concatenate([np.asarray(x, dtype=dtype) for x in ids]).tobytes())
                    bar.update(sum(len(t.encode("utf-8")) for t in texts))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def token_dtype(path: Path) -> type[np.unsignedinteger]:
    """The id type of a token file, which its name says."""
    return np.uint32 if path.stem.endswith(WIDE_SUFFIX) else np.uint16


def _load(tokenizer: str, source: Path | None) -> Tokenizer:
    try:
        return (
            get_tokenizer(tokenizer) if tokenizer == "gpt2" else load_tokenizer(tokenizer, source)
        )
    except TokenizerError as exc:
        raise TrainError(f"tokenizer: {exc}") from None


def _text_chunks(path: Path, piece_chars: int = 1 << 16, batch: int = 16):
    """Yield lists of ~64k-character pieces cut at line ends (BPE never merges across them)."""
    texts: list[str] = []
    piece: list[str] = []
    size = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                piece.append(line)
                size += len(line)
                if size >= piece_chars:
                    texts.append("".join(piece))
                    piece, size = [], 0
                    if len(texts) == batch:
                        yield texts
                        texts = []
    except UnicodeDecodeError as exc:
        raise TrainError(
            f"data file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    if piece:
        texts.append("".join(piece))
    if texts:
        yield texts


def split_tokens(
    tokens: np.ndarray, block_size: int, val_fraction: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """The last val_fraction of the tokens is the validation split; both must hold a block + 1."""
    n = len(tokens)
    n_val = int(n * val_fraction)
    train, val = tokens[: n - n_val], (tokens[n - n_val :] if val_fraction > 0 else None)
    if len(train) < block_size + 1 or (val is not None and len(val) < block_size + 1):
        need = math.ceil((block_size + 1) / min(1 - val_fraction, val_fraction or 1.0))
        raise TrainError(
            f"data has {n} tokens, too few for --block-size {block_size} with --val-fraction "
            f"{val_fraction} (need at least {need}); use more data or a smaller --block-size"
        )
    return train, val


class BatchSampler:
    """Random (B, T) windows from a token array, from its own seeded RNG (restorable)."""

    def __init__(
        self, tokens: np.ndarray, block_size: int, batch_size: int, seed: list[int]
    ) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.block_size
        starts = self.rng.integers(0, len(self.tokens) - T, size=self.batch_size)
        window = np.stack([self.tokens[s : s + T + 1] for s in starts]).astype(np.int64)
        window = torch.from_numpy(window)  # (B, T + 1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state


def prepare_data(
    data: Path, cache_dir: Path, info: Dist, tokenizer: str = "gpt2", source: Path | None = None
) -> np.ndarray:
    """Tokenize on rank 0, then memory-map the token file on every rank.

    Ranks on other nodes read the file rank 0 wrote, under their own cache_dir: a node that does
    not see it (no shared filesystem) stops the run with an error that says so.
    """
    name, size = on_rank0(lambda: _tokenized(data, cache_dir, tokenizer, source), info)
    path = cache_dir / name

    def check() -> None:
        seen = path.stat().st_size if path.is_file() else None
        if seen != size:
            found = "it is missing" if seen is None else f"it has {seen} bytes, not {size}"
            raise TrainError(
                f"the token file rank 0 wrote is not here: {path} ({found}); every node must "
                f"see --cache-dir (default OUT/cache) and --out on a shared filesystem"
            )

    on_every_rank(check)
    return np.memmap(path, dtype=token_dtype(path), mode="r")


def _tokenized(data: Path, cache_dir: Path, tokenizer: str, source: Path | None) -> tuple[str, int]:
    path = tokenize_cached(find_text_files(data), cache_dir, tokenizer, source=source)
    return path.name, path.stat().st_size


def data_fingerprint(tokens: np.ndarray, samples: int = 64, span: int = 1 << 15) -> str:
    """What the tokens are, in 16 hex digits: their count and `samples` evenly spaced runs of
    `span` tokens, hashed (milliseconds for any size). A run stores it, and --resume checks that
    it continues on the same data."""
    h = hashlib.sha256(f"{len(tokens)}:{tokens.dtype}".encode())
    step = max(1, len(tokens) // samples)
    for start in range(0, len(tokens), step):
        h.update(np.ascontiguousarray(tokens[start : start + span]).tobytes())
    return h.hexdigest()[:16]
