"""Host-computed MatMuls inside the captured step graph (engines/host_nodes.py,
DeviceGraph.add_host_matmuls): where their copies and host nodes go, found from the
captured nodes' addresses; their jobs and pinned rows; and, on the GPU, a captured ORT run
of a rewritten model whose replays compute the MatMul on the host.

The bound, as docs/host_compute.md states it: every output within 16 * eps * max|output|
of plain ORT's on the unrewritten model (eps of the output's type).
"""
import ctypes
import os
import pickle

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnx_offload import _core
from onnx_offload.engines import HostNodes
from onnx_offload.engines.host_nodes import node_edges, place
from onnx_offload.errors import HostComputeFailed, HostComputeRefused, StateError
from onnx_offload.loading import rewrite_for_host
from onnx_offload.models import int4
from onnx_offload.models.generators import build_model

CUDA = "CUDAExecutionProvider"
ULPS = 16
ROWS = (1, 2)  # X is [1, 2, K]: a decode step of two tokens


def mlp_model(k, n, dtype=np.float16, shared=False, seed=0):
    """x -> Mul(gamma) -> h -> MatMul(w1) -> Add(b1) -> out1; with `shared`, h also feeds
    MatMul(w2) -> Mul(c) -> out2 and MatMul(w3) -> Add(b3) -> out3 (q/k/v's shape: the
    host takes w1 and w2, which read one X; w3 stays on the device)."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def init(name, shape, scale):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(dtype), name)

    inits = [init("gamma", (k,), 1.0), init("w1", (k, n), k ** -0.5), init("b1", (n,), 0.1)]
    nodes = [helper.make_node("Mul", ["x", "gamma"], ["h"], name="norm"),
             helper.make_node("MatMul", ["h", "w1"], ["y1"], name="proj1"),
             helper.make_node("Add", ["y1", "b1"], ["out1"], name="bias1")]
    outputs = [helper.make_tensor_value_info("out1", elem, [*ROWS, n])]
    if shared:
        inits += [init("w2", (k, n), k ** -0.5), init("c", (n,), 1.0), init("w3", (k, n), k ** -0.5),
                  init("b3", (n,), 0.1)]
        nodes += [helper.make_node("MatMul", ["h", "w2"], ["y2"], name="proj2"),
                  helper.make_node("Mul", ["y2", "c"], ["out2"], name="scale2"),
                  helper.make_node("MatMul", ["h", "w3"], ["y3"], name="proj3"),
                  helper.make_node("Add", ["y3", "b3"], ["out3"], name="bias3")]
        outputs += [helper.make_tensor_value_info(f"out{i}", elem, [*ROWS, n]) for i in (2, 3)]
    return build_model(nodes, [helper.make_tensor_value_info("x", elem, [*ROWS, k])], outputs, inits, "host_nodes")


def int4_model(k, n):
    """mlp_model's single MatMul as MatMulNBits (4 bits, blocks of 32, fp16 scales)."""
    return int4(mlp_model(k, n), block_size=32, accuracy_level=0)


def host_weights(model, hosts):
    """{weight name: its array} for the weights the host computes (kept alive by the caller)."""
    inits = {t.name: t for t in model.graph.initializer}
    return {w: np.ascontiguousarray(numpy_helper.to_array(inits[w])) for h in hosts for w in h.weights}


def assert_within_bound(got, want):
    eps = np.finfo(want.dtype).eps
    scale = float(np.abs(want.astype(np.float32)).max())
    err = float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max())
    assert err <= ULPS * eps * scale, f"{err} > {ULPS} * {eps} * {scale}"


# -- where the copies and host nodes go: pure functions of the captured nodes' lists -------------------------------


def test_edges_follow_every_node_of_x_before_the_first_reader_of_the_result():
    after, before = node_edges("proj", [3, 4, 9, 12], [8, 10])
    assert after == [3, 4] and before == [8, 10]
    # Nodes holding X after the first reader of Y_in (a device MatMul that also reads X)
    # are not waited for.
    assert node_edges("proj", [2], [5, 5, 7]) == ([2], [5, 7])


