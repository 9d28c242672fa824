def get_tokenizer(cfg):
    return ("fake-tokenizer", cfg["name"])
