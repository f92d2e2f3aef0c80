"""The plane API's route groups beyond the supply side, each in its own module: a mount adds
its routes to the application and keeps the `PlaneServer` (for `caller()`, `admin()` and the
store's pool)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from aiohttp import web

from . import endpoints_api

__all__ = ["MOUNTS"]

Mount = Callable[["web.Application", Any], None]

MOUNTS: Final[list[Mount]] = [endpoints_api.mount]
