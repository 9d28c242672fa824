def get_runtime_env_for_policy_worker(name):
    return {"fake_runtime_env_for": name}
