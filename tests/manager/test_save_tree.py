"""save_tree: the app's own arrangement of the saved tree, checked at prepare and inverted."""

import numpy as np
import pytest

from overlap_ckpt.errors import ConfigError
from overlap_ckpt.hostarray import HostArray
from overlap_ckpt.manager.save_tree import SaveTree

STANDARD = {"step": HostArray.from_numpy(np.int32(3)), "params": {"w": HostArray.from_numpy(np.ones(2))},
            "opt_state": (HostArray.from_numpy(np.zeros(2)), None)}


def test_rearrangement_round_trips():
    tree = SaveTree(lambda t: {"model": t["params"], "optimizer": t["opt_state"], "step": t["step"]})
    tree.bind(STANDARD)
    saved = tree.to_saved(STANDARD)
    assert set(saved) == {"model", "optimizer", "step"} and saved["model"]["w"] is STANDARD["params"]["w"]
    back = tree.to_standard(saved)
    assert back["params"]["w"] is STANDARD["params"]["w"] and back["step"] is STANDARD["step"]


@pytest.mark.parametrize("arrange, why", [
    (lambda t: {"params": t["params"]}, "missing leaves"),
    (lambda t: {**t, "version": 1}, "new values"),
    (lambda t: {"p": t["params"]["w"] * 2, "rest": t}, "rearrange"),
])
def test_functions_that_are_not_rearrangements_are_refused(arrange, why):
    with pytest.raises(ConfigError, match=why) as info:
        SaveTree(arrange).bind(STANDARD)
    assert len(str(info.value)) < 2000
