"""The TPU decode megakernel (issue 5): its static plan, the weight stream and the paged-attention
tile loop. Each kernel has a pure-jnp twin and runs in Pallas TPU interpret mode on CPU."""
