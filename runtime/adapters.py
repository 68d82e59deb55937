"""LoRA adapters served unmerged: the artifact's adapter slots (compiler/lora_slots.py) and
the adapters written into them.

Slot 0 is the base (the kernels skip it); adapter i of those loaded is slot i + 1. For each
adapted linear the engine hands the library A [S, in, C, 16] and B [S, C, 16, out], S = the
adapters + 1, C = the largest rank among them in chunks of 16 (smaller ranks padded with
zeros). B holds s·B, the adapter's scale (alpha / r, times the user's) folded in. A QA-LoRA
adapter reads its input pooled over blocks of 32: its A is written out per input, each
column the block's times peft's pooling weight, which is the same product.
"""

from __future__ import annotations

import numpy as np

from qwc.errors import QwcError
from qwc.manifest import LoraSlots

from . import memory


class AdapterSlots:
    """The adapter inputs of every call: A and B of each linear for the loaded adapters."""

    def __init__(self, spec: LoraSlots, adapters: list, max_rank: int | None, to_tensor):
        """`adapters`: (name, adapter_files.Adapter) in slot order; `max_rank`: the largest rank
        served (None: the artifact's)."""
        self.spec = spec
        limit = spec.max_rank if max_rank is None else max_rank
        if not 1 <= limit <= spec.max_rank:
            raise QwcError(f"--max-lora-rank {limit}: this artifact's adapter slots take ranks up to {spec.max_rank} "
                           "(qwc compile --max-lora-rank)")
        for name, ad in adapters:
            if ad.rank > limit:
                raise QwcError(f"adapter {name} ({ad.path}) has rank {ad.rank}, above --max-lora-rank {limit}")
        self.names = [name for name, _ in adapters]
        self.ranks = [ad.rank for _, ad in adapters]
        rank = max((ad.rank for _, ad in adapters), default=1)
        chunks = -(-rank // spec.chunk)
        slots = len(adapters) + 1
        shapes = []
        for _, k, n in spec.linears:
            shapes += [(slots, k, chunks, spec.chunk), (slots, chunks, spec.chunk, n)]
        arena = memory.arena_for((s, np.float32) for s in shapes)
        self.arrays = [arena.take(s, np.float32) for s in shapes]
        for a in self.arrays:
            a.fill(0)
        for slot, (_, ad) in enumerate(adapters, start=1):
            self._write(slot, ad)
        self.tensors = [to_tensor(a) for a in self.arrays]
        self.nbytes = sum(a.nbytes for a in self.arrays)

    def _write(self, slot: int, ad) -> None:
        from qwc.adapter_files import QA_GROUP

        c16 = self.arrays[0].shape[2] * self.spec.chunk
        for i, (name, k, n) in enumerate(self.spec.linears):
            pair = ad.pairs.get(name)
            if pair is None:
                continue
            a = pair.a.astype(np.float32)
            if ad.kind == "qalora":   # peft pools a block as its mean times the number of blocks
                a = np.repeat(a, QA_GROUP, axis=1) * np.float32((k // QA_GROUP) / QA_GROUP)
            r = a.shape[0]
            a_slot, b_slot = self.arrays[2 * i][slot], self.arrays[2 * i + 1][slot]
            a_full = np.zeros((k, c16), np.float32)
            a_full[:, :r] = a.T
            a_slot[:] = a_full.reshape(a_slot.shape)
            b_full = np.zeros((c16, n), np.float32)
            b_full[:r] = (pair.b.astype(np.float32) * np.float32(pair.scale)).T
            b_slot[:] = b_full.reshape(b_slot.shape)

    def describe(self) -> str:
        """For `qwc serve` and `qwc run` at start."""
        each = ", ".join(f"{n} (rank {r})" for n, r in zip(self.names, self.ranks))
        return f"adapters {each}, served unmerged ({self.nbytes / 2**20:.1f} MiB of slots)"

    def slot_of(self, name: str | None) -> int:
        """The slot of adapter `name` (None: the base)."""
        if name is None:
            return 0
        return self.names.index(name) + 1


def load_adapters(specs: list[tuple[str, str]], config) -> list:
    """(name, adapter_files.Adapter) for each (name, PATH[:SCALE]), read and checked against
    the artifact's model config; names must be distinct."""
    from qwc.adapter_files import read_adapter

    seen = set()
    out = []
    for name, spec in specs:
        if name in seen:
            raise QwcError(f"--lora {name}: the name is given twice")
        seen.add(name)
        out.append((name, read_adapter(spec, config)))
    return out
