"""Every ISA-dependent test runs twice in the default suite: on this CPU as it is
(`[this-cpu]`), and as an AVX2-only host (`[avx2-host]`: `EMBER_CPU_ISA=avx2`, so no native
bf16 math, no AMX or VNNI, ember's kernels built for x86-64-v3 and ATen and oneDNN capped at
AVX2). A process holds one ISA, so the `[avx2-host]` items run in one child pytest of their
own, started when collection ends and run beside the parent's own tests; each of their
reports (pass, failure with its traceback, skip) comes back to the parent's item of the same
id, so they count, print and fail like any other test.

A test is ISA-dependent when it is marked `host_isa` (a module's `pytestmark` marks all of
its tests) or when its source names something whose behaviour follows the CPU: a narrow dtype
(bfloat16, int8, int4, quantization), the ISA (cpu_isa, native bf16, AMX, AVX, the kernels'
panel width). So a new test that assumes native bf16 fails in CI on any CPU: its
`[avx2-host]` run sees none. `one_host` (a reason) opts a test or a parametrized case out:
code whose path does not follow the CPU, such as Triton's interpreter.

Where this process already is an AVX2-only host (an older CPU, or the whole suite run under
`EMBER_CPU_ISA=avx2`), `[this-cpu]` is that run and the `[avx2-host]` items are deselected; the
whole suite then runs in two pytest-xdist workers instead (`pytest_cmdline_main`)."""

from __future__ import annotations

import getpass
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import pytest

HOSTS = ("this-cpu", "avx2-host")
# Set in the child pytest: where it writes its reports, and the ids it is to run.
_REPORTS_ENV = "EMBER_TEST_AVX2_REPORTS"
_IDS_ENV = "EMBER_TEST_AVX2_IDS"
_CHILD_TIMEOUT_S = 3600
_config: Any = None
_DEPENDENT = re.compile(
    r"bfloat16|bf16|int8|int4|quantiz|cpu_isa|native_bf16|amx|avx|panel_width", re.IGNORECASE
)


def _is_child() -> bool:
    return _REPORTS_ENV in os.environ


