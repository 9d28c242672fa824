"""FAKE Policy: resolves the worker class by its FQN in a fresh interpreter (the 'worker venv')
whose environment is policy.megatron_cfg.env_vars, as NeMo-RL's Ray workers get it."""
import json
import os
import subprocess
import sys
import tempfile

import nemo_rl
from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY

FAKE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_WORKER = r'''
import importlib, json, sys
fqn, cfg_path = sys.argv[1], sys.argv[2]
mod, name = fqn.rsplit(".", 1)
cls = getattr(importlib.import_module(mod), name)
worker = cls(json.load(open(cfg_path)), tokenizer=None, worker_sharding_annotations=None)
print("REPORT " + json.dumps({**worker.fake_report, "extension": worker.efa_ep_report(),
                              "remote_options": cls._fake_ray_remote_options}))
'''


class Policy:
    def __init__(self, cluster, config, tokenizer, name_prefix="lm_policy", workers_per_node=None,
                 init_optimizer=True, weights_path=None, optimizer_path=None,
                 init_reference_model=True, processor=None, worker_extension_cls_fqn=None,
                 skip_weight_load=False):
        fqn = worker_extension_cls_fqn or "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
        if fqn not in ACTOR_ENVIRONMENT_REGISTRY:
            raise ValueError(f"{fqn} is not in ACTOR_ENVIRONMENT_REGISTRY")
        env_vars = dict(config["megatron_cfg"].get("env_vars") or {})
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EFA_EP_", "PYTHONPATH"))}
        env.update({k: str(v) for k, v in env_vars.items()})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env_vars.get("PYTHONPATH"), FAKE_ROOT]))
        with tempfile.TemporaryDirectory() as tmp:
            cfg_path = os.path.join(tmp, "policy.json")
            with open(cfg_path, "w") as f:
                json.dump(config, f)
            out = subprocess.run([sys.executable, "-c", _WORKER, fqn, cfg_path], cwd=tmp, env=env,
                                 capture_output=True, text=True, timeout=240)
        if out.returncode != 0:
            raise RuntimeError(f"fake worker failed:\n{out.stdout}\n{out.stderr}")
        line = [l for l in out.stdout.splitlines() if l.startswith("REPORT ")][-1]
        self.worker_report = json.loads(line[len("REPORT "):])
        nemo_rl.CALLS.append(("Policy", {"worker_extension_cls_fqn": worker_extension_cls_fqn,
                                         "report": self.worker_report}))
