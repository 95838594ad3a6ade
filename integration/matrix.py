"""The combination matrix: host mode x layer kind x option x tier, every pair covered.

Why all-pairs: the full product (4 host modes x 8 families x 5 options x 3 tiers, times the
reuse kinds) is hundreds of servers, far past CI's budget; a failure that needs two dimensions
to show (a bounded entry in the SSD tier, a chunked cut on the sequential path) is caught by
any covering array of pairs. ``allpairspy`` builds it; the reuse kinds are not a dimension
but every cell's workload: an extension of a stored entry, a prefix cut of a longer entry (a new
conversation on the shared system prompt) and two concurrent requests on one prefix.

Each cell passes only if its answers equal the reference's (stock at fp16; the same options
without a tier where entries are quantized or bounded), the tier really carried the entry
(counted, then reused after a restart or on a second replica), and it reused at least what
the reference reused (a quantized cell on the hot tier: what stock reused on the requests it
was asked stock's very prompts, :func:`same_prompts`); or if one start-up line says why
kvplugin does not serve it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import harness
from allpairspy import AllPairs

from kvplugin.tools.client import at_once
from kvplugin.tools.models.corpus import CORPUS

SYSTEM = {"role": "system", "content": " ".join(CORPUS.split()[:260])}  # ~430 tokens
MAX_TOKENS = 16
QUESTIONS = {"A": ["Where is the river?", "And the hills?", "Who lives there?"],
             "B": ["What grows in the garden?"], "C": ["When does the market open?"],
             "D": ["Why is the bridge old?"]}

OPTIONS: dict[str, tuple[str, ...]] = {
    "fp16": (),
    "8-bit": ("--kv-cache-quantization", "--kv-cache-quantization-bits", "8",
              "--kv-cache-min-quantize-tokens", "0"),
    "4-bit": ("--kv-cache-quantization", "--kv-cache-quantization-bits", "4",
              "--kv-cache-min-quantize-tokens", "0"),
    "bounded": ("--max-kv-size", "256"),
    "hot-only": ("--hot-cache-only",),
}
TIERS = ("hot", "ssd", "redis")
EXACT = {"fp16", "hot-only"}  # options whose answers must equal stock's


@dataclass(frozen=True)
class Cell:
    mode: str
    family: str
    option: str
    tier: str

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.family}-{self.option}-{self.tier}"


def cells(modes: list[str], families: list[str]) -> list[Cell]:
    """A covering array of every pair of values of the four dimensions."""
    rows = AllPairs([modes, families, list(OPTIONS), list(TIERS)])
    return [Cell(*row) for row in rows]


@dataclass
class Run:
    """What one workload gave: answers and cached tokens per request, in order."""

    answers: list[str] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    phase2_reused: int = 0
    #: tokens the reading server's store served in phase 2 (kvplugin's own count: a host
    #: mode may report no cached tokens to the client); None on stock
    phase2_served: int | None = None
    #: prompt tokens the host's own cache statistics say it served over the run (hosts
    #: whose responses carry no cached tokens); None where the host counts none
    host_counted: int | None = None


def _ask(srv: Any, messages: list, seed: int | None) -> tuple[str, int]:
    """One request; a 503 (a host that serves one request at a time, as vllm-mlx's simple
    mode does, answers a concurrent one so) is retried as a client would."""
    import time

    deadline = time.monotonic() + 120
    while True:
        try:
            r = srv.chat(messages, max_tokens=MAX_TOKENS, seed=seed)
            return harness.answer_text(r), harness.cached_tokens(r) or 0
        except harness.ServerHTTPError as exc:
            if exc.status != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


#: the answers each request's prompt carries, in :func:`phase1` and :func:`phase2`'s order:
#: A's second turn carries A's first answer, A's third both; B, C and D none
CARRIES = [(), (0,), (), (0, 1), (), ()]


def same_prompts(run: Run, stock: Run) -> list[bool]:
    """Which of ``run``'s requests were asked stock's very prompts: those whose carried
    answers are stock's. A quantized entry may change an answer; the next turn's prompt then
    holds other tokens (on a random-weight model, bytes that tokenize back differently), so
    its reuse is not stock's to compare with."""
    return [all(run.answers[j] == stock.answers[j] for j in carried) for carried in CARRIES]


def phase1(srv: Any, run: Run, seed: int | None) -> list:
    """Conversation A's two turns: the second extends the first's entry. Returns A's history."""
    history = [SYSTEM]
    for q in QUESTIONS["A"][:2]:
        history.append({"role": "user", "content": q})
        answer, reused = _ask(srv, history, seed)
        run.answers.append(answer)
        run.reused.append(reused)
        history.append({"role": "assistant", "content": answer})
    return history


def _served(srv: Any) -> int | None:
    try:
        return srv.get("/kvplugin/stats")["store_tokens_reused"]
    except harness.ServerHTTPError:  # stock: no such route
        return None


