"""Many LoRA adapters in one batch: slots of adapters over a model's linear layers.

`install_lora(model, max_loras, max_rank)` wraps each layer's four products (attention's
`c_attn` and `c_proj`, the feed-forward block's `c_fc` and `c_proj`) in a `LoraLinear`, after
quantization and the CPU wing's layouts, so the update applies over any kind of base product
(float, oneDNN, tiles, int8, a GGUF file's int4 or stacked rows). It returns the `LoraBank`
that holds the adapters in slots 0 .. max_loras - 1 and the current step's rows of each.

Per step the engine names each packed row's slot (-1: the base, no update) with `set_step`;
each wrapped product then computes, per adapter (never per row), on that adapter's rows only:

    y[rows, lo:hi] += (x[rows] @ A.T) @ B.T

where A (R, in) stacks the adapter's pieces of the layer (q, k, v of `c_attn`...) and each
piece's B (its rows, its r), times the adapter's scaling, adds into its own output rows: one
product for x @ A.T, one per piece after it, per adapter and layer (no zero blocks: a decode step
reads the adapter's weights, and their bytes are its cost). Rows of one adapter that form one
run (the scheduler groups decodes by adapter) are views; scattered ones are gathered and added
back by index. On the CPU a float32 run of rows takes one compiled call instead
(`lora_update_`, kernels/cpu/lora_update.cpp: plain loops for a decode step's few rows, where
PyTorch's products of a few rows cost their dispatch, the same products for more). The updates
are computed in float32 by default (as PEFT computes them, even over a bfloat16 base; `dtype`
bfloat16 halves the bytes, a gain on a GPU: on a CPU PyTorch's bfloat16 products of a few rows
are slower) and added in the product's output dtype.

A product that applies the activation itself (the CPU wing's `FusedMLP`: GELU inside the first
feed-forward product) gets a twin without it, sharing its weights, for the steps its adapters
update it: the update must come before the activation.

Compiled paths that run a whole layer without calling its products' forwards would skip the
update. The one-call layers (`model.cpu.llama_layer`, `model.cpu.decode_layer`) take the step's
updates of their layer as packed arguments instead (`LoraBank.one_call_updates`) and add them
with the same compiled function on the same views, where each adapter's rows are one run and
the adapters are float32; any other step with adapter rows (`LoraBank.active`) they leave to
the block's forward, whose products' wrappers apply the updates.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from gptserve.kernels.cpu.native import native_ops
from gptserve.model.activations import KERNEL_CODES, activate
from gptserve.model.lora.adapter import LoraAdapter

BASE_SLOT = -1  # a row without adapter
# a layer's products, in the order `install_lora` wraps them and `llama_decode_layer` numbers them
PRODUCTS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class LoraShapeError(ValueError):
    """An adapter that does not fit the base: a layer it lacks or a shape it does not have."""


class LoraRankError(ValueError):
    """An adapter whose rank is above the bank's `max_rank`."""


@dataclass(frozen=True, slots=True)
class SlotWeights:
    """One adapter's update of one layer, packed for its products (transposed, contiguous, as
    the compiled `lora_update_` reads them): x @ a_t once for every piece, then each piece's b
    into its rows."""

    a_t: torch.Tensor  # (in, R): every piece's a, stacked, transposed
    # per piece: its columns [c0, c1) of x @ a_t, its output rows [lo, hi), b_t (c1 - c0, hi - lo)
    # (its b times the adapter's scaling)
    pieces: tuple[tuple[int, int, int, int, torch.Tensor], ...]
    spans: tuple[int, ...]  # the pieces' c0, c1, lo, hi, one after another (`lora_update_`'s)
    b_ts: tuple[torch.Tensor, ...]  # the pieces' b_t


Rows = slice | torch.Tensor | None  # a slot's packed rows: all of them (None), a range, or indices
# one layer's updates as llama_decode_layer's lora_meta and lora_weights take them
OneCallUpdates = tuple[list[int], list[torch.Tensor]]


