"""Speculative decoding: proposers (n-gram lookup, the DSpark block drafter), on-device acceptance,
and the drafter's self-distillation training. The only engine package besides the runner,
cache and sampler that touches jax."""