def _beyond_avx2() -> bool:
    from ember.host.isa import beyond_avx2

    return beyond_avx2()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns -n into workers
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The whole suite (no paths given) on an AVX2-only host, where no [avx2-host] child runs
    beside the parent, runs in two pytest-xdist workers, unless `-n` says otherwise: the
    suite's compiles and subprocesses leave a core idle much of the time. Measured under
    `EMBER_CPU_ISA=avx2` on a 2-core Intel Xeon (AMX): 7.3 min in one process, 6.1 min in two
    workers (1225 passed either way). Beyond AVX2 the child is the second process."""
    if (
        config.pluginmanager.hasplugin("xdist")
        and getattr(config.option, "numprocesses", 0) is None
        and "PYTEST_XDIST_WORKER" not in os.environ
        and config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not config.option.collectonly
        and not config.getoption("usepdb", False)
        and (os.cpu_count() or 1) >= 2
        and not _is_child()
        and not _beyond_avx2()
    ):
        config.option.numprocesses = 2


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config  # the child's report writer serializes through its hooks
    config.addinivalue_line("markers", "host_isa: run on this CPU and as an AVX2-only host")
    config.addinivalue_line("markers", "one_host(reason): runs on this CPU only")
    config._ember_avx2_child = None  # type: ignore[attr-defined]


def _host_dependent(metafunc: pytest.Metafunc) -> bool:
    if metafunc.definition.get_closest_marker("host_isa") is not None:
        return True
    try:
        source = inspect.getsource(metafunc.function)
    except (OSError, TypeError):
        return False
    return _DEPENDENT.search(source) is not None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "host_isa" in metafunc.fixturenames and _host_dependent(metafunc):
        metafunc.parametrize("host_isa", HOSTS, indirect=True)


@pytest.fixture(autouse=True)
def host_isa(request: pytest.FixtureRequest) -> str:
    """The host this test runs as: "this-cpu", or "avx2-host" (in the child pytest)."""
    return getattr(request, "param", HOSTS[0])


def needs_fp32_math() -> None:
    """Skip a test of fp32 math on bf16 weights where bf16 math is native: its [avx2-host]
    run checks it there (on an AVX2-only CPU its own run does)."""
    from ember.host.isa import cpu_has_native_bf16

    if cpu_has_native_bf16():
        pytest.skip("bf16 math is native here; the [avx2-host] run checks fp32 math")


def _host_of(item: pytest.Item) -> str:
    spec = getattr(item, "callspec", None)
    return spec.params.get("host_isa", HOSTS[0]) if spec is not None else HOSTS[0]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _is_child():
        with open(os.environ[_IDS_ENV]) as f:
            wanted = set(f.read().split("\n"))
        keep = [i for i in items if i.nodeid in wanted]
    elif _beyond_avx2():
        keep = [
            i for i in items if _host_of(i) == HOSTS[0] or i.get_closest_marker("one_host") is None
        ]
        # The child's items last: the parent's own run first, while the child runs beside it.
        keep.sort(key=lambda i: _host_of(i) == HOSTS[1])
    else:
        keep = [i for i in items if _host_of(i) == HOSTS[0]]
    kept = set(keep)
    dropped = [i for i in items if i not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def pytest_collection_finish(session: pytest.Session) -> None:
    delegated = [i for i in session.items if _host_of(i) == HOSTS[1]]
    if delegated and not _is_child() and not session.config.option.collectonly:
        session.config._ember_avx2_child = _Child(session.config, delegated)  # type: ignore[attr-defined]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(_REPORTS_ENV)
    if path is None:
        return
    data = _config.hook.pytest_report_to_serializable(config=_config, report=report)
    with open(path, "a") as f:
        f.write(json.dumps(data) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    child = item.config._ember_avx2_child  # type: ignore[attr-defined]
    if child is None or _host_of(item) != HOSTS[1]:
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in child.reports_for(item):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """How long the child ran and how long the parent then waited for it: the suite's time is
    the parent's own run plus that wait, so a cut pays where it shortens the longer side (the
    parent's, while the wait is 0)."""
    child = getattr(config, "_ember_avx2_child", None)
    if child is not None and child.timing is not None:
        ran, waited = child.timing
        terminalreporter.write_line(
            f"[avx2-host] child pytest: ran {ran:.0f} s from collection; the parent waited "
            f"{waited:.0f} s for it"
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    child = getattr(config, "_ember_avx2_child", None)
    if child is not None:
        child.stop()


def _child_inductor_cache() -> str:
    """The child's inductor cache: one of its own, as the FX graph cache keys a graph without
    the vector ISA, so sharing the parent's served AVX2 kernels code built for its wider
    vectors (the [avx2-host] linears read garbage; see tests/kernels/test_scalar_build.py).
    Kept from run to run beside the parent's (inductor's default under the temp dir, or
    `TORCHINDUCTOR_CACHE_DIR` + "-avx2-host"), as the parent's is: a fresh one each run made
    the child compile every graph cold, taking CPU from the parent's run beside it."""
    parent = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if parent:
        return parent.rstrip(os.sep) + "-avx2-host"
    user = re.sub(r"[^\w.-]", "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}-avx2-host")


class _Child:
    """The child pytest that runs the `[avx2-host]` items under `EMBER_CPU_ISA=avx2`."""

    def __init__(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        self.config = config
        self.dir = tempfile.mkdtemp(prefix="ember-avx2-host-")
        ids = os.path.join(self.dir, "ids.txt")
        with open(ids, "w") as f:
            f.write("\n".join(i.nodeid for i in items))
        self.reports_path = os.path.join(self.dir, "reports.jsonl")
        self.log_path = os.path.join(self.dir, "log.txt")
        files = sorted({i.nodeid.split("::")[0] for i in items})
        env = dict(os.environ, EMBER_CPU_ISA="avx2", **{_REPORTS_ENV: self.reports_path})
        env["TORCHINDUCTOR_CACHE_DIR"] = _child_inductor_cache()
        env[_IDS_ENV] = ids
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
        self.started = time.monotonic()
        self.timing: tuple[float, float] | None = None  # (the child's run, the parent's wait)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*cmd, *files], cwd=str(config.rootpath), env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        self._reports: dict[str, list[pytest.TestReport]] | None = None
        # When the child exits (its run's length: the parent asks for its reports only once
        # its own tests are done, which may be long after).
        self.ended: float | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    def _collect(self) -> dict[str, list[pytest.TestReport]]:
        if self._reports is None:
            waited = time.monotonic()
            try:
                self.proc.wait(timeout=_CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            reports: dict[str, list[pytest.TestReport]] = {}
            if os.path.exists(self.reports_path):
                with open(self.reports_path) as f:
                    for line in f:
                        report = self.config.hook.pytest_report_from_serializable(
                            config=self.config, data=json.loads(line)
                        )
                        reports.setdefault(report.nodeid, []).append(report)
            self._reports = reports
            now = time.monotonic()
            self.timing = ((self.ended or now) - self.started, now - waited)
        return self._reports

    def reports_for(self, item: pytest.Item) -> list[pytest.TestReport]:
        reports = self._collect().get(item.nodeid)
        if reports:
            return reports
        with open(self.log_path, errors="replace") as f:
            tail = f.read()[-6000:]
        text = (
            f"the AVX2-host child pytest (EMBER_CPU_ISA=avx2) gave no report for this test "
            f"(exit status {self.proc.returncode}); its output ends:\n{tail}"
        )
        return [pytest.TestReport(item.nodeid, item.location, {}, "failed", text, "call")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
