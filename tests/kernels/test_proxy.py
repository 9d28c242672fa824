"""The ``proxy`` transport (native CPU proxy over libfabric) against the ``torch`` reference.

Each test spawns ranks as processes (gloo group for setup and for the torch reference) and runs
both transports in the same ranks on the same inputs; every output must be bit-identical. Traffic
stays on loopback (FI_TCP_IFACE=lo). Sizes are small: CI has 2 cores.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from efa_ep.distributed import RankFailure, run_ranks
from efa_ep.kernels import proxy as proxy_mod
from efa_ep.testing.transports import proxy_creation_error

pytestmark = pytest.mark.skipif(proxy_mod.availability() is not None,
                                reason=f"proxy unavailable: {proxy_mod.availability()}")

# Loopback only: the tcp provider otherwise picks the host's external interface. FI_PROVIDER=tcp
# restricts libfabric to tcp (and its rxm layering) for the tcp tests; the shm test drops it.
LOOPBACK = {"FI_TCP_IFACE": "lo", "FI_PROVIDER": "tcp", "OMP_NUM_THREADS": "1"}
SHM_ENV = {"FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "1"}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _compare_cases(rank, world, cases, options, device):
    """Runs each case with torch and proxy (built with ``options`` over the EFA_EP_PROXY_*
    variables, as the dispatcher's settings resolve them) on the same inputs; returns
    (per-case list of mismatching output names, per-channel stats of the proxy, its
    ``one_calls`` per transport)."""
    from efa_ep.dispatcher.settings import environment_options
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    options = {**environment_options("proxy"), **options}
    device_layout = options.pop("device_layout", None)  # test-only: where the dispatch's layout runs

    report, transports = [], {}
    for (route, num_experts, hidden, topk, dtype_name, tokens, seed) in cases:
        dtype = getattr(torch, dtype_name)
        key = (num_experts, hidden, dtype_name)
        if key not in transports:
            transports[key] = (
                create_transport("torch", None, num_experts, hidden, 64, dtype),
                create_transport("proxy", None, num_experts, hidden, 64, dtype, **options))
            if device_layout is not None:
                transports[key][1].device_layout = device_layout
        ref, px = transports[key]
        t = tokens[rank] if isinstance(tokens, (list, tuple)) else tokens
        idx, w = contract_route(route, t, num_experts, topk, world, seed + 17 * rank)
        g = torch.Generator().manual_seed(seed * 31 + rank)
        x = torch.randn(t, hidden, generator=g).to(dtype)
        n_dev = lambda v: v.to(device)  # noqa: E731
        bad = []
        r_out = ref.dispatch(x, idx, w)
        p_out = px.dispatch(n_dev(x), n_dev(idx), n_dev(w))
        for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights", "tokens_per_expert"),
                              r_out[:4], p_out[:4]):
            if not _bits_equal(a, b.cpu()):
                bad.append(name)
        if p_out[3].device.type != "cpu" or p_out[3].dtype != torch.int64:
            bad.append("tokens_per_expert not CPU int64")
        if p_out[0].device.type != torch.device(device).type:
            bad.append("recv_x device")
        hr, hp = r_out[4], p_out[4]
        if hr.num_send_per_rank != hp.num_send_per_rank or hr.num_recv_per_rank != hp.num_recv_per_rank:
            bad.append("handle counts")
        n = r_out[0].shape[0]
        y = torch.randn(n, hidden, generator=g).to(dtype)
        if not _bits_equal(ref.combine(y, hr), px.combine(n_dev(y), hp).cpu()):
            bad.append("combine")
        # wider than a window row (fp32, 2H+3 columns): exercises the column rounds
        y2 = torch.randn(n, 2 * hidden + 3, generator=g, dtype=torch.float32)
        if not _bits_equal(ref.combine(y2, hr), px.combine(n_dev(y2), hp).cpu()):
            bad.append("combine_wide_fp32")
        x2 = torch.randn(t, hidden, generator=g).to(dtype)
        if not _bits_equal(ref.dispatch_cached(x2, hr), px.dispatch_cached(n_dev(x2), hp).cpu()):
            bad.append("dispatch_cached")
        gw = torch.randn(n, topk, generator=g, dtype=torch.float32)
        if not _bits_equal(ref.combine_topk_weights(gw, hr), px.combine_topk_weights(n_dev(gw), hp).cpu()):
            bad.append("combine_topk_weights")
        report.append(bad)
    stats = [px.stats() for _, px in transports.values()]
    one_calls = [dict(px.one_calls, cpp=px.cpp_calls) for _, px in transports.values()]
    for _, px in transports.values():
        px.close()
    return report, stats, one_calls


def _compare_rank(rank, world, cases, configs):
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = os.environ.get("EFA_EP_TEST_DEVICE", "cpu")
    out = [_compare_cases(rank, world, cases, opts, device) for opts in configs]
    dist.barrier()
    return out


def _run_compare(world, cases, configs, env=None, timeout_s=200, base_env=None):
    e = dict(base_env or LOOPBACK)
    e.update(env or {})
    out = run_ranks(_compare_rank, world, (cases, configs), timeout_s=timeout_s,
                    pg_timeout_s=90, env=e)
    for rank, per_config in enumerate(out):
        for opts, (report, *_) in zip(configs, per_config):
            for case, bad in zip(cases, report):
                assert not bad, f"rank {rank} options {opts} case {case}: proxy differs from torch in {bad}"
    return out


CASES_2 = [
    ("random", 8, 32, 4, "float32", 24, 1),
    ("hot_experts", 8, 32, 4, "float32", 24, 2),
    ("dropped", 8, 32, 4, "float32", 24, 3),
    ("one_rank", 8, 32, 4, "float32", 24, 4),
    ("random", 8, 32, 4, "float32", [0, 24], 5),      # T=0 on rank 0
    ("random", 8, 48, 2, "bfloat16", [17, 5], 6),
]
# Small chunks so one message becomes many descriptors spread over every channel.
CONFIGS_2 = [
    {"provider": "tcp", "num_channels": 1, "timeout_s": 30, "chunk_bytes": 512},
    {"provider": "tcp", "num_channels": 2, "timeout_s": 30, "chunk_bytes": 256, "inject_reorder": 1},
    {"provider": "tcp", "num_channels": 4, "timeout_s": 30, "chunk_bytes": 512},
    # the Triton descriptor producer (run by the Triton interpreter on CPU here)
    {"provider": "tcp", "num_channels": 2, "timeout_s": 30, "chunk_bytes": 512, "producer": "triton"},
]


def test_tcp_two_ranks_k124_bit_identical():
    """2 ranks over tcp;ofi_rxm, K = 1, 2 (with injected reordering), 4, and the Triton producer.
    (Invalid input on one rank: the contract suite, tests/contract/test_contract_cases.py.)"""
    out = _run_compare(2, CASES_2, CONFIGS_2, env={"TRITON_INTERPRET": "1"})
    for per_config in out:
        for opts, (_, stats, _) in zip(CONFIGS_2, per_config):
            chans = stats[0]
            assert len(chans) == opts["num_channels"]
            # the wire really carried the rows, on every channel
            assert all(c["posted"] > 0 and c["arrived"] > 0 for c in chans), (opts, chans)


def test_tcp_four_ranks_k2_injected_and_k4():
    cases = [
        ("random", 16, 32, 4, "float32", 32, 11),
        ("hot_experts", 16, 32, 6, "float32", [32, 0, 9, 31], 12),
        ("dropped", 16, 24, 4, "bfloat16", [20, 0, 0, 7], 13),
        ("one_rank", 16, 32, 4, "float32", 16, 14),
    ]
    _run_compare(4, cases, [
        {"provider": "tcp", "num_channels": 2, "inject_reorder": 1, "timeout_s": 60, "chunk_bytes": 256},
        {"provider": "tcp", "num_channels": 4, "timeout_s": 60, "chunk_bytes": 1024},
    ], timeout_s=230)


def test_shm_two_ranks_env_knobs_with_injection():
    """shm provider, 3 channels and injection chosen by EFA_EP_PROXY_* env vars (the first-class
    knobs; the dispatcher's settings turn them into options)."""
    why = proxy_mod.native.probe("shm")
    if why:
        pytest.skip(f"shm provider unusable: {why}")
    out = _run_compare(2, CASES_2[:3] + CASES_2[4:], [{"timeout_s": 30}], base_env=SHM_ENV,
                       env={"EFA_EP_PROXY_PROVIDER": "shm", "EFA_EP_PROXY_CHANNELS": "3",
                            "EFA_EP_PROXY_INJECT": "1", "EFA_EP_PROXY_CHUNK_BYTES": "256"})
    assert len(out[0][0][1][0]) == 3


def _dead_peer_rank(rank, world):
    from efa_ep.kernels import create_transport, TransportError

    torch.set_num_threads(1)
    t = create_transport("proxy", None, 4, 8, 16, torch.float32, provider="tcp", num_channels=2,
                         timeout_s=3)
    if rank == 1:
        os._exit(0)  # dies without closing anything, before the dispatch
    time.sleep(0.5)
    idx = torch.tensor([[0, 3], [2, 1]], dtype=torch.int64)
    start = time.monotonic()
    try:
        t.dispatch(torch.ones(2, 8), idx, torch.ones(2, 2))
    except TransportError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_dead_peer_gives_deadline_error():
    out = run_ranks(_dead_peer_rank, 2, (), timeout_s=60, pg_timeout_s=20, env=LOOPBACK,
                    raise_on_error=False)
    ok, val = out[0]
    assert ok, val
    msg, elapsed = val
    assert "rank 1" in msg, msg
    assert elapsed < 10, (elapsed, msg)


def test_available_transports_lists_proxy():
    from efa_ep.kernels import available_transports

    assert "proxy" in available_transports()


def test_clear_error_without_libfabric(monkeypatch):
    """Missing headers (simulated): availability() says what to install; torch still works."""
    from efa_ep.kernels import available_transports, transport_status
    from efa_ep.kernels.proxy import native, native_build, transport

    assert transport.native is native  # the module the transport's loader calls
    assert native.build_problem is native_build.build_problem  # reads the module patched here
    monkeypatch.delenv("EFA_EP_PROXY_SO", raising=False)
    monkeypatch.setattr(native_build, "libfabric_header", lambda: None)
    why = proxy_mod.availability()
    assert why is not None and "libfabric-dev" in why and "rdma/fabric.h" in why
    assert "proxy" not in available_transports()
    assert "torch" in available_transports()
    assert "libfabric" in transport_status()["proxy"]
    monkeypatch.setattr(native_build, "libfabric_header", lambda: "/usr/include/rdma/fabric.h")
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    assert "compiler" in proxy_mod.availability()


def test_default_channel_count_follows_the_host(monkeypatch):
    from efa_ep.kernels.proxy import options

    monkeypatch.setattr(options.os, "cpu_count", lambda: 16)
    assert options.resolve_options({"provider": "tcp"}).num_channels == 4
    assert options.resolve_options({"provider": "tcp", "num_channels": 1}).num_channels == 1
    monkeypatch.setattr(options.os, "cpu_count", lambda: 2)
    assert options.resolve_options({"provider": "tcp"}).num_channels == 2
    with pytest.raises(Exception, match="num_channels=0"):
        options.resolve_options({"provider": "tcp", "num_channels": 0})


def test_unknown_provider_is_refused():
    from efa_ep.kernels.proxy import native

    why = native.probe("no_such_provider")
    assert why is not None and "fi_getinfo" in why and "no_such_provider" in why


def test_describe_messages_encoding():
    d = proxy_mod.describe_messages(torch.tensor([3, 1]), torch.tensor([32, 4096]),
                                    torch.tensor([64, 8192]), torch.tensor([40, 16]), 7, 16)
    # message 0: 40 bytes -> chunks 16,16,8 ; message 1: one chunk of 16
    assert d.shape == (4, 2)
    lens = (d[:, 0] & 0xFFFFFFFF).tolist()
    assert lens == [16, 16, 8, 16]
    assert ((d[:, 0] >> 52) & 0xFFF).tolist() == [3, 3, 3, 1]
    assert ((d[:, 0] >> 32) & 0xFFFFF).tolist() == [7] * 4
    assert ((d[:, 1] >> 32) << 4).tolist() == [32, 48, 64, 4096]
    assert ((d[:, 1] & 0xFFFFFFFF) << 4).tolist() == [64, 80, 96, 8192]
    # only the id's 8 bits are sent: the field's chunk-mark bits stay 0 (a mark from this
    # producer would be refused by the receiver)
    d = proxy_mod.describe_messages(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]),
                                    torch.tensor([16]), 0x307, 16)
    assert ((d[:, 0] >> 32) & 0xFFFFF).tolist() == [7]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_host_staged_two_ranks_bit_identical():
    """CUDA inputs, host window: the native host producer (default), the dispatch's layout on
    the host, and the Triton producer. Every case runs twice with other values, so the device
    path's bound native programs run again (other row counts, other tensors)."""
    again = [c[:-1] + (c[-1] + 100,) for c in CASES_2]
    out = _run_compare(2, CASES_2 + again, [{"provider": "tcp", "num_channels": 2, "timeout_s": 30},
                                            {"provider": "tcp", "num_channels": 2, "timeout_s": 30,
                                             "device_layout": False},
                                            {"provider": "tcp", "num_channels": 2, "timeout_s": 30,
                                             "producer": "triton"}],
                       env={"EFA_EP_TEST_DEVICE": "cuda"})
    # the repeated cases ran as one native call each (planned.py), on every rank: the checks
    # above compared those outputs too
    for rank, per_config in enumerate(out):
        one_calls = per_config[0][2]
        assert all(min(c[k] for k in ("dispatch", "combine", "cached")) > 0
                   for c in one_calls), (rank, one_calls)
        assert all(min(c["cpp"].values()) > 0 for c in one_calls), (rank, one_calls)


