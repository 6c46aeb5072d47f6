"""Meta-World (Farama Foundation, MuJoCo) behind meshtron's environment seam.

``MetaWorldEnv`` wraps one or more of Meta-World's goal-observable tasks as one Gymnasium
environment with the observation every meshtron policy reads: a camera ``image`` (uint8
[S, S, 3]), the ``instruction`` and the proprioceptive ``state`` (hand x, y, z and the gripper's
opening). Actions are Meta-World's 4-D continuous ones (dx, dy, dz, grip in [-1, 1]);
``info["success"]`` is the task's own success test, and an episode terminates on success (the
benchmark's convention for success rates) or is truncated after ``max_steps``.

Seeds: Meta-World ignores ``reset(seed=...)``; a scene is fixed by the seed its constructor
is given. ``reset(seed=s)`` draws the scene exactly as ``<task>-goal-observable(seed=s)``'s
constructor does (the legacy global NumPy generator seeded with ``s``, restored afterwards),
without building a new simulation every episode. Seeds of 2^32 and above (evaluation's) seed
it from their two 32-bit halves, so they never meet a demonstration's 32-bit seed.

Rendering: the scene's defaults cost ~200 ms of CPU per small frame on Mesa's software
renderer; with the shadow map and multisampling off and reflections off (set before the first
render) 15-20 ms. The corner cameras see the table upside down, so their frames are turned by
180 degrees. ``MUJOCO_GL`` defaults to ``egl``; a renderer that cannot start is one line naming
what to install.
"""

from __future__ import annotations

import os
import string
import weakref
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from meshtron.envs.metaworld_tasks import OUTCOMES, STATE_DIMS, phrasings, tasks_of
from meshtron.errors import MeshtronError

CAMERA = "corner4"
"""The camera the policy sees through: the nearest corner camera, which shows the hand and the
objects of every MT10 task largest."""
DEFAULT_MAX_STEPS = 200
"""Steps before an episode is truncated (the experts need about 73 on average)."""
INSTRUCTION_CHARS = 64
RENDERER_HINT = ("install libegl1 libegl-mesa0 libgl1-mesa-dri (or libosmesa6 and set "
                 "MUJOCO_GL=osmesa); `make setup` does when it runs as root")


def import_metaworld() -> tuple[Any, Any, Any]:
    """(mujoco, the goal-observable task classes, metaworld.policies), or one line saying
    what is missing."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        import metaworld.policies as policies
        import mujoco
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE as classes
    except ImportError as err:
        raise MeshtronError(f"Meta-World is not installed ({err}); run `make setup` or "
                            "`pip install metaworld==3.1.1`") from None
    except Exception as err:  # noqa: BLE001 - mujoco's GL backend fails at import
        raise MeshtronError(f"MuJoCo's renderer (MUJOCO_GL={os.environ['MUJOCO_GL']}) cannot "
                            f"start: {str(err).splitlines()[0]}; {RENDERER_HINT}") from None
    return mujoco, classes, policies


def legacy_seed(seed: int) -> int | list[int]:
    """``seed`` as ``np.random.seed`` takes it: itself below 2^32, else its 32-bit halves."""
    if seed < 0:
        raise MeshtronError(f"an episode seed must not be negative, got {seed}")
    return seed if seed < 2**32 else [seed % 2**32, seed // 2**32 % 2**32]


class _Task:
    """One Meta-World task's simulation, its renderer and its scripted expert."""

    def __init__(self, task: str, image_size: int) -> None:
        mujoco, classes, policies = import_metaworld()
        self.name = task
        self.sim = classes[f"{task}-goal-observable"](seed=0)
        quality = self.sim.model.vis.quality
        quality.shadowsize, quality.offsamples = 0, 0
        try:
            self.renderer = mujoco.Renderer(self.sim.model, image_size, image_size)
        except Exception as err:  # noqa: BLE001 - GL context creation fails in many ways
            raise MeshtronError(f"MuJoCo's renderer (MUJOCO_GL={os.environ['MUJOCO_GL']}) "
                                f"cannot start: {str(err).splitlines()[0]}; "
                                f"{RENDERER_HINT}") from None
        self.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        self.expert = getattr(policies, _policy_class(task))()
        # closed before the interpreter tears EGL down (else its __del__ prints tracebacks)
        self._finalize = weakref.finalize(self, _close, self.renderer, self.sim)

    def reset(self, seed: int) -> np.ndarray:
        """The state vector of the scene ``seed`` fixes (the constructor's draw)."""
        saved = np.random.get_state()
        try:
            np.random.seed(legacy_seed(seed))
            self.sim._freeze_rand_vec = False
            state, _ = self.sim.reset()
        finally:
            self.sim._freeze_rand_vec = True
            np.random.set_state(saved)
        return state

    def image(self) -> np.ndarray:
        self.renderer.update_scene(self.sim.data, camera=CAMERA)
        return np.ascontiguousarray(self.renderer.render()[::-1, ::-1])

    def close(self) -> None:
        self._finalize()


