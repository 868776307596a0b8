"""Configuration from keywords and the environment, bad values included."""
import pytest

from onnx_offload import OffloadConfig, parse_bytes
from onnx_offload.config import parse_vram_limit

GiB = 1 << 30
MiB = 1 << 20


@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 * GiB), ("6 GiB", 6 * GiB), ("6000000000", 6_000_000_000), ("6GB", 6_000_000_000),
    ("512MiB", 512 << 20), ("1.5GiB", int(1.5 * GiB)), ("64k", 64 << 10), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "six", "6 GiBs", "-1", "0", "1.5", "GiB", True])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="expected"):
        parse_bytes(text, "X")


@pytest.mark.parametrize("text,expected", [("auto", None), ("0.9", 0.9), ("1.0", 1.0), ("6GiB", 6 * GiB),
                                           ("6000000000", 6_000_000_000), (0.5, 0.5)])
def test_parse_vram_limit(text, expected):
    assert parse_vram_limit(text) == expected


@pytest.mark.parametrize("text", ["1.5", "0.0", "-0.5", "lots", "90%"])
def test_parse_vram_limit_rejects_naming_the_variable(text):
    with pytest.raises(ValueError, match=r"ONNX_GENAI_VRAM_LIMIT=.*fraction.*auto"):
        parse_vram_limit(text)


def test_from_env_reads_every_flag():
    env = {"ONNX_GENAI_WEIGHT_OFFLOAD": "1", "ONNX_GENAI_WEIGHT_OFFLOAD_VMM": "1",
           "ONNX_GENAI_WEIGHT_OFFLOAD_DEVICE_BYTES": "6000000000", "ONNX_GENAI_VRAM_LIMIT": "0.5",
           "ONNX_GENAI_CUDA_GRAPH": "0", "ONNX_GENAI_WEIGHT_OFFLOAD_POLICY": "LRU"}
    c = OffloadConfig.from_env(env)
    assert (c.offload, c.vmm, c.weight_bytes, c.vram_limit, c.cuda_graph, c.policy) == (
        True, True, 6_000_000_000, 0.5, False, "lru")
    assert c.graph_override is None


def test_keywords_win_over_the_environment():
    env = {"ONNX_GENAI_WEIGHT_OFFLOAD": "0", "ONNX_GENAI_VRAM_LIMIT": "1GiB"}
    c = OffloadConfig.from_env(env, offload=True, vram_limit="2GiB", cuda_graph=True)
    assert c.offload and c.vram_limit == 2 * GiB and c.graph_override is True and c.cuda_graph is None


@pytest.mark.parametrize("value,expected", [(True, True), ("1", True), ("true", True), (1, True),
                                            (False, False), ("0", False), ("false", False), (0, False)])
def test_switches_given_by_keyword_read_as_the_environment_spells_them(value, expected):
    c = OffloadConfig.from_env({}, offload=value, vmm=value)
    assert c.offload is expected and c.vmm is expected


@pytest.mark.parametrize("value", ["yes", "off", 2, 0.5, []])
def test_a_bad_switch_by_keyword_is_refused_by_name(value):
    with pytest.raises(ValueError, match="offload=.*not valid"):
        OffloadConfig.from_env({}, offload=value)


@pytest.mark.parametrize("name,value,forms", [
    ("ONNX_GENAI_WEIGHT_OFFLOAD", "yes", "'0' or '1'"),
    ("ONNX_GENAI_WEIGHT_OFFLOAD_VMM", "2", "'0' or '1'"),
    ("ONNX_GENAI_CUDA_GRAPH", "on", "'0' or '1'"),
    ("ONNX_GENAI_WEIGHT_OFFLOAD_DEVICE_BYTES", "6 gigs", "integer byte count"),
    ("ONNX_GENAI_VRAM_LIMIT", "half", "fraction"),
    ("ONNX_GENAI_WEIGHT_OFFLOAD_POLICY", "fifo", "planned, stable, lru, mru"),
])
def test_bad_env_values_name_the_variable_and_the_forms(name, value, forms):
    with pytest.raises(ValueError) as e:
        OffloadConfig.from_env({name: value})
    assert name in str(e.value) and repr(value) in str(e.value) and forms in str(e.value)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="vram_limt"):
        OffloadConfig.from_env({}, vram_limt="1GiB")


def test_budget_resolution():
    free, total = 50 * GiB, 80 * GiB
    assert OffloadConfig(vram_limit=None).resolve_budget(free, total) == free  # auto: the free memory, less
    assert OffloadConfig(vram_limit=None).resolve_budget(free, total, GiB) == free - GiB  # the device's margin
    assert OffloadConfig(vram_limit=0.5).resolve_budget(free, total, GiB) == 40 * GiB  # a fraction: no margin
    assert OffloadConfig(vram_limit=0.5).resolve_budget(free, total) == 40 * GiB
    assert OffloadConfig(vram_limit="6GiB").resolve_budget(free, total) == 6 * GiB


@pytest.mark.parametrize("kw,needle", [
    (dict(host_granularity=-1), "host_granularity=-1"), (dict(zone_va_bytes=-5), "zone_va_bytes=-5"),
    (dict(handle_classes=("a",)), "handle_classes"), (dict(handle_classes=(0,)), "handle_classes"),
    (dict(kv_bytes=True), "kv_bytes=True"), (dict(device_id="x"), "device_id='x'"), (dict(device_id=-1), "device_id"),
])
def test_advanced_keywords_are_checked_by_name(kw, needle):
    with pytest.raises(ValueError, match=needle):
        OffloadConfig.from_env({}, **kw)


