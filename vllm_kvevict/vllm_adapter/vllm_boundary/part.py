"""One entry of the listing of vLLM (``VllmPart``) and the helpers that write entries."""

from __future__ import annotations

from dataclasses import dataclass

#: how the plugin uses a part of vLLM, one per entry
USES = ("imports", "wraps", "overrides", "calls", "reads")


@dataclass(frozen=True)
class VllmPart:
    """A part of vLLM the plugin ``use``s (``USES``), with why.

    "imports": ``from owner import names`` (``owner`` a module). "wraps" (``vllm_patches``), "overrides" (a
    subclass or mixin of ours) or "calls" (a private one, ``vllm_private``): method ``names`` of vLLM's
    class ``owner`` (a dotted path), ``params`` its parameters after self/cls as vLLM defines them (a wrapper
    or override passes them on). "reads": attributes ``names`` the plugin reads or sets on instances of
    ``owner``; vLLM defines each on the class, as a field, or by assignment in ``owner``'s module (or
    ``set_in``: a module that sets them on another object, e.g. vLLM's CPU impl on its layer).
    Names and parameters are space-separated.
    """

    use: str
    owner: str
    names: str
    why: str
    params: str = ""
    set_in: str = ""

    def __post_init__(self) -> None:
        if self.use not in USES:
            raise ValueError(f"VllmPart.use={self.use!r} is not valid; valid: {', '.join(USES)}")

    @property
    def listed(self) -> tuple[str, ...]:
        """The imported names, the method's name or the attributes, one each."""
        return tuple(self.names.split())

    @property
    def parameters(self) -> tuple[str, ...]:
        return tuple(self.params.split())


def imported(module: str, names: str, why: str) -> VllmPart:
    """``from module import names``."""
    return VllmPart("imports", module, names, why)


def methods(use: str, owner: str, why: str, params: dict[str, str]) -> tuple[VllmPart, ...]:
    """One entry per method of ``owner`` the plugin ``use``s: {name: its parameters}."""
    return tuple(VllmPart(use, owner, name, why, names) for name, names in params.items())


def read(owner: str, names: str, why: str, set_in: str = "") -> VllmPart:
    """Attributes ``names`` of ``owner``'s instances."""
    return VllmPart("reads", owner, names, why, set_in=set_in)
