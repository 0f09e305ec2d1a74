"""Kernel compiles in worker processes (llmc.codegen.precompile): the kernels a tuning's calls would compile
are collected through Triton's jit_cache_hook without compiling or launching, each worker preloads what it
is sent and answers every request, a failure is reported and counted, and run_on_threads hands its calls to the
compile's pool first. The Triton side (a real kernel's specialization data preloaded on a GPU) runs on the GPU:
`bash benchmarks/gpu_pending.sh OUT compile-cold` with COLD_PROCESSES."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from llmc.codegen import autotune, precompile
from llmc.codegen.precompile import CompilePool, Request, collect, serve

STAND_IN = '''
class Kernel:  # as a JITFunction, whose .fn is the Python function and has no preload
    fn = print

    def preload(self, data):
        if data == "bad":
            raise ValueError("no such specialization")
        open(data, "w").write("compiled")


from llmc.codegen.kernels import PDLKernel

kernel, pdl_kernel = Kernel(), PDLKernel(Kernel())
'''


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / "stand_in_kernels.py"
    path.write_text(STAND_IN)
    yield str(path)
    sys.modules.pop("llmc_test_kernels.stand_in", None)


def test_a_worker_answers_each_request(stand_in, tmp_path):
    out = []
    reqs = [Request("llmc_test_kernels.stand_in", stand_in, "kernel", str(tmp_path / "a")),
            Request("llmc_test_kernels.stand_in", stand_in, "pdl_kernel", str(tmp_path / "b")),
            Request("llmc_test_kernels.stand_in", stand_in, "kernel", "bad"),
            Request("llmc_test_kernels.stand_in", stand_in, "missing", "x")]
    serve([r.line() for r in reqs], out.append)
    answers = [__import__("json").loads(a) for a in out]
    assert [a["ok"] for a in answers] == [True, True, False, False]
    assert "no such specialization" in answers[2]["error"] and "missing" in answers[3]["error"]
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() == "compiled"


def test_a_pool_compiles_every_request_on_its_workers(stand_in, tmp_path):
    reqs = [Request("llmc_test_kernels.stand_in", stand_in, "kernel", str(tmp_path / f"k{i}")) for i in range(7)]
    reqs.append(Request("llmc_test_kernels.stand_in", stand_in, "kernel", "bad"))
    with CompilePool(2) as pool:
        assert precompile.active() is pool and len(pool.procs) == 2
        assert pool.run(reqs) == 7
        assert pool.failed == 1 and all((tmp_path / f"k{i}").read_text() == "compiled" for i in range(7))
        procs = list(pool.procs)
    assert precompile.active() is None and all(p.poll() is not None for p in procs)


def test_a_dead_worker_is_a_failure_not_a_hang(tmp_path):
    with CompilePool(1, command=[sys.executable, "-c", "import sys; sys.stdin.readline()"]) as pool:
        assert pool.run([Request("m", "p", "k", str(tmp_path / "x"))] * 3) == 0
        assert pool.failed >= 1


def test_collect_takes_each_kernel_once_and_compiles_none(stand_in):
    from triton import knobs
    mod = precompile._import("llmc_test_kernels.stand_in", stand_in)
    before = knobs.runtime.jit_cache_hook

    def launch(data, module="llmc_test_kernels.stand_in"):  # what JITFunction.run does on a cache miss
        fn = SimpleNamespace(module=module, name="kernel", jit_function=mod.kernel)
        return knobs.runtime.jit_cache_hook(key=data, repr="kernel", fn=fn, compile={"specialization_data": data},
                                           is_manual_warmup=False, already_compiled=False)
    skipped = []

    def fail():
        raise RuntimeError("out of shared memory")
    calls = [lambda: skipped.append(launch("s1")), lambda: skipped.append(launch("s2")), fail,
             lambda: skipped.append(launch("s1")), lambda: skipped.append(launch("s3", module="not.imported"))]
    reqs = collect(calls)
    assert [(r.module, r.name, r.data) for r in reqs] == [("llmc_test_kernels.stand_in", "kernel", "s1"),
                                                          ("llmc_test_kernels.stand_in", "kernel", "s2")]
    assert reqs[0].path == stand_in
    assert skipped == [True, True, True, True]  # none compiles here (one no worker can import: on the threads after)
    assert knobs.runtime.jit_cache_hook is before


def test_run_on_threads_hands_its_calls_to_the_pool_first(monkeypatch):
    seen, ran = [], []

    class Pool:
        def compile(self, calls):
            seen.append(len(calls))
            assert not ran  # before any call runs
    monkeypatch.setattr(precompile, "_ACTIVE", Pool())
    monkeypatch.setattr(autotune, "tune_threads", lambda: 2)
    autotune.run_on_threads([lambda: ran.append(1), lambda: ran.append(2)])
    assert seen == [2] and sorted(ran) == [1, 2]


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("LLMC_TUNE_PROCESSES", raising=False)
    assert precompile.tune_processes() == 0
    monkeypatch.setenv("LLMC_TUNE_PROCESSES", "8")
    assert precompile.tune_processes() == 8
    assert CompilePool(0).compile([lambda: 1 / 0]) == 0  # no workers: nothing collected, nothing run


def test_run_on_threads_compiles_each_distinct_kernel_once_before_the_calls(monkeypatch):
    """Without worker processes, calls that share a kernel (a linear's buckets with one recorded choice) have
    it compiled once, on the threads, before any call runs; a compile that fails is left to the calls."""
    events = []
    reqs = [Request("m", "p", "k", "a"), Request("m", "p", "k", "b"), Request("m", "p", "k", "bad")]
    monkeypatch.setattr(precompile, "_ACTIVE", None)
    monkeypatch.setattr(precompile, "collect", lambda calls: (events.append(("collect", len(calls))), reqs)[1])

    def compile_here(r):
        if r.data == "bad":
            raise RuntimeError("out of resources")
        events.append(("compile", r.data))
    monkeypatch.setattr(precompile, "compile_here", compile_here)
    monkeypatch.setattr(autotune, "tune_threads", lambda: 4)
    calls = [lambda i=i: events.append(("call", i)) for i in range(5)]
    autotune.run_on_threads(calls, shared_kernels=True)
    kinds = [e[0] for e in events]
    assert kinds[0] == "collect" and events[0] == ("collect", 5)
    assert sorted(e for e in events if e[0] == "compile") == [("compile", "a"), ("compile", "b")]
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "compile")
    assert sorted(e[1] for e in events if e[0] == "call") == list(range(5))
    events.clear()
    autotune.run_on_threads(calls)  # candidates of one tuning (each its own kernel): nothing collected
    assert sorted(events) == [("call", i) for i in range(5)]


def test_compile_here_is_what_a_worker_runs(stand_in, tmp_path):
    precompile.compile_here(Request("llmc_test_kernels.stand_in", stand_in, "pdl_kernel", str(tmp_path / "c")))
    assert (tmp_path / "c").read_text() == "compiled"
    with pytest.raises(ValueError, match="no such specialization"):
        precompile.compile_here(Request("llmc_test_kernels.stand_in", stand_in, "kernel", "bad"))
