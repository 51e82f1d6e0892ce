"""A plan's choice for one block as a typed value, and the option families (layer 1: no torch).

NOTE [Choices as values]
A block takes one of the four whole-block options (``keep``, ``recompute``, ``selective``,
``output``: NOTE [Plan cost model] in ``_problem.py``) or an option of a family inside the
block: ``children`` marks the children named (``"children:attn+fc"``, NOTE [Options inside
blocks] in ``_options.py``), ``ops`` keeps the outputs of the operator calls named
(``"ops:aten::mm#0+aten::addmm#3"``, NOTE [Options per operator]), and ``staged`` keeps them
too with the block re-run in stages (``"staged:aten::mm#0"``, NOTE [Re-runs in stages] in
``remat/_engine/stages.py``; eager plans only). The compiled planner gives
each module outside the blocks a column of its own, the option after the module's name
(``"head=recompute"``, NOTE [Modules outside the blocks] in ``_compiled.py``).

`Choice` is that value. Its text is the one format of these options: `str` writes it and
`Choice.parse` reads and checks it, and no other module joins or splits it. Plans keep the
text (``Decision.choice``, the solvers' columns, a plan's JSON), so what they print and
store is what it was before the value existed; `Plan.from_json` parses every decision's.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat._vocab.policy import parse_call_key

#: the options that mark a whole block: the first four columns of every `Problem`
BLOCK_OPTIONS = ("keep", "recompute", "selective", "output")
#: the family of options that mark children of a block, named ``"children:<child>+<child>"``
CHILDREN = "children"
#: the family of per-operator options: the block marked with a policy keeping the outputs of
#: the operator calls named, ``"ops:aten::addmm#3+aten::bmm#0"`` (NOTE [Options per operator])
OPS = "ops"
#: the family of per-operator options re-run in stages: the same policy as ``ops:``, the block
#: rebuilt a stage at a time as its backward reads it (NOTE [Re-runs in stages] in
#: ``remat/_engine/stages.py``), ``"staged:aten::add#1+aten::mm#2"``; eager plans only
STAGED = "staged"
#: how many stages a ``staged:`` option re-runs its block in
STAGES = 2
#: the option families a plan uses unless told (``remat.plan(options=...)``)
OPTIONS = (*BLOCK_OPTIONS, CHILDREN, OPS)
#: every option family a plan may be asked to use: `OPTIONS` and ``staged``, which a plan
#: uses only when asked (NOTE [Options re-run in stages] in ``planner/_options.py``)
FAMILIES = (*OPTIONS, STAGED)
#: the families that keep the outputs of the operator calls they name
CALL_FAMILIES = (OPS, STAGED)
#: the forms of an option's text, as errors list them
FORMS = (f"{BLOCK_OPTIONS}, '{CHILDREN}:<child>+<child>', "
         f"'{OPS}:<operator>#<call>+...' ('ops:aten::mm#0') or '{STAGED}:<operator>#<call>+...'")
API = "remat.planner.Choice"


@dataclass(frozen=True)
class Choice:
    """One block's option as a value (NOTE [Choices as values]); prints as its text.

    Args:
        family: one of `FAMILIES`: a whole-block option, ``"children"``, ``"ops"`` or ``"staged"``.
        parts: the children marked (``children``) or the operator calls whose outputs are
            kept (``ops``), in the order the text lists them; empty for a whole-block option.
        module: the compiled planner's column for a module outside the blocks: the module
            marked (a whole-block option only); empty otherwise.

    Raises:
        ValueError: an unknown family, or parts that family does not take.

    Examples:
        >>> from remat.planner import Choice
        >>> c = Choice.parse("children:attn+fc")
        >>> c.family, c.children, str(c)
        ('children', ('attn', 'fc'), 'children:attn+fc')
        >>> Choice("ops", ("aten::mm#0",)).calls, str(Choice("recompute"))
        (('aten::mm#0',), 'recompute')
    """

    family: str
    parts: tuple[str, ...] = ()
    module: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))  # a list given: the frozen tuple
        fault = _fault(self.family, self.parts, self.module)
        if fault is not None:
            raise ValueError(f"{API}: not an option: family {self.family!r}, parts {self.parts!r}"
                             f"{f', module {self.module!r}' if self.module else ''} ({fault}); "
                             f"choose from {FORMS}")

    @classmethod
    def parse(cls, text: str, *, api: str = f"{API}.parse", block: str | None = None) -> Choice:
        """The choice an option's text stands for: the inverse of `str`.

        Args:
            text: ``"keep"``, ``"recompute"``, ``"selective"``, ``"output"``,
                ``"children:<child>+<child>"``, ``"ops:<operator>#<call>+..."`` or the
                compiled planner's ``"<module>=<option>"``.
            api: the API named by the error.
            block: the block the option is for, named by the error.

        Raises:
            ValueError: the text is none of those forms; the message names it and lists them
                (for an ``ops`` option, the call key that is none).

        Examples:
            >>> from remat.planner import Choice
            >>> Choice.parse("ops:aten::mm#0+aten::addmm#3").calls
            ('aten::mm#0', 'aten::addmm#3')
            >>> Choice.parse("offload")
            Traceback (most recent call last):
            ...
            ValueError: remat.planner.Choice.parse: unknown option 'offload'; choose from ...
        """
        family, parts, module = _split(text) if isinstance(text, str) else (None, (), "")
        fault = "not text" if family is None else _fault(family, parts, module)
        if fault is not None and family in CALL_FAMILIES and not module:  # the family is right, a call is not
            where = "" if block is None else f" of block {block!r}"
            raise ValueError(f"{api}: option {text!r}{where}: {fault}")
        if fault is not None:
            where = "" if block is None else f" for block {block!r}"
            why = "" if fault == "" else f" ({fault})"
            raise ValueError(f"{api}: unknown option {text!r}{where}{why}; choose from {FORMS}")
        return cls(family, parts, module)

    def __str__(self) -> str:
        text = self.family if self.family in BLOCK_OPTIONS else f"{self.family}:{'+'.join(self.parts)}"
        return f"{self.module}={text}" if self.module else text

    @property
    def children(self) -> tuple[str, ...]:
        """The children a ``children`` option marks (none for the other families)."""
        return self.parts if self.family == CHILDREN else ()

    @property
    def calls(self) -> tuple[str, ...]:
        """The operator calls whose outputs an ``ops`` option keeps (none for the others)."""
        return self.parts if self.family in CALL_FAMILIES else ()

    def without_module(self) -> Choice:
        """The option alone, without the module of a compiled planner's column."""
        return Choice(self.family, self.parts)


