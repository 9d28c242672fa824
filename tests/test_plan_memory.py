"""Window memory per rank (``efa_ep.kernels.memory``, ``efa-ep-plan memory``): against the
layouts' closed forms, against a real proxy transport's window, and the CLI."""
import json

import pytest
import torch

from efa_ep.distributed import run_ranks
from efa_ep.kernels.memory import gda_window_bytes, proxy_window_bytes, window_bytes
from efa_ep.tools.plan.memory import main as memory_main

DS = dict(hidden=7168, dtype=torch.bfloat16, max_tokens_per_rank=4096, num_experts=256)


def test_gda_and_proxy_windows_match_their_closed_forms():
    for w in (2, 4, 8):
        # gda: two parities x (W sources x T_MAX rows x (row + 8-byte id + 4-byte weight per
        # slot) + W count headers of 2 + L int64 + the compact dispatch's board: [W, W] counts,
        # [W] first rows, [W, 2 + L] announced headers, int64), each region 256-byte aligned
        hdr = 2 + 256 // w
        want = 2 * (w * 4096 * (7168 * 2 + 12 * 16) + w * hdr * 8 + ((w + 1) * w + w * hdr) * 8)
        got = window_bytes("gda", world=w, **DS)
        assert want <= got <= want + 2 * 5 * 256, (w, got, want)
        # proxy: send slots + receive regions, each W x T_MAX rows of row_cap, plus headers
        want = 2 * w * 4096 * (7168 * 2 + 16 * 8)
        got = window_bytes("proxy", world=w, **DS)
        assert want <= got <= want + 4 * w * 4096, (w, got, want)
    # linear in T_MAX; drop-and-pad sizing (max_topk = experts) costs more
    assert window_bytes("gda", world=4, **dict(DS, max_tokens_per_rank=2048)) * 2 == pytest.approx(
        window_bytes("gda", world=4, **DS), rel=1e-4)
    assert window_bytes("proxy", world=8, max_topk=256, **DS) > window_bytes("proxy", world=8, **DS)


def test_hier_is_the_sum_of_its_stages():
    # EP 16 as 2 nodes of 8: aggregated = proxy over the rail (2 ranks) + gda over the node
    # forwarding 2 sources' rows; direct = proxy over all 16 + gda over the node
    agg = window_bytes("hier", world=16, node_size=8, **DS)
    assert agg == (proxy_window_bytes(world=2, hidden=7168, dtype=torch.bfloat16,
                                      max_tokens_per_rank=4096, num_experts=256)
                   + gda_window_bytes(world=8, hidden=7168, dtype=torch.bfloat16,
                                      max_tokens_per_rank=8192, num_experts=128))
    direct = window_bytes("hier", world=16, node_size=8, aggregate=0, **DS)
    assert direct == window_bytes("proxy", world=16, **DS) + gda_window_bytes(
        world=8, hidden=7168, dtype=torch.bfloat16, max_tokens_per_rank=4096, num_experts=128)
    # one node: no network window, the local stage alone
    assert window_bytes("hier", world=8, node_size=8, **DS) == window_bytes("gda", world=8, **DS)
    assert window_bytes("torch", world=8, **DS) == 0
    with pytest.raises(ValueError, match="node_size=3 does not divide world=16"):
        window_bytes("hier", world=16, node_size=3, **DS)
    with pytest.raises(ValueError, match="unknown transport 'nccl'"):
        window_bytes("nccl", world=2, **DS)


def _proxy_window(rank, world):
    from efa_ep.kernels import create_transport

    t = create_transport("proxy", None, 8, 64, 48, torch.bfloat16, provider="tcp", timeout_s=30)
    try:
        return t.window_bytes
    finally:
        t.close()


def test_a_real_proxy_window_has_the_computed_size():
    got = run_ranks(_proxy_window, 2, (), timeout_s=120,
                    env={"FI_TCP_IFACE": "lo", "FI_PROVIDER": "tcp", "OMP_NUM_THREADS": "1"})
    want = window_bytes("proxy", world=2, hidden=64, dtype=torch.bfloat16,
                        max_tokens_per_rank=48, num_experts=8)
    assert got == [want, want]


def test_plan_memory_cli(tmp_path, capsys):
    out = tmp_path / "mem.json"
    assert memory_main(["--ep", "8,16", "--max-tokens-per-rank", "1024", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| deepseek_v3 | 16 | - |" in text  # gda does not span hosts
    rows = json.loads(out.read_text())
    by = {(r["shape"], r["ep"], r["transport"]): r["bytes"] for r in rows}
    assert by[("deepseek_v3", 8, "gda")] == window_bytes("gda", world=8, **dict(DS, max_tokens_per_rank=1024))
    assert by[("deepseek_v3", 16, "hier:agg1")] < by[("deepseek_v3", 16, "hier:agg0")]
    assert memory_main(["--max-tokens-per-rank", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
