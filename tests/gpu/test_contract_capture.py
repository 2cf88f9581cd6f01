"""The CuPy contract knows CUDA stream capture (dspark.backends.contract): between a stream's
begin_capture and end_capture a synchronisation, a device->host copy, a pageable host->device copy
or a memory-pool allocation raises as CUDA refuses it (and the capture is invalidated), launches
are recorded and not run, and Graph.launch replays them with the arguments they had at capture
time, on whatever the buffers hold then. So a host value baked into a captured pass replays stale,
on the CPU. Also: null memory (shape, dtype and a pointer, no memory) and the stand-in's own time.
"""

from __future__ import annotations

import resource

import numpy as np
import pytest

from dspark import profile
from dspark.backends import contract
from dspark.ops.norm import rmsnorm, rmsnorm_ref


@pytest.fixture(scope="module")
def dev():
    return contract.backend()


@pytest.fixture
def stream(dev):
    return dev.xp.cuda.Stream(non_blocking=True)


def captured(stream, work):
    """Run `work()` under capture on `stream`; returns the graph."""
    with stream:
        stream.begin_capture()
        work()
        return stream.end_capture()


def refused(dev, stream, work, match):
    """`work()` inside a capture raises CaptureError naming `match`, and the capture is lost."""
    with stream:
        stream.begin_capture()
        with pytest.raises(contract.CaptureError, match=match):
            work()
        with pytest.raises(contract.CaptureError, match="invalidated by"):
            stream.end_capture()
    assert not stream.is_capturing()


@pytest.mark.parametrize("sync", ["device", "stream", "runtime", "other stream"])
def test_a_sync_inside_capture_raises(dev, stream, sync):
    xp = dev.xp
    do = {"device": lambda: xp.cuda.Device().synchronize(), "stream": stream.synchronize,
          "runtime": xp.cuda.runtime.deviceSynchronize, "other stream": lambda: xp.cuda.Stream().synchronize()}
    refused(dev, stream, do[sync], "a synchronization")


@pytest.mark.parametrize("copy", ["get", "item", "int", "asnumpy"])
def test_a_device_to_host_copy_inside_capture_raises(dev, stream, copy):
    a = dev.xp.zeros(3, np.int32)
    do = {"get": a.get, "item": a[0].item, "int": lambda: int(a[0]), "asnumpy": lambda: dev.xp.asnumpy(a)}
    refused(dev, stream, do[copy], "device->host copy")


@pytest.mark.parametrize("upload", ["asarray", "set", "index array"])
def test_a_pageable_upload_inside_capture_raises(dev, stream, upload):
    a = dev.xp.zeros(3, np.int32)
    host = np.arange(3, dtype=np.int32)
    do = {"asarray": lambda: dev.xp.asarray(host), "set": lambda: a.set(host), "index array": lambda: a[host]}
    refused(dev, stream, do[upload], "host->device copy from pageable host memory")


@pytest.mark.parametrize("alloc", ["empty", "zeros", "arithmetic", "astype", "gather", "copy"])
def test_a_pool_allocation_inside_capture_raises(dev, stream, alloc):
    xp = dev.xp
    a = xp.zeros((4, 4), np.float32)
    idx = xp.asarray(np.array([0, 2]))
    do = {"empty": lambda: xp.empty(8, np.float32), "zeros": lambda: xp.zeros(8, np.int32), "arithmetic": lambda: a + 1,
          "astype": lambda: a.astype(np.float64), "gather": lambda: a[idx], "copy": a.copy}
    refused(dev, stream, do[alloc], "memory-pool allocation")


def test_capture_refuses_the_legacy_stream_and_work_on_another_stream(dev, stream):
    with pytest.raises(RuntimeError, match="default \\(legacy\\) stream"):
        dev.xp.cuda.Stream.null.begin_capture()
    a = dev.xp.zeros(4, np.float32)
    with stream:
        stream.begin_capture()
    try:  # the legacy stream is current here: its work would join (and break) the capture
        with pytest.raises(contract.CaptureError, match="another stream"):
            dev.xp.add(a, 1, out=a)
    finally:
        with pytest.raises(contract.CaptureError):
            stream.end_capture()