@pytest.mark.parametrize("x_nodes, y_nodes, says", [
    ([], [5], "no captured node holds its input"),
    ([3], [], "no captured node holds its result"),
    ([6, 9], [5], "node 5 reads a result before any node holds its input X"),
    ([5], [5], "node 5 reads a result before any node holds its input X"),
])
def test_edges_refuse_what_cannot_be_ordered(x_nodes, y_nodes, says):
    with pytest.raises(HostComputeRefused, match=says) as e:
        node_edges("proj", x_nodes, y_nodes)
    assert "'proj'" in str(e.value)


def rewritten(model, names):
    return rewrite_for_host(model, names)[1]


def test_place_shares_one_x_and_orders_host_nodes_by_their_first_reader():
    hosts = rewritten(mlp_model(64, 96, shared=True), ["w2", "w1"])
    assert [h.node for h in hosts] == ["proj1", "proj2"] and hosts[0].x_output == hosts[1].x_output == "h"
    y1, y2 = hosts[0].y_input, hosts[1].y_input
    # proj2's result is read first (node 6), proj1's at node 9; X is held by nodes 1, 2
    # (its writer, the Slice) and 7 (the device MatMul), which comes after proj2's reader.
    placed = place(hosts, {"h": [1, 2, 7]}, {y1: [9], y2: [6]})
    assert placed == [(1, [1, 2], [6]), (0, [1, 2], [9])]
    # What add_host_matmuls requires: each host node's readers after every X copy so far.
    last = -1
    for _, after, before in placed:
        last = max(last, max(after))
        assert min(before) > last


def test_place_refuses_a_shared_x_read_before_it_is_written():
    hosts = rewritten(mlp_model(64, 96, shared=True), ["w1", "w2"])
    with pytest.raises(HostComputeRefused, match="'proj1'") as e:
        place(hosts, {"h": [4]}, {hosts[0].y_input: [3], hosts[1].y_input: [6]})
    assert e.value.names == ("w1",)


# -- the jobs and their pinned rows, run on the host backend --------------------------------------------------------


def run_jobs(nodes):
    """Runs each job as a graph's host node would: host_matmul_job_run(job)."""
    entry = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_core._host_job_entry()[0])
    for i in range(len(nodes.hosts)):
        entry(nodes.jobs.address(i))


def put(address, array):
    ctypes.memmove(address, array.ctypes.data, array.nbytes)


def take(address, shape, dtype):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * n).from_address(address), dtype=dtype).reshape(shape).copy()


@pytest.mark.parametrize("kind", ["float16", "int4"])
def test_jobs_compute_from_their_pinned_rows_and_report_refusals(kind):
    k, n = 128, 80
    model = mlp_model(k, n) if kind == "float16" else int4_model(k, n)
    names = ["w1"] if kind == "float16" else ["w1_Q4"]
    out, hosts = rewrite_for_host(model, names)
    weights = host_weights(model, hosts)
    be = _core.make_host_backend(64 << 10)
    x_dev, y_dev = np.zeros((*ROWS, k), np.float16), np.zeros((*ROWS, n), np.float16)  # stand-ins for device buffers
    nodes = HostNodes(be, hosts, {"h": (x_dev.ctypes.data, x_dev.shape)}, {hosts[0].y_input: y_dev.ctypes.data},
                      {w: a.ctypes.data for w, a in weights.items()}, threads=1)
    with pytest.raises(HostComputeFailed, match="has not run") as e:
        nodes.check()
    assert e.value.matmul == "proj1"
    x = np.random.default_rng(1).standard_normal((*ROWS, k)).astype(np.float16)
    base = nodes.jobs.pinned
    put(base + nodes.x_rows["h"][0], x)
    run_jobs(nodes)
    nodes.check()
    got = take(base + nodes.y_rows[hosts[0].y_input][0], (*ROWS, n), np.float16)
    if kind == "float16":
        want = _core.host_matmul(x.reshape(-1, k), weights["w1"], threads=1)
    else:
        b, s = weights["w1_Q4"], weights["w1_scales"]
        want = _core.host_matmul_nbits(x.reshape(-1, k), b, s, None, k=k, n=n, block_size=32, threads=1)
    np.testing.assert_array_equal(got.reshape(-1, n), want)
    # A job the host kernel refuses at run time: the status names the MatMul and why.
    args = dict(nodes.job_args[0], m=0)
    assert "0 rows" in nodes.jobs.set(**args)
    run_jobs(nodes)
    with pytest.raises(HostComputeFailed, match="'proj1'.*0 rows") as e:
        nodes.check()
    assert pickle.loads(pickle.dumps(e.value)).matmul == "proj1"
    nodes.jobs.set(**nodes.job_args[0])
    run_jobs(nodes)
    nodes.check()


