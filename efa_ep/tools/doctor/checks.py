"""The doctor's checks: each judges one fact of this host (:class:`Host`, gathered by
:func:`gather_host` from :mod:`.probes`) against what efa-ep supports and what the user's layout
(:class:`Layout`) needs, as one :class:`Check` line: ``ok``, ``warn``, ``fail`` or ``skip``, with
the fix. ``skip`` means the probe cannot run here (no GPU, no EFA device) and says why.

What is supported comes from ``pyproject.toml`` and the README: Python >= 3.10 (megatron-core
0.19 declares >= 3.12 and runs on 3.11), torch >= 2.6, triton >= 3.2 (``gda``), megatron-core
>= 0.19, < 0.20.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import probes

STATUSES = ("ok", "warn", "fail", "skip")
PROVIDERS = ("efa", "tcp", "shm")
SUPPORTED = {"python": (3, 10), "torch": (2, 6), "triton": (3, 2), "megatron-core": ((0, 19), (0, 20))}
MEGATRON_PIN = "megatron-core==0.19.2"


@dataclasses.dataclass
class Check:
    """One line of the doctor's report.

    Attributes:
        name: what was checked (``python``, ``provider efa``, ``selftest proxy:tcp``).
        status: ``ok`` | ``warn`` | ``fail`` | ``skip``.
        detail: what was found (one line).
        fix: what to do about a ``warn``/``fail`` (one line; empty when nothing to do).
        data: the facts behind it, for ``--json``.
    """

    name: str
    status: str
    detail: str
    fix: str = ""
    data: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r} must be one of {STATUSES}")

    def line(self) -> str:
        return f"{self.status:<4}  {self.name:<18} {self.detail}" + (f"  -> fix: {self.fix}" if self.fix else "")

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix,
                "data": self.data}


@dataclasses.dataclass(frozen=True)
class Layout:
    """The job the verdict is for: ``nodes`` x ``gpus_per_node``, expert-parallel size ``ep``."""

    nodes: int
    gpus_per_node: int
    ep: int

    @property
    def ranks_per_host(self) -> int:
        """Ranks of one EP group on one host (the group is laid out node-contiguously)."""
        return min(self.ep, self.gpus_per_node)

    @property
    def spans_nodes(self) -> bool:
        return self.ep > self.gpus_per_node

    @property
    def group_nodes(self) -> int:
        """Nodes one EP group spans."""
        return max(1, self.ep // self.gpus_per_node)


@dataclasses.dataclass
class Host:
    """Everything the checks read, as plain data (tests build one by hand)."""

    python: str
    versions: Dict[str, Optional[str]]
    torch_cuda: Optional[str]
    gpus: int
    gpu_name: Optional[str]
    topology: Optional[Dict[str, Any]]
    mps: bool
    symm_mem: Optional[str]
    native: Dict[str, Any]
    libfabric: Dict[str, Any]
    providers: Dict[str, Optional[str]]
    hmem: Dict[str, Optional[str]]
    efa_devices: List[str]
    cpus: int
    channels: Dict[str, Any]
    transports: Dict[str, Optional[str]]
    settings: Dict[str, Any] = dataclasses.field(default_factory=lambda: {
        "transport": "auto", "options": {}, "fallback": None, "error": None, "hint": None})

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def gather_host() -> Host:
    """Reads this machine through :mod:`.probes` (loads the native library, hence libfabric)."""
    g = probes.gpus()
    native = probes.native_library()
    loaded = native["problem"] is None
    providers = {p: (probes.provider(p) if loaded else f"not probed: {native['problem']}")
                 for p in PROVIDERS}
    hmem: Dict[str, Optional[str]] = {}
    if g["count"] and loaded:
        for p in ("efa", "shm"):
            if providers[p] is None:
                hmem[p] = probes.provider(p, hmem=True)
    return Host(
        python=probes.python_version(),
        versions={n: probes.dist_version(n) for n in ("torch", "triton", "megatron-core")},
        torch_cuda=probes.torch_cuda_build(), gpus=int(g["count"]), gpu_name=g["name"],
        topology=probes.nvlink_topology(int(g["count"])), mps=bool(probes.mps_running()),
        symm_mem=probes.symmetric_memory(), native=native, libfabric=probes.libfabric(),
        providers=providers, hmem=hmem, efa_devices=probes.efa_devices(), cpus=probes.cpus(),
        channels=probes.proxy_channels(), transports=probes.transports(), settings=probes.settings())


def version_tuple(text: Optional[str]) -> Tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; leading numeric parts only."""
    out = []
    for part in re.split(r"[.+-]", text or ""):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def _short(why: Optional[str], limit: int = 160) -> str:
    """The first clause of a probe's reason (before ``; ``), at most ``limit`` characters."""
    text = " ".join(str(why or "").split()).split("; ")[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Versions
# ----------------------------------------------------------------------------------------------
def check_python(h: Host, lay: Layout) -> Check:
    v = version_tuple(h.python)
    data = {"version": h.python, "requires": ">=3.10"}
    if v < SUPPORTED["python"]:
        return Check("python", "fail", f"{h.python}: efa-ep requires >= 3.10", "use Python 3.11 or newer", data)
    if v[:2] == (3, 10):
        return Check("python", "warn", f"{h.python}: allowed by efa-ep, but megatron-core 0.19 declares >= 3.12 "
                     "and efa-ep is tested on 3.11", "use Python 3.11 or newer", data)
    return Check("python", "ok", f"{h.python} (efa-ep >= 3.10; megatron-core 0.19 declares >= 3.12, runs on 3.11)",
                 data=data)


def check_torch(h: Host, lay: Layout) -> Check:
    v = h.versions.get("torch")
    data = {"version": v, "cuda_build": h.torch_cuda, "requires": ">=2.6"}
    build = f"CUDA {h.torch_cuda} build" if h.torch_cuda else "CPU build"
    if v is None:
        return Check("torch", "fail", "not installed", "pip install 'torch>=2.6'", data)
    if version_tuple(v) < SUPPORTED["torch"]:
        return Check("torch", "fail", f"{v}: efa-ep requires >= 2.6", "pip install -U 'torch>=2.6'", data)
    if h.gpus and not h.torch_cuda:
        return Check("torch", "fail", f"{v} ({build}) on a host with GPUs", "install a CUDA build of torch", data)
    return Check("torch", "ok", f"{v} ({build}; efa-ep >= 2.6)", data=data)


def check_triton(h: Host, lay: Layout) -> Check:
    v = h.versions.get("triton")
    data = {"version": v, "requires": ">=3.2"}
    if v is None:
        if not h.gpus:
            return Check("triton", "skip", "not installed; only gda's kernels need it, and gda needs a GPU "
                         "(none here)", data=data)
        return Check("triton", "fail", "not installed: gda (the one-node transport) cannot run",
                     "pip install 'efa-ep[gpu]' (triton>=3.2)", data)
    if version_tuple(v) < SUPPORTED["triton"]:
        return Check("triton", "fail" if h.gpus else "warn", f"{v}: gda needs >= 3.2",
                     "pip install -U 'triton>=3.2'", data)
    return Check("triton", "ok", f"{v} (>= 3.2; gda's kernels" + (")" if h.gpus else ", on a GPU: none here)"),
                 data=data)


def check_megatron(h: Host, lay: Layout) -> Check:
    v = h.versions.get("megatron-core")
    lo, hi = SUPPORTED["megatron-core"]
    data = {"version": v, "requires": ">=0.19,<0.20"}
    fix = f"pip install --ignore-requires-python {MEGATRON_PIN}"
    if v is None:
        return Check("megatron-core", "fail", "not installed: the efa dispatcher plugs into Megatron-Core's "
                     "MoELayer", fix, data)
    if not lo <= version_tuple(v)[:2] < hi:
        return Check("megatron-core", "warn", f"{v}: efa-ep is built and tested against >= 0.19, < 0.20", fix, data)
    return Check("megatron-core", "ok", f"{v} (>= 0.19, < 0.20)", data=data)


# ----------------------------------------------------------------------------------------------
# GPUs
# ----------------------------------------------------------------------------------------------
def check_gpus(h: Host, lay: Layout) -> Check:
    data = {"count": h.gpus, "name": h.gpu_name, "gpus_per_node": lay.gpus_per_node}
    if not h.gpus:
        return Check("gpus", "skip", "no CUDA GPU visible (torch.cuda.is_available() is False): the NVLink, "
                     "MPS, symmetric-memory and FI_HMEM checks and gda's self-test skip", data=data)
    if h.gpus < lay.gpus_per_node:
        return Check("gpus", "warn", f"{h.gpus} x {h.gpu_name} visible; the layout says {lay.gpus_per_node} per node",
                     f"set gpus_per_node={h.gpus}, or check CUDA_VISIBLE_DEVICES", data)
    return Check("gpus", "ok", f"{h.gpus} x {h.gpu_name} (layout: {lay.gpus_per_node} per node)", data=data)


def check_nvlink(h: Host, lay: Layout) -> Check:
    topo = h.topology or {}
    data = dict(topo)
    if not h.gpus:
        return Check("nvlink", "skip", "no GPU", data=data)
    if h.gpus < 2:
        return Check("nvlink", "skip", "one GPU: no GPU pairs (ranks sharing it store through its own memory)",
                     data=data)
    pairs = topo.get("pairs") or {}
    if not pairs:
        return Check("nvlink", "skip", "neither nvidia-smi topo -m nor torch's peer access gave the GPU pairs",
                     data=data)
    src = topo.get("source", "?")
    if src.startswith("nvidia-smi"):
        bad = {p: v for p, v in pairs.items() if not v.startswith("NV")}
        kinds = sorted({v for v in pairs.values() if v.startswith("NV")})
        if not bad:
            return Check("nvlink", "ok", f"all {len(pairs)} pairs of {h.gpus} GPUs over NVLink "
                         f"({', '.join(kinds)}; {src})", data=data)
        listed = ", ".join(f"{p} {v}" for p, v in list(bad.items())[:6]) + (" ..." if len(bad) > 6 else "")
        return Check("nvlink", "warn", f"{len(bad)} of {len(pairs)} GPU pairs without NVLink: {listed} ({src})",
                     "gda stores cross whatever link joins two GPUs: without NVLink expect PCIe rates; check "
                     "the instance type and the fabric manager (nvidia-fabricmanager)", data)
    bad = [p for p, v in pairs.items() if v != "peer"]
    if bad:
        return Check("nvlink", "warn", f"no peer access between GPUs {', '.join(bad[:6])} ({src}; nvidia-smi absent, "
                     "link types unknown)", "gda needs peer access between the GPUs of a node", data)
    return Check("nvlink", "ok", f"peer access between all {len(pairs)} pairs ({src}; nvidia-smi absent, so the "
                 "link type is unknown)", data=data)


def ranks_per_gpu(h: Host, lay: Layout) -> int:
    """Ranks of the layout that share one of this host's GPUs (1: one GPU each)."""
    return math.ceil(lay.ranks_per_host / h.gpus) if h.gpus else 0


def check_mps(h: Host, lay: Layout) -> Check:
    share = ranks_per_gpu(h, lay)
    data = {"running": h.mps, "ranks_per_gpu": share}
    if not h.gpus:
        return Check("mps", "skip", "no GPU", data=data)
    if share <= 1:
        return Check("mps", "ok", f"not needed: one rank per GPU ({lay.ranks_per_host} ranks, {h.gpus} GPUs); "
                     f"MPS {'running' if h.mps else 'off'}", data=data)
    if h.mps:
        return Check("mps", "ok", f"running; {share} ranks share each GPU", data=data)
    return Check("mps", "fail", f"{share} ranks share each GPU and no MPS daemon runs: one rank's spinning "
                 "gda wait can keep a peer's kernels off the GPU", "nvidia-cuda-mps-control -d (with "
                 "CUDA_MPS_PIPE_DIRECTORY set for every rank), or one rank per GPU", data)


def check_symm_mem(h: Host, lay: Layout) -> Check:
    data = {"importable": h.symm_mem is None, "why": h.symm_mem}
    if not h.gpus:
        return Check("symmetric memory", "skip", ("importable" if h.symm_mem is None else
                     f"not importable ({_short(h.symm_mem)})") + "; no GPU to allocate it on", data=data)
    if h.symm_mem is not None:
        return Check("symmetric memory", "fail", f"torch.distributed._symmetric_memory does not import: "
                     f"{_short(h.symm_mem)}", "gda needs torch >= 2.6 built with CUDA", data)
    return Check("symmetric memory", "ok", "importable; allocation and rendezvous: see gda's self-test",
                 data=data)


def update_symm_mem(check: Check, gda: Optional[Check]) -> Check:
    """The symmetric-memory line once gda's self-test ran: gda allocates its windows there and
    rendezvouses over the group, so its outcome says whether symmetric memory is usable."""
    if check.status != "ok" or gda is None:
        return check
    if gda.status == "ok":
        return dataclasses.replace(check, detail="importable; allocated and rendezvoused by gda's self-test")
    if gda.status == "fail":
        return dataclasses.replace(check, status="fail", detail=f"importable, but gda's self-test failed: "
                                   f"{gda.detail}", fix=gda.fix)
    return dataclasses.replace(check, detail=f"importable; not allocated: gda's self-test skipped ({gda.detail})")


# ----------------------------------------------------------------------------------------------
# libfabric and the native proxy
# ----------------------------------------------------------------------------------------------
def check_libfabric(h: Host, lay: Layout) -> Check:
    lf = h.libfabric
    data = dict(lf)
    path, version, source = lf.get("path"), lf.get("version"), lf.get("source")
    need = "fail" if lay.spans_nodes else "warn"
    install = ("apt-get install libfabric-dev (tcp, shm); on AWS the EFA installer (/opt/amazon/efa), whose "
               "libfabric has the efa provider built with CUDA")
    if not path:
        return Check("libfabric", need, "not found: the proxy (the transport across nodes) cannot run", install, data)
    if version and version_tuple(version) < (1, 9):
        return Check("libfabric", "fail", f"{version} at {path}: the proxy needs API >= 1.9", install, data)
    how = "loaded by the proxy's native library" if lf.get("loaded") else (
        f"found, not loaded ({_short(h.native.get('problem'), 80) or 'native library not loaded'})")
    fi = f"; fi_info on PATH: {lf['fi_info']}" if lf.get("fi_info") else ""
    detail = f"{version or '?'} at {path} ({source}; {how}{fi})"
    if h.efa_devices and source != "efa installer":
        return Check("libfabric", "warn", detail + ": not the EFA installer's on a host with EFA devices",
                     "use the AWS EFA installer's libfabric (/opt/amazon/efa, found by default; "
                     "EFA_EP_FI_LIB / EFA_EP_FI_INCLUDE select another)", data)
    return Check("libfabric", "ok", detail, data=data)


def check_provider(name: str) -> Callable[[Host, Layout], Check]:
    """The check of libfabric provider ``name`` (efa, tcp or shm)."""
    def check(h: Host, lay: Layout) -> Check:
        why = h.providers.get(name)
        data = {"usable": why is None, "why": why}
        label = f"provider {name}"
        if h.native.get("problem"):
            return Check(label, "skip", "cannot probe: the native library is not loaded "
                         f"({_short(h.native['problem'], 100)})", data=data)
        if why is None:
            use = {"efa": "the proxy's default provider here (AWS EFA)",
                   "tcp": "the proxy's fallback without efa (sockets)",
                   "shm": "same-host transfers (tests, benchmarks)"}[name]
            return Check(label, "ok", f"usable: RDM + RMA + remote CQ data; {use}", data=data)
        if name == "efa":
            if h.efa_devices:
                return Check(label, "fail", f"{len(h.efa_devices)} EFA device(s) but the efa provider is unusable: "
                             f"{_short(why)}", "install the AWS EFA installer's libfabric (fi_info -p efa lists it)",
                             data)
            if lay.spans_nodes:
                return Check(label, "warn", f"unusable, no EFA device here: across nodes the proxy would run "
                             f"over tcp ({_short(why, 110)})", "run on EFA-enabled instances (p5, p5en, p6) for "
                             "efa", data)
            return Check(label, "skip", f"no EFA device on this host ({_short(why, 110)})", data=data)
        fix = ("set FI_TCP_IFACE to the interface the ranks use (e.g. lo, eth0)" if name == "tcp"
               else "shm is part of every libfabric build; check fi_info -p shm")
        return Check(label, "warn", f"unusable: {_short(why)}", fix, data)
    check.__name__ = f"check_provider_{name}"
    return check


def check_hmem(h: Host, lay: Layout) -> Check:
    data = {"probed": dict(h.hmem)}
    if not h.gpus:
        return Check("fi_hmem cuda", "skip", "no GPU: the proxy's window lives in host memory (hmem=off)", data=data)
    if h.native.get("problem"):
        return Check("fi_hmem cuda", "skip", "cannot probe: the native library is not loaded", data=data)
    if not h.hmem:
        return Check("fi_hmem cuda", "skip", "neither efa nor shm is usable to probe FI_HMEM on", data=data)
    ok = [p for p, why in h.hmem.items() if why is None]
    if "efa" in ok:
        return Check("fi_hmem cuda", "ok", "efa registers CUDA memory: hmem=auto puts the proxy's window in GPU "
                     "memory (GPUDirect RDMA)", data=data)
    probed = ", ".join(h.hmem)
    detail = (f"{probed}: no FI_HMEM for CUDA memory ({_short(next(iter(h.hmem.values())), 100)}): the proxy "
              "stages rows through host memory" if not ok else
              f"only {', '.join(ok)} registers CUDA memory: over efa the proxy stages rows through host memory")
    return Check("fi_hmem cuda", "warn", detail, "the AWS EFA installer's libfabric is built with CUDA "
                 "(Debian's 1.17 is not)", data)


def check_efa_devices(h: Host, lay: Layout) -> Check:
    n = len(h.efa_devices)
    data = {"devices": list(h.efa_devices), "per_gpu": (n / h.gpus) if h.gpus else None}
    if not n:
        return Check("efa devices", "skip", "none (no device of the efa driver under /sys/class/infiniband)",
                     data=data)
    names = ", ".join(h.efa_devices[:4]) + (" ..." if n > 4 else "")
    if h.gpus and n < h.gpus:
        return Check("efa devices", "warn", f"{n} ({names}) for {h.gpus} GPUs: fewer than one per GPU",
                     "check the instance type's EFA count (p5en: 16, p5: 32, p6-b200: 8)", data)
    per = f", {n / h.gpus:g} per GPU" if h.gpus else " (no GPU visible)"
    return Check("efa devices", "ok", f"{n} ({names}){per}", data=data)


def check_nic_spread(h: Host, lay: Layout) -> Check:
    n = len(h.efa_devices)
    ch = int(h.channels.get("value") or 1)
    data = {"devices": n, "channels_per_rank": ch, "ranks_per_host": lay.ranks_per_host}
    if not n:
        return Check("proxy nic spread", "skip", "no EFA device", data=data)
    if n == 1:
        return Check("proxy nic spread", "ok", f"one EFA device: every channel of the {lay.ranks_per_host} ranks "
                     "per host uses it", data=data)
    return Check("proxy nic spread", "warn", f"{n} EFA devices, but every proxy channel of every rank opens the "
                 f"first device fi_getinfo lists ({h.efa_devices[0]}; kernels/native/efa_endpoint.c efa_get_info): "
                 f"{lay.ranks_per_host} ranks x {ch} channels share one NIC", "nothing to set in efa-ep yet; "
                 "the planner's wire term assumes the node's whole EFA bandwidth, so its proxy/hier figures "
                 "are optimistic where the wire bounds them", data)


def check_cpu_cores(h: Host, lay: Layout) -> Check:
    ch = int(h.channels.get("value") or 1)
    r = lay.ranks_per_host
    need = r * (ch + 1)
    data = {"cpus": h.cpus, "ranks_per_host": r, "channels": ch, "channels_source": h.channels.get("source"),
            "threads": need, "cpu_base": h.channels.get("cpu_base")}
    head = (f"{h.cpus} CPUs ({h.cpus / r:.3g} per rank) for {r} ranks x ({ch} proxy channels "
            f"[{h.channels.get('source')}] + 1 rank thread) = {need} busy threads")
    base = h.channels.get("cpu_base")
    if base is not None:
        return Check("cpu cores", "warn", head + f"; EFA_EP_PROXY_CPU_BASE={base} pins channel c of every rank "
                     f"to CPU {base}+c, so the {r} ranks of a host share CPUs {base}..{base + ch - 1}",
                     "unset EFA_EP_PROXY_CPU_BASE when several ranks share a host", data)
    if h.cpus >= need:
        return Check("cpu cores", "ok", head, data=data)
    fit = max(1, h.cpus // max(1, r) - 1)
    return Check("cpu cores", "warn", head + ": the channels' spinning threads share cores, ops get slower",
                 f"EFA_EP_PROXY_CHANNELS={fit} (fits {h.cpus} CPUs), or a host with >= {need} CPUs", data)


def check_native(h: Host, lay: Layout) -> Check:
    nat = h.native
    data = dict(nat)
    problem, path = nat.get("problem"), nat.get("path")
    if problem and "ABI version" in problem:
        return Check("native library", "fail", f"{path}: ABI {nat.get('abi')}, this efa-ep expects "
                     f"{nat.get('expected_abi')}", "rebuild it (unset EFA_EP_PROXY_SO, or rebuild that file "
                     "from kernels/native/)", data)
    if problem:
        status = "fail" if lay.spans_nodes else "warn"
        return Check("native library", status, f"cannot be built or loaded: {_short(problem)}",
                     "apt-get install gcc libfabric-dev (on AWS: the EFA installer), or set EFA_EP_PROXY_SO to "
                     "a prebuilt libefa_proxy.so", data)
    abi = f"ABI {nat.get('abi')} (expects {nat.get('expected_abi')})"
    if nat.get("prebuilt"):
        return Check("native library", "ok", f"prebuilt {path} (EFA_EP_PROXY_SO), {abi}", data=data)
    if nat.get("built"):
        return Check("native library", "ok", f"built: {path}, {abi}", data=data)
    return Check("native library", "warn", f"not built yet: the first proxy run compiles it into "
                 f"{nat.get('expected_path') or 'the cache'} (the doctor built a throwaway copy in "
                 f"{load_s(nat)}), {abi}", "nothing to do; or build it once per image: python3 -c 'from "
                 "efa_ep.kernels.proxy import native; native.build()'", data)


def load_s(nat: Dict[str, Any]) -> str:
    return f"{nat['load_s']:.1f} s" if nat.get("load_s") is not None else "?"


def check_settings(h: Host, lay: Layout) -> Check:
    st = h.settings
    data = dict(st)
    if st.get("error"):
        return Check("efa_ep settings", "fail", st["error"], st.get("hint") or "see README 'Use it in Megatron-Core'",
                     data)
    opts = ",".join(f"{k}={v}" for k, v in sorted(st.get("options", {}).items()))
    fb = ("EFA_EP_FALLBACK=alltoall: a transport that cannot run on some rank makes every rank use "
          "Megatron's alltoall" if st.get("fallback") else
          "EFA_EP_FALLBACK unset: a transport that cannot run raises one line on every rank")
    return Check("efa_ep settings", "ok", f"EFA_EP_TRANSPORT={st.get('transport')}"
                 + (f" ({opts})" if opts else "") + f"; {fb}", data=data)


CHECKS: List[Callable[[Host, Layout], Check]] = [
    check_python, check_torch, check_triton, check_megatron,
    check_gpus, check_nvlink, check_mps, check_symm_mem,
    check_libfabric, *(check_provider(p) for p in PROVIDERS), check_hmem,
    check_efa_devices, check_nic_spread, check_cpu_cores, check_native, check_settings,
]


def run_checks(h: Host, lay: Layout) -> List[Check]:
    """Every check of :data:`CHECKS`, in order; a check that raises becomes a ``fail`` line
    naming the exception (the doctor never stops at a broken probe)."""
    out = []
    for fn in CHECKS:
        try:
            out.append(fn(h, lay))
        except Exception as e:
            name = fn.__name__.replace("check_", "").replace("_", " ")
            out.append(Check(name, "fail", f"the check itself failed: {type(e).__name__}: {e}",
                             "report this with the --json output"))
    return out
