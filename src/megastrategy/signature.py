"""A visible signature for ``MegatronStrategy.__init__``, built from the configuration's fields.

The constructor takes ``(tp, pp, **kwargs)`` so that :class:`~megastrategy.config.MegatronConfig`
stays the one list of options. ``inspect.signature`` (and so ``LightningCLI``/jsonargparse, IDEs,
``help()``) would see only ``tp`` and ``pp``; :func:`signature_from` gives it every field, typed
and with its default, followed by the keywords of Lightning's ``DDPStrategy`` that the strategy
passes through. The signature is derived, so it cannot drift from the dataclass.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Callable

__all__ = ["passthrough_arguments", "signature_from"]

_P = inspect.Parameter


def passthrough_arguments(base_init: Callable, config_cls: type) -> dict[str, inspect.Parameter]:
    """``base_init``'s keyword parameters, typed, less ``self``/``*args``/``**kwargs`` and the
    names the configuration owns (e.g. ``timeout``: ours is validated and then handed on)."""
    ours = {f.name for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(base_init)
    return {
        p.name: p.replace(kind=_P.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation))
        for p in inspect.signature(base_init).parameters.values()
        if p.name != "self" and p.name not in ours and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)
    }


def _field_parameter(f: dataclasses.Field, hints: dict, positional: bool) -> inspect.Parameter:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    kind = _P.POSITIONAL_OR_KEYWORD if positional else _P.KEYWORD_ONLY
    return _P(f.name, kind, default=default, annotation=hints[f.name])


def signature_from(config_cls: type, base_init: Callable, positional: tuple[str, ...] = ("tp", "pp")):
    """Decorator: give ``__init__`` the signature ``(self, <positional>, *, <other fields>, <base_init's>)``.

    Only the advertised signature changes; the function still receives ``**kwargs``.
    """

    def decorate(init: Callable) -> Callable:
        hints = typing.get_type_hints(config_cls)
        fields = dataclasses.fields(config_cls)
        first = [f for f in fields if f.name in positional]
        rest = [f for f in fields if f.name not in positional]
        params = [_P("self", _P.POSITIONAL_OR_KEYWORD)]
        params += [_field_parameter(f, hints, True) for f in first]
        params += [_field_parameter(f, hints, False) for f in rest]
        params += list(passthrough_arguments(base_init, config_cls).values())
        init.__signature__ = inspect.Signature(params, return_annotation=None)
        init.__annotations__ = {p.name: p.annotation for p in params[1:]} | {"return": None}
        return init

    return decorate

