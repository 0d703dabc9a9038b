"""Which LoRA adapter is in which slot, by name, and who still uses it.

The model's slots (`model.lora.batched.LoraBank`) hold the weights; this ledger, owned by the
engine and changed only on its thread, names them. A request names its adapter (`SamplingParams.
lora`); the engine `acquire`s it when the request arrives and `release`s it when the request
ends. Unloading an adapter takes its name away at once (new requests for it are refused) but
its slot stays filled until the last request using it has ended, so those finish as they began.
Every load gets a number never reused (`uid`): the prefix cache keys an adapter's blocks by it,
so an adapter loaded again under the same name never reads blocks its predecessor computed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from gptserve.engine.errors import RequestError
from gptserve.model.config import ModelConfig
from gptserve.model.lora.adapter import LoraAdapter
from gptserve.model.lora.batched import LoraBank, LoraRankError, LoraShapeError
from gptserve.model.lora.peft_format import AdapterError as PeftFormatError
from gptserve.model.lora.peft_format import BaseMismatchError, read_peft

# the kinds of refusal (`AdapterError.code`)
NOT_FOUND = "lora_not_found"
RANK_TOO_LARGE = "lora_rank_too_large"
BASE_MISMATCH = "lora_base_mismatch"
SLOTS_FULL = "lora_slots_full"
NAME_TAKEN = "lora_name_taken"
BAD_PATH = "lora_path_invalid"


class AdapterError(RequestError):
    """An adapter that cannot be loaded, unloaded or used; `code` says why (NOT_FOUND ...)."""


def read_adapter(path: str | Path, config: ModelConfig, name: str) -> LoraAdapter:
    """The PEFT adapter directory `path` for a base of `config`, named `name`; raises
    AdapterError (BAD_PATH: no adapter there, or files it cannot read; BASE_MISMATCH: the
    adapter's modules or shapes are not the base's)."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"no adapter directory at {str(path)!r}", "lora_path", BAD_PATH)
    try:
        adapter = read_peft(directory, config)
    except PeftFormatError as exc:
        text = str(exc).splitlines()[0] if str(exc) else "the adapter cannot be read"
        mismatch = isinstance(exc, BaseMismatchError)
        raise AdapterError(text, "lora_path", BASE_MISMATCH if mismatch else BAD_PATH) from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read the adapter at {str(path)!r}: {exc}", "lora_path",
                           BAD_PATH) from None  # fmt: skip
    adapter.name = name
    return adapter


@dataclass
class LoadedAdapter:
    name: str
    slot: int
    uid: int  # this load's number, never reused
    users: int = 0  # requests using it now
    unloaded: bool = False  # its name is gone; the slot empties once `users` is 0


class AdapterSlots:
    """The adapters loaded into one model's LoRA slots, by name."""

    def __init__(self, bank: LoraBank) -> None:
        self.bank = bank
        self._by_name: dict[str, LoadedAdapter] = {}
        self._by_slot: dict[int, LoadedAdapter] = {}  # filled slots (named or draining)
        self._uids = itertools.count(1)

    def load(self, name: str, adapter: LoraAdapter) -> LoadedAdapter:
        """Put `adapter` in a free slot under `name`; raises AdapterError."""
        if name in self._by_name:
            raise AdapterError(
                f"an adapter named {name!r} is already loaded", "lora_name", NAME_TAKEN
            )
        try:
            self.bank.check(adapter)
        except LoraRankError as exc:
            raise AdapterError(str(exc), "lora_path", RANK_TOO_LARGE) from None
        except LoraShapeError as exc:
            raise AdapterError(str(exc), "lora_path", BASE_MISMATCH) from None
        free = next((s for s in range(self.bank.max_loras) if s not in self._by_slot), None)
        if free is None:
            raise AdapterError(
                f"all {self.bank.max_loras} LoRA slots are in use (--max-loras); unload an "
                "adapter first",
                "lora_name",
                SLOTS_FULL,
            )
        self.bank.load(free, adapter)
        entry = LoadedAdapter(name, free, next(self._uids))
        self._by_name[name] = self._by_slot[free] = entry
        return entry

    def unload(self, name: str) -> None:
        """Take `name` away; its slot empties when no request uses it. Raises AdapterError."""
        entry = self._by_name.pop(name, None)
        if entry is None:
            raise AdapterError(f"no adapter named {name!r} is loaded", "lora_name", NOT_FOUND)
        entry.unloaded = True
        if entry.users == 0:
            self._empty(entry)

    def acquire(self, name: str) -> LoadedAdapter:
        """The adapter `name` for a new request, counted as in use; raises AdapterError."""
        entry = self._by_name.get(name)
        if entry is None:
            raise AdapterError(f"no adapter named {name!r} is loaded", "model", NOT_FOUND)
        entry.users += 1
        return entry

    def release(self, entry: LoadedAdapter) -> None:
        """A request that acquired `entry` has ended."""
        entry.users -= 1
        if entry.unloaded and entry.users == 0:
            self._empty(entry)

    def _empty(self, entry: LoadedAdapter) -> None:
        self.bank.unload(entry.slot)
        del self._by_slot[entry.slot]
