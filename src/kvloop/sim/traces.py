"""Replay request traces: the shipped public traces, or a file in one of their formats.

Formats, detected from the first line (``.gz`` decompressed): Azure LLM inference CSV
(``TIMESTAMP,ContextTokens,GeneratedTokens``), Mooncake JSONL (``timestamp`` in ms,
``input_length``, ``output_length``, ``hash_ids`` naming 512-token prompt blocks) and ShareGPT
length stats CSV (``num_prefill_tokens,num_decode_tokens[,...]``, no timestamps). Traces carry
no token ids, so ids are made up: each prompt gets its own disjoint ``range``, except Mooncake
blocks, which get equal ids for equal hash ids (:class:`BlockPrompt`) so prefix caching hits.
"""

from __future__ import annotations

import csv
import datetime
import functools
import gzip
import io
import itertools
import json
import math
import operator
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

#: Shipped trace name -> data file in ``kvloop/sim/data`` (see ATTRIBUTION.md there).
SHIPPED_TRACES: dict[str, str] = {
    "azure-conv": "azure_conv.csv.gz",
    "azure-code": "azure_code.csv.gz",
    "mooncake": "mooncake.jsonl.gz",
    "sharegpt": "sharegpt.csv.gz",
}


class TraceFormatError(ValueError):
    """A trace file is malformed; the message names the file, the line and the problem."""


@dataclass
class WorkloadRequest:
    """One request of a workload, as the simulator or a benchmark client submits it."""

    request_id: str
    """Unique within the workload."""
    arrival_time: float
    """Seconds from the start of the workload."""
    prompt_token_ids: Sequence[int]
    """Prompt token ids; a compact sequence (``range`` or :class:`BlockPrompt`), not a list."""
    output_len: int
    """The simulator finishes the request after this many output tokens (>= 1)."""
    priority: int = 0
    """Scheduling priority; lower is more urgent."""
    tenant: str = ""
    """Who sends it (the ``fair`` policy shares service by it; "" = no tenant)."""


