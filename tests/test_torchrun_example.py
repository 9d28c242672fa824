"""scripts/torchrun_moe_example.py under torchrun (CPU, gloo, EP 2): its usage line's command
prints the two ranks' result lines, not Megatron-Core's known warnings."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "torchrun_moe_example.py")


def test_usage_line_documents_omp_num_threads():
    with open(SCRIPT) as f:
        doc = f.read()
    assert "OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/torchrun_moe_example.py" in doc


def test_prints_its_result_lines_and_at_most_one_other(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFA_EP_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("PYTHONWARNINGS", None)
    # --standalone: a free rendezvous port (tests may run side by side); same output otherwise
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", SCRIPT], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=600)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert out.returncode == 0, "\n".join(lines)
    results = sorted(ln for ln in lines if ln.startswith("rank "))
    assert [r.split(":")[0] for r in results] == ["rank 0", "rank 1"], lines
    assert all(r.endswith("dispatcher EfaTokenDispatcher") for r in results), results
    assert len(lines) - len(results) <= 1, lines
