"""Compile workers: graphs compiled in forked child processes (in parallel, or in the background
while the engine serves eager), their jobs, and reaping them."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ember.compile.capture import CompiledForward, _join_prewarm, _partial

logger = logging.getLogger("ember")


@dataclass(frozen=True, eq=False)
class GraphJob:
    """A graph for warm-up to prepare: `forward`'s graph for the example step `args`, kept in
    the compile-cache file `path` (None: no cache)."""

    forward: CompiledForward
    args: tuple[Any, ...]
    path: str | None


# Compile workers at most, this process included (each holds a compiler's memory).
MAX_COMPILE_WORKERS = 4
# A compile worker still running this long (plus 4x what this process's own share took) after
# this process finished its share is taken to be stuck: it is stopped and its graphs compiled
# here.
WORKER_GRACE_S = 120.0


def compile_workers(jobs: list[GraphJob]) -> int:
    """How many processes compile `jobs` at once: one per graph to compile, up to the cores
    this process may run on (a compile keeps about one core busy: its Python lowering, then
    the C++ builds of its kernels), `MAX_COMPILE_WORKERS`, and `EMBER_COMPILE_WORKERS` when
    set. Frozen graphs are not saved, so they compile here, one by one; so does everything
    off Linux, and in a process that has started CUDA (which a forked child cannot use)."""
    todo = _to_compile(jobs)
    if (
        not sys.platform.startswith("linux")
        or torch.cuda.is_initialized()
        or any(j.forward.freezing for j in todo)
    ):
        return 1
    cores = len(os.sched_getaffinity(0))
    limit = MAX_COMPILE_WORKERS
    requested = os.environ.get("EMBER_COMPILE_WORKERS", "")
    if requested:
        try:
            limit = int(requested)
        except ValueError:
            raise ValueError(
                f"EMBER_COMPILE_WORKERS must be a whole number of processes, got {requested!r}"
            ) from None
    return max(1, min(len(todo), cores, limit))


def can_compile_in_background(jobs: list[GraphJob]) -> bool:
    """Whether `jobs`' graphs can compile in forked workers while this process runs steps:
    on Linux, not frozen (frozen graphs compile in this process), no CUDA started."""
    return (
        sys.platform.startswith("linux")
        and not torch.cuda.is_initialized()
        and not any(j.forward.freezing for j in jobs)
    )


def _to_compile(jobs: list[GraphJob]) -> list[GraphJob]:
    """The jobs whose graph has no cache file yet."""
    return [j for j in jobs if j.path is None or not os.path.isfile(j.path)]


def prepare_graphs(
    jobs: list[GraphJob],
    workers: int = 1,
    ready: Callable[[GraphJob], None] = lambda job: None,
) -> None:
    """Prepare every job's graph: loaded from its cache file when there is one, else compiled;
    `ready(job)` is called as each one is prepared.

    With `workers` > 1 the graphs to compile are dealt out round-robin: this process compiles
    the first share while `workers - 1` children forked from it (sharing its loaded weights
    copy-on-write) compile the others, each saving its graphs to their cache files (or
    temporary ones), which this process then loads. A worker that fails or is stuck leaves its
    graphs to be compiled here. Measured cold starts of llama-160m (2 cores, two graphs, runs
    alternated): 50.5 / 46.0 / 43.2 / 50.8 s one after the other, 35.6 / 33.3 / 34.9 / 38.4 s
    at once (a compile alone keeps ~1.3 of the 2 cores busy)."""
    todo = _to_compile(jobs)
    workers = max(1, min(workers, len(todo)))
    if workers == 1:
        for job in jobs:
            job.forward.prepare(job.args, job.path)
            ready(job)
        return
    scratch = tempfile.mkdtemp(prefix="ember-graphs-")
    forked: list[tuple[int | None, list[tuple[GraphJob, str]]]] = []
    running: set[int] = set()
    try:
        for w in range(1, workers):
            share = [
                (job, job.path or os.path.join(scratch, f"graph{w}-{i}"))
                for i, job in enumerate(todo[w::workers])
            ]
            pid = _fork_worker(share)
            if pid is not None:
                running.add(pid)
            forked.append((pid, share))
        delegated = set(todo) - set(todo[0::workers])
        start = time.monotonic()
        for job in jobs:
            if job not in delegated:
                job.forward.prepare(job.args, job.path)
                ready(job)
        deadline = time.monotonic() + WORKER_GRACE_S + 4 * (time.monotonic() - start)
        for pid, share in forked:
            code = None
            if pid is not None:
                code = _reap(pid, deadline)
                running.discard(pid)
                if code != 0:
                    logger.warning(
                        "compile worker %d %s; compiling its %d graph(s) here",
                        pid,
                        "was stuck" if code is None else f"failed (exit code {code})",
                        len(share),
                    )
            for job, target in share:
                if pid is not None:  # what a stopped worker was writing
                    with contextlib.suppress(OSError):
                        os.remove(_partial(target, pid))
                if code == 0 and os.path.isfile(target):
                    job.forward.adopt(job.args, target)
                else:
                    job.forward.prepare(job.args, job.path)
                ready(job)
    finally:
        for pid, share in forked:  # this process failed: stop the workers still running
            if pid in running:
                _reap(pid, time.monotonic())
                for _, target in share:
                    with contextlib.suppress(OSError):
                        os.remove(_partial(target, pid))
        shutil.rmtree(scratch, ignore_errors=True)


class BackgroundGraphs:
    """Graphs prepared while the engine already answers (`EngineArgs.background_compile`).

    Graphs in the compile cache are loaded at once; the others are dealt out to compile
    workers forked from this process (as `prepare_graphs` does, but this process compiles
    none: it serves steps on the eager path meanwhile, `CompiledForward.eager_fallback`).
    `poll()`, called between steps, adopts the graphs of every worker that has finished, so
    each bucket switches to its graph at a step boundary; a worker that failed leaves its
    graphs to be compiled here at that poll. `ready(job)` runs after each graph is in place
    (the runner's dummy step); `settings()` is the context the graphs are loaded in."""

    def __init__(
        self,
        jobs: list[GraphJob],
        workers: int,
        ready: Callable[[GraphJob], None],
        settings: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self.ready, self.settings = ready, settings
        todo = _to_compile(jobs)
        with settings():
            for job in jobs:
                if job not in todo:
                    job.forward.prepare(job.args, job.path)
                    ready(job)
        self.scratch = tempfile.mkdtemp(prefix="ember-graphs-")
        self.workers: list[tuple[int | None, list[tuple[GraphJob, str]]]] = []
        workers = max(1, min(workers, len(todo)))
        for w in range(workers if todo else 0):
            share = [
                (job, job.path or os.path.join(self.scratch, f"graph{w}-{i}"))
                for i, job in enumerate(todo[w::workers])
            ]
            self.workers.append((_fork_worker(share), share))
        self.forwards = {job.forward for job in todo}  # eager while any graph is missing
        for forward in self.forwards:
            forward.eager_fallback = True

    def poll(self, block: bool = False) -> bool:
        """Adopt the graphs of the workers that have finished (`block`: wait for all);
        True when every graph is in place."""
        for entry in list(self.workers):
            pid, share = entry
            code: int | None = -1
            if pid is not None:
                try:
                    done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
                except ChildProcessError:
                    done, status = pid, 1 << 8
                if not done:
                    continue
                code = os.waitstatus_to_exitcode(status)
            self.workers.remove(entry)
            if code != 0:
                logger.warning("compile worker %s failed (exit code %s); compiling its %d "
                               "graph(s) here", pid, code, len(share))  # fmt: skip
            with self.settings():
                for job, target in share:
                    if code == 0 and os.path.isfile(target):
                        job.forward.adopt(job.args, target)
                    else:
                        job.forward.prepare(job.args, job.path)
                    self.ready(job)
        if not self.workers:
            for forward in self.forwards:
                forward.eager_fallback = False
            shutil.rmtree(self.scratch, ignore_errors=True)
        return not self.workers

    def stop(self) -> None:
        """Stop the workers still compiling (an engine closed before its graphs were done)."""
        for pid, share in self.workers:
            if pid is not None:
                _reap(pid, time.monotonic())
                for _, target in share:
                    with contextlib.suppress(OSError):
                        os.remove(_partial(target, pid))
        self.workers.clear()
        for forward in self.forwards:
            forward.eager_fallback = False
        shutil.rmtree(self.scratch, ignore_errors=True)


def _fork_worker(share: list[tuple[GraphJob, str]]) -> int | None:
    """Fork a compile worker that compiles `share`'s graphs, each into its file; its pid, or
    None when this process cannot fork."""
    _join_prewarm()
    threads = torch.get_num_threads()
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        with warnings.catch_warnings():  # Python >= 3.12 warns on fork with threads running
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        return None
    if pid != 0:
        return pid
    code = 1
    try:
        _die_with_parent(parent)
        # The parent's OpenMP threads do not exist here, so no parallel region may start:
        # ATen runs its loops on this one thread, while inductor, which asks
        # `torch.get_num_threads()`, still writes the kernels the parent would (same code,
        # same `#pragma omp parallel`). The parent's C++-build thread pool has no threads here
        # either: a fresh one is made on use.
        torch.set_num_threads(1)
        torch.get_num_threads = lambda: threads
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.pool.cache_clear()
        for job, target in share:
            job.forward.compile_to(job.args, target)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this compile worker when its parent exits (Linux's
    PR_SET_PDEATHSIG): a server stopped while its graphs compile in the background leaves no
    compiler running."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent exited before the request took effect
        os._exit(1)


def _reap(pid: int, deadline: float) -> int | None:
    """Wait for child `pid` until `deadline` (`time.monotonic()`); its exit code, or None when
    it was still running then (it is killed)."""
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return -1
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)
