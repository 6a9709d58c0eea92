"""Named registries for the extension points: each entry declares the inputs and options it accepts.

One registry per extension point (advantage estimator, policy loss, off-policy weight, KL estimator, task,
reward, tool, environment, backend, doctor check). A name can be registered once; looking up an unknown name
raises an error that lists the valid names and suggests the nearest one. Every entry says what it reads:

- ``inputs``: the data the caller hands it (tensors such as ``rewards`` or ``mask``), by keyword;
- ``options``: its hyperparameters, as ``{setting name: keyword}`` — the setting name is what a user writes
  (a config field such as ``estimator.clip_range`` or a key of ``task.options``), the keyword what the
  function takes (``clip_low``). A tuple of names means setting name = keyword.

``Registry.call`` passes exactly the declared inputs and options, nothing else, so a setting can never be
dropped on the way; ``Registry.check_options`` rejects a setting the entry does not accept, listing the ones it
does. Declarations are checked against the function's signature when it registers.

    >>> LOSSES = Registry("policy loss")
    >>> @LOSSES.register("scaled", inputs=("advantages",), options={"scale": "factor"})
    ... def scaled(advantages, *, factor=1.0):
    ...     return advantages * factor
    >>> LOSSES.call("scaled", {"advantages": 2.0, "mask": None}, {"scale": 3.0})
    6.0
    >>> try:
    ...     LOSSES.check_options("scaled", ["scael"])
    ... except RegistryError as error:
    ...     print(error)
    policy loss 'scaled' has no option 'scael'; did you mean 'scale'? It accepts: scale
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T", bound=Callable)


class RegistryError(KeyError):
    """An unknown or duplicate name in a registry, or an option an entry does not accept."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered callable and what it reads."""

    name: str
    fn: T
    inputs: tuple[str, ...] = ()
    """keywords the caller fills from its data (tensors, texts)."""
    options: dict[str, str] = field(default_factory=dict)
    """setting name → keyword of ``fn``: the hyperparameters it accepts."""

    @property
    def summary(self) -> str:
        """The first line of the function's docstring."""
        return (inspect.getdoc(self.fn) or "").split("\n", 1)[0]


class Registry(Generic[T]):
    """A name → callable table with duplicate rejection, declared inputs and options, and helpful errors."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(
        self, name: str, *, inputs: Iterable[str] = (), options: Mapping[str, str] | Iterable[str] = ()
    ) -> Callable[[T], T]:
        """Decorator: ``@ADVANTAGES.register("gae", inputs=(...), options={"lambda_gae": "lam"})``.

        Registering a name twice is an error, and so is declaring a keyword ``fn`` does not take.
        """
        option_map = dict(options) if isinstance(options, Mapping) else {name: name for name in options}

        def decorate(fn: T) -> T:
            if name in self._entries:
                raise RegistryError(f"{self.kind} '{name}' is already registered; pick another name")
            _check_signature(self.kind, name, fn, [*inputs, *option_map.values()])
            self._entries[name] = Entry(name, fn, tuple(inputs), option_map)
            return fn

        return decorate

    def get(self, name: str) -> T:
        return self.entry(name).fn

    def entry(self, name: str) -> Entry[T]:
        if name not in self._entries:
            raise RegistryError(unknown_name_message(self.kind, name, self.names()))
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry[T]]:
        return [self._entries[name] for name in self.names()]

    def options(self, name: str) -> list[str]:
        """The setting names entry ``name`` accepts."""
        return list(self.entry(name).options)

    def check_options(self, name: str, given: Iterable[str]) -> None:
        """Raise ``RegistryError`` for a setting entry ``name`` does not accept, listing those it does."""
        accepted = self.options(name)
        for option in given:
            if option not in accepted:
                raise RegistryError(unknown_option_message(self.kind, name, option, accepted))

    def bind(self, name: str, settings: Mapping[str, Any] | object) -> dict[str, Any]:
        """The keyword arguments of entry ``name``'s options, read from ``settings`` (a mapping or an object
        with the settings as attributes, such as a config section)."""
        read = settings.get if isinstance(settings, Mapping) else lambda key: getattr(settings, key)
        return {keyword: read(setting) for setting, keyword in self.entry(name).options.items()}

    def call(self, name: str, data: Mapping[str, Any], settings: Mapping[str, Any] | object = None, **extra):
        """Call entry ``name`` with its declared inputs taken from ``data`` and its options from ``settings``;
        ``extra`` keywords are passed as they are."""
        entry = self.entry(name)
        missing = [key for key in entry.inputs if key not in data]
        if missing:
            raise RegistryError(f"{self.kind} '{name}' needs {', '.join(missing)}, which the caller did not provide")
        arguments = {key: data[key] for key in entry.inputs}
        if settings is not None:
            arguments.update(self.bind(name, settings))
        return entry.fn(**arguments, **extra)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(self.names())


class FactoryRegistry(Registry):
    """A registry of factories whose keyword parameters are their options, declared once when they register.

    ``@TASKS.register("arithmetic")`` declares every parameter of the factory as an option (setting name =
    keyword), except the ``inputs`` the caller hands every factory of the registry (an environment's task and
    reward function); ``register(name, options=...)`` declares them explicitly instead. A factory that also
    takes ``**options`` accepts any option besides its named ones. ``required(name)`` lists the options
    without a default, so a configuration can be checked before anything is built.
    """

    def __init__(self, kind: str, inputs: tuple[str, ...] = ()):
        super().__init__(kind)
        self.inputs = tuple(inputs)
        self._open: set[str] = set()
        self._required: dict[str, list[str]] = {}

    def register(
        self,
        name: str,
        *,
        inputs: tuple[str, ...] | None = None,
        options: dict[str, str] | tuple[str, ...] | None = None,
    ) -> Callable[[Callable], Callable]:
        inputs = self.inputs if inputs is None else tuple(inputs)

        def decorate(fn):
            parameters = inspect.signature(fn).parameters
            named = [
                key
                for key, p in parameters.items()
                if key not in inputs and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            Registry.register(self, name, inputs=inputs, options=named if options is None else options)(fn)
            if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                self._open.add(name)
            keywords = self.entry(name).options
            self._required[name] = [
                setting
                for setting, keyword in keywords.items()
                if keyword in parameters and parameters[keyword].default is inspect.Parameter.empty
            ]
            return fn

        return decorate

    def required(self, name: str) -> list[str]:
        """The options entry ``name`` cannot be built without."""
        self.entry(name)  # an unknown name: RegistryError listing the valid ones
        return list(self._required[name])

    def check_options(self, name: str, given: Any) -> None:
        """Like ``Registry.check_options``; a factory with ``**options`` accepts any option."""
        if name not in self._open:
            super().check_options(name, given)


def _check_signature(kind: str, name: str, fn: Callable, keywords: list[str]) -> None:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = [keyword for keyword in keywords if keyword not in parameters]
    if unknown:
        raise RegistryError(f"{kind} '{name}' declares {', '.join(unknown)}, which {fn.__qualname__} does not take")


def unknown_name_message(kind: str, name: str, valid: list[str]) -> str:
    """ "unknown advantage estimator 'gea'; did you mean 'gae'? Valid names: a, b, c"."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown {kind} '{name}'{hint} Valid names: {', '.join(valid)}"


