"""What the prefix cache holds, as the KV events published so far say, so that the replay socket
can answer a consumer that asks for more than its buffer keeps (a router started after the
engine has run past `buffer_steps` steps) with the whole state instead of a hole.

The publisher thread applies every batch it sends (`apply`) and builds a snapshot on request
(`snapshot`): one EventBatch in vLLM's format, `AllBlocksCleared` first (forget everything you
had), then one `BlockStored` per cached block, every parent before its children, with the
batch time of the last batch applied. Sent as the replay's answer under that last batch's
sequence number: a consumer that knows vLLM's events applies it as it is (a batch that begins by
clearing is a complete state), and treats the live batches up to that number as already seen.

Only the publisher thread touches it: no lock. Cost: one entry per cached block (its hash, its
parent's, its tokens as an `array`), about 200 bytes for a 16-token block.
"""

from __future__ import annotations

from array import array

from shoal.engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


class CacheMirror:
    def __init__(self) -> None:
        # block hash -> (parent hash or None, token ids, the BlockStored's other fields)
        self._blocks: dict[int, tuple[int | None, array, tuple]] = {}
        self.last_ts = 0.0

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent, size = ev.parent_block_hash, ev.block_size
                rest = (size, ev.lora_id, ev.medium, ev.lora_name, ev.group_idx)
                for i, h in enumerate(ev.block_hashes):
                    self._blocks.pop(h, None)  # re-stored: its place is now, after its parent
                    self._blocks[h] = (parent, array("q", ev.token_ids[i * size:(i + 1) * size]),
                                       rest)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._blocks.pop(h, None)
            elif isinstance(ev, AllBlocksCleared):
                self._blocks.clear()
        self.last_ts = batch.ts

    def snapshot(self, data_parallel_rank: int | None = 0) -> EventBatch:
        """The state: AllBlocksCleared, then every block once, parents first."""
        events: list = [AllBlocksCleared()]
        done: set[int] = set()
        for h in self._blocks:
            chain = []
            while h is not None and h not in done and h in self._blocks:
                chain.append(h)
                h = self._blocks[h][0]
            for b in reversed(chain):
                parent, tokens, (size, lora_id, medium, lora_name, group_idx) = self._blocks[b]
                events.append(BlockStored(
                    block_hashes=[b], parent_block_hash=parent, token_ids=tokens.tolist(),
                    block_size=size, lora_id=lora_id, medium=medium, lora_name=lora_name,
                    group_idx=group_idx))
                done.add(b)
        return EventBatch(ts=self.last_ts, events=events, data_parallel_rank=data_parallel_rank)