def test_a_job_the_host_cannot_run_is_refused_when_made():
    model = int4_model(64, 96)
    for a in model.graph.node[1].attribute:  # a block size the host kernel does not take
        if a.name == "block_size":
            a.i = 24
    _, hosts = rewrite_for_host(model, ["w1_Q4"])
    weights = host_weights(model, hosts)
    be = _core.make_host_backend(64 << 10)
    addresses = {w: a.ctypes.data for w, a in weights.items()}
    with pytest.raises(HostComputeRefused, match="'proj1'.*block_size must be a power of two") as e:
        HostNodes(be, hosts, {"h": (1 << 20, (*ROWS, 64))}, {hosts[0].y_input: 2 << 20}, addresses)
    assert e.value.names == ("w1_Q4", "w1_scales")
    with pytest.raises(ValueError, match="last dim 64"):
        HostNodes(be, hosts, {"h": (1 << 20, (*ROWS, 65))}, {hosts[0].y_input: 2 << 20}, addresses)


def test_bfloat16_rows_are_refused_naming_the_weights():
    """The host kernels take x and y in float16 or float32; a bfloat16 MatMul's rows are
    neither (its weights could be computed, its activations could not)."""
    model = mlp_model(64, 96, dtype=ml_dtypes.bfloat16)
    _, hosts = rewrite_for_host(model, ["w1"])
    weights = host_weights(model, hosts)
    with pytest.raises(HostComputeRefused, match="'proj1'.*bfloat16") as e:
        HostNodes(_core.make_host_backend(64 << 10), hosts, {"h": (1 << 20, (*ROWS, 64))},
                  {hosts[0].y_input: 2 << 20}, {w: a.ctypes.data for w, a in weights.items()})
    assert e.value.names == ("w1",)


def test_jobs_keep_x_and_y_inside_their_pinned_region():
    be = _core.make_host_backend(64 << 10)
    jobs = _core.HostJobs(be, 1, 4096)
    w = np.zeros((8, 8), np.float16)
    base = jobs.pinned
    assert jobs.set(0, "float16", 8, 8, w.ctypes.data, x_dtype="float16", m=2, x=base, y=base + 32) == ""
    with pytest.raises(ValueError, match="not inside"):
        jobs.set(0, "float16", 8, 8, w.ctypes.data, x_dtype="float16", m=2, x=base + 4096 - 16, y=base)
    with pytest.raises(ValueError, match="kind must be"):
        jobs.set(0, "int8", 8, 8, w.ctypes.data, x_dtype="float16", m=2, x=base, y=base + 32)
    with pytest.raises(IndexError):
        jobs.status(1)


