"""Key maps and the tree planner on their own: expert slices, conversions and every kind of bad
checkpoint, each reported by name before anything is read."""

from __future__ import annotations

import numpy as np
import pytest

from weld.models.common.checkpoint import Convert, KeyMap, split_rows
from weld.models.common.spec import WeightSpec
from weld.weights.tree import CheckpointError, fill_tree, plan_tensors

SPECS = {"moe": {"w_gate": WeightSpec((3, 4, 2), ("experts", "mlp", "embed")),
                 "w_up": WeightSpec((3, 4, 2), ("experts", "mlp", "embed"))},
         "norm": WeightSpec((2,), ("embed",))}
KEYS = KeyMap({"experts.{e}.gate": ("moe", "w_gate"), "experts.{e}.up": ("moe", "w_up"),
               "experts.gate_up": Convert(split_rows(1, 1), ("moe", "w_gate"), ("moe", "w_up")),
               "norm": ("norm",)}, ignore=("rotary.*",))


def per_expert(rng) -> dict[str, np.ndarray]:
    tensors = {f"experts.{e}.{n}": rng.standard_normal((4, 2)).astype(np.float32)
               for e in range(3) for n in ("gate", "up")}
    return tensors | {"norm": np.ones(2, np.float32), "rotary.inv_freq": np.zeros(1, np.float32)}


def load(tensors: dict[str, np.ndarray]) -> dict:
    specs = {"moe": dict(SPECS["moe"]), "norm": SPECS["norm"]}
    plan = plan_tensors("ckpt", {n: t.shape for n, t in tensors.items()}, KEYS, specs)
    return fill_tree("ckpt", plan, specs, None, np.dtype(np.float32), lambda n: (tensors[n], False),
                     lambda n: tensors[n].nbytes, False)


def test_experts_one_by_one_or_stacked_fill_the_same_leaves():
    rng = np.random.default_rng(0)
    tensors = per_expert(rng)
    one_by_one = load(tensors)
    gate = np.stack([tensors[f"experts.{e}.gate"] for e in range(3)])
    up = np.stack([tensors[f"experts.{e}.up"] for e in range(3)])
    stacked = load({"experts.gate_up": np.concatenate([gate, up], axis=1), "norm": tensors["norm"]})
    for tree in (one_by_one, stacked):
        np.testing.assert_array_equal(np.asarray(tree["moe"]["w_gate"]), gate)
        np.testing.assert_array_equal(np.asarray(tree["moe"]["w_up"]), up)


@pytest.mark.parametrize("change,needle", [
    (lambda t: t.pop("experts.1.up"), "missing tensors: experts.1.up (-> moe.w_up[1])"),
    (lambda t: t.update({"experts.3.up": np.zeros((4, 2), np.float32)}),
     "experts.3.up is expert 3, but moe.w_up holds 3"),
    (lambda t: t.update({"experts.gate_up": np.zeros((3, 8, 2), np.float32)}), "tensors mapped twice"),
    (lambda t: t.update({"experts.0.gate": np.zeros((2, 4), np.float32)}),
     "experts.0.gate has shape (2, 4), expected (4, 2)"),
    (lambda t: t.update({"lm_head": np.zeros(3, np.float32)}), "unmapped tensors: lm_head"),
])
def test_bad_checkpoints_name_the_tensor(change, needle):
    tensors = per_expert(np.random.default_rng(1))
    change(tensors)
    with pytest.raises(CheckpointError) as err:
        load(tensors)
    assert needle in str(err.value)


def test_a_conversion_that_cannot_read_the_layout_is_a_checkpoint_error():
    """The element count fits the leaf, but the rule wants three axes: a clear error, no traceback."""
    specs = {"w": WeightSpec((2, 3, 4), (None, None, None))}
    keymap = KeyMap({"t": Convert(lambda w, _: np.swapaxes(w, 1, 2), ("w",))})
    plan = plan_tensors("f", {"t": (24,)}, keymap, specs)
    with pytest.raises(CheckpointError, match=r"t of shape \(24,\) is not in the layout expected for w"):
        fill_tree("f", plan, specs, None, np.dtype(np.float32), lambda n: (np.zeros(24, np.float32), False),
                  lambda n: 96, False)