class LoraBank:
    """The adapter slots of one model and the rows each slot has in the current step."""

    def __init__(
        self, layers: dict[str, LoraLinear], max_loras: int, max_rank: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        self.layers = layers  # our layer name -> its wrapper
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype  # the adapters' weights and products
        self.slots: list[LoraAdapter | None] = [None] * max_loras
        self.groups: list[tuple[int, Rows]] = []  # this step's (slot, rows); [] when none
        # this step's (slot, first row, end) per adapter, or None: rows not in one run each
        self.runs: list[tuple[int, int, int]] | None = []
        # per slot: layer index -> its updates' (count, then per update its product, piece
        # count and pieces' columns and rows), (a_t, then each piece's b_t); see `_one_call_pack`
        self.one_call_packs: list[dict[int, OneCallUpdates]] = [{} for _ in range(max_loras)]

    @property
    def active(self) -> bool:
        """Whether the current step has adapter rows (then only a one-call layer that applies
        the updates itself runs: `one_call_updates`)."""
        return bool(self.groups)

    def check(self, adapter: LoraAdapter) -> None:
        """Raise LoraRankError or LoraShapeError (one line) if `adapter` cannot be loaded."""
        rank = adapter.max_rank
        if rank > self.max_rank:
            raise LoraRankError(
                f"adapter {adapter.name!r} has rank {rank}, above --max-lora-rank {self.max_rank}"
            )
        if not adapter.pieces:
            raise LoraShapeError(f"adapter {adapter.name!r} updates no layer")
        for name, pieces in adapter.pieces.items():
            layer = self.layers.get(name)
            if layer is None:
                raise LoraShapeError(
                    f"adapter {adapter.name!r} updates {name}, which this model does not have "
                    "(or cannot adapt)"
                )
            for p in pieces:
                fits = (
                    p.a.dim() == 2 and p.b.dim() == 2 and p.a.shape[1] == layer.in_features
                    and p.b.shape[1] == p.a.shape[0] and 0 <= p.offset
                    and p.offset + p.rows <= layer.out_features
                )  # fmt: skip
                if not fits:
                    raise LoraShapeError(
                        f"adapter {adapter.name!r} does not fit {name} of this model: a "
                        f"{tuple(p.a.shape)}, b {tuple(p.b.shape)} at row {p.offset} over a "
                        f"({layer.out_features}, {layer.in_features}) product"
                    )

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` (checked first) in `slot`, replacing what it held. Not during a
        forward (the engine loads between steps)."""
        self.check(adapter)
        for name, layer in self.layers.items():
            layer.weights[slot] = _pack(adapter, name, layer.device, self.dtype)
        self.slots[slot] = adapter
        self.one_call_packs[slot] = self._one_call_pack(slot)
        self.place_wrappers()

    def unload(self, slot: int) -> None:
        """Empty `slot` (no step may name it afterwards); not during a forward."""
        for layer in self.layers.values():
            layer.weights[slot] = None
        self.slots[slot] = None
        self.one_call_packs[slot] = {}
        self.place_wrappers()

    def _one_call_pack(self, slot: int) -> dict[int, OneCallUpdates]:
        """`slot`'s updates of each layer it updates, as `one_call_updates` passes them on:
        ([count, then per update: product, pieces, then c0, c1, lo, hi per piece], [a_t, then
        each piece's b_t])."""
        packs: dict[int, OneCallUpdates] = {}
        for name, layer in self.layers.items():
            w = layer.weights[slot]
            if w is None:
                continue
            _, _, index, suffix = name.split(".", 3)  # transformer.h.<index>.<product>
            meta, tensors = packs.setdefault(int(index), ([0], []))
            meta[0] += 1
            meta += [PRODUCTS.index(suffix), len(w.pieces), *w.spans]
            tensors += [w.a_t, *w.b_ts]
        return packs

    def one_call_updates(self, layer: int) -> OneCallUpdates | None:
        """This step's adapter updates of layer `layer` as `llama_decode_layer` takes them
        (lora_meta: per adapter its first row and end, then its pack; lora_weights), or None
        where the call cannot take them (an adapter's rows not one run, adapters not float32)."""
        if self.runs is None:
            return None
        meta: list[int] = []
        tensors: list[torch.Tensor] = []
        for slot, r0, r1 in self.runs:
            pack = self.one_call_packs[slot].get(layer)
            if pack is not None:
                meta += [r0, r1, *pack[0]]
                tensors += pack[1]
        return meta, tensors

    def place_wrappers(self, wrapped: bool | None = None) -> None:
        """Put each product's wrapper in its place in the model where a loaded adapter updates
        that product, the product itself elsewhere; `wrapped` True or False: every wrapper, or
        none (the model as it was: a benchmark's baseline, for steps of base rows only: a
        one-call layer still applies a step's adapter updates)."""
        for layer in self.layers.values():
            parent, child = layer.place
            on = any(w is not None for w in layer.weights) if wrapped is None else wrapped
            setattr(parent, child, layer if on else layer.base)

    def set_step(self, row_slots: list[int], device: torch.device | str = "cpu") -> bool:
        """Name the slot of each packed row of the next forward (BASE_SLOT: none); returns
        whether any row has an adapter. Rows of one slot are grouped once here, for every layer."""
        self.groups, self.runs = [], []
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot != BASE_SLOT:
                by_slot.setdefault(slot, []).append(row)
        for slot, rows in by_slot.items():
            if self.slots[slot] is None:
                raise ValueError(f"no adapter is loaded in slot {slot}")
            if len(rows) == len(row_slots):
                self.groups.append((slot, None))
            elif rows[-1] - rows[0] + 1 == len(rows):  # one run of rows: a view, no gather
                self.groups.append((slot, slice(rows[0], rows[-1] + 1)))
            else:
                self.groups.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))
        self.runs = [] if self.dtype == torch.float32 else None
        for slot, rows in self.groups:
            if self.runs is None or isinstance(rows, torch.Tensor):
                self.runs = None
                break
            r0, r1 = (0, len(row_slots)) if rows is None else (rows.start, rows.stop)
            self.runs.append((slot, r0, r1))
        return self.active

    def clear_step(self) -> None:
        self.groups = []
        self.runs = []


def _pack(
    adapter: LoraAdapter, name: str, device: torch.device, dtype: torch.dtype
) -> SlotWeights | None:
    """`adapter`'s pieces of layer `name` as one SlotWeights (None: it leaves the layer alone)."""
    pieces = adapter.pieces.get(name)
    if not pieces:
        return None
    a = torch.cat([p.a.float() for p in pieces]).to(device, dtype)  # (R, in)
    packed, col = [], 0
    for p in pieces:
        r = p.a.shape[0]
        b = (p.b.float() * adapter.scaling).to(device, dtype)  # (rows, r)
        packed.append((col, col + r, p.offset, p.offset + p.rows, b.T.contiguous()))
        col += r
    spans = tuple(n for piece in packed for n in piece[:4])
    return SlotWeights(a.T.contiguous(), tuple(packed), spans, tuple(p[4] for p in packed))


class LoraLinear(nn.Module):
    """A product of the model (any kind) plus the current step's adapter updates of it.

    Attributes it does not have are read from the base product (`op_dtype`, `out_dtype`...),
    so code that asks the product what it takes still gets the base's answer.
    """

    def __init__(
        self, base: nn.Module, in_features: int, out_features: int, bank_slots: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        # a base that applies an activation: the same product without it, and the activation
        split = _split_activation(base)
        pre, self.activation = split if split is not None else (None, "none")
        self.add_module("pre", pre)  # a child even when None, for the forward's dict read
        self.in_features, self.out_features = in_features, out_features
        self.device = device
        self.weights: list[SlotWeights | None] = [None] * bank_slots
        # the compiled kernels (`lora_update_`) on the CPU, else None: PyTorch's products
        self.update_ops = _compiled_update() if device.type == "cpu" else None
        self.bank: LoraBank | None = None  # set by install_lora
        self.place: tuple[nn.Module, str] | None = None  # (parent module, attribute), likewise

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.bank.groups
        if not groups:
            return self._modules["base"].forward(x)  # (..., out)
        weights = self.weights
        work = [(w, rows) for slot, rows in groups if (w := weights[slot]) is not None]
        if not work:  # the step's adapters leave this layer alone
            return self._modules["base"].forward(x)
        pre = self._modules["pre"]
        y = (pre or self._modules["base"]).forward(x)  # (..., out), before any activation
        x2 = x.reshape(-1, x.shape[-1])  # (N, in): the step's packed rows
        if x2.dtype != self.bank.dtype:
            x2 = x2.to(self.bank.dtype)
        y2 = y.view(-1, y.shape[-1])  # (N, out), the same memory as y
        in_place = y.dtype == self.bank.dtype  # the second products add into y themselves
        compiled = (
            self.update_ops is not None and in_place and x2.dtype == torch.float32
            and y2.stride(-1) == 1
        )  # fmt: skip
        if compiled and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        for w, rows in work:
            if compiled and not isinstance(rows, torch.Tensor):  # the compiled update
                x_rows, y_rows = (x2, y2) if rows is None else (x2[rows], y2[rows])
                self.update_ops.lora_update_(y_rows, x_rows, w.a_t, w.spans, w.b_ts)
            elif rows is None or isinstance(rows, slice):  # all rows, or one run: views
                h = torch.mm(x2 if rows is None else x2[rows], w.a_t)  # (n, R)
                for c0, c1, lo, hi, b_t in w.pieces:
                    out = y2[:, lo:hi] if rows is None else y2[rows, lo:hi]  # (n, rows)
                    if in_place:
                        out.addmm_(h[:, c0:c1], b_t)
                    else:
                        out.add_(torch.mm(h[:, c0:c1], b_t).to(y.dtype))
            else:  # scattered rows: gathered, then added back by index
                h = torch.mm(x2.index_select(0, rows), w.a_t)  # (n, R)
                for c0, c1, lo, hi, b_t in w.pieces:
                    delta = torch.mm(h[:, c0:c1], b_t)  # (n, rows)
                    y2[:, lo:hi].index_add_(0, rows, delta if in_place else delta.to(y.dtype))
        return y if pre is None else activate(y, self.activation)


def _compiled_update() -> Any | None:
    """The compiled kernels where they have `lora_update_` (`kernels.cpu.native`), else None."""
    ops = native_ops()
    return ops if ops is not None and hasattr(ops, "lora_update_") else None


_CODE_NAMES = {code: name for name, code in KERNEL_CODES.items()}
_ONEDNN_NAMES = {"gelu": "gelu_tanh", "relu": "relu"}


def _split_activation(product: nn.Module) -> tuple[nn.Module, str] | None:
    """For a product that applies an activation to its outputs: a shallow copy of it (the same
    weights) that does not, and the activation's name; None for any other product."""
    act = getattr(product, "activation", None)
    if isinstance(act, int) and act != 0:  # FewRowsLinear: the compiled kernel's code
        name, none = _CODE_NAMES[act], 0
    elif isinstance(act, str) and act != "none":  # Int8Linear
        name, none = act, "none"
    elif getattr(product, "attr", "none") != "none":  # OneDnnLinear: oneDNN's post-op
        name, none = _ONEDNN_NAMES[product.attr], None
    else:
        return None
    twin = copy.copy(product)
    twin._modules = dict(product._modules)  # a copy's own children, the same weights
    if none is None:
        twin.attr, twin.algorithm = "none", ""
    else:
        twin.activation = none
    for child_name, child in product._modules.items():  # FewRowsLinear's `many`
        inner = _split_activation(child)
        if inner is not None:
            twin._modules[child_name] = inner[0]
    return twin, name


def _product_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) of each layer product an adapter may update, by its suffix."""
    c = model.config
    q_width, kv_width = c.n_head * c.head_dim, c.kv_heads * c.head_dim
    fc_rows = (2 if c.gated_mlp else 1) * c.mlp_width
    return {
        "attn.c_attn": (c.n_embd, q_width + 2 * kv_width),
        "attn.c_proj": (q_width, c.n_embd),
        "mlp.c_fc": (c.n_embd, fc_rows),
        "mlp.c_proj": (c.mlp_width, c.n_embd),
    }


def install_lora(
    model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype | None = None
) -> LoraBank:
    """Make `model`'s layer products adaptable: a `LoraLinear` for each, sharing one new
    `LoraBank` of `max_loras` slots (also `model.lora_slots`); returns the bank. A wrapper takes
    its product's place while a loaded adapter updates that product (`LoraBank.place_wrappers`),
    so the base's steps pay nothing for slots no adapter uses. Run it after quantization and
    `optimize_for_cpu` (it wraps whatever product each layer then has). `dtype`: the adapters'
    weights and products (None: float32, as PEFT computes them; bfloat16 reads half the bytes)."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError("max_loras and max_rank must be at least 1")
    if getattr(model, "lora_slots", None) is not None:
        raise ValueError("the model already has LoRA slots")
    device = next(model.parameters()).device
    shapes = _product_shapes(model)
    layers: dict[str, LoraLinear] = {}
    for i, block in enumerate(model.transformer.h):
        for suffix in PRODUCTS:
            n_in, n_out = shapes[suffix]
            parent_name, _, child = suffix.partition(".")
            parent = getattr(block, parent_name)
            base = getattr(parent, child)
            wrapper = LoraLinear(base, n_in, n_out, max_loras, device)
            wrapper.place = (parent, child)  # a tuple: not a child module (no cycle)
            layers[f"transformer.h.{i}.{suffix}"] = wrapper
    bank = LoraBank(layers, max_loras, max_rank, dtype or torch.float32)
    for wrapper in layers.values():
        wrapper.bank = bank
    for block in model.transformer.h:
        if hasattr(block, "lora_bank"):  # a one-call layer, which applies the updates itself
            block.lora_bank = bank
    model.lora_slots = bank
    return bank
