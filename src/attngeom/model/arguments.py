"""What the API takes: a model (the handle :func:`attngeom.load_model` returns) and whole numbers
(positions in a sequence, counts); the one check of each for every public function.

Every public function with a ``handle`` parameter is decorated with :func:`takes_handle` (anything
else is refused in one line, saying what to pass); every one with a ``model`` parameter (a
transformers model) with :func:`takes_model` (a handle stands for its model). tests/unit/test_structure.py
checks that no public function is left undecorated. Imports nothing heavy (torch only when a value is checked),
so a module that decorates its functions stays light to import.

Positions and counts (:func:`check_position`, :func:`check_count`) are Python or numpy integers:
``True``, ``2.7``, ``"3"`` or ``None`` are refused in one line (:class:`InputError`), never taken as
the whole numbers they convert to."""

from __future__ import annotations

import functools
import inspect
import operator

from attngeom.errors import InputError


def _is_module(obj) -> bool:
    import torch

    return isinstance(obj, torch.nn.Module)


def whole_number(value, name: str) -> int:
    """``value`` as an ``int`` if it is a whole number (a Python or numpy integer, not a bool), else a
    one-line :class:`InputError` naming ``name``."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InputError(f"{name} must be a whole number, not {value!r}"[:200])


def check_count(value, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """A count (rows, tokens, ...): a whole number from ``minimum`` to ``maximum`` (None: no upper
    bound), else a one-line :class:`InputError`."""
    n = whole_number(value, name)
    if n < minimum or (maximum is not None and n > maximum):
        span = f"at least {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise InputError(f"{name} must be a whole number {span}, not {n}")
    return n


def check_position(value, name: str, length: int, what: str = "the trace") -> int:
    """A position in a sequence of ``length`` items (negative counts from the end) as ``0..length-1``,
    else a one-line :class:`InputError` (``what``: the sequence, as the message names it)."""
    p = whole_number(value, name)
    if not -length <= p < length:
        raise InputError(f"{name} {p} is outside {what} ({length} tokens)")
    return p % length


HANDLE_HINT = "the ModelHandle that attngeom.load_model returns"


def _what(obj) -> str:
    if isinstance(obj, str):
        return f"the string {obj[:60]!r} (load it first: attngeom.load_model({obj[:60]!r}))"
    if _is_module(obj):
        return f"a bare {type(obj).__name__} (wrap it with its tokenizer: attngeom.wrap(model, tokenizer))"
    return f"a value of type {type(obj).__name__} (load a model with attngeom.load_model(...))"


def is_handle(obj) -> bool:
    """Whether ``obj`` is a model handle: a :class:`~attngeom.model.handle.ModelHandle` or anything with its ``model``,
    ``tokenizer`` and ``name`` (:class:`attngeom.runs.contract.ModelHandleLike`)."""
    return not _is_module(obj) and all(hasattr(obj, a) for a in ("model", "tokenizer", "name"))


def check_handle(obj, where: str):
    """``obj`` if it is a model handle (:func:`is_handle`), else one-line :class:`InputError` saying what to pass."""
    if not is_handle(obj):
        raise InputError(f"{where} takes {HANDLE_HINT}, not {_what(obj)}")
    return obj


def as_model(obj, where: str):
    """The transformers model of a function that takes one: a handle's ``model``, or the module itself;
    anything else is refused in one line."""
    if is_handle(obj):
        return obj.model
    if _is_module(obj):
        return obj
    raise InputError(f"{where} takes {HANDLE_HINT} or its transformers model, not {_what(obj)}")


def _where(fn) -> str:
    """``attngeom.<package>.<name>`` of a public function (a class for its ``__init__``)."""
    return f"attngeom.{fn.__module__.split('.')[1]}.{fn.__qualname__.removesuffix('.__init__')}"


def takes_handle(fn):
    """Decorator of a public function (or method) whose parameter ``handle`` is a model handle: any
    other value is refused in one line before the function runs (:func:`check_handle`)."""
    names = list(inspect.signature(fn).parameters)
    k = names.index("handle")
    where = _where(fn)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        check_handle(args[k] if len(args) > k else kwargs.get("handle"), where)
        return fn(*args, **kwargs)

    checked.takes_handle = True
    return checked


def takes_model(fn):
    """Decorator of a public function (or method) whose parameter ``model`` is a transformers model:
    a model handle stands for its model; anything else is refused in one line (:func:`as_model`)."""
    names = list(inspect.signature(fn).parameters)
    k = names.index("model")
    where = _where(fn)

    @functools.wraps(fn)
    def unwrapped(*args, **kwargs):
        if len(args) > k:
            args = (*args[:k], as_model(args[k], where), *args[k + 1:])
        else:
            kwargs["model"] = as_model(kwargs.get("model"), where)
        return fn(*args, **kwargs)

    unwrapped.takes_model = True
    return unwrapped


def check_positions(handle, n: int, what: str, hint: str = "") -> None:
    """Refuse, in one line, ``n`` positions (tokens read plus tokens generated) beyond the model's
    ``max_positions`` (when its config says): ``"<what> needs n positions but <model> handles at
    most <limit> positions"``, then ``hint``. Before any compute: a model reads no further than it
    was made for."""
    limit = getattr(handle, "max_positions", None)
    if limit and n > limit:
        raise InputError(f"{what} needs {n} positions but {getattr(handle, 'name', 'the model')} handles at most "
                         f"{limit} positions" + (f"; {hint}" if hint else ""))