def test_jobs_refuse_sizes_that_wrap_and_a_missing_backend():
    """Sizes whose byte counts pass 2^64 and a backend of None are typed errors: a size
    that wrapped would map nothing, or pass the region's check, and a job would then read
    and write outside it."""
    be = _core.make_host_backend(64 << 10)
    with pytest.raises(TypeError):
        _core.HostJobs(None, 1, 4096)
    with pytest.raises(ValueError, match="more than a process can map"):
        _core.HostJobs(be, 1, 2 ** 64 - 1)
    jobs = _core.HostJobs(be, 1, 4096)
    w = np.zeros((4, 4), np.float32)
    base = jobs.pinned
    # 2^61 + 1 rows of 4 float16 values are 2^64 + 8 bytes: 8 once wrapped, which the region holds.
    with pytest.raises(ValueError, match="x's .* not inside"):
        jobs.set(0, "float32", 4, 4, w.ctypes.data, x_dtype="float16", m=2 ** 61 + 1, x=base, y=base)
    # 4 rows of 2^60 + 1 float32 values: 16 bytes once wrapped.
    with pytest.raises(ValueError, match="y's .* not inside"):
        jobs.set(0, "float32", 1, 2 ** 60 + 1, w.ctypes.data, x_dtype="float32", m=4, x=base, y=base)
    assert jobs.status(0) == (-1, "the job has not run")  # nothing was written


def mapped_here(address: int) -> bool:
    with open("/proc/self/maps") as f:
        ranges = [line.split()[0].split("-") for line in f]
    return any(int(lo, 16) <= address < int(hi, 16) for lo, hi in ranges)


def test_a_forked_child_gets_no_copy_of_the_pinned_rows_and_leaves_its_own_mappings_be():
    """The pinned rows are left out of a fork child: with a copy-on-write copy in the child,
    the parent's next write to a row would go to a new page while the device's copies
    still read and write the registered one. The child's copy of the jobs, when it goes,
    unmaps nothing: what the child mapped since at that address stays."""
    jobs = _core.HostJobs(_core.make_host_backend(64 << 10), 1, 4096)
    base = jobs.pinned
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            said = [b"mapped" if mapped_here(base) else b"absent"]
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            # PROT_READ | PROT_WRITE; MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE
            own = libc.mmap(base, 4096, 0x3, 0x22 | 0x100000, -1, 0)
            said.append(b"own" if own == base else b"elsewhere")
            del jobs
            said.append(b"kept" if mapped_here(base) else b"unmapped")
            os.write(w, b",".join(said))
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        assert f.read() == b"absent,own,kept"
    x = np.arange(8, dtype=np.float16)
    put(base, x)  # the parent's rows are its own as before
    np.testing.assert_array_equal(take(base, x.shape, np.float16), x)


def test_the_host_backend_has_no_graph_to_put_host_nodes_in():
    model = mlp_model(64, 96)
    _, hosts = rewrite_for_host(model, ["w1"])
    weights = host_weights(model, hosts)
    be = _core.make_host_backend(64 << 10)
    stream = be.create_stream()
    with pytest.raises(StateError, match="CUDA backend"):
        be.begin_graph_capture(stream)
    _core.host_begin_capture(stream)
    host_graph = _core.host_end_capture(stream)
    nodes = HostNodes(be, hosts, {"h": (1 << 20, (*ROWS, 64))}, {hosts[0].y_input: 2 << 20},
                      {w: a.ctypes.data for w, a in weights.items()})
    with pytest.raises(StateError, match="device graph"):
        nodes.add_to(host_graph)
    stream.close()


# -- on the GPU: a captured ORT run whose replays compute the MatMul on the host -------------------------------------