def test_launches_are_recorded_not_run_and_replayed_on_the_buffers_contents(dev, stream, rng):
    x = dev.asarray(rng.standard_normal((5, 40)).astype(np.float32))
    w = dev.asarray(rng.standard_normal(40).astype(np.float32))
    out = dev.asarray(np.full((5, 40), np.nan, np.float32))
    with profile.counting() as c:
        graph = captured(stream, lambda: rmsnorm(dev, x, w, 1e-6, out=out))
    assert c.launches == 1 and contract.graph_nodes(graph) == 1
    assert np.isnan(out.get()).all(), "a captured launch must not run"
    with profile.counting() as c:
        graph.launch()
    assert (c.graphs, c.graph_nodes, c.launches, dict(c.by_name)) == (1, 1, 1, {"rmsnorm_f32": 1})
    assert np.array_equal(out.get(), rmsnorm_ref(x.get(), w.get(), 1e-6))
    x[...] = 2 * x  # a device-side update: the replay reads what the buffer holds now
    graph.launch()
    assert np.array_equal(out.get(), rmsnorm_ref(x.get(), w.get(), 1e-6))


def test_a_host_scalar_baked_into_a_capture_replays_stale(dev, stream, rng):
    """The hazard the round's graphs avoid by reading positions, lengths and counts from device
    memory: a scalar argument (here the row count) is kept as captured, so the replay differs
    from the eager call made with today's value."""
    x = dev.asarray(rng.standard_normal((6, 32)).astype(np.float32))
    w = dev.asarray(rng.standard_normal(32).astype(np.float32))
    out = dev.xp.zeros((6, 32), np.float32)
    live_rows = 2
    graph = captured(stream, lambda: rmsnorm(dev, x[:live_rows], w, 1e-6, out=out[:live_rows]))
    live_rows = 6  # the host value moves on
    eager = rmsnorm(dev, x[:live_rows], w, 1e-6).get()
    out[...] = 0
    graph.launch()
    replayed = out.get()
    assert np.array_equal(replayed[:2], eager[:2]) and not np.array_equal(replayed, eager)
    assert not replayed[2:].any()


def test_in_place_array_ops_are_captured_and_a_graph_nests(dev, stream):
    xp = dev.xp
    a = xp.zeros(4, np.float32)
    inner = captured(stream, lambda: xp.add(a, 1, out=a))

    def outer():
        inner.launch()
        a[1:3] = 5
        view = a[...]
        view *= 2
    graph = captured(stream, outer)
    assert not a.get().any()
    graph.launch()
    assert a.get().tolist() == [2, 10, 10, 2]


def test_a_graph_refuses_a_buffer_freed_since_its_capture(dev, stream, rng):
    x = dev.asarray(rng.standard_normal((2, 32)).astype(np.float32))
    w = dev.asarray(np.ones(32, np.float32))
    out = dev.xp.zeros((2, 32), np.float32)
    graph = captured(stream, lambda: rmsnorm(dev, x, w, 1e-6, out=out))
    del out
    with pytest.raises(RuntimeError, match="freed since"):
        graph.launch()


def test_null_memory_holds_real_shapes_without_memory(dev):
    """Null memory: a 64 GB array is a shape, a dtype and a pointer of its own; with execution
    off, a launch over it packs its arguments and touches nothing."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with contract.null_memory(), contract.executing(False):
        big = dev.xp.zeros((1 << 16, 1 << 18), np.float32)
        other = dev.xp.empty((1 << 16, 1 << 18), np.float32)
        w = dev.xp.empty(1 << 18, np.float32)
        rmsnorm(dev, big, w, 1e-6, out=other)
    assert big.nbytes == 1 << 36 and big.data.ptr != other.data.ptr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 18  # KiB: under 256 MB


def test_own_time_counts_the_stand_ins_calls(dev):
    a = dev.xp.zeros(8, np.float32)
    with contract.own_time() as own:
        for _ in range(10):
            a = a + 1
        a.get()
    assert own.calls == 11 and own.ns > 0
