"""Grammar compilation with xgrammar: off the hot path, cached by spec hash, bounded in time.

Compiling turns a spec into a `CompiledGrammar`: the grammar plus, for every parser state it can
precompute, which tokens of this vocabulary may come next. Simple schemas take about a millisecond,
pathological ones (a regex of nested counted repeats, huge `minItems`) seconds or more. So:

* compilation runs on threads of its own (at most `max_workers` at once), never in the engine's step;
* results are kept in an LRU cache keyed by `StructuredOutput.key` (a hash of kind and source), and
  concurrent requests for the same grammar share one compilation;
* every wait has a timeout. A compile that overruns raises `GrammarTimeoutError` (a 400 for the
  server). The thread cannot be killed, so it finishes in the background and its result is cached:
  the in-flight table means repeating the same pathological request does not start another one. (A
  process exiting waits for such a compile: killing a thread inside xgrammar's C++ aborts the process.
  The size cap on grammar sources bounds how long that can be.)
"""

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from kvyard.errors import InvalidRequestError
from kvyard.structured.spec import JSON_WHITESPACE, MAX_JSON_WHITESPACE, StructuredOutput

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_ENTRIES = 512

# xgrammar's messages start with "[11:16:31] /project/cpp/grammar_parser.cc:820: "; the client needs the rest.
_XGR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarCompileError(InvalidRequestError):
    """The schema, regex or grammar is invalid or uses something xgrammar does not support."""


class GrammarTimeoutError(GrammarCompileError):
    """Compiling took longer than the timeout (a pathological schema or grammar)."""


class _Failed(Exception):
    """A compile failure on a compile thread, before it is given the caller's parameter name."""


@dataclass
class CompileStats:
    compiled: int = 0  # grammars compiled (cache misses that succeeded)
    cache_hits: int = 0
    failures: int = 0
    timeouts: int = 0
    compile_seconds: float = 0.0  # total time spent compiling
    last_compile_seconds: float = 0.0


class GrammarCompiler:
    """Compiles `StructuredOutput` specs for one tokenizer; thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        max_workers: int = 2,
        json_whitespace: str = "compact",
    ):
        if json_whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {', '.join(JSON_WHITESPACE)}, got {json_whitespace!r}")
        self.json_whitespace = json_whitespace
        # vocab_size is the model's (lm_head rows), which may exceed the tokenizer's: padding rows are masked.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # xgrammar's own cache is off: ours is keyed by spec (kind + source) and bounded in entries.
        self._xgr = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.timeout_s = timeout_s
        self.cache_entries = cache_entries
        self.stats = CompileStats()
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._inflight: dict[str, Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_workers)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    # ---- public API -----------------------------------------------------------------------------------

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Compile (or fetch from the cache), waiting at most `timeout_s`. Raises GrammarCompileError."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        future = self._submit(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeoutError:
            raise self._timeout(spec) from None
        except _Failed as e:
            raise GrammarCompileError(f"invalid {_what(spec)}: {e}", param=spec.param) from None

    async def compile_async(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """`compile` for the event loop: it awaits the compile thread without blocking the loop."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        future = asyncio.wrap_future(self._submit(spec))
        try:
            # shield: a timeout must not cancel a compile that other requests may be waiting on.
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise self._timeout(spec) from None
        except _Failed as e:
            raise GrammarCompileError(f"invalid {_what(spec)}: {e}", param=spec.param) from None

    async def attach(self, spec: StructuredOutput | None) -> StructuredOutput | None:
        """The spec with its compiled grammar attached (the server's path: compile before the engine)."""
        if spec is not None and spec.compiled is None:
            spec.compiled = await self.compile_async(spec)
        return spec

    # ---- internals ------------------------------------------------------------------------------------

    def _cached(self, spec: StructuredOutput) -> xgr.CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
                self.stats.cache_hits += 1
            return compiled

    def _submit(self, spec: StructuredOutput) -> "Future[xgr.CompiledGrammar]":
        with self._lock:
            future = self._inflight.get(spec.key)
            if future is not None:
                return future
            future = Future()
            self._inflight[spec.key] = future
        # Never a daemon, even when started from one (see the module doc on exiting).
        threading.Thread(target=self._run, args=(spec, future), name="kvyard-grammar", daemon=False).start()
        return future

    def _run(self, spec: StructuredOutput, future: "Future[xgr.CompiledGrammar]") -> None:
        with self._slots:  # at most max_workers compiles at once; the others wait their turn here
            if not future.set_running_or_notify_cancel():
                with self._lock:
                    self._inflight.pop(spec.key, None)
                return  # nobody is waiting any more
            try:
                future.set_result(self._build(spec))
            except BaseException as e:
                future.set_exception(e)

    def _build(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = self._compile_now(spec)
        except Exception as e:  # any failure to compile user input is the input's fault
            with self._lock:
                self._inflight.pop(spec.key, None)
                self.stats.failures += 1
            raise _Failed(_clean(e)) from None
        elapsed = time.perf_counter() - start
        with self._lock:
            self._inflight.pop(spec.key, None)
            self._cache[spec.key] = compiled
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
            self.stats.compiled += 1
            self.stats.compile_seconds += elapsed
            self.stats.last_compile_seconds = elapsed
        return compiled

    def _compile_now(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        c = self._xgr
        if spec.kind == "json_object":
            # Any JSON object (not an array or a scalar), as OpenAI's json_object mode promises.
            return c.compile_json_schema('{"type": "object"}', strict_mode=False, **self._whitespace())
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.source, strict_mode=True, **self._whitespace())
        if spec.kind == "regex":
            return c.compile_regex(spec.source)
        if spec.kind == "choice":
            # JSON string literals are valid EBNF string literals (same escapes).
            return c.compile_grammar("root ::= " + " | ".join(_ebnf_literal(x) for x in spec.choices))
        if spec.kind == "grammar":
            return c.compile_lark(spec.source) if spec.is_lark else c.compile_grammar(spec.source)
        return c.compile_structural_tag(spec.source)

    def _whitespace(self) -> dict[str, Any]:
        if self.json_whitespace == "compact":
            return {"any_whitespace": False}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}

    def _timeout(self, spec: StructuredOutput) -> GrammarTimeoutError:
        with self._lock:
            self.stats.timeouts += 1
        return GrammarTimeoutError(
            f"compiling the {_what(spec)} took longer than {self.timeout_s:g} s; simplify it "
            "(nested counted repeats, very large minItems/maxItems or ranges are expensive)",
            param=spec.param,
        )


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _what(spec: StructuredOutput) -> str:
    return {
        "json_object": "JSON object format",
        "json_schema": "JSON schema",
        "regex": "regex",
        "choice": "choice list",
        "grammar": "grammar",
        "structural_tag": "structural tag",
    }[spec.kind]


def _clean(e: Exception) -> str:
    lines = [_XGR_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines() if line.strip()]
    return "; ".join(lines[:3])[:500] or type(e).__name__