def test_advanced_keywords_take_sizes_and_digits():
    c = OffloadConfig.from_env({}, host_granularity="64KiB", zone_va_bytes="1GiB", device_id="1", handle_classes=[1, 4])
    assert (c.host_granularity, c.zone_va_bytes, c.device_id, c.handle_classes) == (64 << 10, GiB, 1, (1, 4))


def test_counts_and_sizes_read_from_numpy_are_integers():
    np = pytest.importorskip("numpy")
    c = OffloadConfig.from_env({}, prefill_chunk=np.int64(3), kv_bytes=np.int64(MiB), scratch_bytes=np.int32(4 * MiB),
                               weight_bytes=np.uint64(8 * MiB), device_id=np.int64(0), handle_classes=[np.int64(2)])
    assert (c.prefill_chunk, c.kv_bytes, c.scratch_bytes, c.weight_bytes, c.device_id, c.handle_classes) == \
        (3, MiB, 4 * MiB, 8 * MiB, 0, (2,))
    assert all(type(v) is int for v in (c.prefill_chunk, c.kv_bytes, c.scratch_bytes, c.weight_bytes, c.device_id))
    for kw in (dict(prefill_chunk=np.True_), dict(prefill_chunk=True), dict(kv_bytes=np.float64(3.0)),
               dict(prefill_chunk=np.int64(0))):
        with pytest.raises(ValueError, match=next(iter(kw))):
            OffloadConfig.from_env({}, **kw)


@pytest.mark.parametrize("value,expected", [("1", "auto"), ("true", "auto"), ("ON", "auto"), ("0", "off"),
                                            ("none", "off"), ("auto", "auto")])
def test_cache_dir_switches_are_not_folder_names(value, expected):
    assert OffloadConfig.from_env({"ONNX_OFFLOAD_CACHE_DIR": value}).cache_dir == expected


# (variable, a value it refuses, the keyword that overrides it, a value of that keyword, the field and its value)
OVERRIDDEN = [
    ("ONNX_GENAI_WEIGHT_OFFLOAD", "garbage", "offload", True, "offload", True),
    ("ONNX_GENAI_WEIGHT_OFFLOAD_VMM", "garbage", "vmm", "0", "vmm", False),
    ("ONNX_GENAI_WEIGHT_OFFLOAD_DEVICE_BYTES", "garbage", "weight_bytes", "1GiB", "weight_bytes", GiB),
    ("ONNX_GENAI_WEIGHT_OFFLOAD_POLICY", "garbage", "policy", "lru", "policy", "lru"),
    ("ONNX_GENAI_VRAM_LIMIT", "garbage", "vram_limit", "1GiB", "vram_limit", GiB),
    ("ONNX_GENAI_VRAM_LIMIT", "1", "vram_limit", 0.5, "vram_limit", 0.5),  # one byte: less than a granule
    ("ONNX_GENAI_CUDA_GRAPH", "garbage", "cuda_graph", False, "graph_override", False),
    ("ONNX_GENAI_CUDA_GRAPH", "garbage", "graph_override", True, "graph_override", True),
    ("ONNX_OFFLOAD_ENGINE", "garbage", "engine", "segments", "engine", "segments"),
]


@pytest.mark.parametrize("var,bad,keyword,value,field,expected", OVERRIDDEN,
                         ids=[f"{o[0]}={o[1]}-{o[2]}" for o in OVERRIDDEN])
def test_a_keyword_wins_over_an_invalid_variable_which_is_then_not_read(var, bad, keyword, value, field, expected):
    env = {var: bad}
    with pytest.raises(ValueError, match=var):  # not overridden: an error that names the variable
        OffloadConfig.from_env(env)
    with pytest.raises(ValueError, match=var):  # a keyword given as None overrides nothing
        OffloadConfig.from_env(env, **{keyword: None})
    c = OffloadConfig.from_env(env, **{keyword: value})
    assert getattr(c, field) == expected
    other = "policy" if keyword != "policy" else "engine"  # another keyword leaves the variable in force
    with pytest.raises(ValueError, match=var):
        OffloadConfig.from_env(env, **{other: OffloadConfig.__dataclass_fields__[other].default})


def test_an_explicit_vram_limit_runs_a_session_whatever_the_variable_says(monkeypatch):
    import numpy as np
    from onnx_offload import OffloadSession
    from onnx_offload.models import mlp_stack
    model = mlp_stack(layers=2, hidden=256, batch=4).SerializeToString()
    monkeypatch.setenv("ONNX_GENAI_VRAM_LIMIT", "garbage")
    with pytest.raises(ValueError, match="ONNX_GENAI_VRAM_LIMIT='garbage'"):
        OffloadSession(model, providers=["CPUExecutionProvider"])
    with OffloadSession(model, providers=["CPUExecutionProvider"], vram_limit="1GiB") as s:
        assert s.device.ledger.snapshot().budget == GiB
        assert s.run(None, {"x": np.ones((4, 256), np.float32)})[0].shape == (4, 256)


@pytest.mark.parametrize("n", [2**62, 2**63 - 1, 0])
def test_a_zone_va_that_cannot_be_reserved_is_a_value_error_naming_it(n):
    with pytest.raises(ValueError, match="zone_va_bytes"):
        OffloadConfig(zone_va_bytes=n)


def test_the_arena_refuses_a_reservation_past_the_address_space():
    from onnx_offload import _core
    backend = _core.make_host_backend(64 << 10)
    with pytest.raises(ValueError, match="zone_va_bytes"):
        _core.Arena(backend, _core.BudgetOwner(1 << 20), zone_va_bytes=2**62)