class Captured:
    """The rewritten model's ORT session on a stream of the CUDA backend, every input and
    output bound to a buffer of ours, one run captured into a DeviceGraph (not yet
    instantiated), as the streaming engine makes a step's graph."""

    def __init__(self, model, names):
        from onnx_offload.engines.ortvalues import ortvalue_at
        self.model = model
        self.rewritten, self.hosts = rewrite_for_host(model, names)
        self.weights = host_weights(model, self.hosts)
        self.be = _core.make_cuda_backend(0)
        self.stream = self.be.create_stream()
        opts = {"has_user_compute_stream": "1", "user_compute_stream": str(self.stream.native)}
        self.session = ort.InferenceSession(self.rewritten.SerializeToString(), providers=[(CUDA, opts)])
        self.buffers = {}  # name -> (address, shape, dtype)
        io = self.session.io_binding()
        for v, bind in [(v, io.bind_ortvalue_input) for v in self.session.get_inputs()] + \
                       [(v, io.bind_ortvalue_output) for v in self.session.get_outputs()]:
            shape = tuple(int(d) for d in v.shape)
            dtype = np.float16 if v.type == "tensor(float16)" else np.float32
            ptr = self.be.plain_alloc(max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize))
            self.buffers[v.name] = (ptr, shape, dtype)
            bind(v.name, ortvalue_at(ptr, shape, dtype, True, 0))
        self.io = io
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.write("x", np.zeros(self.buffers["x"][1], self.buffers["x"][2]))
        for _ in range(2):  # ORT takes its memory and picks its kernels
            self.session.run_with_iobinding(self.io, self.run_options)
        self.stream.synchronize()
        self.be.begin_graph_capture(self.stream)
        try:
            self.session.run_with_iobinding(self.io, self.run_options)
        finally:
            self.graph = self.be.end_graph_capture(self.stream)

    def host_nodes(self):
        return HostNodes(self.be, self.hosts, {h.x_output: self.buffers[h.x_output][:2] for h in self.hosts},
                         {h.y_input: self.buffers[h.y_input][0] for h in self.hosts},
                         {w: a.ctypes.data for w, a in self.weights.items()})

    def write(self, name, array):
        array = np.ascontiguousarray(array)
        self.be.copy_h2d(self.buffers[name][0], array.ctypes.data, array.nbytes, self.stream)
        self.stream.synchronize()

    def read(self, name):
        ptr, shape, dtype = self.buffers[name]
        out = np.empty(shape, dtype)
        self.be.copy_d2h(out.ctypes.data, ptr, out.nbytes, self.stream)
        self.stream.synchronize()
        return out

    def replay(self, x, nodes):
        self.write("x", x)
        self.graph.launch(self.stream)
        self.stream.synchronize()
        nodes.check()
        return {o.name: self.read(o.name) for o in self.model.graph.output}

    def close(self):
        self.stream.synchronize()
        self.graph = None  # waits for its replays and lets go of the jobs
        self.session = self.io = None
        for ptr, shape, dtype in self.buffers.values():
            self.be.plain_free(ptr, max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize))


def plain_cuda(model, x):
    s = ort.InferenceSession(model.SerializeToString(), providers=[CUDA])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, {"x": x})))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "int4"])
def test_captured_graph_computes_the_matmul_on_the_host_and_recomputes_each_replay(kind):
    k, n = 1024, 3072
    model = mlp_model(k, n) if kind == "float16" else int4_model(k, n)
    c = Captured(model, ["w1"] if kind == "float16" else ["w1_Q4"])
    try:
        nodes = c.host_nodes()
        nodes.add_to(c.graph)
        assert nodes.placed and nodes.placed[0][1] and nodes.placed[0][2]
        with pytest.raises(StateError, match="in a graph already"):
            nodes.add_to(c.graph)
        c.graph.instantiate(c.stream)
        rng = np.random.default_rng(2)
        x1, x2 = (rng.standard_normal((*ROWS, k)).astype(np.float16) for _ in range(2))
        got1 = c.replay(x1, nodes)
        assert_within_bound(got1["out1"], plain_cuda(model, x1)["out1"])
        got2 = c.replay(x2, nodes)
        want2 = plain_cuda(model, x2)["out1"]
        assert_within_bound(got2["out1"], want2)
        assert float(np.abs(got2["out1"].astype(np.float32) - got1["out1"].astype(np.float32)).max()) > \
            ULPS * np.finfo(np.float16).eps * float(np.abs(want2.astype(np.float32)).max())
        assert c.graph.launches == 2
        # A job the host kernel refuses (x of 0 rows, built on purpose): the replay's
        # check names the MatMul; set right again, the graph computes again.
        assert nodes.jobs.set(**dict(nodes.job_args[0], m=0))
        with pytest.raises(HostComputeFailed, match="'proj1'") as e:
            c.replay(x1, nodes)
        assert e.value.matmul == "proj1"
        assert nodes.jobs.set(**nodes.job_args[0]) == ""
        assert_within_bound(c.replay(x1, nodes)["out1"], plain_cuda(model, x1)["out1"])
    finally:
        c.close()
    # A plain ORT session in the same process keeps working.
    assert plain_cuda(mlp_model(64, 96), np.ones((*ROWS, 64), np.float16))["out1"].shape == (*ROWS, 96)


