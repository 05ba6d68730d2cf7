"""A fake executor that keeps what every KV slot holds, to prove transfers are right.

Each device and host block is a list of token ids (None: never written). Transfers run in
the order the ``SchedulerOutput`` contract gives; a scheduled request must find its own
tokens in every slot it attends over, and sampled tokens depend on that content, so a
wrong block shows up as a failed check or as different outputs.
"""

from __future__ import annotations

from kvloop.core import ModelRunnerOutput, SchedulerOutput


class StepFault(RuntimeError):
    """Raised by ``KVContentExecutor`` where a test injects a fault."""


class KVContentExecutor:
    """Executes steps on token-id "KV", checking every read."""

    def __init__(self, num_gpu_blocks: int, num_host_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.host: list[list[int | None] | None] = [None] * num_host_blocks
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.fail_at: str | None = None
        """Inject a fault in the next step: ``store``, ``load`` (half way through each) or
        ``forward``; cleared once raised."""
        self.bytes_loaded = 0

    def _fault(self, where: str) -> None:
        if self.fail_at == where:
            self.fail_at = None
            raise StepFault(where)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        kept = set(out.swapped_out_request_ids)
        for rid in [*out.finished_request_ids, *out.preempted_request_ids]:
            if rid not in kept:
                self.tokens.pop(rid, None)
                self.tables.pop(rid, None)
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.device[d])
        for i, (d, h) in enumerate(out.blocks_to_offload):
            if i == len(out.blocks_to_offload) // 2:
                self._fault("store")
            self.host[h] = list(self.device[d])
        for h, d in out.blocks_to_swap_in:
            assert self.host[h] is not None, f"swap-in reads unwritten host block {h}"
            self.device[d] = list(self.host[h])  # type: ignore[arg-type]
        for i, (h, d) in enumerate(out.blocks_to_load):
            if i == len(out.blocks_to_load) // 2:
                self._fault("load")
            assert self.host[h] is not None, f"load reads unwritten host block {h}"
            self.device[d] = list(self.host[h])  # type: ignore[arg-type]
            self.bytes_loaded += 1
        for s, d in out.blocks_to_copy:
            self.device[d] = list(self.device[s])
        for nr in out.new_requests:
            self.tokens[nr.request_id] = [*nr.prompt_token_ids, *nr.output_token_ids]
            self.tables[nr.request_id] = list(nr.block_ids)
        c = out.cached_requests
        for rid, new, resumed in zip(c.request_ids, c.new_block_ids, c.resumed_from_swap,
                                     strict=True):
            if resumed:
                self.tables[rid] = list(new)
            else:
                self.tables[rid].extend(new)
        computed = dict(zip(c.request_ids, c.num_computed_tokens, strict=True))
        computed.update((nr.request_id, nr.num_computed_tokens) for nr in out.new_requests)
        self._fault("forward")
        bs = self.bs
        for rid in out.num_scheduled_tokens:
            toks, table = self.tokens[rid], self.tables[rid]
            for p in range(computed[rid]):
                got = self.device[table[p // bs]][p % bs]
                assert got == toks[p], f"{rid} slot {p}: KV of {got}, token {toks[p]}"
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            toks, table, start = self.tokens[rid], self.tables[rid], computed[rid]
            for p in range(start, start + n):
                self.device[table[p // bs]][p % bs] = toks[p]
            if start + n == len(toks):
                # NOTE: the "model": the next token depends on the whole context read
                t = (sum(self.device[table[p // bs]][p % bs] * (p + 1)  # type: ignore
                         for p in range(len(toks))) % 997) + 3
                toks.append(t)
                sampled[rid] = [t]
        return ModelRunnerOutput(sampled, 0.01)