def _close(renderer: Any, sim: Any) -> None:
    renderer.close()
    sim.close()


def _policy_class(task: str) -> str:
    """Meta-World's expert class name of ``task`` (peg-insert-side's is spelled apart)."""
    stem = "peg-insertion-side-v3" if task == "peg-insert-side-v3" else task
    return "Sawyer" + "".join(part.capitalize() for part in stem.split("-")) + "Policy"


class MetaWorldEnv(gym.Env):
    """Meta-World tasks as one environment: ``obs = {"image", "instruction", "state"}``.

    ``reset(seed=s, options={"task": t})`` starts task ``t`` (default: the ``s``-th of the
    environment's tasks, cyclically) in the scene ``s`` fixes; the instruction is one of the
    task's training phrasings, or held-out ones when ``held_out_instructions``. The same seed
    and actions give the same images and outcomes.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}
    OUTCOMES = OUTCOMES

    def __init__(self, name: str, image_size: int = 64, max_steps: int = DEFAULT_MAX_STEPS,
                 held_out_instructions: bool = False, images: bool = True) -> None:
        if not isinstance(image_size, int) or not 16 <= image_size <= 512:
            raise MeshtronError(f"image_size must be an integer from 16 to 512, not {image_size}")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise MeshtronError(f"max_steps must be a positive integer, not {max_steps}")
        self.name, self.tasks = name, tasks_of(name)
        self.image_size, self.max_steps = image_size, max_steps
        self.held_out = held_out_instructions
        self.images = images
        """False: observations carry a black frame instead of rendering one (replaying
        demonstrations for their states needs no frames, and rendering is most of a step)."""
        self._black = np.zeros((image_size, image_size, 3), np.uint8)
        self.observation_space = spaces.Dict({
            "image": spaces.Box(0, 255, (image_size, image_size, 3), np.uint8),
            "instruction": spaces.Text(INSTRUCTION_CHARS, charset=string.ascii_lowercase + " "),
            "state": spaces.Box(-np.inf, np.inf, (STATE_DIMS,), np.float32),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
        self._sims: dict[str, _Task] = {}
        self._task: _Task | None = None
        self._state = np.zeros(39)
        self._instruction, self._steps, self._done = "", 0, True
        self._near = self._unstable = self._success = False

    @property
    def task(self) -> str:
        """The running episode's task."""
        if self._task is None:
            raise MeshtronError("the environment has no episode yet; call reset() first")
        return self._task.name

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        seed = 0 if seed is None else int(seed)
        task = (options or {}).get("task", self.tasks[seed % len(self.tasks)])
        if task not in self.tasks:
            raise MeshtronError(f"task {task!r} is not one of {self.name}'s: "
                                f"{', '.join(self.tasks)}")
        if task not in self._sims:
            self._sims[task] = _Task(task, self.image_size)
        self._task = self._sims[task]
        self._state = self._task.reset(seed)
        texts = phrasings(task, self.held_out)
        self._instruction = texts[int(self.np_random.integers(len(texts)))]
        self._steps, self._done = 0, False
        self._near = self._unstable = self._success = False
        return self._observation(), {"success": False, "task": task}

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        if self._task is None or self._done:
            raise MeshtronError("step() needs a running episode; call reset() first")
        act = np.asarray(action, dtype=np.float64)
        if act.shape != (4,) or not np.all(np.isfinite(act)):
            raise MeshtronError(f"a Meta-World action is 4 finite numbers (dx, dy, dz, grip), "
                                f"got {action!r}")
        self._state, reward, _, _, info = self._task.sim.step(np.clip(act, -1.0, 1.0))
        self._steps += 1
        self._success = bool(info["success"])
        self._near = self._near or bool(info.get("near_object", 0.0))
        self._unstable = bool(self._task.sim._did_see_sim_exception)
        terminated = self._success or self._unstable
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        return self._observation(), float(reward), terminated, truncated, {
            "success": self._success, "task": self._task.name, "steps": self._steps}

    def expert_action(self) -> np.ndarray:
        """The task's scripted expert's action for the current state, clipped to the space."""
        if self._task is None:
            raise MeshtronError("the environment has no episode yet; call reset() first")
        action = self._task.expert.get_action(self._state)
        return np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)

    def outcome(self) -> str:
        """How the episode ended so far (:data:`OUTCOMES`)."""
        if self._success:
            return "success"
        if self._unstable:
            return "unstable"
        return "near_object_not_done" if self._near else "never_near_object"

    def render(self) -> np.ndarray | None:
        return self._task.image() if self._task is not None else None

    def close(self) -> None:
        for sim in self._sims.values():
            sim.close()
        self._sims.clear()

    def _observation(self) -> dict[str, Any]:
        assert self._task is not None
        image = self._task.image() if self.images else self._black.copy()
        return {"image": image, "instruction": self._instruction,
                "state": self._state[:STATE_DIMS].astype(np.float32)}
