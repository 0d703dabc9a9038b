"""Chat data in a run (--data FILE.jsonl): the checked examples as training rows, a seeded and
restorable sampler of padded batches, and the validation loss over the held-out examples.

Each example is one row: its tokens as inputs, and as targets the next tokens where the loss
counts them (the assistant messages of weight 1, training/chat_data.py) and IGNORE_INDEX
elsewhere. A batch is `--batch-size` rows padded at the end to the longest of them, the padding's
targets ignored: attention is causal, so no token sees the padding after it, and no row sees
another, whatever its length.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from gptserve.model import GPT, ModelConfig
from gptserve.model.tokenizers import Tokenizer
from gptserve.server.chat.templates import ChatTemplate, ChatTemplateError, load_chat_format
from gptserve.training.chat_data import (
    IGNORE_INDEX,
    ChatDataError,
    ChatExample,
    ChatRenderer,
    check_chat_file,
    split_examples,
)
from gptserve.training.config import TrainConfig
from gptserve.training.distributed import Dist
from gptserve.training.errors import TrainError
from gptserve.training.setup import tokenizer_dir

Row = tuple[np.ndarray, np.ndarray]  # inputs, targets (int64, same length)


@dataclass
class ChatData:
    """A run's chat examples as rows, and what the run prints and checks of them."""

    train: list[Row]
    val: list[Row]
    fingerprint: str
    sample_prompt: list[int]  # the first validation (else training) example's first prompt

    def summary(self) -> str:
        def count(rows: list[Row]) -> str:
            tokens = sum(len(x) + 1 for x, _ in rows)
            trained = sum(int((y != IGNORE_INDEX).sum()) for _, y in rows)
            noun = "example" if len(rows) == 1 else "examples"
            return f"{len(rows):,} {noun} ({tokens:,} tokens, {trained:,} trained)"

        return f"chat data: {count(self.train)} train / {count(self.val)} val"


def chat_template_source(cfg: TrainConfig, config: ModelConfig) -> Path | None:
    """Where the chat template the trained model is served with comes from: a LoRA adapter is
    served on its base (--init-from); a full run's output carries the tokenizer files of a
    checkpoint with its own tokenizer (the --init-from directory's, --out's on --resume). None:
    the plain "Role: content" template, which a GPT-2-tokenizer output is served with."""
    if cfg.lora_rank is not None:
        return cfg.init_from
    return tokenizer_dir(cfg, config)


def load_chat_data(
    cfg: TrainConfig, source: Path | None, tok: Tokenizer, vocab_size: int, window: int
) -> ChatData:
    """Read, check and render --data (and --val-data) with the served chat template; every
    example at most `window` tokens. TrainError naming every bad line."""
    try:
        template = load_chat_format(source, tok) if source is not None else ChatTemplate()
    except ChatTemplateError as exc:
        raise TrainError(f"the chat template of {source}: {exc}") from None
    renderer = ChatRenderer(template, tok, vocab_size=vocab_size)

    def read(path: Path) -> list[ChatExample]:
        if path.is_dir():
            raise TrainError(f"chat data {path} is a folder; give one .jsonl file")
        try:
            return check_chat_file(path, renderer, max_tokens=window)
        except ChatDataError as exc:
            hint = ""
            if any("longer than the context" in e for e in exc.errors):
                hint = " (the context is the training window, --block-size)"
            raise TrainError(f"chat data {exc}{hint}") from None

    if not cfg.data.exists():
        raise TrainError(f"data path {cfg.data} does not exist")
    examples = read(cfg.data)
    if cfg.val_data is not None:
        if not cfg.val_data.exists():
            raise TrainError(f"--val-data {cfg.val_data} does not exist")
        train, val = examples, read(cfg.val_data)
    else:
        try:
            train, val = split_examples(examples, cfg.val_fraction)
        except ChatDataError as exc:
            raise TrainError(f"chat data {cfg.data}: {exc}") from None
    train_rows, val_rows = [_row(e) for e in train], [_row(e) for e in val]
    first = (val or train)[0]
    assert first.tokens is not None and first.spans
    return ChatData(
        train_rows, val_rows, _fingerprint(train_rows, val_rows), first.tokens[: first.spans[0][0]]
    )


def _row(example: ChatExample) -> Row:
    x, y = example.inputs_and_targets()
    return np.asarray(x, dtype=np.int64), np.asarray(y, dtype=np.int64)


def _fingerprint(train: list[Row], val: list[Row]) -> str:
    """What the rows are, in 16 hex digits (--resume checks it continues on the same data)."""
    h = hashlib.sha256(f"chat:{len(train)}:{len(val)}".encode())
    for x, y in [*train, *val]:
        h.update(len(x).to_bytes(8, "little"))
        h.update(x.tobytes())
        h.update(y.tobytes())
    return h.hexdigest()[:16]


def pad_rows(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as a (B, T) batch, T the longest: inputs padded with pad_id, targets with
    IGNORE_INDEX."""
    width = max(len(x) for x, _ in rows)
    x = np.full((len(rows), width), pad_id, dtype=np.int64)
    y = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    for i, (xs, ys) in enumerate(rows):
        x[i, : len(xs)] = xs
        y[i, : len(ys)] = ys
    return torch.from_numpy(x), torch.from_numpy(y)


class ChatBatchSampler:
    """Batches of rows in a shuffled order, every row once per pass (epoch), from its own seeded
    RNG; its state (RNG, the pass's order and position) restores it exactly."""

    def __init__(self, rows: list[Row], batch_size: int, seed: list[int], pad_id: int) -> None:
        self.rows = rows
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []
        self.pos = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        picks = []
        while len(picks) < self.batch_size:
            if self.pos >= len(self.order):
                self.order, self.pos = self.rng.permutation(len(self.rows)).tolist(), 0
            picks.append(self.order[self.pos])
            self.pos += 1
        return pad_rows([self.rows[i] for i in picks], self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order, self.pos = list(state["order"]), int(state["pos"])


@torch.no_grad()
def chat_val_loss(
    model: GPT,
    rows: list[Row],
    batch_size: int,
    iters: int,
    pad_id: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
    info: Dist,
) -> float:
    """The mean loss over every counted token of the first batch_size x iters validation rows
    (the same rows at every eval), in order; DDP ranks share them out and sum."""
    model.eval()
    mine = rows[: batch_size * iters][info.rank :: info.world]
    sums = torch.zeros(2, dtype=torch.float64)  # loss summed over tokens, tokens
    for start in range(0, len(mine), batch_size):
        x, y = pad_rows(mine[start : start + batch_size], pad_id)
        count = int((y != IGNORE_INDEX).sum())
        with autocast:
            loss = model.loss(x.to(device), y.to(device)).float().cpu()
        sums += torch.tensor([float(loss) * count, count], dtype=torch.float64)
    model.train()
    if dist.is_initialized():
        dist.all_reduce(sums)
    return float(sums[0] / sums[1])
