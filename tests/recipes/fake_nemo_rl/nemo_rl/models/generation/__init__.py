def configure_generation_config(config, tokenizer, has_refit_draft_weights=False, trains_mtp=False):
    return dict(config, _configured=True)
