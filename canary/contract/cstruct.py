"""A kernel's by-value parameter struct described once, in Python: the host's word order (:meth:`Struct.fields`)
and the C declaration of the generated ``kernels/canary_constants.cuh`` (:meth:`Struct.render`) both come from
it, so the two cannot drift apart. Every field is 8 bytes (a pointer, ``i64`` or ``u64``; nested structs of those),
which is what lets the host pack a struct as an array of uint64 words.
"""
from __future__ import annotations

from typing import NamedTuple, Union


class Member(NamedTuple):
    """One declaration: ``ctype name[extent];  // note``. ``ctype`` is a C type, or a :class:`Struct` declared
    earlier in the header (nested by value); ``extent`` is ``(macro name, value)`` for an array."""

    ctype: Union[str, "Struct"]
    name: str
    note: str = ""
    extent: tuple[str, int] | None = None


class Struct(NamedTuple):
    """A C struct: ``name``, its members in order, and the comment printed above it."""

    name: str
    members: tuple[Member, ...]
    doc: str = ""

    def fields(self) -> tuple[str, ...]:
        """The host's word names in order: a nested struct contributes its own fields, an array ``x[N]`` the
        names ``x0 .. x{N-1}``."""
        out: list[str] = []
        for m in self.members:
            if isinstance(m.ctype, Struct):
                out += m.ctype.fields()
            elif m.extent is not None:
                out += [f"{m.name}{k}" for k in range(m.extent[1])]
            else:
                out.append(m.name)
        return tuple(out)

    def render(self, width: int = 118) -> str:
        """The C declaration, one member a line, notes aligned (``width``: where the doc comment wraps)."""
        decls = []
        for m in self.members:
            ctype = m.ctype.name if isinstance(m.ctype, Struct) else m.ctype
            decls.append((f"{ctype} {m.name}{f'[{m.extent[0]}]' if m.extent else ''};", m.note))
        col = max(len(d) for d, _ in decls) + 2
        lines = [f"// {line}" for line in _wrap(self.doc, width - 3)] if self.doc else []
        lines.append(f"struct {self.name} {{")
        for d, note in decls:
            if not note:
                lines.append(f"    {d}")
            elif 4 + col + 3 + len(note) <= width:
                lines.append(f"    {d:<{col}}// {note}")
            else:  # too long for the line: the note goes above the member
                lines += [f"    // {line}" for line in _wrap(note, width - 7)] + [f"    {d}"]
        lines.append("};")
        return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + ([line] if line else [])
