"""Graphs compiled at once by forked compile workers (`capture_workers.prepare_graphs`), with a fake
forward standing in for `CompiledForward` (the real compiles are in the engine tests, which
run them on every machine with 2 cores or more)."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import pytest

from ember.compile import capture
from ember.compile import workers as capture_workers
from ember.compile.workers import GraphJob, compile_workers, prepare_graphs


class FakeForward:
    """Records which process prepared, compiled and adopted which graph; a worker's
    `compile_to` writes its pid and the job's args into the graph file."""

    freezing = False

    def __init__(self, worker: str = "ok") -> None:
        self.worker = worker  # "ok", "fail" or "hang"
        self.log: list[tuple[str, int, object]] = []

    def prepare(self, args: tuple, path: str | None) -> None:
        if path is not None and os.path.isfile(path):
            with open(path) as f:
                self.log.append(("load", os.getpid(), f.read()))
            return
        self.log.append(("compile", os.getpid(), args))
        if path is not None:
            with open(path, "w") as f:
                f.write(f"{os.getpid()} {args}")

    def compile_to(self, args: tuple, path: str) -> None:
        if self.worker == "fail":
            raise RuntimeError("compile failed in the worker")
        if self.worker == "hang":
            time.sleep(600)
        with open(capture._partial(path, os.getpid()), "w") as f:
            f.write(f"{os.getpid()} {args}")
        os.replace(capture._partial(path, os.getpid()), path)

    def adopt(self, args: tuple, path: str) -> None:
        with open(path) as f:
            self.log.append(("adopt", os.getpid(), f.read()))


def _children() -> set[int]:
    """This process's child processes, exited (zombies) or not."""
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids.update(int(pid) for pid in f.read().split())
    return pids


_EXISTING: set[int] = set()


@pytest.fixture(autouse=True)
def _existing_children() -> None:
    """The children this process had before the test: the suite's own (the [avx2-host]
    pytest, tests/host_isa.py) are not the workers'. (`os.waitpid(-1)` would reap theirs.)"""
    _EXISTING.clear()
    _EXISTING.update(_children())


def no_children_left() -> bool:
    """No child process the test started is left, exited or not."""
    return not (_children() - _EXISTING)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """prepare_graphs' temporary dir, under tmp_path so a test can see it removed."""
    made = []

    def mkdtemp(prefix: str = "") -> str:
        path = tmp_path / f"{prefix}{len(made)}"
        path.mkdir()
        made.append(path)
        return str(path)

    monkeypatch.setattr(capture_workers.tempfile, "mkdtemp", mkdtemp)
    return made


def test_a_worker_compiles_its_share_and_this_process_loads_it(tmp_path, scratch):
    forward = FakeForward()
    cached = tmp_path / "cached.graph"
    cached.write_text("from the cache")
    jobs = [
        GraphJob(forward, ("a",), None),
        GraphJob(forward, ("b",), None),
        GraphJob(forward, ("c",), str(tmp_path / "c.graph")),
        GraphJob(forward, ("d",), str(cached)),
    ]
    readied = []
    prepare_graphs(jobs, 2, readied.append)
    me = os.getpid()
    # To compile: a, b, c; this process takes a and c, the worker b (a temporary file).
    assert sorted(readied, key=jobs.index) == jobs and len(readied) == 4
    by_kind = {(kind, pid == me) for kind, pid, _ in forward.log}
    assert by_kind == {("compile", True), ("load", True), ("adopt", True)}
    adopted = [text for kind, _, text in forward.log if kind == "adopt"]
    assert len(adopted) == 1 and adopted[0].endswith("('b',)")
    assert int(adopted[0].split()[0]) != me  # compiled in another process
    compiled = [args for kind, _, args in forward.log if kind == "compile"]
    assert compiled == [("a",), ("c",)]
    assert ("load", me, "from the cache") in forward.log
    assert (tmp_path / "c.graph").read_text().startswith(f"{me} ")
    assert not scratch[0].exists()  # the temporary graph files are gone
    assert no_children_left()


def test_one_worker_prepares_every_graph_here_in_order(tmp_path, scratch):
    forward = FakeForward()
    jobs = [GraphJob(forward, (i,), str(tmp_path / f"g{i}.graph")) for i in range(3)]
    readied = []
    prepare_graphs(jobs, 1, readied.append)
    assert readied == jobs
    assert forward.log == [("compile", os.getpid(), (i,)) for i in range(3)]
    assert not scratch  # no temporary dir


def test_a_worker_writes_into_the_cache_file_itself(tmp_path, scratch):
    forward = FakeForward()
    paths = [str(tmp_path / f"g{i}.graph") for i in range(2)]
    prepare_graphs([GraphJob(forward, (i,), p) for i, p in enumerate(paths)], 2)
    worker_pid = int(open(paths[1]).read().split()[0])
    assert worker_pid != os.getpid()
    assert sorted(os.listdir(tmp_path)) == ["g0.graph", "g1.graph"]  # scratch dir removed
    assert no_children_left()


def test_a_failed_worker_leaves_its_graphs_to_this_process(caplog, scratch):
    forward = FakeForward(worker="fail")
    jobs = [GraphJob(forward, (i,), None) for i in range(3)]
    readied = []
    with caplog.at_level(logging.WARNING, logger="ember"):
        prepare_graphs(jobs, 3, readied.append)
    assert sorted(readied, key=jobs.index) == jobs
    assert [args for kind, _, args in forward.log] == [(0,), (1,), (2,)]
    assert {kind for kind, _, _ in forward.log} == {"compile"}
    assert sum("failed (exit code 1)" in r.message for r in caplog.records) == 2
    assert no_children_left()


