"""The scripted expert of the tabletop task: move straight at the named block, then close.

Its action is a function of the current state alone, and of nothing a camera could not see
(the gripper's and the named block's positions), so a policy imitating it frame by frame
needs no memory, and a policy that drifts off the expert's path is still shown the right
correction: from any state the expert's action leads back to the block.
"""

from __future__ import annotations

import numpy as np

from meshtron.envs.tabletop import MAX_STEP, TabletopState

CLOSE_TOLERANCE = 0.03
"""The expert closes once the gripper is this close (along x and y) to the block's centre, about
one pixel at 32x32: well inside the block, so a slightly early or late close still succeeds."""


def expert_action(state: TabletopState) -> np.ndarray:
    """(dx, dy, grip) in [-1, 1]: the step towards the named block, clipped to full speed, and
    grip = +1 (close) when already over its centre, else -1 (keep open)."""
    block = state.target_block
    delta = np.array([block.x - state.gripper[0], block.y - state.gripper[1]])
    move = np.clip(delta / MAX_STEP, -1.0, 1.0)
    grip = 1.0 if np.abs(delta).max() <= CLOSE_TOLERANCE else -1.0
    return np.array([move[0], move[1], grip], dtype=np.float32)