def _split(text: str) -> tuple[str, tuple[str, ...], str]:
    """``(family, parts, module)`` of an option's text, unchecked."""
    head, sep, tail = text.rpartition("=")
    if head and sep and tail in BLOCK_OPTIONS and not head.startswith((f"{CHILDREN}:", f"{OPS}:", f"{STAGED}:")):
        return tail, (), head
    family, sep, rest = text.partition(":")
    if not sep:  # a family inside blocks without its ':' is no option ("ops" is not "ops:")
        return ("" if text in (CHILDREN, *CALL_FAMILIES) else text), (), ""
    return family, tuple(rest.split("+")) if rest or family not in CALL_FAMILIES else (), ""


def _fault(family: str, parts: tuple[str, ...], module: str) -> str | None:
    """What makes a choice no option ("" when its family is unknown); None: it is one."""
    if family not in FAMILIES:
        return ""
    if family in BLOCK_OPTIONS:
        return "a whole-block option names no parts" if parts else None
    if module:
        return "only a whole-block option marks a module outside the blocks"
    if len(set(parts)) != len(parts):
        return f"a {'call key' if family in CALL_FAMILIES else 'child'} is repeated in {list(parts)!r}"
    if family == CHILDREN:
        bad = [p for p in parts if not p or "+" in p]
        return ("name one child or more, joined by '+'" if not parts or bad else None)
    for key in parts:
        try:
            parse_call_key(key)
        except ValueError:
            return (f"a call key looks like 'aten::mm#0' (operator name, '#', the call's number "
                    f"among the block's calls of that operator, from 0), got {key!r}")
    return None
