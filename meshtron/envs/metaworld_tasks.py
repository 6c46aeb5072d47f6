"""What meshtron adds to Meta-World's tasks: their names, their instructions and how a failed
episode is described. Kept apart from :mod:`.metaworld` so that names and words are known
without importing MuJoCo (the vocabulary of a policy, the command line's checks).

Instructions: every task has several phrasings; the last one of each is held out of the
demonstrations and used at evaluation, so a policy is asked in words it was not trained on
(each held-out phrasing only recombines words the training phrasings use, so the word-level
tokenizer knows them).
"""

from __future__ import annotations

from meshtron.errors import MeshtronError

MT10_ENV = "metaworld-mt10"
"""The environment name of the ten MT10 tasks."""
TASK_PREFIX = "metaworld:"
STATE_DIMS = 4
"""The observation's proprioceptive ``state``: the hand's x, y, z and the gripper's opening
(the first four entries of Meta-World's observation vector)."""
"""``metaworld:<task>`` names one Meta-World task, e.g. ``metaworld:reach-v3``;
``metaworld:<task>+<task>...`` several (a small suite, as the tests use)."""

MT10_TASKS: tuple[str, ...] = (
    "reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3",
    "drawer-close-v3", "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3",
    "window-close-v3",
)

PHRASINGS: dict[str, tuple[str, ...]] = {
    "reach-v3": ("reach the goal", "move the hand to the goal", "reach for the target",
                 "move the hand to the target"),
    "push-v3": ("push the puck to the goal", "slide the puck to the target",
                "push the puck to the target", "slide the puck to the goal"),
    "pick-place-v3": ("pick up the puck and place it at the goal", "put the puck on the target",
                      "pick and place the puck", "pick up the puck and put it on the goal"),
    "door-open-v3": ("open the door", "pull the door open", "swing the door open",
                     "pull open the door"),
    "drawer-open-v3": ("open the drawer", "pull the drawer open", "slide the drawer out",
                       "pull out the drawer"),
    "drawer-close-v3": ("close the drawer", "push the drawer closed", "slide the drawer in",
                        "push in the drawer"),
    "button-press-topdown-v3": ("press the button", "push the button down",
                                "press down on the button", "push down the button"),
    "peg-insert-side-v3": ("insert the peg", "put the peg in the hole",
                           "push the peg into the hole", "insert the peg in the hole"),
    "window-open-v3": ("open the window", "slide the window open", "push the window open",
                       "slide open the window"),
    "window-close-v3": ("close the window", "slide the window closed",
                        "push the window closed", "slide closed the window"),
}
"""Phrasings per task; the last is held out (evaluation), the others train."""
HELD_OUT = 1
"""Phrasings per task held out of the demonstrations."""


def phrasings(task: str, held_out: bool) -> tuple[str, ...]:
    """The training phrasings of ``task``, or its held-out ones."""
    every = PHRASINGS[task]
    return every[-HELD_OUT:] if held_out else every[:-HELD_OUT]


def vocabulary() -> tuple[str, ...]:
    """Every word of every phrasing, sorted: the instruction vocabulary of a Meta-World
    policy (the same for one task and for MT10, so either's data trains one policy)."""
    return tuple(sorted({word for texts in PHRASINGS.values() for text in texts
                         for word in text.split()}))


def tasks_of(name: str) -> tuple[str, ...]:
    """The tasks of environment ``name`` (``metaworld-mt10`` or ``metaworld:<task>``); an
    unknown task is one line listing the known ones."""
    if name == MT10_ENV:
        return MT10_TASKS
    if name.startswith(TASK_PREFIX):
        tasks = tuple(name[len(TASK_PREFIX):].split("+"))
        for task in tasks:
            if task not in PHRASINGS:
                raise MeshtronError(f"unknown Meta-World task {task!r}; the tasks are "
                                    f"{', '.join(MT10_TASKS)}")
        if len(set(tasks)) != len(tasks):
            raise MeshtronError(f"{name!r} names a task twice")
        return tasks
    raise MeshtronError(f"{name!r} is not a Meta-World environment name ({MT10_ENV} or "
                        f"{TASK_PREFIX}<task>)")


def dataset_env_id(name: str) -> str:
    """The ``env`` a demonstration dataset of environment ``name`` records: one id for every
    Meta-World name (a policy trained on MT10 runs each task, one task's data trains the
    same action space), versioned with the render settings and the instructions."""
    tasks_of(name)
    return "metaworld/v3-render1"


OUTCOMES = ("success", "never_near_object", "near_object_not_done", "unstable")
"""How a Meta-World episode ends, from what the environment reports (``info``): succeeded,
truncated without ever being near the object, truncated after being near it, or stopped by
an unstable simulation."""
