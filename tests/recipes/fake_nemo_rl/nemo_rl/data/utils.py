def setup_response_data(tokenizer, data_cfg, env_cfg):
    return "dataset", None, {"math": None}, {}
