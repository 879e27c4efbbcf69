"""Environments with TRL 1.16's ``environment_factory`` semantics.

An environment is a class whose public methods are tools. ``reset(**row)`` is called before each
rollout with the dataset row's columns (minus ``environment`` when several environments are mixed)
and may return a string appended to the last user message; an optional ``get_reward()`` scores the
finished rollout from the environment's state (an extra reward logged under the class name). Each
rollout gets its own instance; instances are pooled and reused (reset) across rounds, created only
when a round needs more of one environment than exist ("construct once, reset often").
``environment_factory`` is one factory (every row uses it) or a dict of them, selected per row by
its ``environment`` column.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_ascend.errors import ConfigError, DataError, closest
from grpo_ascend.tools.toolset import ToolFunction, Toolset
from grpo_ascend.user_code import load_object

EnvironmentFactory = Callable[[], Any]

#: Methods of an environment that are not tools.
RESERVED_METHODS = ("reset", "get_reward")
#: The dataset column that selects the environment when ``environment_factory`` is a dict.
ENVIRONMENT_COLUMN = "environment"


def environment_methods(instance: Any) -> list[ToolFunction]:
    """The tool methods of an environment instance: public bound methods except reset/get_reward."""
    return [
        member
        for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
        if not name.startswith("_") and name not in RESERVED_METHODS
    ]


def environment_toolset(instance: Any, tools: Toolset | None = None) -> Toolset:
    """The tools a rollout with this environment sees: the standalone ``tools`` then the environment's
    methods (bound to this instance, so calls change this rollout's state only)."""
    base = tools if tools is not None else Toolset()
    try:
        return base.merged(environment_methods(instance))
    except ConfigError as exc:
        raise ConfigError(f"environment {type(instance).__name__}: {exc}") from exc


def append_observation(prompt: Any, observation: str | None) -> Any:
    """``prompt`` with ``reset()``'s string appended to the last user message (a new object; the
    input is not mutated). A plain-text prompt gets the string appended."""
    if observation is None:
        return prompt
    if not isinstance(observation, str):
        raise DataError(
            f"an environment's reset() must return None or a string; got {type(observation).__name__}"
        )
    if isinstance(prompt, str):
        return prompt + observation
    messages = list(prompt)
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            messages[i] = {**messages[i], "content": messages[i]["content"] + observation}
            return messages
    raise DataError("the prompt has no user message to append the environment's reset() observation to")


@dataclass
class RolloutEnvironment:
    """The environment of one rollout: its instance, the name it was selected by (None with a single
    factory), the tools the model may call, and what ``reset`` returned."""

    name: str | None
    instance: Any
    toolset: Toolset
    observation: str | None


class EnvironmentPool:
    """Per-rollout environment instances drawn from ``environment_factory`` (one factory or a dict).

    ``tools`` are standalone tools offered next to every environment's methods. Each factory is
    probed once at construction to check that its instances have ``reset`` and valid tool methods.
    """

    def __init__(
        self,
        environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory],
        tools: Toolset | None = None,
    ):
        self.multi = isinstance(environment_factory, Mapping)
        factories = dict(environment_factory) if self.multi else {None: environment_factory}
        if not factories:
            raise ConfigError("environment_factory is an empty dict; give at least one {name: factory}")
        for name, factory in factories.items():
            if not callable(factory):
                raise ConfigError(
                    f"environment {name!r}: the factory must be callable (a class or function); got {factory!r}"
                )
        self.factories: dict[str | None, EnvironmentFactory] = factories
        self.tools = tools if tools is not None else Toolset()
        self._pool: dict[str | None, list[Any]] = {}
        self.reward_classes: list[type] = []
        for name in factories:
            instance = self._create(name)
            self._pool[name] = [instance]
            environment_toolset(instance, self.tools)
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_classes:
                self.reward_classes.append(type(instance))

    def _create(self, name: str | None) -> Any:
        instance = self.factories[name]()
        if not callable(getattr(instance, "reset", None)):
            label = type(instance).__name__ if name is None else f"{name!r} ({type(instance).__name__})"
            raise ConfigError(
                f"environment {label} has no reset() method; every environment must define reset()"
            )
        return instance

    def offered_tools(self) -> list[Callable[..., Any]]:
        """Every function a rollout may be offered as a tool: the standalone tools, then the methods of each
        environment's first instance not offered yet (TRL's ``trainer.tools``; ``reset`` / ``get_reward`` are
        never tools)."""
        out = [tool.function for tool in self.tools]
        for pool in self._pool.values():
            out += [t.function for t in environment_toolset(pool[0], self.tools) if t.function not in out]
        return out

    def instances(self, name: str | None = None) -> list[Any]:
        """The instances made so far of environment ``name`` (None: the single factory), in the order they are
        handed out each round (one per rollout; reused from round to round)."""
        return list(self._pool[name])

    def names_for(self, rows: Sequence[Mapping[str, Any]]) -> list[str | None]:
        """The environment name of each row: its ``environment`` column with a dict of factories, else None."""
        if not self.multi:
            return [None] * len(rows)
        names = []
        for i, row in enumerate(rows):
            name = row.get(ENVIRONMENT_COLUMN)
            if name not in self.factories:
                valid = [str(n) for n in self.factories]
                hint = closest(str(name), valid) if isinstance(name, str) else ""
                raise DataError(
                    f"row {i} has {ENVIRONMENT_COLUMN}={name!r}{hint}, which is not among the environments given to "
                    f"environment_factory ({', '.join(valid)}); add an '{ENVIRONMENT_COLUMN}' column naming one of them"
                )
            names.append(name)
        return names

    def start(self, rows: Sequence[Mapping[str, Any]]) -> list[RolloutEnvironment]:
        """One reset environment per row (rows are per rollout, i.e. already repeated per generation).

        ``reset`` gets the row's columns as keyword arguments (without ``environment`` when several
        environments are mixed).
        """
        names = self.names_for(rows)
        handed_out: dict[str | None, int] = {}
        out = []
        for row, name in zip(rows, names):
            pool = self._pool[name]
            index = handed_out.get(name, 0)
            if index == len(pool):
                pool.append(self._create(name))
            handed_out[name] = index + 1
            instance = pool[index]
            kwargs = {k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN} if self.multi else dict(row)
            observation = instance.reset(**kwargs)
            if observation is not None and not isinstance(observation, str):
                raise DataError(
                    f"{type(instance).__name__}.reset() returned a {type(observation).__name__}; "
                    "it must return None or a string (appended to the last user message)"
                )
            out.append(
                RolloutEnvironment(name, instance, environment_toolset(instance, self.tools), observation)
            )
        return out

    def reward_functions(self) -> list[Callable[..., Any]]:
        """One reward function per environment class with ``get_reward``, named after the class.

        Each takes ``environments`` (the rollouts' instances, as TRL passes them to reward functions)
        and scores a rollout only when its environment is exactly that class (None otherwise).
        """
        return [_environment_reward(cls) for cls in self.reward_classes]