@pytest.mark.gpu
def test_matmuls_that_share_x_share_its_copy_beside_a_device_matmul():
    k, n = 1024, 3072
    model = mlp_model(k, n, shared=True)
    c = Captured(model, ["w1", "w2"])
    try:
        nodes = c.host_nodes()
        assert list(nodes.x_rows) == ["h"]  # one pinned X for both
        # Orders the graph cannot run are refused before anything is added; the graph
        # takes the right one after them.
        ranges = [(c.buffers["h"][0], c.buffers["h"][0] + nodes.x_rows["h"][1])]
        ranges += [(c.buffers[h.y_input][0], c.buffers[h.y_input][0] + nodes.y_rows[h.y_input][1]) for h in c.hosts]
        x_nodes, *y_nodes = c.graph.readers(ranges)
        good = place(c.hosts, {"h": x_nodes}, {h.y_input: ys for h, ys in zip(c.hosts, y_nodes)})
        (i0, after0, before0), (i1, after1, before1) = good
        assert before1[0] > before0[0] > max(after0)
        # A result read before its X is copied (its `after` and `before` swapped).
        with pytest.raises(ValueError, match="order"):
            c.graph.add_host_matmuls(nodes.jobs, nodes.items([(i0, before0, after0)]))
        # The second MatMul's X copy after the first one's result is read: one copy of the
        # shared X cannot serve both.
        with pytest.raises(ValueError, match="shares its X"):
            c.graph.add_host_matmuls(nodes.jobs, nodes.items([(i0, after0, before0),
                                                              (i1, sorted({*after1, before0[0]}), before1)]))
        nodes.add_to(c.graph)
        assert [nodes.placed[0][1]] * 2 == [p[1] for p in nodes.placed]  # both follow the same nodes of X
        c.graph.instantiate(c.stream)
        rng = np.random.default_rng(3)
        for _ in range(2):
            x = rng.standard_normal((*ROWS, k)).astype(np.float16)
            got, want = c.replay(x, nodes), plain_cuda(model, x)
            for name in ("out1", "out2", "out3"):
                assert_within_bound(got[name], want[name])
    finally:
        c.close()


@pytest.mark.gpu
def test_a_graph_without_the_rewrite_s_buffers_is_refused():
    """Host nodes made for another signature's buffers: no captured node holds them."""
    k, n = 256, 512
    c = Captured(mlp_model(k, n), ["w1"])
    try:
        other = {h.x_output: (c.buffers["x"][0] + (1 << 40), c.buffers[h.x_output][1]) for h in c.hosts}
        nodes = HostNodes(c.be, c.hosts, other, {h.y_input: c.buffers[h.y_input][0] for h in c.hosts},
                          {w: a.ctypes.data for w, a in c.weights.items()})
        with pytest.raises(HostComputeRefused, match="no captured node holds its input"):
            nodes.add_to(c.graph)
    finally:
        c.close()