def _planned_bad_routing(rank, world):
    """Two dispatch + combine of one case (the second runs as one native call each), then the
    same case with an expert id out of range on rank 1 only, then valid again."""
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.base import DispatchInputError
    from efa_ep.testing.routes import contract_route

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    ref = create_transport("torch", None, 16, 64, 32, torch.bfloat16)
    px = create_transport("proxy", None, 16, 64, 32, torch.bfloat16, provider="tcp",
                          num_channels=2, timeout_s=30)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(24, 64, generator=g).to(torch.bfloat16)
    out = {"errors": [], "equal": []}
    for step in range(4):
        idx, w = contract_route("random", 24, 16, 4, world, seed=10 * step + rank)
        if step == 2 and rank == 1:
            idx = idx.clone()
            idx[3, 0] = 16  # one expert id out of range, on one rank only
        try:
            got = px.dispatch(x.to(dev), idx.to(dev), w.to(dev))
        except DispatchInputError as e:
            out["errors"].append(str(e))
            continue
        exp = ref.dispatch(x, idx, w)
        y = torch.randn(exp[0].shape[0], 64, generator=g).to(torch.bfloat16)
        equal = all(_bits_equal(a, b.cpu()) for a, b in zip(exp[:4], got[:4]))
        equal &= _bits_equal(ref.combine(y, exp[4]), px.combine(y.to(dev), got[4]).cpu())
        out["equal"].append(equal)
    out["one_calls"], out["cpp_calls"], out["cpp_off"] = px.one_calls, px.cpp_calls, px.cpp_off
    out["broken"] = px.broken
    px.close()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_one_call_bad_routing_refused_on_every_rank():
    """A case that ran before goes to one native call (planned.py); an out-of-range expert id
    on one rank there is flagged by the device layout, refused on every rank naming that rank,
    and the transport stays usable: the next call of the case is bit-identical again."""
    out = run_ranks(_planned_bad_routing, 2, (), timeout_s=200, pg_timeout_s=90, env=LOOPBACK)
    for rank, o in enumerate(out):
        assert o["equal"] == [True, True, True], (rank, o)
        assert len(o["errors"]) == 1 and "rank 1" in o["errors"][0], (rank, o)
        assert o["broken"] is None
        assert o["one_calls"]["dispatch"] >= 1 and o["one_calls"]["combine"] >= 1, (rank, o)
        # through the C++ call (the default; built once per install)
        assert o["cpp_off"] is None, (rank, o["cpp_off"])
        assert o["cpp_calls"]["dispatch"] >= 1 and o["cpp_calls"]["combine"] >= 1, (rank, o)