def _environment_reward(cls: type) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(cls.get_reward):

        async def reward(prompts=None, completions=None, completion_ids=None, *, environments, **kwargs):
            return [
                await _instance(e).get_reward() if type(_instance(e)) is cls else None for e in environments
            ]

    else:

        def reward(prompts=None, completions=None, completion_ids=None, *, environments, **kwargs):
            return [_instance(e).get_reward() if type(_instance(e)) is cls else None for e in environments]

    reward.__name__ = reward.__qualname__ = cls.__name__
    reward.__doc__ = (
        f"{cls.__name__}.get_reward() of each rollout's environment (None for other environments)."
    )
    return reward


def _instance(environment: Any) -> Any:
    return environment.instance if isinstance(environment, RolloutEnvironment) else environment


def load_environment_factory(spec: Any) -> EnvironmentFactory | dict[str, EnvironmentFactory]:
    """A factory from a recipe's ``environment:`` value: a class or callable, ``module:Class``,
    ``path/to/file.py:Class``, or a mapping ``{name: one of those}`` for per-row selection."""
    if isinstance(spec, Mapping):
        return {str(name): load_environment_factory(s) for name, s in spec.items()}
    if callable(spec):
        return spec
    if isinstance(spec, str) and ":" in spec:
        return load_object(spec, "environment")
    raise ConfigError(
        f"an environment is a class, 'module:Class', 'path/to/file.py:Class' or a mapping {{name: ...}}; got {spec!r}"
    )