def phase2(srv: Any, run: Run, history: list, seed: int | None) -> None:
    """A cut (B on the shared system prompt), an extension (A's third turn), then C and D at
    once on the system prompt."""
    start, served = len(run.reused), _served(srv)
    for messages in ([SYSTEM, {"role": "user", "content": QUESTIONS["B"][0]}],
                     history + [{"role": "user", "content": QUESTIONS["A"][2]}]):
        answer, reused = _ask(srv, messages, seed)
        run.answers.append(answer)
        run.reused.append(reused)
    def one(who: str) -> Any:
        return lambda barrier: (barrier.wait(timeout=60), _ask(
            srv, [SYSTEM, {"role": "user", "content": QUESTIONS[who][0]}], seed))[1]

    got = dict(zip("CD", at_once(one("C"), one("D"))))
    for who in "CD":
        run.answers.append(got[who][0])
        run.reused.append(got[who][1])
    run.phase2_reused = sum(run.reused[start:])
    if served is not None:
        run.phase2_served = _served(srv) - served


@dataclass
class Host:
    """How one host's cells are started: its command and its own flags."""

    cmd: Callable[..., list[str]]
    mode_flags: dict[str, tuple[str, ...]]
    seeded_modes: frozenset = frozenset()
    budget_flags: tuple[str, ...] = ()  # a budget so small that every entry spills
    #: (mode, family) -> the start-up line that says why kvplugin keeps nothing there
    not_served: dict = field(default_factory=dict)
    #: the prompt tokens a server's own cache statistics say it served (stock included)
    counted: Callable[[Any], int | None] | None = None

    def seed(self, mode: str) -> int | None:
        return 0 if mode in self.seeded_modes else None


def workload(host: Host, cell: Cell, start: Callable[..., Any], redis_url: str | None,
             tmp: Path) -> tuple[Run, list[Any]]:
    """The cell's workload on its tier; returns the run and the servers it used (the last
    one's stats tell what the tier did)."""
    flags = (*host.mode_flags[cell.mode], *OPTIONS[cell.option])
    seed, run = host.seed(cell.mode), Run()
    if cell.tier == "hot":
        srv = start(*flags)
        phase2(srv, run, phase1(srv, run, seed), seed)
        return run, [srv]
    if cell.tier == "ssd":
        tier = ("--ssd-cache-dir", str(tmp / "ssd"), *host.budget_flags)
        first = start(*flags, *tier)
        history = phase1(first, run, seed)
        settle(first)
        first.stop()
        second = start(*flags, *tier)
        phase2(second, run, history, seed)
        return run, [first, second]
    tier = ("--kv-cache-remote", redis_url or "")
    first, second = start(*flags, *tier), start(*flags, *tier)
    history = phase1(first, run, seed)
    settle(first)
    phase2(second, run, history, seed)
    return run, [first, second]


def tier_carried(cell: Cell, stats: dict) -> bool:
    """Whether the reading server got at least one entry from the tier (counted)."""
    if cell.tier == "ssd":
        return stats.get("store_cold_hits", 0) >= 1
    if cell.tier == "redis":
        return (stats.get("remote_hits") or 0) >= 1
    return True


def settle(srv: Any, quiet: float = 2.0, timeout: float = 30.0) -> dict:
    """The stats once the server has stored what it answered (hosts answer, then store):
    ``quiet`` seconds without a change, long enough for a store that CI's load delays past
    the answer."""
    import time

    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        stats = srv.get("/kvplugin/stats")
        state = (stats.get("entries_stored"), stats.get("store_spills"),
                 stats.get("remote_puts"), stats.get("remote_queued_bytes"))
        if state != last:
            last, since = state, time.monotonic()
        elif time.monotonic() - since >= quiet and not stats.get("remote_queued_bytes"):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