def _hmem_option_errors(rank, world):
    from efa_ep.kernels import create_transport

    t = create_transport("proxy", None, 4, 8, 16, torch.float32, provider="tcp")
    out = [t.hmem]  # auto resolves to a host window: tcp has no FI_HMEM (and no GPU here)
    t.close()
    for opts in ({"hmem": "cuda"}, {"hmem": "gpu"}, {"provider": "no_such_provider"}):
        out.append(proxy_creation_error(**{"provider": "tcp", **opts}))
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_hmem_option_refused_without_cuda_or_unknown():
    (auto_mode, cuda_msg, bad_msg, prov_msg), = run_ranks(_hmem_option_errors, 1, (), timeout_s=60, env=LOOPBACK)
    assert auto_mode == "off"
    assert "hmem='cuda' needs a CUDA device" in cuda_msg
    assert "hmem='gpu'" in bad_msg and "'off'" in bad_msg
    # an engine that cannot start names the rank, the provider and the libfabric verb
    assert "rank 0" in prov_msg and "no_such_provider" in prov_msg and "fi_getinfo" in prov_msg, prov_msg


def test_hmem_probe_names_the_missing_capability():
    from efa_ep.kernels.proxy import native

    why = native.probe("no_such_provider", hmem=True)
    assert why is not None and "FI_HMEM" in why and "no_such_provider" in why and "hmem='off'" in why


