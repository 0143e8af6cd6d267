"""Pallas TPU interpret mode for the kernel tests.

`InterpretParams`, never plain `interpret=True`: with `dma_execution_mode="on_wait"` a copy lands
only when its semaphore is waited on, and scratch starts as NaN (`uninitialized_memory="nan"`),
so a missing `.wait()` or a read of the wrong ring slot gives NaN or stale numbers instead of
silently right ones; `detect_races=True` runs the happens-before race detector over every VMEM /
HBM access and DMA. Reading its verdict uses a private module of JAX 0.10.2 (the documented way:
"`races.races_found` will be set to True").
"""

from jax.experimental.pallas import tpu as pltpu


def interpret_params() -> pltpu.InterpretParams:
    return pltpu.InterpretParams(dma_execution_mode="on_wait", uninitialized_memory="nan",
                                 detect_races=True, out_of_bounds_reads="raise")


def races_found() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.races is not None and interpret_pallas_call.races.races_found)
