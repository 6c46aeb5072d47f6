"""The server's generation engine: one thread that batches waiting requests through the
batched :class:`~meshtron.models.generation.Generator`, and the loop the other ranks of a
tp x pp replica run to follow it.

HTTP handlers only queue jobs (one per prompt). The engine thread takes every waiting job that
can share a batch with the first one (the same sampling settings, up to ``max_batch``, and
together within the model's positions: a batch is left-padded to its longest prompt, so the
longest prompt plus the largest token budget must fit), broadcasts that batch's work to the
other ranks, and runs it; each job hears its new text after every decode step. A batch runs to
its end before the next one starts (no continuous batching: a job that arrives meanwhile waits
for the next batch).

Every rank must call the generator with the same arguments, so what rank 0 runs is exactly what
it broadcasts (:class:`Work`, through :func:`run_work`); between batches rank 0 broadcasts a
keep-alive so a follower's wait never reaches the process group's timeout, and at shutdown a
stop.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from meshtron.data import Tokenizer
from meshtron.inference.generate_command import completion_text, stop_rule
from meshtron.models.generation import Completion, Generator, Sampling, StepHook

BATCH_WINDOW_S = 0.01
"""How long the engine waits after a first job for others that arrive with it (requests sent
together then share a batch rather than the first running alone)."""
PING, STOP = "ping", "stop"
"""The messages besides :class:`Work` that rank 0 broadcasts to the other ranks."""
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
"""The generator's finish -> the OpenAI API's ``finish_reason``."""


@dataclass(frozen=True)
class Work:
    """One batch, as every rank runs it."""

    prompts: list[list[int]]
    max_tokens: list[int]
    sampling: Sampling
    stops: list[tuple[str, ...]]
    ends: tuple[int, ...]
    """The ids that end a completion (the model's end-of-sequence ids)."""


@dataclass(frozen=True)
class Progress:
    """What a job hears after a decode step: its new text (stop strings cut, held back while
    it may still become one or ends in a partial character) and, once ended, why."""

    text: str
    finish: str | None = None
    """``stop`` or ``length`` (the OpenAI API's names) once the sequence has ended."""
    tokens: int = 0
    """New tokens so far."""


Report = Callable[[Progress | BaseException], None]
Broadcast = Callable[[object], object]
"""Rank 0 sends a message and gets it back; a follower passes None and gets rank 0's."""


@dataclass
class Job:
    """One prompt of a request. ``report`` is called from the engine thread."""

    tokens: list[int]
    max_tokens: int
    sampling: Sampling
    """Its seed is replaced by :attr:`seed`."""
    seed: int | None
    """None: a fresh random seed for the batch."""
    stops: tuple[str, ...]
    report: Report

    @property
    def positions(self) -> int:
        """Positions the prompt takes (an empty one starts from EOS)."""
        return max(len(self.tokens), 1)


class EngineClosed(RuntimeError):
    """The engine takes no more jobs (shutting down, or failed)."""


def run_work(generator: Generator, tokenizer: Tokenizer, work: Work,
             on_step: StepHook | None = None) -> list[Completion]:
    """Run one batch: the same call on every rank of the replica."""
    rules = [stop_rule(tokenizer, list(stops)) for stops in work.stops]
    completions, _ = generator.generate(work.prompts, work.max_tokens, work.sampling,
                                        work.ends, rules, on_step)
    return completions


def follow(generator: Generator, tokenizer: Tokenizer, broadcast: Broadcast) -> int:
    """A rank other than 0: run every batch rank 0 broadcasts, until it says stop."""
    while True:
        message = broadcast(None)
        if message == STOP:
            return 0
        if isinstance(message, Work):
            run_work(generator, tokenizer, message)


class TextStream:
    """A sequence's text as it grows: what can be sent so far without taking anything back."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops, self.sent = tokenizer, stops, 0

    def update(self, completion: Completion, ended: bool) -> Progress:
        text = self.tokenizer.decode(completion.tokens)
        if ended:
            final = completion_text(self.tokenizer, completion, list(self.stops))
            delta, self.sent = final[self.sent:], len(final)
            return Progress(delta, FINISH_REASONS[completion.finish], len(completion.tokens))
        end = len(text.rstrip("\ufffd"))  # a character whose bytes have not all come
        held = max([n for stop in self.stops for n in range(1, min(len(stop), end + 1))
                    if text[end - n:end] == stop[:n]], default=0)  # may begin a stop string
        safe = end - held
        delta = text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return Progress(delta, None, len(completion.tokens))


class Engine:
    """Rank 0's batching loop on its own thread (the HTTP server keeps the main thread)."""

    def __init__(self, generator: Generator, tokenizer: Tokenizer, max_batch: int,
                 broadcast: Broadcast | None = None, keepalive_s: float = 60.0,
                 ends: tuple[int, ...] | None = None):
        self.generator, self.tokenizer, self.max_batch = generator, tokenizer, max_batch
        self.ends = ends or (tokenizer.eos_id,)
        self.broadcast, self.keepalive_s = broadcast, keepalive_s
        self.max_len = generator.model.cfg.max_seq_len
        self.error: BaseException | None = None
        """Why the engine stopped serving, if it failed."""
        self.batches = 0
        """Batches run so far (``/health`` says it)."""
        self._jobs: list[Job] = []
        self._ready = threading.Condition()
        self._closing = False
        self._seeds = random.Random()
        self._thread = threading.Thread(target=self._loop, name="meshtron-engine", daemon=True)
        self._on_fatal: Callable[[], None] = lambda: None

    def start(self, on_fatal: Callable[[], None] = lambda: None) -> None:
        """Start the loop; ``on_fatal`` is called (from its thread) if a batch fails."""
        self._on_fatal = on_fatal
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs``; they are reported to as they run."""
        with self._ready:
            if self._closing or self.error is not None:
                raise EngineClosed("the server is shutting down")
            self._jobs += jobs
            self._ready.notify()

    @property
    def waiting(self) -> int:
        with self._ready:
            return len(self._jobs)

    def close(self) -> None:
        """Finish the running batch, refuse the waiting jobs, stop the other ranks."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        device = self.generator.device
        if device.type == "cuda":  # a thread starts on device 0; NCCL uses the current one
            torch.cuda.set_device(device)
        try:
            while (batch := self._take()) is not None:
                if batch:
                    self._run(batch)
                elif self.broadcast is not None:
                    self.broadcast(PING)
        except BaseException as err:  # a failed collective: the replica cannot go on
            self.error = err
            self._on_fatal()
        finally:
            with self._ready:
                left, self._jobs = self._jobs, []
            for job in left:
                job.report(EngineClosed("the server stopped before this request ran"))
            if self.broadcast is not None and self.error is None:
                with contextlib.suppress(Exception):  # the signal that stops us stopped them
                    self.broadcast(STOP)

    def _take(self) -> list[Job] | None:
        """The next batch ([] after ``keepalive_s`` without jobs; None once closing)."""
        with self._ready:
            if not self._jobs and not self._closing:
                self._ready.wait(self.keepalive_s)
            if self._closing:
                return None
            if not self._jobs:
                return []
            full = len(self._jobs) >= self.max_batch
        if not full:
            time.sleep(BATCH_WINDOW_S)
        with self._ready:
            batch = self._pack()
            taken = {id(job) for job in batch}
            self._jobs = [job for job in self._jobs if id(job) not in taken]
            return batch

    def _pack(self) -> list[Job]:
        """From the oldest job on, the waiting jobs that share its sampling and fit with it."""
        batch: list[Job] = []
        for job in self._jobs:
            if len(batch) == self.max_batch:
                break
            if batch and (job.sampling, job.seed) != (batch[0].sampling, batch[0].seed):
                continue
            longest = max([j.positions for j in batch] + [job.positions])
            budget = max([j.max_tokens for j in batch] + [job.max_tokens])
            if not batch or longest + budget <= self.max_len:
                batch.append(job)
        return batch

    def _run(self, batch: list[Job]) -> None:
        seed = batch[0].seed
        sampling = replace(batch[0].sampling,
                           seed=self._seeds.randrange(2**63) if seed is None else seed)
        work = Work([job.tokens for job in batch], [job.max_tokens for job in batch],
                    sampling, [job.stops for job in batch], self.ends)
        streams = [TextStream(self.tokenizer, job.stops) for job in batch]
        reported = [False] * len(batch)

        def on_step(completions: list[Completion], done: list[bool]) -> None:
            for i, (job, stream) in enumerate(zip(batch, streams)):
                if reported[i]:
                    continue
                progress = stream.update(completions[i], done[i])
                reported[i] = done[i]
                if progress.text or progress.finish:
                    job.report(progress)

        if self.broadcast is not None:
            self.broadcast(work)
        self.batches += 1
        try:
            completions = run_work(self.generator, self.tokenizer, work, on_step)
        except BaseException as err:
            for i, job in enumerate(batch):
                if not reported[i]:
                    job.report(err)
            raise
        for i, job in enumerate(batch):  # ended by the token budget of the whole batch
            if not reported[i]:
                job.report(streams[i].update(completions[i], True))
