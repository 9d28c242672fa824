def get_next_experiment_dir(log_dir):
    return log_dir.rstrip("/") + "/exp_001"