class BlockPrompt(Sequence[int]):
    """A prompt made of hash-named blocks, without materialising its token ids.

    Token ``i`` is ``h * block_size + i % block_size`` where ``h = hash_ids[i // block_size]``,
    so blocks with equal hash ids hold equal token ids. Positions past the named blocks (when
    ``length > len(hash_ids) * block_size``) get unique ids ``tail_base, tail_base + 1, ...``.
    Slices are returned as a ``range`` when they lie inside one block (or inside the tail),
    else as a list.
    """

    __slots__ = ("_blocked", "_hash_ids", "_len", "_tail_base", "block_size")

    def __init__(
        self, hash_ids: Sequence[int], length: int, tail_base: int = 0, block_size: int = 512
    ) -> None:
        if length < 0 or block_size < 1:
            raise ValueError("length must be >= 0 and block_size >= 1")
        self._hash_ids, self._len, self._tail_base = tuple(hash_ids), length, tail_base
        self.block_size = block_size
        self._blocked = min(length, len(self._hash_ids) * block_size)

    def __len__(self) -> int:
        return self._len

    def _span(self, start: int, stop: int) -> range:
        """Ids in ``[start, stop)``, which must lie inside one block or inside the tail."""
        if start >= self._blocked:
            off = self._tail_base - self._blocked
            return range(off + start, off + stop)
        bs = self.block_size
        base = self._hash_ids[start // bs] * bs - (start // bs) * bs
        return range(base + start, base + stop)

    def _pieces(self, start: int, stop: int) -> Iterator[range]:
        bs = self.block_size
        while start < stop:
            end = stop if start >= self._blocked else min(stop, (start // bs + 1) * bs)
            yield self._span(start, end)
            start = end

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            bs = self.block_size
            if start >= self._blocked or stop <= start or (stop - 1) // bs == start // bs:
                return self._span(start, stop)  # inside one block or the tail (or empty)
            return list(itertools.chain.from_iterable(self._pieces(start, stop)))
        i = operator.index(index)
        if not -self._len <= i < self._len:
            raise IndexError("BlockPrompt index out of range")
        return self._span(i % self._len, i % self._len + 1).start

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._pieces(0, self._len))

    def __repr__(self) -> str:
        return f"BlockPrompt(len={self._len}, blocks={len(self._hash_ids)})"


_Row = tuple[int, float | None, int, int, list[int] | None]  # line, time, lengths, hash ids


def _open_text(name_or_path: str) -> tuple[str, str]:
    """Return (label for error messages, decompressed text) for a trace name or path."""
    if name_or_path in SHIPPED_TRACES:
        fname = SHIPPED_TRACES[name_or_path]
        data = (resources.files("kvloop.sim") / "data" / fname).read_bytes()
        return fname, gzip.decompress(data).decode("utf-8")
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown trace {name_or_path!r}: neither a shipped trace "
            f"({', '.join(SHIPPED_TRACES)}) nor an existing file"
        )
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    try:
        return name_or_path, data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{name_or_path}: not UTF-8 text ({e.reason})") from None


def _lengths(values: tuple, names: tuple, src: str, line: int) -> tuple[int, int]:
    """Check (prompt, output) lengths: integers >= 0 and a prompt >= 1; output 0 becomes 1."""
    out = []
    for value, field in zip(values, names, strict=True):
        try:
            ok = isinstance(value, str | int) and not isinstance(value, bool)
            n = int(value) if ok else None
        except ValueError:
            n = None
        if n is None or n < 0:
            what = "is not an integer" if n is None else "is negative"
            raise TraceFormatError(f"{src}:{line}: {field} {what}: {value!r}")
        out.append(n)
    if out[0] == 0:
        raise TraceFormatError(f"{src}:{line}: {names[0]} is 0 (a prompt needs >= 1 token)")
    return out[0], max(1, out[1])


def _wallclock(value: str, days: dict[str, float], src: str, line: int) -> float:
    """Seconds of ``YYYY-MM-DD HH:MM:SS[.fff...]`` (or plain seconds) since the first day seen."""
    try:
        text = value.strip().rstrip("Z")
        if ":" not in text:
            return float(text)
        date, _, clock = text.replace("T", " ").partition(" ")
        day = days.get(date)
        if day is None:
            ordinal = datetime.date.fromisoformat(date).toordinal()
            day = days[date] = (ordinal - days.setdefault("", ordinal)) * 86400.0
        h, m, s = clock.split(":")
        t = day + int(h) * 3600 + int(m) * 60 + float(s)
        if math.isfinite(t):
            return t
    except ValueError:
        pass
    raise TraceFormatError(f"{src}:{line}: TIMESTAMP is not a date-time: {value!r}")


def _parse_csv(text: str, src: str, limit: int | None) -> tuple[str, list[_Row]]:
    reader = csv.reader(io.StringIO(text))
    header = [h.strip() for h in next(reader, [])]
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(header):
        kind, names = "azure", ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    elif {"num_prefill_tokens", "num_decode_tokens"} <= set(header):
        kind, names = "sharegpt", ("", "num_prefill_tokens", "num_decode_tokens")
    else:
        what = "Azure (TIMESTAMP,ContextTokens,GeneratedTokens), ShareGPT stats or Mooncake"
        raise TraceFormatError(f"{src}:1: unknown trace header {','.join(header)!r}; not {what}")
    ti = header.index(names[0]) if names[0] else -1
    pi, oi = header.index(names[1]), header.index(names[2])
    width, days, rows = len(header), {}, []
    for fields in reader:
        line = reader.line_num
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue
        if len(fields) < width:
            raise TraceFormatError(f"{src}:{line}: expected {width} columns, got {len(fields)}")
        t = _wallclock(fields[ti], days, src, line) if ti >= 0 else None
        rows.append((line, t, *_lengths((fields[pi], fields[oi]), names[1:], src, line), None))
        if limit is not None and len(rows) >= limit:
            break
    return kind, rows


def _parse_jsonl(text: str, src: str, limit: int | None) -> tuple[str, list[_Row]]:
    rows: list[_Row] = []
    keys = ("input_length", "output_length")
    for line, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{src}:{line}: not valid JSON: {e.msg}") from None
        if type(obj) is not dict or not obj.keys() >= {"timestamp", *keys}:
            raise TraceFormatError(f"{src}:{line}: expected an object with timestamp, {keys}")
        t = obj["timestamp"]
        if type(t) not in (int, float) or not math.isfinite(t):
            raise TraceFormatError(f"{src}:{line}: timestamp is not a number: {t!r}")
        hash_ids = obj.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
            raise TraceFormatError(f"{src}:{line}: hash_ids is not a list of ints >= 0")
        lengths = _lengths((obj[keys[0]], obj[keys[1]]), keys, src, line)
        rows.append((line, t / 1000.0, *lengths, hash_ids))
        if limit is not None and len(rows) >= limit:
            break
    return "mooncake", rows


def _parse(name_or_path: str, limit: int | None = None) -> tuple[str, str, list[_Row]]:
    """Return (format kind, label, rows) of a trace; raise if it has no requests."""
    src, text = _open_text(name_or_path)
    parse = _parse_jsonl if text.lstrip().startswith("{") else _parse_csv
    kind, rows = parse(text, src, limit) if text.strip() else ("", [])
    if not rows:
        raise TraceFormatError(f"{src}: trace has no requests")
    return kind, src, rows


def load_trace(
    name_or_path: str,
    *,
    rate_scale: float = 1.0,
    num_requests: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Load a shipped trace (see ``SHIPPED_TRACES``) or a trace file as workload requests.

    Arrivals are the trace's timestamps relative to its earliest one; traces without
    timestamps (ShareGPT) arrive all at t=0 unless ``request_rate`` is given. A
    ``request_rate`` (req/s) replaces the arrivals of any trace with a Poisson process
    seeded by ``seed`` (first request at t=0; ``math.inf`` = all at t=0). ``rate_scale``
    multiplies the arrival rate (arrival times are divided by it). ``num_requests`` keeps the
    first N rows of the file. Output lengths of 0 become 1. Requests come sorted by arrival.
    """
    if not (rate_scale > 0 and math.isfinite(rate_scale)):
        raise ValueError(f"rate_scale must be a positive finite number, got {rate_scale!r}")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate!r}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    kind, src, rows = _parse(name_or_path, num_requests)
    if request_rate is not None:
        rng, rate = random.Random(seed), request_rate
        gaps = [0.0] + [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in rows[1:]]
        times = list(itertools.accumulate(gaps))
    elif kind == "sharegpt":
        times = [0.0] * len(rows)
    else:
        t0 = min(row[1] for row in rows)  # type: ignore[type-var]
        times = [row[1] - t0 for row in rows]  # type: ignore[operator]
    label = name_or_path if name_or_path in SHIPPED_TRACES else Path(src).name.split(".")[0]
    tail_base = (max((max(r[4], default=0) for r in rows if r[4]), default=0) + 1) * 512
    out: list[WorkloadRequest] = []
    offset = 0
    for i, (row, t) in enumerate(zip(rows, times, strict=True)):
        _, _, prompt_len, output_len, hash_ids = row
        prompt: Sequence[int]
        if hash_ids is None:
            prompt, offset = range(offset, offset + prompt_len), offset + prompt_len
        else:
            prompt = BlockPrompt(hash_ids, prompt_len, tail_base)
            tail_base += max(0, prompt_len - len(hash_ids) * 512)
        out.append(WorkloadRequest(f"{label}-{i}", t / rate_scale, prompt, output_len))
    if any(a.arrival_time > b.arrival_time for a, b in itertools.pairwise(out)):
        out.sort(key=lambda r: r.arrival_time)
    return out


@functools.lru_cache(maxsize=16)
def _cached_lengths(name_or_path: str) -> tuple[tuple[int, int], ...]:
    return tuple((row[2], row[3]) for row in _parse(name_or_path)[2])


def trace_lengths(name_or_path: str) -> list[tuple[int, int]]:
    """(prompt length, output length) of every request of a trace, in file order (cached)."""
    return list(_cached_lengths(name_or_path))
