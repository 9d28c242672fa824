"""Checks of a GRPO run before any rank starts, and the environment its ranks get."""
from __future__ import annotations

import contextlib
import os

from .config import TrainerConfig
from .task import VOCAB_SIZE, make_task


@contextlib.contextmanager
def _sigint_held_back():
    """SIGINT blocked on this thread meanwhile, delivered (to Python's handler) afterwards.
    For the transport probe: loading libfabric installs a SIGINT handler that ends the process
    with status 1 and no message; the probe puts Python's handler back when it is done, and a
    Ctrl-C that came in between then reaches it instead of libfabric's."""
    import signal

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)



def rank_env(cfg: TrainerConfig, environ=None):
    """What the ranks will see: ``(env, names)`` where ``env`` is the variables the launcher
    sets on top of ``environ`` (default ``os.environ``) and ``names`` maps each ``EFA_EP_*``
    variable the recipe set to its recipe key (for messages)."""
    from efa_ep.dispatcher.settings import raw

    env = dict(cfg.efa_ep.transport.env())
    names = {var: f"efa_ep.transport.{key}" for var, key in (
        ("EFA_EP_TRANSPORT", "transport"), ("EFA_EP_MAX_TOKENS_PER_RANK", "max_tokens_per_rank"),
        ("EFA_EP_TRANSPORT_OPTIONS", "transport_options")) if var in env}
    env.setdefault("OMP_NUM_THREADS", str(cfg.efa_ep.num_threads))
    transport = raw("EFA_EP_TRANSPORT", environ)
    if transport is not None and cfg.efa_ep.transport.transport == "auto":
        # the recipe's default leaves the choice to the environment
        env["EFA_EP_TRANSPORT"] = transport
        names.pop("EFA_EP_TRANSPORT", None)
    return env, names


def check_task_fits(cfg: TrainerConfig) -> None:
    """The task's prompts and answers fit the model and the generation settings."""
    task = make_task(cfg.efa_ep.task)
    model_cfg, pol = cfg.efa_ep.model, cfg.policy
    gen_cfg = pol.generation
    if model_cfg.vocab_size < VOCAB_SIZE:
        raise ValueError(f"efa_ep.model.vocab_size={model_cfg.vocab_size} < task vocab {VOCAB_SIZE}")
    total_len = task.prompt_len + gen_cfg.max_new_tokens
    if total_len > min(pol.max_total_sequence_length, model_cfg.seq_length):
        raise ValueError(f"prompt ({task.prompt_len}) + policy.generation.max_new_tokens "
                         f"({gen_cfg.max_new_tokens}) = {total_len} exceeds "
                         f"policy.max_total_sequence_length / efa_ep.model.seq_length")
    if gen_cfg.max_new_tokens < task.max_answer_len:
        raise ValueError(f"policy.generation.max_new_tokens={gen_cfg.max_new_tokens} < longest "
                         f"answer + <eos> ({task.max_answer_len})")


def check_before_start(cfg: TrainerConfig, environ=None) -> None:
    """Everything the ranks will read, checked here first (seconds, one error): the dispatcher
    settings from the recipe and the ``EFA_EP_*`` environment against the transport's schema,
    and that the transport runs on this machine.

    Raises:
        ValueError / ConfigError: naming the recipe key or environment variable.
    """
    check_task_fits(cfg)
    if cfg.policy.megatron_cfg.moe_token_dispatcher_type != "efa":
        return
    from efa_ep.dispatcher.settings import check_environment

    environ = os.environ if environ is None else environ
    env, names = rank_env(cfg, environ)
    with _sigint_held_back():
        check_environment({**environ, **env}, names)