class Bench:
    """One host's cells against their references, on one module's servers.

    ``no_reuse``: flags that turn reuse off, so a bounded cell is compared with what the
    bounded cache answers when every request is prefilled whole (None: a bounded cell on the
    hot tier is checked for reuse only).
    """

    def __init__(self, host: Host, models: Callable[[str], Path], start_server: Callable,
                 no_reuse: tuple[str, ...] | None = None) -> None:
        self.host, self.models, self.start_server = host, models, start_server
        self.no_reuse = no_reuse
        self.runs: dict = {}

    def forget(self, cell: Cell) -> None:
        """Drop every kept run of ``cell``'s mode and family (a rerun starts afresh)."""
        for key in [k for k in self.runs if (k[0].mode, k[0].family) == (cell.mode, cell.family)]:
            del self.runs[key]

    def _starter(self, family: str, started: list, env: dict | None = None) -> Callable:
        def start(*flags: str) -> Any:
            started.append(self.start_server(self.host.cmd, *flags, env=env,
                                             model_dir=self.models(family)))
            return started[-1]
        return start

    def _run(self, cell: Cell, tmp: Path, *, stock: bool = False,
             extra: tuple[str, ...] = (), redis: Any = None, keep: bool = True,
             again: bool = False) -> tuple:
        """The cell's workload (stock's, or with ``extra`` flags) and what its last server
        reported ``(stats, kvplugin's log lines)``; kept by key when ``keep``, run anew when
        ``again``."""
        key = (cell, stock, extra)
        if key in self.runs and not again:
            return self.runs[key]
        started: list = []
        host = self.host
        if stock or extra:
            flags = () if stock else (*OPTIONS[cell.option], *extra)
            host = Host(cmd=host.cmd, seeded_modes=host.seeded_modes,
                        budget_flags=host.budget_flags, not_served=host.not_served,
                        counted=host.counted,
                        mode_flags={cell.mode: (*host.mode_flags[cell.mode], *flags)})
            cell = Cell(cell.mode, cell.family, "fp16", cell.tier)
        env = {"KVPLUGIN_DISABLE": "1"} if stock else None
        if cell.tier == "redis":
            redis.client().flushall()
        try:
            run, servers = workload(host, cell, self._starter(cell.family, started, env),
                                    redis.url if redis is not None else None, tmp)
            stats = servers[-1].get("/kvplugin/stats") if not stock else {}
            if not stock and cell.tier == "redis":  # what the writing replica published
                writer = servers[0].get("/kvplugin/stats")
                stats["writer"] = {k: v for k, v in writer.items()
                                   if k.startswith("remote_") or k == "entries_stored"}
            if host.counted is not None and cell.tier == "hot":
                run.host_counted = host.counted(servers[-1])
            logs = "\n".join(line for srv in servers for line in srv.log_text().splitlines()
                              if line.startswith("kvplugin:"))
        finally:
            for srv in started:
                srv.stop()
        if keep:
            self.runs[key] = run, (stats, logs)
        return run, (stats, logs)

    def check(self, cell: Cell, redis: Any, tmp: Path) -> None:
        """Run the cell and assert what it must hold (see the module docstring)."""
        hot = Cell(cell.mode, cell.family, cell.option, "hot")
        stock, _ = self._run(hot, tmp, stock=True)
        run, (stats, logs) = self._run(cell, tmp, redis=redis, keep=cell.tier == "hot")
        why = (cell, run.reused, stats, logs)
        said = self.host.not_served.get((cell.mode, cell.family))
        if said is not None:  # named at start-up: it must then run exactly as stock
            assert said in logs, why
            assert run.answers == stock.answers and run.reused == stock.reused, (why, stock)
            return
        if cell.option == "hot-only" and cell.tier != "hot":  # a tier it turns off: said once
            assert "--hot-cache-only wins" in logs, why
        elif cell.tier != "hot":  # the tier carried what the hot tier would have held
            same, _ = self._run(hot, tmp)
            refs = [same]
            if (run.phase2_reused < same.phase2_reused
                    or run.phase2_served < same.phase2_served):
                # a batching host's reuse can vary from run to run (which request its
                # scheduler stored first under load): held to a second hot run too
                refs.append(self._run(hot, tmp, keep=False, again=True)[0])
            assert run.phase2_reused >= min(r.phase2_reused for r in refs), (why, same.reused)
            assert run.phase2_served >= min(r.phase2_served for r in refs), (
                why, [r.phase2_served for r in refs])
            if same.phase2_served:
                assert tier_carried(cell, stats), why
            # Quantized: the SSD tier chooses its entry as the hot one does; the Redis tier
            # serves the entry its pointer names, whose codec groups may span other tokens.
            if cell.option not in EXACT and cell.tier == "ssd":
                assert run.answers == same.answers, (why, same.answers)
        elif cell.option != "bounded":  # never less reuse than stock, on stock's prompts
            same = same_prompts(run, stock)
            assert (sum(r for r, s in zip(run.reused, same) if s)
                    >= sum(r for r, s in zip(stock.reused, same) if s)), (
                why, stock.reused, same, run.answers, stock.answers)
            if stock.host_counted is not None:
                assert (run.host_counted or 0) >= stock.host_counted, (why, stock.host_counted)
        if cell.option in EXACT and run.answers != stock.answers:
            # the host's own answers can vary from run to run (a scheduler's timing under
            # load): then they must be those of another stock run of the same workload
            other, _ = self._run(hot, tmp, stock=True, keep=False, again=True)
            assert run.answers == other.answers, (why, run.answers, stock.answers,
                                                  other.answers)
        elif cell.option == "bounded" and self.no_reuse is not None:
            whole, _ = self._run(hot, tmp, extra=self.no_reuse)
            assert run.answers == whole.answers, (why, whole.answers)
        if cell.option in ("8-bit", "4-bit"):  # windows and recurrent state included
            assert stats["entries_quantized"] >= 1, why


def model_dirs(tiny_model: Path, tmp_path_factory: Any) -> Callable[[str], Path]:
    """The model directory of each family, built once on first use."""
    from kvplugin.tools.models.families import build_family_model

    built: dict[str, Path] = {"llama": tiny_model}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_family_model(family, tmp_path_factory.mktemp(family) / "m")
        return built[family]

    return get