def test_a_stuck_worker_is_stopped_and_its_graph_compiled_here(
    tmp_path, caplog, monkeypatch, scratch
):
    monkeypatch.setattr(capture_workers, "WORKER_GRACE_S", 0.5)
    forward = FakeForward(worker="hang")
    jobs = [GraphJob(forward, (i,), str(tmp_path / f"g{i}.graph")) for i in range(2)]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ember"):
        prepare_graphs(jobs, 2)
    assert time.monotonic() - start < 30
    assert [kind for kind, _, _ in forward.log] == ["compile", "compile"]
    assert any("was stuck" in r.message for r in caplog.records)
    assert sorted(os.listdir(tmp_path)) == ["g0.graph", "g1.graph"]  # no partial file left
    assert no_children_left()


def test_an_error_here_stops_the_workers(monkeypatch, scratch):
    forward = FakeForward(worker="hang")

    def broken(args: tuple, path: str | None) -> None:
        raise RuntimeError("this process's compile failed")

    monkeypatch.setattr(forward, "prepare", broken)
    with pytest.raises(RuntimeError, match="this process's compile failed"):
        prepare_graphs([GraphJob(forward, (i,), None) for i in range(2)], 2)
    assert no_children_left()
    assert not scratch[0].exists()


def test_compile_workers_counts_graphs_to_compile_cores_and_the_override(tmp_path, monkeypatch):
    monkeypatch.delenv("EMBER_COMPILE_WORKERS", raising=False)
    monkeypatch.setattr(
        capture.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False
    )
    cached = tmp_path / "cached.graph"
    cached.write_text("")
    forward = FakeForward()
    jobs = [GraphJob(forward, (i,), None) for i in range(3)]
    assert compile_workers(jobs) == 3
    assert compile_workers(jobs + [GraphJob(forward, (9,), str(cached))]) == 3  # loaded here
    assert compile_workers([GraphJob(forward, (i,), None) for i in range(9)]) == 4
    monkeypatch.setattr(capture.os, "sched_getaffinity", lambda pid: {0})
    assert compile_workers(jobs) == 1
    monkeypatch.setattr(capture.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv("EMBER_COMPILE_WORKERS", "1")
    assert compile_workers(jobs) == 1
    monkeypatch.setenv("EMBER_COMPILE_WORKERS", "two")
    with pytest.raises(ValueError, match="EMBER_COMPILE_WORKERS"):
        compile_workers(jobs)
    monkeypatch.delenv("EMBER_COMPILE_WORKERS", raising=False)
    frozen = FakeForward()
    frozen.freezing = True
    assert compile_workers(jobs + [GraphJob(frozen, (5,), None)]) == 1


# ---- BackgroundGraphs: graphs compiled while the engine answers (background_compile) -------


def test_background_graphs_load_the_cached_at_once_and_compile_the_rest_in_workers(
    tmp_path, scratch
):
    forward = FakeForward()
    cached = tmp_path / "cached.graph"
    cached.write_text("from the cache")
    jobs = [GraphJob(forward, ("a",), None), GraphJob(forward, ("b",), str(tmp_path / "b.graph")),
            GraphJob(forward, ("c",), str(cached))]  # fmt: skip
    readied: list = []
    background = capture_workers.BackgroundGraphs(jobs, 2, readied.append, contextlib.nullcontext)
    me = os.getpid()
    assert readied == [jobs[2]] and forward.log == [("load", me, "from the cache")]
    assert forward.eager_fallback  # steps run eagerly until every graph is in
    assert background.poll(block=True)
    assert sorted(readied, key=jobs.index) == jobs
    adopted = [text for kind, pid, text in forward.log if kind == "adopt"]
    assert len(adopted) == 2 and all(int(t.split()[0]) != me for t in adopted)
    assert not any(kind == "compile" for kind, _, _ in forward.log)  # none compiled here
    assert (tmp_path / "b.graph").exists()  # a worker wrote the cache file itself
    assert not forward.eager_fallback and not scratch[0].exists() and no_children_left()
    assert background.poll()  # nothing left: polls return at once


def test_a_failed_background_worker_leaves_its_graphs_to_the_next_poll(caplog, scratch):
    forward = FakeForward("fail")
    jobs = [GraphJob(forward, (i,), None) for i in range(2)]
    readied: list = []
    background = capture_workers.BackgroundGraphs(jobs, 2, readied.append, contextlib.nullcontext)
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert background.poll(block=True)
    assert sorted(readied, key=jobs.index) == jobs
    assert [kind for kind, pid, _ in forward.log] == ["compile", "compile"]
    assert all(pid == os.getpid() for _, pid, _ in forward.log)
    assert "failed" in caplog.text and no_children_left()


def test_stopping_background_graphs_stops_their_workers(scratch):
    forward = FakeForward("hang")
    background = capture_workers.BackgroundGraphs(
        [GraphJob(forward, (0,), None)], 1, lambda job: None, contextlib.nullcontext
    )
    assert not background.poll()  # still compiling
    background.stop()
    assert no_children_left() and not forward.eager_fallback and not scratch[0].exists()


def test_inductors_runtime_imports_on_one_thread_while_weights_load():
    """`prewarm_graph_imports` (called by every compiling engine before its weights load)
    imports what each compiled graph's code imports on one thread per process; a fresh process,
    since this one has imported inductor already."""
    import subprocess
    import sys

    code = (
        "import sys, threading\n"
        "from ember.compile import capture\n"
        "assert 'torch._inductor.select_algorithm' not in sys.modules\n"
        "capture.prewarm_graph_imports(); first = capture._prewarm\n"
        "capture.prewarm_graph_imports(); assert capture._prewarm is first\n"
        "first.join(120)\n"
        "assert 'torch._inductor.select_algorithm' in sys.modules\n"
        "from torch._inductor.select_algorithm import extern_kernels\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
