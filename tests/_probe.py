"""What the tuning probes (ll_probe.py, dispatch_probe.py) share: running one body per config variant."""
import torch


def sweep_configs(config_cls, variants, hidden, body, world=1):
    """For each variant (a dict of fields over config_cls.for_device(cuda, hidden, world)), make
    config_cls.for_device return that config while body(variant) runs, and print what body returns; a variant
    that raises prints its error and the sweep goes on. body returns False to stop the sweep, "" or None to
    print nothing."""
    default = config_cls.for_device
    try:
        for over in variants:
            try:
                cfg = config_cls(**{**default(torch.device("cuda"), hidden, world).__dict__, **over})
                config_cls.for_device = staticmethod(lambda device, hidden, world=1, cfg=cfg: cfg)
                line = body(over)
            except Exception as err:  # keep sweeping
                line = f"{str(over):55s} failed: {type(err).__name__}: {str(err)[:200]}"
            finally:
                config_cls.for_device = default
            if line is False:
                return
            if line:  # (ranks other than 0 of a multi-rank probe return "" or None)
                print(line, flush=True)
    finally:
        config_cls.for_device = default


def routed_tokens(tokens, hidden, experts, topk, seed=0):
    """(x [T, H] bf16, topk_idx [T, K], topk_weights [T, K] float32) on the GPU, random top-k routing."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    idx = torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1).indices
    w = torch.softmax(torch.randn(tokens, topk, device="cuda", generator=gen), dim=1)
    return x, idx, w