# shm is the libfabric provider that takes CUDA memory on a host without EFA (tcp never
# advertises FI_HMEM, up to libfabric 2.6); on AWS set EFA_EP_TEST_HMEM_PROVIDER=efa.
HMEM_PROVIDER = os.environ.get("EFA_EP_TEST_HMEM_PROVIDER", "shm")


def _hmem_unavailable():
    if not torch.cuda.is_available():
        return "needs CUDA"
    from efa_ep.kernels.proxy import native

    why = native.probe(HMEM_PROVIDER, hmem=True)
    if why is not None:
        return f"libfabric here cannot do FI_HMEM over {HMEM_PROVIDER}: {why}"
    # providers may offer FI_HMEM without CUDA support compiled in (Debian's shm): register one
    window = torch.zeros(1 << 12, dtype=torch.uint8, device="cuda")
    rings = torch.zeros(1, 16, 2, dtype=torch.int64)
    ctrl = torch.zeros(1, native.CTRL_STRIDE, dtype=torch.int64)
    counters = torch.zeros(4, dtype=torch.int64)
    try:
        eng = native.Engine(HMEM_PROVIDER, 0, 1, 1, window.data_ptr(), window.numel(), rings.data_ptr(),
                                  16, ctrl.data_ptr(), counters.data_ptr(), 4, 4, 0, 0, 1, -1, 20000,
                                  torch.cuda.current_device())
    except native.NativeError as e:
        return f"libfabric here cannot register CUDA memory over {HMEM_PROVIDER}: {e}"
    eng.destroy()
    return None


