"""Checks shared by the test tiers: hooks that read what a model computes without attngeom."""


def o_proj_inputs(adapter, run, tokens: int):
    """Run ``run()`` and return, by attention layer, the input ``[B, T, H*d]`` of the module the
    adapter found as that layer's output projection, whatever it is called (its first call with
    ``tokens`` positions: reads of the projection as an affine map, ``adapter.Projection``, have
    other shapes)."""
    seen, hooks = {}, []

    def hook(layer):
        def record(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            if x.shape[-2] == tokens:
                seen.setdefault(layer, x.detach().clone())
        return record

    for layer in range(adapter.num_layers):
        hooks.append(adapter.o_proj(layer).register_forward_pre_hook(hook(layer), with_kwargs=True))
    try:
        out = run()
    finally:
        for h in hooks:
            h.remove()
    return seen, out