def unknown_option_message(kind: str, name: str, option: str, accepted: list[str]) -> str:
    """ "policy loss 'ppo' has no option 'clip_rnage'; did you mean 'clip_range'? It accepts: ..."."""
    close = difflib.get_close_matches(option, accepted, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "."
    return f"{kind} '{name}' has no option '{option}'{hint} It accepts: {', '.join(accepted) or 'no options'}"


_PLAIN_TYPES = {int, float, str, bool, type(None)}


def check_option_types(kind: str, name: str, factory: Callable, options: dict) -> None:
    """Reject an option whose value does not match a plain annotation of ``factory`` (int, float, str, bool, None),
    e.g. ``path: 3`` or ``test_fraction: "half"``; options with other annotations are left to the factory."""
    try:
        hints = typing.get_type_hints(factory)
    except (NameError, TypeError):  # an annotation that cannot be resolved here: nothing to check against
        return
    for option, value in options.items():
        hint = hints.get(option)
        origin = typing.get_origin(hint)
        accepted = set(typing.get_args(hint)) if origin in (typing.Union, types.UnionType) else {hint}
        if not accepted or not accepted <= _PLAIN_TYPES:
            continue
        matches = isinstance(value, tuple(accepted)) and not (isinstance(value, bool) and bool not in accepted)
        if not matches and not (float in accepted and isinstance(value, int) and not isinstance(value, bool)):
            optional = ["None"] if type(None) in accepted else []
            names = " or ".join(sorted(t.__name__ for t in accepted - {type(None)}) + optional)
            raise ValueError(
                f"{kind} '{name}': option '{option}' must be {names}, got {type(value).__name__} {value!r}"
            )


def validate_options(registry: FactoryRegistry, name: str, options: dict) -> None:
    """Check ``options`` against what entry ``name`` of ``registry`` declares, before building it.

    Raises ValueError for an unknown option (suggesting the nearest valid one) or a missing required one, and
    RegistryError for an unknown name.
    """
    accepts = ", ".join(registry.options(name)) or "no options"
    try:
        registry.check_options(name, options)
    except RegistryError as error:
        raise ValueError(str(error)) from None
    missing = [option for option in registry.required(name) if option not in options]
    if missing:
        raise ValueError(f"{registry.kind} '{name}' needs the option(s) {', '.join(missing)}. It accepts: {accepts}")