_HMEM_WHY = _hmem_unavailable()


@pytest.mark.skipif(_HMEM_WHY is not None, reason=str(_HMEM_WHY))
def test_gpu_hmem_window_two_ranks_bit_identical():
    """Device window registered with FI_HMEM_CUDA (no host staging): bit-identical to torch."""
    _run_compare(2, CASES_2[:2] + CASES_2[4:],
                 [{"provider": HMEM_PROVIDER, "num_channels": 2, "timeout_s": 30, "hmem": "cuda"},
                  {"provider": HMEM_PROVIDER, "num_channels": 2, "timeout_s": 30, "hmem": "cuda",
                   "producer": "torch", "chunk_bytes": 512}],
                 env={"EFA_EP_TEST_DEVICE": "cuda"},
                 base_env=LOOPBACK if HMEM_PROVIDER == "tcp" else SHM_ENV)


def _hmem_auto_falls_back(rank, world):
    import warnings

    from efa_ep.kernels import create_transport

    from efa_ep.kernels.proxy import options as proxy_options

    proxy_options.HMEM_AUTO_PROVIDERS = ("shm",)  # make 'auto' try the device window over shm
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = create_transport("proxy", None, 8, 32, 16, torch.float32, provider="shm")
    mode = t.hmem
    x = torch.randn(16, 32, device="cuda")
    idx = torch.randint(0, 8, (16, 2), device="cuda")
    out = t.dispatch(x, idx, torch.ones(16, 2, device="cuda"))
    y = t.combine(out[0], out[4])
    t.close()
    return mode, [str(w.message) for w in caught], y.shape[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_hmem_auto_uses_host_window_when_registration_fails():
    """hmem='auto' picked a device window but this libfabric cannot register it (Debian's build
    has no CUDA): the transport warns, names the failed call and runs host-staged. With a
    CUDA-enabled libfabric the device window starts and no warning is given."""
    out = run_ranks(_hmem_auto_falls_back, 2, (), timeout_s=120, env=SHM_ENV)
    for mode, msgs, rows in out:
        assert rows == 16
        if mode == "off":
            assert any("fi_mr_regattr" in m and "host window" in m for m in msgs), msgs
        else:
            assert mode == "cuda" and not msgs, (mode, msgs)
